"""Sampling through `posttrain tinker-serve --sampler hf` (posttrain's in-process engine, the
default) and `--sampler vllm` (the base model in vLLM, each revision's adapter a vLLM LoRA), on
the embedded SmolLM2-135M-Instruct, in the loop an RL recipe sends:

    .venv/bin/python benchmarks/tinker_sampling.py OUT [--rounds 3] [--steps 4] [--max_tokens 48]

A step: `save_weights_and_get_sampling_client` (a new revision), 16 prompts x 4 samples (2-digit
additions in the chat template, temperature 1, up to `--max_tokens` tokens) sent together, then
one `forward_backward` (`importance_sampling`, the samples' own log-probs, advantages +-1) and an
`optim_step`, as tinker-cookbook's RL loop sends them. One training client (LoRA 32). Each
server's first step is a warm-up, left out. One server at a time, the two samplers in turn
`--rounds` times.

Prints, and writes to OUT/record.json (with provenance): for each sampler, the seconds a
sampling round (64 samples) and a whole step take, and the tokens sampled a second (mean ± sd
over rounds).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from posttrain.run.provenance import provenance  # noqa: E402
from tinker_cookbook import start_server  # noqa: E402

PROMPTS, SAMPLES, RANK, LR = 16, 4, 32, 1e-5


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for i in range(PROMPTS):
        a, b = 10 + (7 * i) % 90, 10 + (11 * i) % 90
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                             tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text)["input_ids"])
    return out


def one_step(tc, asked: list[list[int]], max_tokens: int, k: int) -> dict[str, float]:
    """A new revision, its samples, and the update on them; the seconds of each part."""
    from tinker import types
    t0 = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=SAMPLES, sampling_params=params)
               for p in asked]
    results = [f.result() for f in futures]
    t1 = time.perf_counter()
    data, tokens = [], 0
    for p, res in zip(asked, results):
        for j, s in enumerate(res.sequences):
            full, n = p + s.tokens, len(s.tokens)
            tokens += n
            sign = 1.0 if (j + k) % 2 else -1.0
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": full[1:], "logprobs": [0.0] * (len(p) - 1) + list(s.logprobs),
                "advantages": [0.0] * (len(p) - 1) + [sign] * n}))
    tc.forward_backward(data, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    return {"sample_s": t1 - t0, "step_s": time.perf_counter() - t0, "tokens": tokens}


def measure(out: Path, sampler: str, steps: int, max_tokens: int, tokenizer) -> dict:
    """One server with `sampler`, one training client, a warm-up step and `steps` timed ones."""
    import os
    import tinker
    folder = out / f"{sampler}-{int(time.time())}"
    folder.mkdir(parents=True)
    server, url = start_server(folder, None, ("--sampler", sampler))
    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0")
    try:
        tc = tinker.ServiceClient().create_lora_training_client(
            base_model=json.loads((folder / "server" / "config.json").read_text())["model"],
            rank=RANK, seed=0).result()
        asked = prompts(tokenizer)
        rows = [one_step(tc, asked, max_tokens, k) for k in range(steps + 1)][1:]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    sample_s = sum(r["sample_s"] for r in rows)
    return {"sampler": sampler, "steps": rows, "sample_s": sample_s / steps,
            "step_s": sum(r["step_s"] for r in rows) / steps,
            "tokens_per_s": sum(r["tokens"] for r in rows) / sample_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max_tokens", type=int, default=48)
    args = ap.parse_args()
    args.out = args.out.resolve()     # (each server runs in its own folder)
    from posttrain.config.sections import ModelConfig
    from posttrain.model.loading import load_tokenizer, resolve_model_path
    tokenizer = load_tokenizer(resolve_model_path(ModelConfig.path))
    prov = provenance(" ".join(sys.argv))
    runs = []
    for r in range(args.rounds):
        for sampler in ("hf", "vllm"):
            runs.append({"round": r, **measure(args.out, sampler, args.steps, args.max_tokens, tokenizer)})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "steps"}), flush=True)
    summary = {}
    for sampler in ("hf", "vllm"):
        mine = [x for x in runs if x["sampler"] == sampler]
        summary[sampler] = {k: (statistics.mean(x[k] for x in mine), statistics.pstdev(x[k] for x in mine))
                            for k in ("sample_s", "step_s", "tokens_per_s")}
    record = {"provenance": prov, "args": vars(args) | {"out": str(args.out)}, "runs": runs,
              "summary": summary}
    (args.out / "record.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
