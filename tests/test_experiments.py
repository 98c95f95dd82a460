"""The lecture's experiments (posttrain/experiments): their measuring parts on hand-checkable
inputs, and each experiment end to end on a tiny model (a smoke run of seconds)."""

import json
import math

import pytest
import torch

from tests.conftest import make_tiny_model
from posttrain.cli import main
from posttrain.experiments import EXPERIMENTS
from posttrain.experiments.baselines import arm_statistics, expected_scale, off_diagonal_sums
from posttrain.experiments.common import CountSketch, experiment_module, jackknife, mean_se
from posttrain.experiments.importance_sampling import drift
from posttrain.experiments.kl_estimators import (answer_products, drifted_copy, logit_gradients,
                                                 regression)
from posttrain.losses import exact_kl_from_logits


def test_count_sketch_adds_signed_coordinates_into_their_buckets():
    sketch = CountSketch(5, 2)
    sketch.sign[:5] = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0])
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert sketch(x).tolist() == [1.0 - 3.0 - 5.0, -2.0 + 4.0]     # buckets d mod 2; pad 0
    assert sketch.sign[5:].tolist() == [0.0]


def test_count_sketch_keeps_inner_products_on_average_over_hashes():
    x, y = torch.arange(1.0, 9.0), torch.arange(8.0, 0.0, -1.0)   # <x, y> = 120
    products = [float(CountSketch(8, 4, seed=s)(x) @ CountSketch(8, 4, seed=s)(y)) for s in range(2000)]
    mean, se = mean_se(products)
    assert abs(mean - 120.0) < 4 * se and se < 5.0


def test_off_diagonal_sums_and_leave_one_out_by_hand():
    c = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    total, without = off_diagonal_sums(c)
    assert total == 2 + 3 + 4 + 6 + 7 + 8
    assert without.tolist() == [6.0 + 8.0, 3.0 + 7.0, 2.0 + 4.0]   # batch 0 out: C12 + C21, ...
    assert jackknife(torch.tensor([1.0, 1.0, 1.0])) == 0.0
    assert jackknife(torch.tensor([0.0, 2.0])) == pytest.approx(math.sqrt(0.5 * 2))


def test_arm_statistics_read_a_scaled_expectation_exactly():
    g = torch.randn(6, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 1.0
    stats = arm_statistics(0.75 * g, g)
    assert stats["scale"] == pytest.approx(0.75)
    assert stats["cosine"] == pytest.approx(1.0)
    assert stats["scale_se"] == pytest.approx(0.0, abs=1e-12)
    assert stats["variance"] == pytest.approx(0.75 ** 2 * arm_statistics(g, g)["variance"])
    assert expected_scale("group_mean", 64, 4) == 0.75
    assert expected_scale("batch_mean", 64, 4) == 1 - 1 / 64
    assert expected_scale("leave_one_out", 64, 4) == 1.0 and expected_scale("grpo_std", 64, 4) is None


def _enumerated_gradients(V: int = 5, seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Every token of a V-word vocabulary as its own answer (one position each, same logits):
    sum_y pi(y) g(y) is the estimator's exact expectation."""
    g = torch.Generator().manual_seed(seed)
    # logits of spread 0.5: no token's k3 reaches its cap of 10, where capped estimators stop
    z = 0.5 * torch.randn(V, generator=g, dtype=torch.float64)
    z_ref = 0.5 * torch.randn(V, generator=g, dtype=torch.float64)
    logits, ref = z.expand(V, 1, V).clone(), z_ref.expand(V, 1, V).clone()
    grads = logit_gradients(logits, ref, torch.arange(V)[:, None], torch.ones(V, 1), 1.0)
    pi = torch.softmax(z, -1)
    expected = {n: (pi[:, None] * v[:, 0, :]).sum(0) for n, v in grads.items()}
    return expected, z, z_ref


def test_estimator_gradients_in_expectation_are_the_divergences_theory_names():
    expected, z, z_ref = _enumerated_gradients()
    zr = z.clone().requires_grad_(True)
    reverse, = torch.autograd.grad(exact_kl_from_logits(zr, z_ref), zr)
    zf = z.clone().requires_grad_(True)
    forward, = torch.autograd.grad(exact_kl_from_logits(z_ref, zf), zf)
    assert torch.allclose(expected["k1"], torch.zeros_like(z), atol=1e-12)
    assert torch.allclose(expected["k2"], reverse, atol=1e-12)
    assert torch.allclose(expected["k3_st"], reverse, atol=1e-12)
    assert torch.allclose(expected["k3"], forward, atol=1e-12)
    assert not torch.allclose(reverse, forward, atol=1e-3)       # the two are not the same here


def test_regression_recovers_a_known_mixture_of_the_two_gradients():
    g = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(6, 3, 7, generator=g) for n in ("reverse", "forward")}
    grads["k1"] = torch.zeros(6, 3, 7)
    grads["k2"] = 2.0 * grads["reverse"] - 0.5 * grads["forward"]
    grads["k3"] = grads["forward"]
    grads["k3_st"] = grads["reverse"]
    coef = regression(answer_products(grads), "k2")
    assert coef.tolist() == pytest.approx([2.0, -0.5], abs=1e-6)
    assert regression(answer_products(grads), "k3").tolist() == pytest.approx([0.0, 1.0], abs=1e-6)


def test_drifted_copy_moves_each_tensor_by_its_own_scale_and_leaves_the_model(tokenizer):
    model = make_tiny_model(tokenizer)
    before = {n: p.clone() for n, p in model.named_parameters()}
    ref = drifted_copy(model, 0.1, seed=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, before[name])
        if p.numel() >= 1000:
            moved = ((q - p).pow(2).mean().sqrt() / p.pow(2).mean().sqrt()).detach()
            assert 0.08 < float(moved) < 0.12, name


def test_drift_at_the_start_is_none_and_counts_tokens_outside_the_band():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    d = drift(old.clone(), old, adv, mask, (0.2, 0.2))
    assert d["ratio_mean"] == 1.0 and d["approx_kl_old"] == 0.0 and d["ess_share"] == 1.0
    logp = torch.log(torch.tensor([[1.5, 1.0, 9.0], [0.5, 1.0, 1.0]]))
    d = drift(logp, old, adv, mask, (0.2, 0.2))
    assert d["outside_band"] == pytest.approx(2 / 5)            # 1.5 and 0.5; the padded 9 is not counted
    assert d["clip_frac_high"] == pytest.approx(1 / 5) and d["clip_frac_low"] == pytest.approx(1 / 5)
    w = torch.tensor([1.5, 0.5], dtype=torch.float64)
    assert d["ess_share"] == pytest.approx(float(w.sum() ** 2 / (w ** 2).sum() / 2))


@pytest.fixture(scope="module")
def tiny_dir(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


SMOKE = ["--rollout.prompts_per_step", "4", "--rollout.group_size", "4",
         "--rollout.max_new_tokens", "6", "--data.eval_size", "4", "--threads", "2"]


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_each_experiment_writes_its_record_and_figure(name, tiny_dir, tmp_path, capsys):
    out = tmp_path / name
    assert main(["experiment", name, "--out", str(out), "--repeats", "3", "--no-progress",
                 "--model.path", str(tiny_dir), *SMOKE]) == 0
    printed = json.loads(capsys.readouterr().out)
    record = json.loads((out / f"{name}.json").read_text())
    assert printed["record"] == str(out / f"{name}.json") and (out / f"{name}.png").stat().st_size > 10_000
    assert record["claim"] == experiment_module(name).CLAIM
    assert record["experiment"] == name and record["provenance"]["command"].startswith(
        f"posttrain experiment {name}")
    assert record["numbers"]


def test_an_unknown_experiment_or_too_few_repeats_is_refused(tiny_dir, tmp_path, capsys):
    out = tmp_path / "refused"
    assert main(["experiment", "baselines", "--repeats", "2", "--out", str(out),
                 "--model.path", str(tiny_dir)]) == 2
    assert "needs at least 3" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        main(["experiment", "no-such-thing"])
