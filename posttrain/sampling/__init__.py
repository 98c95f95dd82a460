"""Layer 7: sampling, for every command: the `Sampling` service (service.py: engine, environment,
reward scorer, prompts and seed policy, one owner of the engine's life), sample-then-score
(collect.py, with DAPO's dynamic sampling), a step's batch in turn or sampled ahead
(sources.py), the scored batch (batch.py) and the one held-out evaluator (evaluation.py)."""
