"""Layer 9: the commands besides `train`, one module each, on the common lifecycle (run/lifecycle.py;
the offline stages' shared parts: `common.py`; TRL-format rows as token ids: `rows.py`):

    sft.py           posttrain sft             SFT on prompt-completion, messages or text rows (§8)
    preference.py    posttrain dpo             DPO on preference pairs (§9); the log-ratio reward model
    reward_model.py  posttrain reward-model    a Bradley-Terry reward model with a score head (§1)
    generate.py      posttrain generate        a teacher's answers or an environment's demonstrations
    evaluate.py      posttrain eval            held-out accuracy and pass@k of a model

Short loops with no rollout; they share the trainer's prompt encoding, its response-only forward
pass, its logging and its data parallelism:

    torchrun --nproc-per-node N -m posttrain.cli sft|dpo|reward-model ... [--parallel.strategy fsdp]

This file imports nothing: importing one stage runs only its own module and the ones below it.
"""
