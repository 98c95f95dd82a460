"""torch.distributed data parallelism (gloo, 2 CPU processes under torchrun) against 1 process:
the same global batch and seed must give the same parameters, and checkpoints must move between
world sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"


def launch(script, args, nproc):
    """Run a worker script as 1 plain process or as `nproc` ranks under torchrun (gloo)."""
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def run(tok_dir, run_dir, strategy="ddp", steps=4, preset="grpo", nproc=1, resume=False, extra=()):
    args = [str(tok_dir), str(run_dir), strategy, str(steps), preset, *extra] + (["--resume"] if resume else [])
    launch(WORKER, args, nproc)
    return run_dir


def weights(run_dir, folder="final_model"):
    return load_file(Path(run_dir) / folder / "model.safetensors")


def rewards(run_dir):
    rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


def assert_same_weights(a, b, atol=2e-4):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def single(embedded_dir, tmp_path_factory):
    return run(embedded_dir, tmp_path_factory.mktemp("single") / "run")


@pytest.mark.slow   # (two ranks, 15-25 s each: in the full suite, README)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_end_with_the_parameters_of_one(embedded_dir, tmp_path, single, strategy):
    two = run(embedded_dir, tmp_path / "run", strategy, nproc=2)
    # the same responses were sampled (per-response seeds) and scored: the same reward curve
    assert rewards(two) == pytest.approx(rewards(single), abs=1e-6)
    assert_same_weights(weights(two), weights(single))
    summary = json.loads((Path(two) / "summary.json").read_text())
    assert summary["steps"] == 4 and "eval_after" in summary
    # the evaluation, split over the ranks, gathers every held-out problem back in order
    held_out = [[s["prompt"] for s in json.loads(line)["samples"]]
                for line in (Path(two) / "eval_samples.jsonl").read_text().splitlines()]
    alone = [[s["prompt"] for s in json.loads(line)["samples"]]
             for line in (Path(single) / "eval_samples.jsonl").read_text().splitlines()]
    assert held_out == alone and len(set(held_out[-1])) == len(held_out[-1]) > 1


@pytest.mark.slow   # (two ranks, 15-50 s: in the full suite, README)
def test_dynamic_sampling_on_two_ranks_keeps_the_groups_of_one(embedded_dir, tmp_path):
    """DAPO's dynamic sampling under torchrun: the ranks count informative groups together,
    refill together, and share out the first P of them in one process's order (FSDP2, whose
    forwards need the same number of rows on every rank)."""
    one = run(embedded_dir, tmp_path / "one", "ddp", preset="dapo")
    two = run(embedded_dir, tmp_path / "two", "fsdp", preset="dapo", nproc=2)
    rows = [json.loads(line) for line in open(Path(one) / "metrics.jsonl")]
    assert max(r.get("rollout/dynamic_rounds", 0) for r in rows) > 1     # refills did happen
    assert rewards(two) == pytest.approx(rewards(one), abs=1e-6)
    assert_same_weights(weights(two), weights(one))


@pytest.mark.slow   # (two ranks, 15-50 s: in the full suite, README)
def test_a_checkpoint_written_by_two_ranks_resumes_on_one(embedded_dir, tmp_path, single):
    two = run(embedded_dir, tmp_path / "run", "fsdp", steps=2, nproc=2)
    assert (Path(two) / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()
    run(embedded_dir, two, "ddp", steps=4, nproc=1, resume=True)
    assert rewards(two) == pytest.approx(rewards(single), abs=1e-6)
    assert_same_weights(weights(two), weights(single))


STAGE_WORKER = ROOT / "tests" / "dist_stage_worker.py"


def run_stage(stage, tok_dir, run_dir, strategy="ddp", nproc=1):
    data = Path(run_dir).parent / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {a}?", "response": f"{2 * a}"}) + "\n"
                            for a in range(10, 23)))
    launch(STAGE_WORKER, [stage, str(tok_dir), str(run_dir), strategy, str(data)], nproc)
    return Path(run_dir)


def stage_metrics(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


@pytest.fixture(scope="module")
def single_stages(embedded_dir, tmp_path_factory):
    return {stage: run_stage(stage, embedded_dir, tmp_path_factory.mktemp(stage) / "run")
            for stage in ("sft", "sft-frozen", "dpo", "reward-model")}


@pytest.mark.slow   # (two ranks, 15-50 s: in the full suite, README)
@pytest.mark.parametrize("stage,strategy", [("sft", "ddp"), ("sft", "fsdp"),
                                            pytest.param("dpo", "fsdp", marks=pytest.mark.slow),
                                            ("reward-model", "ddp"), ("sft-frozen", "fsdp")])
def test_offline_stages_on_two_ranks_match_one(embedded_dir, tmp_path, single_stages, stage, strategy):
    """SFT, DPO and reward-model training under torchrun: each rank runs its share of every batch
    (the last batch has one row, so one rank has none), the reference pass and evaluations are
    split and gathered; the metrics and the saved model equal the 1-process run's."""
    one, two = single_stages[stage], run_stage(stage, embedded_dir, tmp_path / "run", strategy, 2)
    m1, m2 = stage_metrics(one), stage_metrics(two)
    assert [sorted(m) for m in m1] == [sorted(m) for m in m2]
    for a, b in zip(m1, m2):
        for k, v in a.items():
            if isinstance(v, float) and not k.startswith(("perf/", "time")):
                assert b[k] == pytest.approx(v, abs=1e-4), (k, a["step"])
    assert_same_weights(weights(two), weights(one))
    if stage == "reward-model":
        stats = [json.loads((d / "final_model" / "reward_stats.json").read_text()) for d in (one, two)]
        assert stats[1]["mean"] == pytest.approx(stats[0]["mean"], abs=1e-4)
    if stage == "sft-frozen":   # --freeze_layers 1 on FSDP2 shards: frozen stays put, the top learns
        from posttrain.model.loading import load_tokenizer
        from tests.conftest import make_tiny_model
        start = make_tiny_model(load_tokenizer(embedded_dir)).state_dict()
        w = weights(two)
        for k in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"):
            assert torch.equal(w[k], start[k]), k
        assert not torch.equal(w["model.layers.1.mlp.up_proj.weight"],
                               start["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.slow   # (~45 s: in the full suite, README)
def test_lora_under_fsdp_matches_one_process(embedded_dir, tmp_path):
    """LoRA adapters on FSDP2-sharded layers (frozen base shards beside trainable adapter shards):
    the same reward curve and merged final model as 1 process, and the adapter checkpoint
    gathered from the shards."""
    lora = ["--lora.rank", "4", "--lora.alpha", "8"]
    one = run(embedded_dir, tmp_path / "one", "ddp", extra=lora)
    two = run(embedded_dir, tmp_path / "two", "fsdp", nproc=2, extra=lora)
    assert rewards(two) == pytest.approx(rewards(one), abs=1e-6)
    assert_same_weights(weights(two), weights(one))
    adapter = load_file(Path(two) / "checkpoints" / "step_000004" / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert_same_weights(adapter, load_file(Path(one) / "checkpoints" / "step_000004" / "adapter"
                                           / "adapter_model.safetensors"))
    # adapters and their optimizer state written by 2 FSDP2 ranks resume on 1 process
    resumed = run(embedded_dir, tmp_path / "resumed", "fsdp", steps=2, nproc=2, extra=lora)
    run(embedded_dir, resumed, "ddp", steps=4, resume=True, extra=lora)
    assert rewards(resumed) == pytest.approx(rewards(one), abs=1e-6)
    assert_same_weights(weights(resumed), weights(one))


@pytest.mark.slow   # (~45 s: in the full suite, README)
def test_ppo_value_model_sharded_by_fsdp_matches_one_process(embedded_dir, tmp_path):
    """PPO's separate value model under FSDP2 (its layers sharded like the policy's): the same
    policy and value model as 1 process, and a 2-rank checkpoint (critic weights and optimizer
    state gathered) resumes on 1 process and continues identically."""
    # (lr 1e-3: FSDP's sums differ from one process's in the last float bits, and Adam at lr 1e-2
    # turns that into a flipped sampled token on this tiny model within 4 steps)
    extra = ["--optim.lr", "1e-3"]
    one = run(embedded_dir, tmp_path / "one", "ddp", preset="ppo", extra=extra)
    two = run(embedded_dir, tmp_path / "two", "fsdp", preset="ppo", nproc=2, extra=extra)
    assert rewards(two) == pytest.approx(rewards(one), abs=1e-6)
    assert_same_weights(weights(two), weights(one))
    assert_same_weights(weights(two, "final_value_model"), weights(one, "final_value_model"))
    resumed = run(embedded_dir, tmp_path / "resumed", "fsdp", steps=2, preset="ppo", nproc=2,
                  extra=extra)
    run(embedded_dir, resumed, "ddp", steps=4, preset="ppo", resume=True, extra=extra)
    assert_same_weights(weights(resumed), weights(one))
    assert_same_weights(weights(resumed, "final_value_model"), weights(one, "final_value_model"))


@pytest.mark.slow   # (two ranks, 15-50 s: in the full suite, README)
def test_minibatches_are_split_over_the_global_batch(embedded_dir, tmp_path):
    """With several minibatches per step the groups are drawn into minibatches over the global
    batch, so 2 ranks update on exactly the minibatches of 1 process; under FSDP2 a rank holding
    fewer groups of a minibatch than another pads with zero-weight passes (collectives match)."""
    extra = ["--optim.minibatches", "2", "--optim.micro_batch_size", "4", "--optim.lr", "1e-3"]
    one = run(embedded_dir, tmp_path / "one", "ddp", preset="ppo", extra=extra)
    two = run(embedded_dir, tmp_path / "two", "fsdp", preset="ppo", nproc=2, extra=extra)
    assert rewards(two) == pytest.approx(rewards(one), abs=1e-6)
    assert_same_weights(weights(two), weights(one))
    assert_same_weights(weights(two, "final_value_model"), weights(one, "final_value_model"))
