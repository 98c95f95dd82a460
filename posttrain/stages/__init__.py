"""The offline stages around RL, one module per command, sharing one lifecycle (`common.py`):

    sft.py           posttrain sft             SFT on (prompt, response) rows (§8)
    preference.py    posttrain dpo             DPO on preference pairs (§9); the log-ratio reward model
    reward_model.py  posttrain reward-model    a Bradley-Terry reward model with a score head (§1)
    generate.py      posttrain generate        a teacher's answers or an environment's demonstrations

Short loops with no rollout; they share the trainer's prompt encoding, its response-only forward
pass, its logging and its data parallelism:

    torchrun --nproc-per-node N -m posttrain.cli sft|dpo|reward-model ... [--parallel.strategy fsdp]

This file imports nothing: importing one stage runs only its own module and the ones below it.
"""
