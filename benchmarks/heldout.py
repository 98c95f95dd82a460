"""One held-out evaluator for every side of a benchmark: plain transformers, nothing of posttrain's
sampler or trainer, so posttrain and TRL models are scored by exactly the same code.

Greedy `model.generate` (left-padded batches, at most 24 new tokens), the answer cut at the first
blank line, scored by posttrain's verifier (the last number of the response, math-verify). The
problems are posttrain's built-in addition held-out set (fixed seed 1234), disjoint from training.
Importable from any virtual environment that has torch, transformers and math-verify (it reads
posttrain's task and verifier modules from this checkout, which need only those).

    python benchmarks/heldout.py MODEL_DIR [--digits 3 --n 300] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def problems(digits: int = 2, n: int = 200, seed: int = 1234):
    from posttrain.data.tasks import addition_task
    task = addition_task(digits)
    task.build_eval(n, seed)
    return task.eval_problems


def greedy_accuracy(model, tokenizer, probs, max_new_tokens: int = 24, batch_size: int = 50,
                    stop: str = "\n\n") -> dict:
    """Held-out greedy accuracy of `model` on `probs` (and split by carry)."""
    import torch
    from posttrain.rewards.verifiers import math_correct

    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ok: list[bool] = []
    with torch.no_grad():
        for i in range(0, len(probs), batch_size):
            chunk = probs[i:i + batch_size]
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}],
                                                   add_generation_prompt=True, tokenize=False)
                     for p in chunk]
            enc = tokenizer(texts, return_tensors="pt", padding=True,
                            add_special_tokens=False).to(model.device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad, temperature=None, top_p=None, top_k=None)
            for p, row in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
                text = tokenizer.decode(row, skip_special_tokens=True).split(stop)[0]
                ok.append(bool(math_correct(text, p)))
    tokenizer.padding_side = side
    model.train(was_training)
    carry = [p.meta.get("carry") for p in probs]
    res = {"accuracy": sum(ok) / max(len(ok), 1)}
    for flag in (True, False):
        idx = [i for i, c in enumerate(carry) if c is flag]
        if idx:
            res[f"accuracy_carry={str(flag).lower()}"] = sum(ok[i] for i in idx) / len(idx)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto", help="auto: the GPU where there is one, else cpu")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model.to(device)
    print(json.dumps(greedy_accuracy(model, tok, problems(args.digits, args.n))))


if __name__ == "__main__":
    main()
