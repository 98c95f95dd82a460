"""tinker-cookbook's recipes, run unchanged (PyPI's tinker-cookbook 0.6.1) against
`posttrain tinker-serve` on the embedded SmolLM2-135M-Instruct, on this CPU, one run at a time
for at most `--minutes` each:
- `--recipe arithmetic`: the arithmetic RL recipe (`tinker_cookbook/recipes/math_rl/train.py`).
  posttrain's own GRPO beside it is benchmarks/learning.py (the command: the record's
  PROVENANCE.md).
- `--recipe sl`: the basic SL recipe (`tinker_cookbook/recipes/sl_basic.py`) on the conversation
  file the cookbook ships (`example_data/conversations.jsonl`, 128 conversations, 16 held out):
  LoRA 32, lr 2e-4 linear to 0 (the recipe's), 8 conversations a step, 3 epochs, the held-out NLL
  (the cookbook's own evaluator, through `compute_logprobs`) every 4 steps; run K shuffles with
  seed K. sl_basic looks a renderer up by the model's name before it reads a flag, so a local
  folder cannot be named: the run uses the recipe's default name, `Qwen/Qwen3.5-9B-Base` (renderer
  `role_colon`), as a link in the run's folder to the embedded model, where the cookbook loads its
  tokenizer from and the server (started in that folder) loads the model from. (Its generic entry
  point, `python -m tinker_cookbook.supervised.train`, does not start in 0.6.1: chz refuses its
  un-annotated lambda.)
- `--recipe posttrain-sl`: posttrain's own `sft` beside it, on each run's same split (made as the
  cookbook's builder makes it) with the recipe's settings as the served run gets them (LoRA 32,
  alpha 32, on attention, MLP and unembedding; AdamW (0.9, 0.95), no weight decay or clipping;
  lr 2e-4 linear to 0; 8 a step; 3 epochs; held-out NLL every 4 steps), rendered by the model's
  own chat template (not role_colon), so its NLL values are of other token streams.
Rendered by benchmarks/tables.py (tables tinker-cookbook and tinker-cookbook-sl, docs/tinker.md).

    .venv/bin/python benchmarks/tinker_cookbook.py OUT [--recipe arithmetic|sl|posttrain-sl] [--runs 3] [--minutes 10]

The cookbook lives in its own venv (.venv-cookbook, made on first use: its declared
`tml-renderers>=0.4.1` is not on PyPI's index here and the arithmetic path never imports it, so
the cookbook goes in with --no-deps and the packages that path imports are named). Its flags:
the `role_colon` renderer (the recipe cannot look up a renderer for a local folder),
`loss_fn=importance_sampling` (the recipe's default `stable_reinforce` is refused by the server:
its formula is not published), 16 problems x 4 samples a step, LoRA rank 32, lr 1e-4, at most 5
new tokens, as the recipe's own defaults except the batch (100 x 4) and the lr (1e-5).

Each run's OUT/runK holds the cookbook's metrics.jsonl (per step; arithmetic: `env/all/correct`,
`env/all/reward/total`, timings; sl: `train_mean_nll`, `test/nll`), the server's run folder
(metrics.jsonl of every request, summary.json) and record.json with the provenance, the commands
and the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from posttrain.run.provenance import provenance  # noqa: E402

VENV = ROOT / ".venv-cookbook"
PACKAGES = ["tinker==0.38.0", "chz", "blobfile", "datasets", "sympy", "pylatexenc", "termcolor",
            "rich", "tqdm", "pillow", "transformers"]
FLAGS = ["env=arithmetic", "renderer_name=role_colon", "lora_rank=32", "group_size=4",
         "groups_per_batch=16", "learning_rate=1e-4", "max_tokens=5",
         "loss_fn=importance_sampling", "save_every=20", "eval_every=0",
         "behavior_if_log_dir_exists=delete"]


def cookbook_python() -> Path:
    """The cookbook's venv, made once: torch 2.13.0 (the CPU build on this disk), the cookbook
    without its declared dependencies, then what its arithmetic path imports."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, "--no-deps", "tinker-cookbook==0.6.1"], check=True)
        subprocess.run([*pip, "-c", str(ROOT / "scripts/constraints-cpu.txt"), *PACKAGES], check=True)
    return python


def start_server(folder: Path, model: str | None, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`posttrain tinker-serve` (of `model`: a name in `folder`; None: the embedded model; `extra`
    flags) on a free port, in `folder`; its URL from the line it prints."""
    log = (folder / "server.log").open("w")
    # (PYTHONPATH: this checkout's code, not the editable install's)
    proc = subprocess.Popen([str(ROOT / ".venv/bin/python"), "-m", "posttrain.cli", "tinker-serve",
                             "--port", "0", "--run_dir", str(folder / "server"),
                             *(["--model.path", model] if model else []), *extra],
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=folder,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    for line in proc.stdout:        # (vLLM, as the sampler, logs to stdout too)
        if "TINKER_BASE_URL=" in line:   # (the rest drained into the log: a full pipe would block)
            threading.Thread(target=lambda: [log.write(x) for x in proc.stdout], daemon=True).start()
            return proc, line.split("TINKER_BASE_URL=")[1].split(";")[0]
    proc.kill()
    raise RuntimeError(f"tinker-serve did not start (see {folder / 'server.log'})")


SL_MODEL = "Qwen/Qwen3.5-9B-Base"   # sl_basic's default name (renderer role_colon): a link here


def sl_flags(model: str, seed: int) -> list[str]:
    """The SL run's flags: the shipped conversation file, the role_colon renderer, sl_basic's
    lr and schedule; the dataset builder given whole (chz cannot patch the recipe's instance)."""
    python = cookbook_python()
    data = subprocess.run([str(python), "-c", "import tinker_cookbook, os; print(os.path.join("
                           "os.path.dirname(tinker_cookbook.__file__), 'example_data', "
                           "'conversations.jsonl'))"], check=True, capture_output=True,
                          text=True).stdout.strip()
    common = "dataset_builder.common_config"
    return ["dataset_builder=FromConversationFileBuilder", f"dataset_builder.file_path={data}",
            "dataset_builder.test_size=16", f"dataset_builder.shuffle_seed={seed}",
            f"{common}.model_name_for_tokenizer={model}", f"{common}.renderer_name=role_colon",
            f"{common}.max_length=512", f"{common}.batch_size=8",
            "num_epochs=3", "eval_every=4", "save_every=20"]


RECIPES = {"arithmetic": "tinker_cookbook.recipes.math_rl.train",
           "sl": "tinker_cookbook.recipes.sl_basic"}
# posttrain's own `sft` with sl_basic's settings as the served run gets them: LoRA 32 with
# alpha 32 on the attention, MLP and unembedding (tinker-serve's LoRA of rank 32), AdamW with the
# SDK's (0.9, 0.95), no weight decay and no clipping, lr 2e-4 linear to 0, 8 a step, 3 epochs
POSTTRAIN_SL = ["--lora.rank", "32", "--lora.alpha", "32", "--lora.target_modules",
                "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head",
                "--optim.lr", "2e-4", "--optim.schedule", "linear", "--optim.beta2", "0.95",
                "--optim.weight_decay", "0", "--optim.max_grad_norm", "1e9", "--batch_size", "8",
                "--optim.epochs", "3", "--eval_every", "4", "--max_len", "512"]


def split_conversations(folder: Path, seed: int) -> tuple[Path, Path]:
    """Run K's split of the shipped file, as FromConversationFileBuilder makes it: datasets'
    shuffle with seed K, the first 16 held out. Returns (train.jsonl, test.jsonl)."""
    import datasets
    file = sl_flags(SL_MODEL, seed)[1].split("=", 1)[1]
    rows = [json.loads(line) for line in Path(file).read_text().splitlines() if line.strip()]
    shuffled = datasets.Dataset.from_list(rows).shuffle(seed=seed)
    out = (folder / "train.jsonl", folder / "test.jsonl")
    for path, part in zip(out, (shuffled.skip(16), shuffled.take(16))):
        path.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in part))
    return out


def run_posttrain_sl(folder: Path, seed: int, minutes: float) -> dict:
    """posttrain's own `sft` on run K's split (the embedded model, its own chat template)."""
    train, test = split_conversations(folder, seed)
    command = [str(ROOT / ".venv/bin/python"), "-m", "posttrain.cli", "sft",
               "--data.train_path", str(train), "--data.eval_path", str(test), *POSTTRAIN_SL,
               "--seed", str(seed), "--run_dir", str(folder / "posttrain"), "--no-progress"]
    start = time.monotonic()
    with (folder / "posttrain.log").open("w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=minutes * 60,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    return {"command": command, "exit_code": code, "wall_s": time.monotonic() - start}


def record_posttrain_sl(folder: Path, seed: int, minutes: float, head: dict) -> None:
    """Run K of posttrain's own sft, its record.json (the weights not kept)."""
    ran = run_posttrain_sl(folder, seed, minutes)
    record = {**head, **ran, "recipe": "posttrain-sl",
              **posttrain_sl_figures(folder / "posttrain" / "metrics.jsonl", ran["wall_s"])}
    for weights in ("final_model", "checkpoints"):
        shutil.rmtree(folder / "posttrain" / weights, ignore_errors=True)
    (folder / "record.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k.startswith(("steps", "train_nll_f",
                                                                        "train_nll_l"))}), flush=True)


def posttrain_sl_figures(metrics: Path, wall_s: float) -> dict:
    """As sl_figures, from posttrain's metrics.jsonl (loss/sft, eval/nll)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r["loss/sft"] for r in rows if "loss/sft" in r]
    held = [(r["step"], r["eval/nll"]) for r in rows if "eval/nll" in r]
    return {"steps": len(train), "steps_per_minute": len(train) / (wall_s / 60),
            "train_nll_first_3_steps": sum(train[:3]) / 3, "train_nll_last_3_steps": sum(train[-3:]) / 3,
            "test_nll_per_eval": held, "train_nll_per_step": train,
            "train_s": sum(r["perf/step_s"] for r in rows if "perf/step_s" in r),
            "eval_s": sum(r["perf/eval_s"] for r in rows if "perf/eval_s" in r)}


def run_cookbook(folder: Path, url: str, model: str, minutes: float,
                 recipe: tuple[str, list[str]]) -> dict:
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": "tml-local",
           "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    module, flags = recipe
    command = [str(cookbook_python()), "-m", module,
               f"model_name={model}", f"log_path={folder / 'cookbook'}", *flags]
    start = time.monotonic()
    with (folder / "cookbook.log").open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
        try:
            code = proc.wait(timeout=minutes * 60)
        except subprocess.TimeoutExpired:          # (the budget: the steps logged so far count)
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    return {"command": command, "exit_code": code, "wall_s": time.monotonic() - start}


def sl_figures(metrics: Path, wall_s: float) -> dict:
    """Training NLL (the mean of the first and of the last 3 steps) and the held-out NLL at each
    evaluation (the first is before any step)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "train_mean_nll" in r]
    held = [(r["step"], r["test/nll"]) for r in rows if "test/nll" in r]
    mean = lambda rs: sum(r["train_mean_nll"] for r in rs) / max(len(rs), 1)
    return {"steps": len(train), "steps_per_minute": len(train) / (wall_s / 60),
            "train_nll_first_3_steps": mean(train[:3]), "train_nll_last_3_steps": mean(train[-3:]),
            "test_nll_per_eval": held, "train_nll_per_step": [r["train_mean_nll"] for r in train]}


def figures(metrics: Path, wall_s: float) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "env/all/correct" in r]
    first, last = rows[:3], rows[-3:]
    mean = lambda rs: sum(r["env/all/correct"] for r in rs) / max(len(rs), 1)
    return {"steps": len(rows), "steps_per_minute": len(rows) / (wall_s / 60),
            "correct_first_3_steps": mean(first), "correct_last_3_steps": mean(last),
            "correct_per_step": [r["env/all/correct"] for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--recipe", choices=sorted(RECIPES) + ["posttrain-sl"], default="arithmetic")
    args = ap.parse_args()
    args.out = args.out.resolve()     # (the cookbook runs in its run's folder)
    prov = provenance(" ".join(sys.argv))
    model = subprocess.run([str(ROOT / ".venv/bin/posttrain"), "prepare-model"], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1]
    cookbook_python()
    for k in range(args.runs):
        folder = args.out / f"run{k}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        if args.recipe == "posttrain-sl":
            record_posttrain_sl(folder, k, args.minutes, {"provenance": prov, "model": model})
            continue
        name, served, flags = model, None, FLAGS
        if args.recipe == "sl":
            (folder / SL_MODEL).parent.mkdir(parents=True)
            (folder / SL_MODEL).symlink_to(model)
            name = served = SL_MODEL
            flags = sl_flags(name, k)
        server, url = start_server(folder, served)
        try:
            ran = run_cookbook(folder, url, name, args.minutes, (RECIPES[args.recipe], flags))
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(folder / "server" / "tinker", ignore_errors=True)   # (adapter weights)
        read = figures if args.recipe == "arithmetic" else sl_figures
        record = {"provenance": prov, **ran, "recipe": args.recipe, "flags": flags, "model": model,
                  **read(folder / "cookbook" / "metrics.jsonl", ran["wall_s"])}
        (folder / "record.json").write_text(json.dumps(record, indent=1))
        print(json.dumps({k: v for k, v in record.items() if k.startswith(("steps", "correct_",
                                                                            "train_nll_f", "train_nll_l"))}),
              flush=True)


if __name__ == "__main__":
    main()
