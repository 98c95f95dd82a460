"""How often an LLM judge agrees with the verifier on held-out answers of known correctness.

    .venv/bin/python benchmarks/judge_agreement.py URL MODEL EVAL_SAMPLES OUT [--template yes_no]

Reads a run's eval_samples.jsonl (the last evaluation's answers, each with the verifier's
verdict), asks the judge behind the OpenAI-compatible URL about every one (posttrain's own
`rewards.judge.Judge`, no cache) and writes OUT/record.json: the answers judged, how many the
verifier accepts, the judge's Yes / No / unscorable counts, agreement with the verifier over the
scored ones, the judge's seconds, and the provenance of the code that measured it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from posttrain.rewards.judge import Judge, JudgeSettings  # noqa: E402
from posttrain.run.provenance import provenance  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("eval_samples", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--template", default="yes_no")
    args = ap.parse_args()
    prov = provenance(" ".join(sys.argv))
    samples = [json.loads(line) for line in args.eval_samples.read_text().splitlines()][-1]["samples"]
    judge = Judge(JudgeSettings(args.url, args.model, args.template, retries=1, concurrency=1,
                                max_tokens=48, cache=None))
    t0 = time.perf_counter()
    out = judge([s["prompt"] for s in samples], [s["completion"] for s in samples],
                [s["answer"] for s in samples], group_size=1)
    seconds = time.perf_counter() - t0
    judge.close()
    scored = [(s, v) for s, v in zip(samples, out.scores) if v is not None]
    record = {"provenance": prov, "eval_samples": str(args.eval_samples), "template": args.template,
              "judged": len(samples), "verifier_correct": sum(s["correct"] for s in samples),
              "judge_yes": sum(v >= 0.5 for _, v in scored), "judge_no": sum(v < 0.5 for _, v in scored),
              "unscorable": out.unscorable,
              "agreement": sum((v >= 0.5) == s["correct"] for s, v in scored) / max(len(scored), 1),
              "judge_seconds": round(seconds, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "provenance"}, indent=1))


if __name__ == "__main__":
    main()
