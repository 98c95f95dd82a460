"""Layer 7: the RL step pipeline and loop (docs/algorithms.md §2-§8): a scored batch, frozen passes,
teachers and the value model, the loss terms and the update, the evaluator, what a step logs, and
`train` itself (job.py starts and finishes a run, loop.py is the lecture's loop)."""
