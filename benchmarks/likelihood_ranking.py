"""Does a language model already rank the synthetic correct > wrong pairs by its own likelihood?

    .venv/bin/python benchmarks/likelihood_ranking.py [MODEL] [--pairs 200]

For held-out correct > wrong pairs (posttrain/data/preferences.py, the reward-model benchmark's
kind), compares sum log pi(response | prompt) of the two answers, with no training, and prints the
share ranked right per mistake kind. Measured 2026-11-30 (float32): SmolLM2-135M-Instruct 81.0% (off
by ten 76%), the 83% GRPO checkpoint 93.0% (off by ten 90%), where trained last-token reward models read
61-78% (docs/ppo-rlhf.md): the body knows; the last-token score does not learn to read it.
"""

import argparse
import re
from collections import defaultdict

import torch

from posttrain.data.preferences import synthetic_preferences
from posttrain.data.tasks import Problem, make_task
from posttrain.rollout.forward import frozen_logprobs
from posttrain.losses.common import sequence_logprob
from posttrain.model.loading import load_policy, load_tokenizer, resolve_model_path
from posttrain.rollout.forward import pack
from posttrain.model.prompts import encode_prompts


def response_logprobs(model, tok, prompts: list[str], responses: list[str]) -> torch.Tensor:
    """log pi(y | x) = sum_t log pi(y_t | x, y_<t) per row, through the trainer's own forward."""
    heads = encode_prompts(tok, [Problem(p, "") for p in prompts], None)
    tails = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    rollout = pack(tok, heads, tails)
    logp = frozen_logprobs(model, rollout, 1.0, micro=32)   # float32: close pairs differ by little
    return sequence_logprob(logp, rollout.response_mask_B_T)


def mistake_kind(chosen: str, rejected: str) -> str:
    gap = abs(int(re.findall(r"\d+", chosen)[-1]) - int(re.findall(r"\d+", rejected)[-1]))
    return {1: "off by 1", 2: "off by 2", 10: "off by 10", 100: "off by 100"}.get(gap, "far off")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--pairs", type=int, default=200, help="correct > wrong pairs to rank")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    path = resolve_model_path(args.model)
    tok, model = load_tokenizer(path), load_policy(path).eval()
    task = make_task("addition", 2)
    task.build_eval(2 * args.pairs, 1234)
    rows = [r for r in synthetic_preferences(task, 2 * args.pairs, 0, held_out=True)
            if r["kind"] == "correct>wrong"]
    prompts = [r["prompt"] for r in rows]
    ok = (response_logprobs(model, tok, prompts, [r["chosen"] for r in rows])
          > response_logprobs(model, tok, prompts, [r["rejected"] for r in rows])).tolist()
    right = defaultdict(list)
    for r, o in zip(rows, ok):
        right[mistake_kind(r["chosen"], r["rejected"])].append(o)
    total = [ok for v in right.values() for ok in v]
    print(f"{args.model}: {100 * sum(total) / len(total):.1f}% of {len(total)} correct > wrong pairs "
          "ranked right by the model's own likelihood")
    for kind, v in sorted(right.items()):
        print(f"  {kind:11s} {100 * sum(v) / len(v):5.1f}%  (n={len(v)})")


if __name__ == "__main__":
    main()
