"""`posttrain eval`: a model's held-out accuracy (greedy) and pass@k (sampled) on a task, by the
one evaluator (rl/evaluation.py), on the common lifecycle: threads, seed, a run folder (config.json,
metrics.jsonl, eval_samples.jsonl, summary.json; `--run_dir none`: none), the loop over batches
of problems with its progress bar, `--max_minutes` and stop signals (the figures then cover the
problems answered so far, and summary.json says how many)."""

from __future__ import annotations

from typing import Any


from posttrain.config.commands import TrainConfig
from posttrain.envs import close_env, for_tokenizer
from posttrain.rl.evaluation import (Answers, answer, answers_metrics, eval_settings,
                                    sampling_params)
from posttrain.run.lifecycle import finish_job, open_folder, run_steps, start_job
from posttrain.rollout import close_engine
from posttrain.rl.sampling import load_sampled_model, sampling_engine, sampling_inputs


def evaluate_model(cfg: TrainConfig, k: int = 1, samples: int = 0, show_progress: bool = True,
                   model: Any = None, tokenizer: Any = None) -> dict[str, Any]:
    """Greedy accuracy on the task's held-out problems (split by domain and meta flags), and with
    k > 1 pass@k from max(samples, k) answers per problem at rollout.temperature (seeded by
    `seed`). Returns the summary: the metrics, `problems` answered of `of`, the run folder."""
    job = start_job("eval", cfg, None, show_progress)
    task, env, scorer = sampling_inputs(cfg, judge=False)
    engine = None
    try:   # (the reward sandbox and the engine stop however the command ends)
        model, tokenizer, path = load_sampled_model(cfg, model, tokenizer)
        env = for_tokenizer(env, tokenizer)
        engine = sampling_engine(cfg, path, model, tokenizer)
        open_folder(job, cfg.to_dict())
        greedy, sampled, signal_name = answer_held_out(job, engine, tokenizer, env, scorer,
                                                       task.eval_problems, k, samples)
    finally:
        if engine is not None:
            close_engine(engine)
        scorer.close()
        close_env(env)
    return write_results(job, task.eval_problems, greedy, sampled, k, env, signal_name)


def answer_held_out(job, engine, tokenizer, env, scorer, problems, k: int, samples: int):
    """The loop over batches of held-out problems: greedy answers, and with k > 1 `max(samples,
    k)` sampled ones each. Returns (greedy, sampled, the signal that stopped it or None)."""
    cfg = job.cfg
    settings = eval_settings(cfg)
    n = max(samples, k) if k > 1 else 1
    greedy, sampled = Answers(), Answers()

    def answer_batch(step: int) -> None:
        chunk = problems[(step - 1) * settings.batch_size:step * settings.batch_size]
        answer(engine, tokenizer, env, chunk, scorer, settings, sampling_params(settings, 1, 1.0),
               1, None, greedy)
        if n > 1:
            answer(engine, tokenizer, env, chunk, scorer, settings,
                   sampling_params(settings, n, cfg.rollout.temperature), n, job.generator, sampled)
    batches = -(-len(problems) // settings.batch_size)
    return greedy, sampled, run_steps(job, batches, answer_batch, lambda step: None, "eval")


def write_results(job, problems, greedy: Answers, sampled: Answers, k: int, env,
                  signal_name: str | None) -> dict[str, Any]:
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
