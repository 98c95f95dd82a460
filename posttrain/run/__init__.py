"""Layer 4: one run's lifecycle, the same for every command: start, run folder, the one training
loop (time budget, checkpoint cadence, signals), finish; durable checkpoints; the optimizer and
its schedule; a record's provenance."""
