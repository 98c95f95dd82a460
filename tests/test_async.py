"""Sampling ahead (batch_source.Ahead) with a scripted engine: the staleness bound, the trainer's
and the engine's waits, stale batches dropped and their prompts drawn again, evaluation and
checkpoints between two batches, and in-flight batches saved and restored. On the real collect
(sampler, HF engine on its own copy of a tiny model, verifier) with max_staleness 1 and 0: which
weights sampled each trained batch. The same machinery with the real vLLM engine:
tests/test_async_vllm.py."""

import threading
import time
from statistics import median
from collections import Counter

import pytest
import torch

from posttrain.sampling.setup import SamplingSetup

from posttrain.sampling.batch import ScoredBatch
from posttrain.sampling.sources import Ahead, InTurn, load_sampled, make_batch_source, save_sampled
from posttrain.config.commands import ConfigError
from posttrain.data.source import PromptStream
from posttrain.data.tasks import Problem, Task
from posttrain.config.options import load_config
from posttrain.rollout.base import Rollout

P, G = 2, 2


def numbered_task() -> Task:
    """A stream of distinct prompts ('p0', 'p1', ... in a shuffled order)."""
    pool = [Problem(f"p{i}", str(i)) for i in range(10_000)]
    return Task("file", lambda rng: pool[0], train_pool=pool)


class ScriptedEngine:
    """Holds a weight version; `publish` writes one, `load` takes it (each may be slowed)."""

    def __init__(self, load_s: float = 0.0) -> None:
        self.holds, self.loads, self.load_s = 0, [], load_s
        self.busy = threading.Lock()        # one user at a time, as the trainer guarantees
        self.overlaps = 0
        self.closed = False
        self.discarded = []

    def publish(self):
        return object()

    def load(self, written) -> None:
        self.use()
        try:
            self.loads.append(written)
            time.sleep(self.load_s)
        finally:
            self.busy.release()

    def discard(self, written) -> None:
        self.discarded.append(written)

    def use(self) -> None:
        """Take the engine, counting a caller that found it in use (sampling and loading at once)."""
        if not self.busy.acquire(blocking=False):
            self.overlaps += 1
            self.busy.acquire()

    def close(self) -> None:
        self.closed = True


def collector(sampler: PromptStream, engine: ScriptedEngine, gen_s: float, seen: list):
    """Sample a batch of P prompts x G answers, `gen_s` seconds; `seen` gets each draw's prompts."""
    def collect(timings: Counter, tallies):
        engine.use()
        try:
            problems, _ = sampler.draw(P)
            sampler.report([False] * P)
            time.sleep(gen_s)
            timings["generate"] += gen_s
        finally:
            engine.busy.release()
        B = P * G
        ones = torch.ones(B, 3)
        ro = Rollout(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2),
                     torch.ones(B, 3, dtype=torch.long), ones, -ones, torch.zeros(B, dtype=torch.bool), G)
        per = [p for p in problems for _ in range(G)]
        seen.append([p.prompt for p in problems])
        return ScoredBatch(ro, per, ["x"] * B, torch.arange(B, dtype=torch.float), torch.zeros(B),
                           ones), {"reward/generated_mean": 0.5}
    return collect


def train(ahead: Ahead, steps: int, update_s: float) -> list[tuple[int, ScoredBatch, dict, Counter]]:
    """The trainer's side of the loop: take a batch, 'update' for update_s, publish."""
    out = []
    for step in range(1, steps + 1):
        timings = Counter()
        batch, metrics = ahead.next(step, timings, {})
        time.sleep(update_s)
        ahead.after_update(step)
        out.append((step, batch, metrics, timings))
    return out


def make(K: int, ahead: int | None = None, gen_s: float = 0.02, load_s: float = 0.0):
    sampler = PromptStream(numbered_task(), seed=0)
    engine = ScriptedEngine(load_s)
    seen: list = []
    source = Ahead(collector(sampler, engine, gen_s, seen), engine, sampler, K, ahead or K, 0)
    return source, sampler, engine, seen


@pytest.mark.parametrize("K", [1, 2])
def test_no_trained_batch_is_more_than_K_versions_old_and_each_carries_its_version(K):
    source, _, engine, _ = make(K, gen_s=0.01)
    try:
        steps = train(source, 8, update_s=0.03)
    finally:
        source.close()
    for step, batch, metrics, _ in steps:
        staleness = (step - 1) - int(batch.version_B[0])
        assert (batch.version_B == batch.version_B[0]).all()       # one version per batch
        assert 0 <= staleness <= K and metrics["async/staleness"] == staleness
        assert metrics[f"async/staleness_{staleness}"] == 1.0
    # a slow trainer and a fast engine: the engine runs K batches ahead, as stale as allowed
    assert K in [m["async/staleness"] for _, _, m, _ in steps]
    # the engine never loaded while it sampled; every version was loaded or, superseded
    # before the engine's next batch, removed
    assert engine.overlaps == 0 and engine.closed
    assert len(engine.loads) + len(engine.discarded) in (8, 7)   # (the last may still wait)


def test_a_slow_trainer_with_a_deeper_lead_drops_stale_batches_and_draws_their_prompts_again():
    """async_ahead 4 > K = 1: the engine fills its lead while the trainer is slow, batches grow
    more than one version old and are dropped (counted); their prompts come back, so the
    prompts trained are the stream's, none skipped (this fails when the bound is not enforced:
    a dropped batch would have been trained)."""
    source, _, _, seen = make(1, ahead=4, gen_s=0.005)
    try:
        steps = train(source, 8, update_s=0.05)
    finally:
        source.close()
    staleness = [(s - 1) - int(b.version_B[0]) for s, b, _, _ in steps]
    assert max(staleness) <= 1
    dropped = sum(m["async/dropped_batches"] for _, _, m, _ in steps)
    assert dropped >= 1 and steps[-1][2]["async/dropped_samples_total"] == dropped * P * G
    trained = [p.prompt for _, b, _, _ in steps for p in b.problems[::G]]
    assert len(set(trained)) == len(trained)                    # none trained twice
    task = numbered_task()
    pending = ({p.prompt for s in source.ready for p in s.batch.problems}     # sampled, not trained
               | {task.train_problem(0, i).prompt for i, _ in source.returned + source.prompts.redo})
    stream = [p.prompt for p in PromptStream(numbered_task(), seed=0).next(len(trained) + 4 * P)]
    first_missing = next(p for p in stream if p not in trained)
    # none skipped: every prompt of the stream before the last trained one was trained, or is
    # still on its way (drawn again after its batch was dropped)
    upto = max(stream.index(p) for p in trained)
    assert all(p in trained or p in pending for p in stream[:upto + 1]), first_missing
    assert len(seen) >= 8 + dropped                              # the dropped ones were sampled


def test_a_slow_engine_makes_the_trainer_wait_and_a_slow_trainer_the_engine():
    source, _, _, _ = make(1, gen_s=0.15)
    try:
        slow_engine = train(source, 4, update_s=0.01)
    finally:
        source.close()
    waits = [t["trainer_wait"] for _, _, _, t in slow_engine[1:]]
    assert min(waits) > 0.1                     # ~ generation minus the update each step
    source, _, _, _ = make(1, gen_s=0.01)
    try:
        slow_trainer = train(source, 4, update_s=0.15)
    finally:
        source.close()
    # (medians: one step's scheduling stall on a busy machine cannot decide it)
    assert median(t["trainer_wait"] for _, _, _, t in slow_trainer[1:]) < min(waits) / 2
    assert median(t["engine_idle"] for _, _, _, t in slow_trainer[2:]) > 0.1


def test_a_pause_waits_for_the_batch_in_flight_and_loads_the_newest_weights():
    source, _, engine, _ = make(1, gen_s=0.2)
    try:
        source.next(1, Counter(), {})           # the engine starts the next batch at once
        time.sleep(0.05)
        source.after_update(1)
        t0 = time.perf_counter()
        with source.paused():
            assert time.perf_counter() - t0 > 0.1     # the batch in flight finished first
            assert not source.in_flight and source.engine_version == 1 and len(engine.loads) == 1
            n = len(source.ready)
            time.sleep(0.1)
            assert len(source.ready) == n             # nothing sampled while paused
    finally:
        source.close()


def test_an_engine_failure_reaches_the_trainer():
    sampler = PromptStream(numbered_task(), seed=0)

    def collect(timings, tallies):
        raise RuntimeError("vLLM engine in-process died")
    source = Ahead(collect, ScriptedEngine(), sampler, 1, 1, 0)
    with pytest.raises(RuntimeError, match="died"):
        source.next(1, Counter(), {})
    source.close()


def test_in_flight_batches_round_trip_through_a_checkpoint_folder(tmp_path):
    source, sampler, _, _ = make(2, gen_s=0.0)
    try:
        source.next(1, Counter(), {})
        while len(source.ready) < 2:            # the engine refills its lead of 2
            time.sleep(0.01)
        with source.paused(load_latest=False):
            assert len(source.ready) == 2
            source.save(tmp_path / "in_flight")
            kept = list(source.ready)
    finally:
        source.close()
    fresh, _, _, _ = make(2)
    fresh.restore(tmp_path / "in_flight")
    for a, b in zip(kept, fresh.ready, strict=True):
        assert a.version == b.version and a.drawn == b.drawn
        assert [p.prompt for p in a.batch.problems] == [p.prompt for p in b.batch.problems]
        assert torch.equal(a.batch.rollout.response_ids_B_T, b.batch.rollout.response_ids_B_T)
        assert torch.equal(a.batch.version_B, b.batch.version_B)
    one = kept[0]
    save_sampled(one, tmp_path / "one")
    assert load_sampled(tmp_path / "one").metrics == one.metrics


class CopyEngine:
    """vLLM's contract, in this process: the engine samples (HFRolloutEngine) from its own copy
    of the weights; `publish` writes the trainer's weights as a version, `load` makes the copy
    hold one, and `sync_weights` (sampling in turn) is both at once, as the shm push is."""

    def __init__(self, trainer_model, tokenizer) -> None:
        import copy
        from posttrain.rollout.hf import HFRolloutEngine
        self.trainer = trainer_model
        self.sampler = HFRolloutEngine(copy.deepcopy(trainer_model), tokenizer)
        self.model = self.sampler.model

    def generate(self, *args, **kwargs):
        return self.sampler.generate(*args, **kwargs)

    def publish(self) -> dict:
        return {k: v.detach().clone() for k, v in self.trainer.state_dict().items()}

    def load(self, written: dict) -> None:
        self.model.load_state_dict(written)

    def discard(self, written) -> None:
        pass

    def sync_weights(self) -> None:
        self.load(self.publish())

    def close(self) -> None:
        pass


def real_pipeline(tokenizer, engine_of):
    """The real collect (sampler, HF engine, verifier scorer: rl/collect.generate_and_score) of 2
    prompts x 2 answers of 4 tokens, on a tiny model the 'trainer' moves by seeded noise each
    step; `snapshots[v]`: the weights of version v (0: the start)."""
    from posttrain.sampling.collect import generate_and_score
    from posttrain.sampling.service import sampling_inputs
    from tests.conftest import make_tiny_model
    cfg = load_config(None, ["--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
                             "--rollout.max_new_tokens", "4", "--data.eval_size", "4",
                             "--reward.workers", "0"])
    task, env, scorer = sampling_inputs(cfg)
    model = make_tiny_model(tokenizer)
    engine, sampler = engine_of(model), PromptStream(task, cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)

    def collect(timings, tallies):
        return generate_and_score(SamplingSetup(cfg=cfg, engine=engine, tokenizer=tokenizer,
                                                scorer=scorer, prompts=sampler,
                                                generator=generator, env=env), timings, tallies)
    snapshots = [{k: v.clone() for k, v in model.state_dict().items()}]

    def update(step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std())
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
    return cfg, model, engine, sampler, collect, update, snapshots, scorer


def logp_under(model, weights: dict, batch: ScoredBatch) -> torch.Tensor:
    """The batch's response log-probs recomputed by the trainer's forward under `weights`."""
    import copy
    from posttrain.rollout.forward import frozen_logprobs
    scorer = copy.deepcopy(model)
    scorer.load_state_dict(weights)
    return frozen_logprobs(scorer, batch.rollout, 1.0, 8)


def run_source(source, update, steps: int, update_s: float) -> list[ScoredBatch]:
    """The trainer's side of rl/loop.py: take the step's batch, update, publish (or push)."""
    batches = []
    try:
        for step in range(1, steps + 1):
            batch, _ = source.next(step, Counter(), {})
            batches.append(batch)
            update(step)
            time.sleep(update_s)    # a slow update: the engine samples the next batch meanwhile
            source.after_update(step)
    finally:
        source.close()
    return batches


def test_sampling_ahead_trains_each_batch_with_the_weights_its_version_names(tokenizer):
    """rollout.max_staleness 1 through make_batch_source: at step t the trainer holds version
    t - 1 and trains a batch the engine sampled with version t - 2 (one update stale: the engine
    started it as the trainer took the previous one), as the batch's version_B says; its
    recorded log-probs are those of that version's weights, not of the trainer's."""
    from dataclasses import replace as swap
    cfg, model, engine, sampler, collect, update, snapshots, scorer = real_pipeline(
        tokenizer, lambda m: CopyEngine(m, tokenizer))
    rollout = swap(cfg.rollout, backend="vllm", max_staleness=1)
    source = make_batch_source(rollout, collect, engine, sampler, 0)
    assert isinstance(source, Ahead) and source.K == 1
    batches = run_source(source, update, 4, update_s=0.3)
    scorer.close()
    versions = [int(b.version_B[0]) for b in batches]
    assert all(bool((b.version_B == v).all()) for b, v in zip(batches, versions))
    assert versions == [0, 0, 1, 2]
    for step, (batch, v) in enumerate(zip(batches, versions), start=1):
        mask = batch.rollout.response_mask_B_T
        sampled = batch.rollout.logp_B_T * mask
        torch.testing.assert_close(logp_under(model, snapshots[v], batch), sampled, atol=1e-4, rtol=0)
        if v != step - 1:   # the trainer's own weights would have given other log-probs
            assert (logp_under(model, snapshots[step - 1], batch) - sampled).abs().max() > 1e-2


def test_max_staleness_0_samples_every_batch_with_the_trainers_current_weights(tokenizer):
    """rollout.max_staleness 0 (InTurn) with an engine holding its own copy that is pushed the
    weights after each update samples exactly what the synchronous loop samples from the
    trainer's very weights (HFRolloutEngine, weights shared): the same tokens and log-probs,
    and those are the log-probs of version t - 1 at step t."""
    from posttrain.sampling.sources import InTurn
    from posttrain.rollout.hf import HFRolloutEngine
    runs = {}
    for name, engine_of in (("copy pushed", lambda m: CopyEngine(m, tokenizer)),
                            ("shared", lambda m: HFRolloutEngine(m, tokenizer))):
        cfg, model, engine, sampler, collect, update, snapshots, scorer = real_pipeline(tokenizer, engine_of)
        source = make_batch_source(cfg.rollout, collect, engine, sampler, 0)
        assert isinstance(source, InTurn)
        runs[name] = run_source(source, update, 3, update_s=0.0)
        scorer.close()
        for step, batch in enumerate(runs[name], start=1):
            assert batch.version_B is None     # (in turn: the weights being trained)
            torch.testing.assert_close(logp_under(model, snapshots[step - 1], batch),
                                       batch.rollout.logp_B_T, atol=1e-4, rtol=0)
            if step > 1:   # the weights one update older give other log-probs
                stale = logp_under(model, snapshots[step - 2], batch)
                assert (stale - batch.rollout.logp_B_T).abs().max() > 1e-2
    for a, b in zip(runs["copy pushed"], runs["shared"], strict=True):
        assert torch.equal(a.rollout.response_ids_B_T, b.rollout.response_ids_B_T)
        assert [p.prompt for p in a.problems] == [p.prompt for p in b.problems]
        torch.testing.assert_close(a.rollout.logp_B_T, b.rollout.logp_B_T, atol=1e-5, rtol=0)


@pytest.mark.parametrize("args, message", [
    (["--rollout.max_staleness", "1"], "rollout.backend=vllm"),
    (["--rollout.backend", "vllm", "--rollout.async_ahead", "2"], "max_staleness >= 1"),
    (["--rollout.backend", "vllm", "--rollout.max_staleness", "-1"], "rollout.max_staleness"),
    (["--rollout.backend", "vllm", "--rollout.max_staleness", "1", "--rollout.vllm_weight_push",
      "nccl", "--rollout.vllm_launch", "1"], "'shm'"),
])
def test_async_options_are_checked_before_anything_loads(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, args)


def test_a_dropped_batchs_prompts_are_drawn_again_first_and_no_longer_wait_for_a_retry():
    sampler = PromptStream(numbered_task(), seed=0, retries=1)
    sampler.drawn = []
    first, _ = sampler.draw(4)
    sampler.report([True, True, False, False])          # two wait to be asked again
    drawn, sampler.drawn = sampler.drawn, None
    assert len(sampler.waiting) == 2
    sampler.give_back(drawn)                            # ... but their batch was dropped
    assert sampler.waiting == [] and len(sampler.redo) == 4
    again, _ = sampler.draw(4)
    assert [p.prompt for p in again] == [p.prompt for p in first]
    state = sampler.state()
    restored = PromptStream(numbered_task(), seed=0, retries=1)
    restored.load_state({**state, "redo": [[9, 0]]})
    assert restored.redo == [(9, 0)]


def test_a_checkpoints_batches_in_flight_name_their_prompts_for_a_run_resumed_in_turn(tmp_path):
    from posttrain.sampling.sources import prompts_in_flight
    source, _, _, _ = make(2, gen_s=0.0)
    try:
        source.next(1, Counter(), {})
        while len(source.ready) < 2:
            time.sleep(0.01)
        with source.paused(load_latest=False):
            source.save(tmp_path / "in_flight")
            drawn = [d for s in source.ready for d in s.drawn]
    finally:
        source.close()
    assert prompts_in_flight(tmp_path / "in_flight") == drawn and len(drawn) == 2 * P
    assert prompts_in_flight(tmp_path / "nothing") == []


def test_on_a_cpu_the_engine_and_the_trainer_sampling_ahead_take_separate_cores():
    from posttrain.rollout import async_core_split
    from posttrain.rollout.vllm_engines import split_cores
    cfg = load_config(None, ["--rollout.backend", "vllm", "--rollout.max_staleness", "1"]).rollout
    assert async_core_split(cfg, n_cores=2, has_cuda=False) == (1, 1)     # trainer 1 thread, engine core 1
    assert async_core_split(cfg, n_cores=16, has_cuda=False) == (8, 8)
    assert async_core_split(cfg, n_cores=1, has_cuda=False) is None
    assert async_core_split(cfg, n_cores=16, has_cuda=True) is None
    off = load_config(None, ["--rollout.backend", "vllm", "--rollout.max_staleness", "1",
                             "--rollout.async_cpu_split", "false"]).rollout
    assert async_core_split(off, n_cores=16, has_cuda=False) is None
    assert async_core_split(load_config(None, []).rollout, n_cores=16, has_cuda=False) is None
    assert split_cores(1, 2, first=1) == ["1-1"] and split_cores(2, 16, first=8) == ["8-11", "12-15"]
    assert split_cores(1, 2) == ["0-1"]


class _Reached(Exception):
    """The batch reached the step's first pass over the policy (frozen log-probs)."""


def _tensors(batch: ScoredBatch):
    from dataclasses import fields
    for f in fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, Rollout):
            yield from ((f"rollout.{g.name}", getattr(v, g.name)) for g in fields(v)
                        if isinstance(getattr(v, g.name), torch.Tensor))
        elif isinstance(v, torch.Tensor):
            yield f.name, v


@pytest.mark.parametrize("kind", ["in turn", "sampled ahead", "restored from in_flight"])
def test_every_batch_reaches_the_policy_on_its_device(kind, tmp_path, monkeypatch):
    """vLLM hands its batches over on the CPU, and a checkpoint's in_flight/ is loaded onto it;
    the policy may sit on a GPU. With no GPU here the policy's device is 'meta' (tensors with no
    data): a batch the loop did not move reaches the first pass over the policy on the CPU."""
    from dataclasses import replace
    from types import SimpleNamespace
    from posttrain.model.distributed import SINGLE
    from posttrain.rl import loop
    reached = []

    def first_pass(run, batch, timings):
        reached.append(batch)
        raise _Reached
    monkeypatch.setattr(loop, "frozen_passes", first_pass)
    monkeypatch.setattr(loop, "check_health", lambda *a: None)
    if kind == "in turn":
        sampler = PromptStream(numbered_task(), seed=0)
        source = InTurn(collector(sampler, ScriptedEngine(), 0.0, []), ScriptedEngine(), sampler, 0)
    else:
        source, _, _, _ = make(1, gen_s=0.0)
        if kind == "restored from in_flight":
            from posttrain.sampling.sources import Sampled
            batch, metrics = make(1, gen_s=0.0)[0].collect(Counter(), {})
            batch = replace(batch, version_B=torch.zeros(len(batch.rewards_B), dtype=torch.long))
            save_sampled(Sampled(batch, metrics, 0, [(0, 0)]), tmp_path / "in_flight" / "batch_000")
            (tmp_path / "in_flight" / "count.json").write_text('{"batches": 1}')
            source.restore(tmp_path / "in_flight")
            assert len(source.ready) == 1
    run = SimpleNamespace(cfg=None, algo=None, world=SINGLE,
                          sampling=SimpleNamespace(next=source.next, version=source.version),
                          learner=SimpleNamespace(device=torch.device("meta")))
    try:
        with pytest.raises(_Reached):
            loop.train_step(run, 1)
    finally:
        source.close()
    assert [name for name, t in _tensors(reached[0]) if t.device.type != "meta"] == []


@pytest.mark.parametrize("extra, said", [
    (["--rollout.tis_cap", "null"], "and with one update per batch no trust region either"),
    (["--rollout.tis_cap", "null", "--optim.epochs", "2"], "no importance weight"),
    ([], None),                                                   # the default correction
    (["--rollout.tis_cap", "null", "--algorithm.policy_loss", "dppo_tv"], None),   # weighs by mu
])
def test_stale_samples_without_a_correction_are_said_on_start(extra, said):
    """Sampling ahead with no correction trains stale samples as the trainer's own: allowed (the
    async benchmark measures it), but never silently."""
    cfg = load_config(None, ["--rollout.backend", "vllm", "--rollout.max_staleness", "1", *extra])
    warnings = cfg.start_warnings()
    if said is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and said in warnings[0]
        assert "rollout.tis_cap" in warnings[0] and warnings[0].startswith("UNCORRECTED")
    assert load_config(None, extra).start_warnings() == []        # in turn: nothing is stale
