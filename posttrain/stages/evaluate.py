"""`posttrain eval`: a model's held-out accuracy (greedy) and pass@k (sampled) on a task, by the
one evaluator (sampling/evaluation.py), on the common lifecycle: threads, seed, a run folder (config.json,
metrics.jsonl, eval_samples.jsonl, summary.json; `--run_dir none`: none), the loop over batches
of problems with its progress bar, `--max_minutes` and stop signals (the figures then cover the
problems answered so far, and summary.json says how many)."""

from __future__ import annotations

from typing import Any

from posttrain.config.commands import TrainConfig
from posttrain.data.tasks import Problem
from posttrain.run.lifecycle import Job, Steps, finish_job, open_folder, start_job
from posttrain.sampling.evaluation import (Answers, answer, answers_metrics, eval_settings,
                                           sampling_params)
from posttrain.sampling.service import Sampling, open_sampling


def evaluate_model(cfg: TrainConfig, k: int = 1, samples: int = 0, show_progress: bool = True,
                   model: Any = None, tokenizer: Any = None) -> dict[str, Any]:
    """Greedy accuracy on the task's held-out problems (split by domain and meta flags), and with
    k > 1 pass@k from max(samples, k) answers per problem at rollout.temperature (seeded by
    `seed`). Returns the summary: the metrics, `problems` answered of `of`, the run folder."""
    job = start_job("eval", cfg, None, show_progress)
    with open_sampling(job, model, tokenizer) as sampling:
        open_folder(job, cfg.to_dict())
        problems = sampling.prompts.task.eval_problems
        greedy, sampled, signal_name = answer_held_out(job, sampling, problems, k=k,
                                                       samples=samples)
    return write_results(job, problems, greedy, sampled, sampling.env, signal_name, k=k)


def answer_held_out(job: Job, sampling: Sampling, problems: list[Problem], *, k: int = 1,
                    samples: int = 0) -> tuple[Answers, Answers, str | None]:
    """The loop over batches of held-out problems: greedy answers, and with k > 1 `max(samples,
    k)` sampled ones each (from the job's generator). Returns (greedy, sampled, the signal that
    stopped it or None)."""
    cfg, settings = job.cfg, eval_settings(job.cfg)
    n = max(samples, k) if k > 1 else 1
    greedy, sampled, size = Answers(), Answers(), settings.batch_size
    greedy_setup = sampling.view(generator=None)   # (greedy: no draws)
    with Steps(job, -(-len(problems) // size), "eval") as steps:
        for step in steps:
            with steps.timed(step):
                chunk = problems[(step - 1) * size:step * size]
                answer(greedy_setup, chunk, sampling_params(settings, 1, 1.0), greedy,
                       episodes=settings.episodes)
                if n > 1:
                    answer(sampling, chunk, sampling_params(settings, n, cfg.rollout.temperature),
                           sampled, samples=n, episodes=settings.episodes)
    return greedy, sampled, steps.stop_signal


def write_results(job, problems, greedy: Answers, sampled: Answers, env,
                  signal_name: str | None, *, k: int = 1) -> dict[str, Any]:
    """metrics.jsonl's row, eval_samples.jsonl (greedy answers; sampled: each problem's first),
    summary.json."""
    res = answers_metrics(greedy, problems, 1, k, env)
    samples, lengths = res.pop("_samples"), res.pop("_lengths")
    res["eval/length_mean"] = sum(lengths) / max(len(lengths), 1)
    job.logger.append("eval_samples.jsonl", {"step": 0, "label": "greedy", "samples": samples})
    if sampled.correct:
        res_k = answers_metrics(sampled, problems, sampled.correct[0].shape[1], k, env)
        res[f"eval/pass@{k}"] = res_k[f"eval/pass@{k}"]
        job.logger.append("eval_samples.jsonl", {"step": 0, "label": f"sampled (pass@{k})",
                                                 "samples": res_k["_samples"]})
    job.logger.log(0, res)
    summary = {"run_dir": str(job.run_dir) if job.run_dir else None, "model": job.cfg.model.path,
               "problems": len(samples), "of": len(problems), **res, "samples": samples[:3]}
    if signal_name is not None:
        summary["stopped_by"] = signal_name
    return finish_job(job, summary)
