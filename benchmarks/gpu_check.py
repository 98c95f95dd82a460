"""The prepared GPU check: short runs of the real trainer on one CUDA GPU, printing throughput.

    python benchmarks/gpu_check.py --model MODEL_DIR [--random-init] [--out DIR]

MODEL_DIR is a Hugging Face folder (config + tokenizer; weights unless --random-init, which builds
the architecture with random weights: throughput is the same, learning is not measured). It runs,
each for a few steps: GRPO (P 32 x G 8, 128 new tokens, bf16 autocast), PPO with a separate value
model, GRPO with LoRA and a KL (reference = adapters off), and the vLLM backend when `vllm`
imports. For each it prints generation tokens/s, step time and its parts, peak GPU memory, and
the trainer-vs-sampler log-prob mismatch of the sampled tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from posttrain.run.provenance import provenance  # noqa: E402


def env_report() -> dict:
    import transformers
    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)}
    try:
        import vllm
        out["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001 - report, do not fail
        out["vllm"] = f"not importable ({type(e).__name__}: {e})"[:200]
    return out


def random_model(src: Path, dst: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def run(name: str, model_dir: Path, out: Path, *extra: str) -> dict:
    from posttrain.config.options import load_config
    from posttrain.rl.loop import train
    overrides = ["--model.path", str(model_dir), "--run_dir", str(out / name), "--steps", "4",
                 "--max_minutes", "null", "--eval_every", "0", "--data.eval_size", "64",
                 "--rollout.prompts_per_step", "32", "--rollout.group_size", "8",
                 "--rollout.max_new_tokens", "128", "--rollout.stop", "", "--tensorboard", "false",
                 "--model.autocast", "bfloat16", "--optim.micro_batch_size", "64", *extra]
    cfg = load_config(Path(__file__).resolve().parents[1] / "posttrain/recipes/addition_grpo.yaml",
                      overrides)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    summary = train(cfg, show_progress=False)
    rows = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
    steps = [r for r in rows if "perf/step_s" in r][1:]      # the first step includes warm-up
    mean = lambda k: sum(r.get(k) or 0 for r in steps) / max(len(steps), 1)  # noqa: E731
    return {"name": name, "steps_timed": len(steps), "step_s": mean("perf/step_s"),
            "generate_s": mean("perf/generate_s"), "update_s": mean("perf/update_s"),
            "reference_s": mean("perf/reference_s"),
            "generated_tokens_per_s": mean("perf/generated_tokens_per_s"),
            "logp_mismatch": mean("rollout/logp_mismatch"),
            "is_ratio_max": max((r.get("rollout/is_ratio_max") or 0 for r in steps), default=0),
            "tis_weight_mean": mean("rollout/tis_weight_mean"),
            "old_logprobs_s": mean("perf/old_logprobs_s"),
            "response_tokens_mean": mean("rollout/length_mean"),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
            "eval_accuracy_after": summary.get("eval_after", {}).get("eval/accuracy"),
            "wall_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--out", type=Path, default=Path("/tmp/gpu_check"))
    p.add_argument("--only", default="grpo,ppo,lora,vllm")
    args = p.parse_args()
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("posttrain").setLevel(logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"env": env_report(), "runs": [],
              "provenance": provenance(" ".join(["python", *sys.argv]))}
    print(json.dumps(report["env"]), flush=True)
    model_dir = random_model(args.model, args.out / "model") if args.random_init else args.model
    report["weights"] = "random (architecture only)" if args.random_init else str(args.model)
    # random weights never answer correctly: a toy reward (first letter a-e) gives the update work
    toy = (["--reward.verifier", "none", "--reward.functions", "tests.toy_rewards:first_letter_a_to_e"]
           if args.random_init else [])
    plans = {"grpo": ("grpo", []),
             "ppo": ("ppo", ["--preset", "ppo", "--algorithm.kl_coef", "0.05"]),
             "lora": ("lora", ["--lora.rank", "16", "--algorithm.kl_coef", "0.02",
                               "--optim.lr", "1e-4"]),
             "vllm": ("vllm", ["--rollout.backend", "vllm"])}
    for key in args.only.split(","):
        name, extra = plans[key]
        extra = [*toy, *extra]
        if key == "vllm" and not report["env"]["vllm"][:1].isdigit():
            report["runs"].append({"name": name, "skipped": report["env"]["vllm"]})
            continue
        try:
            res = run(name, model_dir, args.out, *extra)
        except Exception as e:  # noqa: BLE001 - one failing run must not hide the others
            res = {"name": name, "error": f"{type(e).__name__}: {e}",
                   "trace": traceback.format_exc()[-1500:]}
        report["runs"].append(res)
        print(json.dumps(res), flush=True)
        # after every run: a check stopped by a time limit keeps the runs that finished
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
