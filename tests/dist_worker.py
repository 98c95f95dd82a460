"""One rank of a tiny training run; launched by tests/test_distributed.py with or without torchrun.

    python tests/dist_worker.py TOKENIZER_DIR RUN_DIR STRATEGY STEPS PRESET [--resume] [--field VALUE ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from posttrain.config.options import load_config  # noqa: E402
from posttrain.model.loading import load_tokenizer  # noqa: E402
from posttrain.rl.loop import train  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402

if __name__ == "__main__":
    tok_dir, run_dir, strategy, steps, preset = sys.argv[1:6]
    resume = "--resume" in sys.argv
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(tok_dir)
    overrides = ["--reward.verifier", "none", "--reward.functions", "tests.toy_rewards:first_letter_a_to_e",
                 "--data.eval_size", "8", "--rollout.max_new_tokens", "4", "--data.system_prompt", "null",
                 "--tensorboard", "false", "--run_dir", run_dir, "--parallel.strategy", strategy,
                 "--steps", steps, "--checkpoint.every_steps", "2", "--optim.lr", "1e-2",
                 "--algorithm.kl_coef", "0.05", "--rollout.prompts_per_step", "4", "--preset", preset,
                 "--optim.epochs", "2", "--eval_every", "0",
                 "--reward.workers", "0"]   # (the pool is tested on its own; ranks stay light)
    if preset == "dapo":   # its overlong shaping buffer must fit in 4 new tokens
        overrides += ["--algorithm.overlong_buffer", "2"]
    overrides += [a for a in sys.argv[6:] if a != "--resume"]
    cfg = load_config(None, overrides)
    train(cfg, resume=run_dir if resume else None, model=make_tiny_model(tokenizer),
          tokenizer=tokenizer, show_progress=False)
