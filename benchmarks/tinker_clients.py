"""Several Tinker training clients at once on one `posttrain tinker-serve`: their forward_backward
requests run as one batch (`--batch_clients`) or each alone (the default).

    .venv/bin/python benchmarks/tinker_clients.py OUT [--clients 2 4] [--rounds 3] [--steps 3]

Each client (a thread here: the SDK only waits on the network) trains its own LoRA adapter (rank
32) on the embedded SmolLM2-135M-Instruct. A step is what the cookbook's loops send: one
forward_backward of 16 datums (2-digit addition prompts in the chat template with their answers,
`cross_entropy` on the answer's tokens, about 50 tokens a datum) and an optim_step, sent together;
the client waits for both, then sends its next step (a closed loop: with two clients, one
client's request arrives while the other's runs, so there is seldom anything to batch; with more
clients than the worker keeps busy, requests wait together). Each client's first step is a
warm-up, left out; the timed steps start together. One server a setting, one setting at a time,
the settings in turn `--rounds` times.

Prints, and writes to OUT/record.json (with provenance): for each number of clients, alone and
batched, the steps a minute of all clients together (mean ± sd over rounds) and the share of
forward_backwards that ran in one batch with another client's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from posttrain.run.provenance import provenance  # noqa: E402
from tinker_cookbook import start_server  # noqa: E402

DATUMS, RANK, LR = 16, 32, 1e-4


def datums(tokenizer, client: int) -> list:
    """A client's batch: its own DATUMS addition problems, weights on the answer's tokens."""
    from tinker import types
    out = []
    for i in range(DATUMS):
        a, b = 10 + (7 * i + 13 * client) % 90, 10 + (11 * i + 5 * client) % 90
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                               tokenize=False, add_generation_prompt=True)
        p_ids = tokenizer(prompt)["input_ids"]
        ids = p_ids + tokenizer(f"{a + b}<|im_end|>")["input_ids"]
        weights = [0.0] * (len(p_ids) - 1) + [1.0] * (len(ids) - len(p_ids))
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}))
    return out


def client_loop(tc, data: list, steps: int, start: threading.Barrier, times: list[float]) -> None:
    """One warm-up step, then `steps` timed steps from when every client is ready."""
    from tinker import types
    adam = types.AdamParams(learning_rate=LR)
    for step in range(steps + 1):
        if step == 1:
            start.wait()
        fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
        fb.result(), opt.result()
    times.append(time.perf_counter())


def measure(folder: Path, clients: int, batched: bool, steps: int) -> dict:
    """One server (`--batch_clients` where `batched`), `clients` training clients at once: their
    steps a minute."""
    import tinker
    from transformers import AutoTokenizer
    from posttrain.model.loading import prepare_embedded
    folder.mkdir(parents=True, exist_ok=True)
    server, url = start_server(folder, None, ("--batch_clients",) if batched else ())
    try:
        service = tinker.ServiceClient(base_url=url)
        tcs = [service.create_lora_training_client(base_model="smollm2-135m-instruct", rank=RANK,
                                                   seed=k).result() for k in range(clients)]
        tokenizer = AutoTokenizer.from_pretrained(prepare_embedded())
        start, ends = threading.Barrier(clients + 1), []
        threads = [threading.Thread(target=client_loop, args=(tc, datums(tokenizer, k), steps, start, ends))
                   for k, tc in enumerate(tcs)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = max(ends) - t0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=300)
    rows = [json.loads(line) for line in (folder / "server" / "metrics.jsonl").read_text().splitlines()]
    fbs = [r for r in rows if r["op"] == "forward_backward"]
    return {"clients": clients, "batched": batched, "steps": clients * steps, "wall_s": wall,
            "steps_per_minute": 60 * clients * steps / wall,
            "batched_share": sum(r["batched_with"] > 0 for r in fbs) / len(fbs)}


def report(runs: list[dict]) -> None:
    print("| clients | --batch_clients | steps a minute, all clients (mean ± sd) | forward_backwards batched with another client's |")
    print("|---|---|---|---|")
    for key in sorted({(r["clients"], r["batched"]) for r in runs}):
        mine = [r for r in runs if (r["clients"], r["batched"]) == key]
        spm = [r["steps_per_minute"] for r in mine]
        sd = statistics.stdev(spm) if len(spm) > 1 else 0.0
        print(f"| {key[0]} | {key[1]} | {statistics.mean(spm):.2f} ± {sd:.2f} | "
              f"{100 * statistics.mean(r['batched_share'] for r in mine):.0f}% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--clients", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps a client (after one warm-up)")
    args = ap.parse_args()
    os.environ.update(TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0")
    command = " ".join(["benchmarks/tinker_clients.py", *sys.argv[1:]])
    runs = []
    for r in range(args.rounds):
        for clients in args.clients:
            for batched in (False, True):
                run = measure(args.out / f"round{r}-c{clients}-{'batched' if batched else 'alone'}",
                              clients, batched, args.steps)
                runs.append({"round": r, **run})
                print(json.dumps(runs[-1]), flush=True)
    (args.out / "record.json").write_text(json.dumps(
        {"provenance": provenance(command), "datums": DATUMS, "rank": RANK, "runs": runs}, indent=1))
    report(runs)


if __name__ == "__main__":
    main()
