"""`posttrain tinker-serve`: the Tinker API on this machine until Ctrl-C.

    posttrain tinker-serve                               # the embedded SmolLM2, 127.0.0.1:8100
    export TINKER_BASE_URL=http://127.0.0.1:8100 TINKER_API_KEY=tml-local TINKER_TELEMETRY=0
    python -m tinker_cookbook.recipes.math_rl.train model_name=$(posttrain prepare-model) ...

The base model is named by its path as given (`--model.path`) or by the folder it resolves to
(clients such as tinker-cookbook load the tokenizer from the name they pass, so give them the
folder). The run folder holds config.json, metrics.jsonl (every forward_backward and optim_step
of every training client), a TensorBoard run per training client under clients/, the
checkpoints under tinker/ and summary.json when it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

from posttrain.config.sections import ModelConfig
from posttrain.util.errors import ConfigError


def add_command(sub) -> None:
    p = sub.add_parser("tinker-serve", help="Tinker's training and sampling API on this machine, "
                       "for code written with the tinker SDK (docs/tinker.md)")
    p.add_argument("--model.path", dest="model_path", default=ModelConfig.path,
                   help="base model: a local folder or the embedded name (default: embedded)")
    p.add_argument("--model.cache_dir", dest="cache_dir", help="where the embedded model is converted")
    p.add_argument("--port", type=int, default=8100, help="port (default 8100; 0: any free one)")
    p.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1: this machine only)")
    p.add_argument("--api_key", default=os.environ.get("POSTTRAIN_TINKER_API_KEY"),
                   help="the key every request must carry (needed off loopback; env "
                   "POSTTRAIN_TINKER_API_KEY); clients send it as TINKER_API_KEY")
    p.add_argument("--run_dir", type=Path, help="run folder (default runs/tinker-TIME)")
    p.add_argument("--seed", type=int, default=0, help="seed of samples drawn without a seed")
    p.add_argument("--log_tokens", type=int, default=8,
                   help="datums recorded token by token a step and training client, for "
                   "`posttrain view RUN_DIR/clients/*` (0: none)")
    p.add_argument("--max_batch", type=int, default=64,
                   help="waiting requests run as one batch, at most this many (sampling requests "
                   "with the same settings; a client's forward_backward chunks); 1: each alone")
    p.add_argument("--batch_clients", action="store_true",
                   help="also run waiting forward_backwards of different training clients as one "
                   "batch (each row through its own adapter); off: on a CPU it was slower "
                   "(docs/tinker.md)")
    p.add_argument("--sampler", choices=["hf", "vllm"], default="hf",
                   help="what draws samples: hf (posttrain's in-process engine on the training "
                   "model) or vllm (the base model in vLLM, each sampler revision's adapter as a "
                   "vLLM LoRA; docs/tinker.md)")
    p.add_argument("--vllm_max_lora_rank", type=int, default=32,
                   help="--sampler vllm: the largest LoRA rank it samples (vLLM's: 1, 8, 16, 32, "
                   "64, 128, 256, 320, 512)")
    p.set_defaults(fn=cmd_tinker_serve)


def cmd_tinker_serve(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"unexpected arguments {' '.join(overrides)} (posttrain tinker-serve --help)")
    if args.max_batch < 1:
        raise ConfigError(f"--max_batch {args.max_batch}: at least 1 (1: every request alone)")
    if args.sampler == "vllm":
        from posttrain.tinker.sampler_vllm import check_vllm
        check_vllm(args.vllm_max_lora_rank)
    from posttrain.model.loading import load_model
    from posttrain.tinker.server import start_server
    cfg = ModelConfig(path=args.model_path, cache_dir=args.cache_dir)
    model, tokenizer, folder = load_model(cfg)
    run_dir = args.run_dir or Path("runs") / time.strftime("tinker-%Y%m%d-%H%M%S")
    try:
        server = start_server(model, tokenizer, args.model_path, run_dir, host=args.host,
                              port=args.port, api_key=args.api_key, seed=args.seed,
                              aliases=(str(folder),), max_batch=args.max_batch,
                              log_tokens=args.log_tokens, batch_clients=args.batch_clients,
                              sampler=args.sampler, folder=str(folder),
                              max_lora_rank=args.vllm_max_lora_rank)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port} ({e.strerror}); choose another "
                         "with --port (0: any free one)") from None
    (run_dir / "config.json").write_text(json.dumps(
        {"command": "tinker-serve", "model": args.model_path, "folder": str(folder),
         "host": args.host, "port": server.server_address[1], "seed": args.seed,
         "max_batch": args.max_batch, "log_tokens": args.log_tokens,
         "batch_clients": args.batch_clients, "sampler": args.sampler}, indent=1))
    print(f"posttrain tinker-serve: {args.model_path} ({folder}) at {server.base_url}; "
          f"TINKER_BASE_URL={server.base_url}; run folder {run_dir}; Ctrl-C stops", flush=True)
    started, stop = time.monotonic(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):   # (a background job's SIGINT may be ignored)
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        (run_dir / "summary.json").write_text(json.dumps(
            {"requests": server.requests, "minutes": (time.monotonic() - started) / 60,
             "training_clients": sorted(server.service.models.runs)}, indent=1))
    print(f"posttrain tinker-serve: stopped after {server.requests} request(s)", flush=True)
    return 0
