"""Layer 10: the lecture's claims as experiments (docs/lecture-reproduced.md): `posttrain experiment NAME`.

Each experiment is one module with `CLAIM` (the lecture's sentence and section, written into the
record), `OVERRIDES` (its changes to the default recipe), `REPEATS` (how many batches or points
it measures), `MIN_REPEATS`, `KEEP_FREED_MEMORY` (perf.tune_malloc: for buffers of one size
every batch; not where sizes vary, which fragments), `run(run, out, repeats, progress) -> dict`
(the numbers) and `plot(numbers, path)`. They run on the real pipeline (`rl/job.py::start_training`,
`collect.generate_and_score`) and the library's own formulas; common.py writes the record and
the figure. This init imports nothing.
"""

# name -> module under posttrain.experiments (imported only when that experiment runs)
EXPERIMENTS = {
    "baselines": "baselines",
    "importance-sampling": "importance_sampling",
    "kl-estimators": "kl_estimators",
    "length-bias": "length_bias",
    "length-training": "length_training",
    "clip-higher": "clip_higher",
    "dynamic-sampling": "dynamic_sampling",
    "opd-vs-grpo": "opd_vs_grpo",
    "reward-hacking": "reward_hacking",
}
