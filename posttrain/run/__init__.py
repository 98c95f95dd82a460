"""Layer 4: one run's lifecycle, the same for every command: start, run folder, the frame of each
command's own loop (`Steps`: time budget, checkpoint cadence, signals), finish; the common
learner (model, optimizer, schedule, non-finite guard, checkpoint, final save); durable
checkpoints; the optimizer and its schedule; a record's provenance."""
