"""`posttrain serve`: a model behind the OpenAI-compatible endpoint (envs/endpoint.py) on
loopback, for an LLM judge (`--reward.judge http://127.0.0.1:PORT/v1`), an agent harness, or a
look at a trained model with any OpenAI client. Each request is its own conversation (as vLLM's
server); replies carry the exact token ids and log-probs, and every call is appended to
`served.jsonl` in the run folder.

Requests are answered one at a time by the in-process engine, which is what a 2-core machine
can do; for throughput serve the model with vLLM, which speaks the same protocol.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from posttrain.envs.endpoint import Endpoint
from posttrain.model.prompts import _ids
from posttrain.sampling.service import Sampling, load_sampled_model, sampling_engine
from posttrain.rollout import SamplingParams
from posttrain.rollout.driven import PolicyTurn, plain
from posttrain.run.lifecycle import Job, finish_job, open_folder, start_job


class ServedModel:
    """One request, one sample: the chat template applied to the messages (tools too), the
    request's temperature (0: greedy), top_p, max_tokens (up to rollout.max_new_tokens) and
    stop strings, each checked by the endpoint (envs/endpoint.py sampling_fields); `seed` and
    the penalties are accepted and not applied (samples come from the run's generator);
    `record(row)` gets each call."""

    def __init__(self, sampling: Sampling, record=None) -> None:
        self.service = sampling            # (owns the engine: stop_serving closes it)
        self.engine, self.tokenizer, self.cfg = sampling.engine, sampling.tokenizer, sampling.cfg
        self.generator, self.record = sampling.generator, record
        self.served = 0                    # requests answered
        self.vocab_size = len(self.tokenizer)   # (the endpoint refuses a prompt id outside it)
        self.lock = threading.Lock()

    def chat(self, messages, tools=None, max_tokens=None, **options) -> PolicyTurn:
        ids = _ids(self.tokenizer.apply_chat_template(
            [plain(m) for m in messages], add_generation_prompt=True, tokenize=True,
            **({"tools": tools} if tools else {}), **self.cfg.data.chat_template_kwargs))
        return self.sample(ids, max_tokens, options)

    def shown_as(self, content: str | None) -> None:
        """Nothing to keep: each request is its own conversation."""

    def complete(self, prompt, max_tokens=None, **options) -> PolicyTurn:
        ids = (self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
               if isinstance(prompt, str) else list(prompt))
        return self.sample(ids, max_tokens, options)

    def sample(self, ids: list[int], max_tokens: int | None, options: dict[str, Any]) -> PolicyTurn:
        r = self.cfg.rollout
        n = min(max_tokens or r.max_new_tokens, r.max_new_tokens)
        with self.lock:   # (one request at a time; its record line whole)
            params = request_params(options, n, r.temperature, r.top_p)
            out = self.engine.generate([ids], 1, params, self.generator)
            self.served += 1
            k = int(out.response_mask_B_T[0].sum())
            got, logps = out.response_ids_B_T[0, :k].tolist(), out.logp_B_T[0, :k].tolist()
            turn = PolicyTurn(self.tokenizer.decode(got, skip_special_tokens=True), ids, got,
                              logps, "length" if bool(out.truncated_B[0]) else "stop",
                              [self.tokenizer.decode([t]) for t in got])
            if self.record is not None:
                self.record({"time": time.time(), "prompt_token_ids": ids, "token_ids": got,
                             "logprobs": logps, "finish_reason": turn.finish_reason})
        return turn


GREEDY_BELOW = 1e-5     # vLLM's _SAMPLING_EPS: a lower temperature samples greedily


def request_params(body: dict[str, Any], max_new: int, temperature: float,
                   top_p: float) -> SamplingParams:
    """A request's sampling settings over the served defaults (temperature 0: greedy). A
    temperature below GREEDY_BELOW is greedy too, as vLLM takes it: dividing the logits by 1e-300
    makes them infinite and sampling fails."""
    t = float(body.get("temperature", temperature))
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    greedy = t < GREEDY_BELOW
    return SamplingParams(max_new, 1.0 if greedy else t, float(body.get("top_p") or top_p),
                          greedy=greedy, stop=stop)


def serve_model(cfg, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
                model=None, tokenizer=None) -> tuple[Endpoint, Job]:
    """Load the model (default: the embedded one), start the endpoint; returns it (its
    `base_url`) and the job (its run folder) once it listens. `stop_serving` ends both."""
    job = start_job("serve", cfg, None, show_progress=False)
    model, tokenizer, path = load_sampled_model(cfg, model, tokenizer)
    open_folder(job, cfg.to_dict())
    sampling = Sampling(cfg=cfg, engine=sampling_engine(cfg, path, model, tokenizer),
                        tokenizer=tokenizer, generator=job.generator)
    record = (lambda row: job.logger.append("served.jsonl", row)) if job.run_dir else None
    try:
        endpoint = Endpoint(name or str(cfg.model.path), host, port,
                            default=ServedModel(sampling, record))
    except BaseException:   # (the port is taken: the engine stops, the logs close)
        try:
            sampling.close()
        finally:
            job.logger.close()
        raise
    return endpoint, job


def stop_serving(endpoint: Endpoint, job: Job) -> dict[str, Any]:
    """The endpoint closed, the engine stopped, summary.json written (the requests answered)."""
    backend = endpoint.default
    try:
        endpoint.close()
    finally:
        backend.service.close()
    return finish_job(job, {"run_dir": str(job.run_dir) if job.run_dir else None,
                            "model": endpoint.model, "served": backend.served})


def serve_until_stopped(cfg, host: str, port: int, name: str | None) -> None:
    """`posttrain serve`: the endpoint until Ctrl-C."""
    try:
        endpoint, job = serve_model(cfg, host, port, name)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); choose another with "
                         "--port (0: any free one)") from None
    where = job.run_dir / "served.jsonl" if job.run_dir else "nothing"
    print(f"posttrain serve: {endpoint.model} at {endpoint.base_url} (OpenAI-compatible; calls "
          f"recorded in {where}; Ctrl-C stops)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        summary = stop_serving(endpoint, job)
    print(f"posttrain serve: stopped after {summary['served']} request(s)", flush=True)
