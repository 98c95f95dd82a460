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
from posttrain.experiments.common import (CountSketch, evaluations, experiment_module, jackknife,
                                          mean_of, mean_se, per_step)
from posttrain.experiments.clip_higher import bound
from posttrain.experiments.opd_vs_grpo import first_reaching
from posttrain.experiments.reward_hacking import answer_collapse
from posttrain.experiments.importance_sampling import drift
from posttrain.experiments.length_bias import (ARMS, arm_algorithm, arm_summary,
                                               least_squares_slope, length_slope, pooled,
                                               same_weights_as, step_along, token_weights,
                                               weighted_sums)
from posttrain.experiments.kl_estimators import (answer_products, drifted_copy, logit_gradients,
                                                 regression)
from posttrain.losses.kl import exact_kl_from_logits


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


SMOKE = ["--rollout.prompts_per_step", "4", "--rollout.group_size", "4",
         "--rollout.max_new_tokens", "6", "--data.eval_size", "4", "--threads", "2"]
# the quick suite's runs: 2 prompts x 4 answers, the fewest repeats each experiment takes, and
# rewards a random tiny model earns on some answers and not others (the verifier's: on none), so
# that groups differ and every arm has something to weigh
QUICK = ["--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
         "--rollout.max_new_tokens", "6", "--data.eval_size", "4", "--threads", "2", "--reward.workers", "0"]
SIGNAL = ["--reward.functions", "tests.toy_rewards:first_letter_a_to_e"]
QUICK_ARGS = {"baselines": SIGNAL, "importance-sampling": SIGNAL, "kl-estimators": [],
              # (a stop string a random model's tokens often complete: answers of 1 to 6 tokens)
              "length-bias": [*SIGNAL, "--rollout.stop", "e"],
              # (odd first operands score 0 on every answer: groups dynamic sampling refills)
              "dynamic-sampling": ["--reward.functions", "tests.toy_rewards:even_prompts_only"],
              "reward-hacking": []}


# (the three slowest, 7-10 s each, in the slow suite, on SMOKE with 3 repeats: the quick suite
# keeps the other six, which run the same command path)
SLOW_EXPERIMENTS = {"clip-higher", "opd-vs-grpo", "length-training", "reward-hacking",
                    "dynamic-sampling"}


def check_baselines(n: dict, out, repeats: int) -> None:
    arms = n["arms"]
    assert {a: v["expected_scale"] for a, v in arms.items()} == {
        "none": 1.0, "none_reward_plus_1": 1.0, "batch_mean": 1 - 1 / 8, "group_mean": 0.75,
        "leave_one_out": 1.0, "grpo_std": None}                      # B = 8 answers, G = 4
    # the group mean's advantage is (G-1)/G times leave-one-out's, answer by answer: so are
    # the sketched gradients, and their variance by (3/4)^2
    assert arms["group_mean"]["variance"] == pytest.approx(0.75 ** 2 * arms["leave_one_out"]["variance"],
                                                           rel=1e-3)
    # a reward every answer earns (+1) adds variance; there is signal to measure
    assert arms["none_reward_plus_1"]["variance"] > arms["none"]["variance"] > 0
    assert (n["answers_per_batch"], n["group_size"]) == (8, 4)


def check_importance_sampling(n: dict, out, repeats: int) -> None:
    arms = n["arms"]
    for rows in arms.values():
        assert len(rows) == repeats + 1                                # before each epoch, after the last
        start, after = rows[0], rows[-1]
        # pi_old is recomputed by the same forward: the first ratio is exactly 1
        assert (start["ratio_mean"], start["ratio_sd"], start["approx_kl_old"], start["ess_share"]) == (
            1.0, 0.0, 0.0, 1.0)
        assert after["approx_kl_old"] > 0 and after["ratio_sd"] > 0    # the step moved pi
        assert after["outside_band"] == 0.0
    # no ratio left the clip band: PPO's clipped objective took the very step the plain one took
    assert arms["clipped"] == arms["importance_sampled"]
    assert n["answers"] == 8 and 0 < n["answers_with_signal"] <= 8 and n["answers_with_signal"] % 4 == 0


def check_kl_estimators(n: dict, out, repeats: int) -> None:
    rows = n["drifts"]
    assert list(rows) == ["0.005", "0.01", "0.02", "0.04", "0.08"]
    kl = [r["exact_reverse_kl"] for r in rows.values()]
    assert 0 < kl[0] and kl == sorted(kl)                               # a larger drift: a larger KL
    assert len({r["tokens"] for r in rows.values()}) == 1               # the same tokens at every drift
    for r in rows.values():
        e = r["estimators"]
        # k3_st: k3's value ...
        assert [e["k3_st"][k] for k in ("bias", "bias_se", "sd_per_token")] == [
            e["k3"][k] for k in ("bias", "bias_se", "sd_per_token")]
        # ... with k2's gradient
        for k in ("coef_reverse", "coef_forward", "cos_grad_reverse", "cos_grad_forward"):
            assert e["k3_st"][k] == pytest.approx(e["k2"][k], rel=1e-9, abs=1e-12), k


def check_length_bias(n: dict, out, repeats: int) -> None:
    arms = n["arms"]
    # at pi_theta = pi_old GSPO and GMPO take GRPO's step, CISPO and SAPO token-mean's
    assert {a: v["same_step_as"] for a, v in arms.items()} == {
        "grpo": None, "grpo_token_mean": None, "dr_grpo": None, "gspo": "grpo", "gmpo": "grpo",
        "cispo": "grpo_token_mean", "sapo": "grpo_token_mean"}
    lengths = n["wrong_answer_weights"]["dr_grpo"]["log_length"]
    assert len(set(lengths)) > 1                                        # wrong answers of several lengths
    # Dr. GRPO weighs every token A / (B L_max): no slope in length; GRPO's 1/|o| slopes down
    assert arms["dr_grpo"]["weight_length_slope"] == pytest.approx(0.0, abs=1e-9)
    assert arms["grpo"]["weight_length_slope"] < -0.5
    assert arms["gspo"]["weight_length_slope"] == arms["grpo"]["weight_length_slope"]
    assert len({v["wrong_answers_weighed"] for v in arms.values()}) == 1 and n["pairs"] == repeats


def check_dynamic_sampling(n: dict, out, repeats: int) -> None:
    off, on, B = n["arms"]["off"], n["arms"]["on"], n["answers_per_step"]
    assert off["generated"] == [B] * repeats                           # one round a step
    # on: another round of B answers whenever the first round had an all-equal group
    assert [g % B for g in on["generated"]] == [0] * repeats
    assert [g > B for g in on["generated"]] == [e > 0 for e in on["equal_groups"]]
    assert any(e > 0 for e in on["equal_groups"])
    # step 1's first round: the same weights, seed and prompts in both arms
    assert (on["equal_groups"][0], on["generated_reward"][0]) == (off["equal_groups"][0],
                                                                  off["generated_reward"][0])


def check_reward_hacking(n: dict, out, repeats: int) -> None:
    # the policy trained on the reward model's score, not the verifier's
    policy = json.loads((out / "run" / "policy" / "config.json").read_text())["reward"]
    assert policy["correct_reward"] == 0.0 and policy["model"].startswith(str(out / "run" / "reward_model"))
    p = n["arms"]["policy"]
    assert None not in p["model_score"] and p["reward"] == pytest.approx(p["model_score"])
    assert n["reward_model"]["pairs"] == 20 * repeats and n["reward_model"]["eval_pairs"] == 4
    assert p["eval_steps"] == [0, 1, 2] and [c["step"] for c in p["collapse"]] == p["eval_steps"]


def check_clip_higher(n: dict, out, repeats: int) -> None:
    arms = n["arms"]   # each arm trained: its metrics and records kept, its weights not
    assert list(arms) == ["symmetric", "clip_higher", "gspo", "cispo", "sapo", "gmpo"]
    assert arms["cispo"]["bound"] == "weight capped at 5, no gradient clipped"
    for arm in arms:   # each arm trained with its own objective and bounds
        trained = json.loads((out / "run" / arm / "config.json").read_text())["algorithm"]
        assert {k: trained[k] for k in arms[arm]["algorithm"]} == arms[arm]["algorithm"]
        assert (out / "run" / arm / "metrics.jsonl").exists()
        assert not (out / "run" / arm / "final_model").exists()
        assert arms[arm]["step"] == [1, 2, 3]


def check_opd_vs_grpo(n: dict, out, repeats: int) -> None:
    arms = n["arms"]   # the teacher is GRPO's own final model, dropped once OPD is done
    assert not (out / "run" / "grpo" / "final_model").exists()
    assert arms["grpo"]["eval_steps"] == [0, 2, 3] and arms["opd"]["eval_steps"] == [0, 2, 3]
    assert json.loads((out / "run" / "opd" / "config.json").read_text())["teacher"]["path"] == str(
        out / "run" / "grpo" / "final_model")


def check_length_training(n: dict, out, repeats: int) -> None:
    arms = n["arms"]   # each arm trained with its aggregation and advantage
    assert list(arms) == ["grpo", "grpo_token_mean", "dr_grpo"]
    expected = {"grpo": ("seq_mean_token_mean", True), "grpo_token_mean": ("token_mean", True),
                "dr_grpo": ("seq_mean_token_sum_norm", False)}
    for arm, (aggregation, by_std) in expected.items():
        trained = json.loads((out / "run" / arm / "config.json").read_text())["algorithm"]
        assert (trained["aggregation"], trained["scale_by_std"]) == (aggregation, by_std)
        assert len(arms[arm]["length_wrong"]) == 3 and "length_wrong_last_quarter" in arms[arm]


CHECKS = {"baselines": check_baselines, "importance-sampling": check_importance_sampling,
          "kl-estimators": check_kl_estimators, "length-bias": check_length_bias,
          "dynamic-sampling": check_dynamic_sampling, "reward-hacking": check_reward_hacking,
          "clip-higher": check_clip_higher, "opd-vs-grpo": check_opd_vs_grpo,
          "length-training": check_length_training}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_EXPERIMENTS
                                  else n for n in sorted(EXPERIMENTS)])
def test_each_experiment_measures_what_its_claim_names(name, tiny_dir, tmp_path, capsys):
    """Each experiment end to end on a tiny model, then figures its numbers must hold exactly
    whatever the model: identities between its arms, the sizes it ran at (CHECKS: one a name)."""
    out = tmp_path / name
    slow = name in SLOW_EXPERIMENTS
    repeats = 3 if slow else experiment_module(name).MIN_REPEATS
    args = SMOKE if slow else [*QUICK, *QUICK_ARGS[name]]
    assert main(["experiment", name, "--out", str(out), "--repeats", str(repeats), "--no-progress",
                 "--model.path", str(tiny_dir), *args]) == 0
    printed = json.loads(capsys.readouterr().out)
    record = json.loads((out / f"{name}.json").read_text())
    assert printed["record"] == str(out / f"{name}.json") and (out / f"{name}.png").stat().st_size > 10_000
    assert record["claim"] == experiment_module(name).CLAIM
    assert record["experiment"] == name and record["provenance"]["command"].startswith(
        f"posttrain experiment {name}")
    assert record["numbers"] and "max_minutes_cut" not in record["numbers"]   # (no budget given)
    assert record["numbers"].get("batches", repeats) == repeats   # --repeats N: N batches measured
    CHECKS[name](record["numbers"], out, repeats)


def test_quarters_average_the_first_and_last_quarter_of_the_steps_with_a_value():
    from posttrain.experiments.length_training import quarters
    assert quarters([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) == (1.5, 7.5)
    assert quarters([None, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, None]) == (2.0, 7.0)   # no wrong answer
    assert quarters([4.0, 6.0]) == (4.0, 6.0)                                   # one step a quarter


def test_each_arm_is_labelled_by_what_bounds_its_update():
    from dataclasses import replace
    from posttrain.config.presets import PRESETS
    grpo = PRESETS["grpo"]
    assert bound(replace(grpo, clip_high=0.28)) == "ratio in [0.80, 1.28]"
    assert bound(PRESETS["gspo"]) == "sequence ratio in [1 - 0.0003, 1 + 0.0004]"
    assert bound(PRESETS["gmpo"]) == "token log-ratio in [-0.4, 0.4]"
    assert bound(PRESETS["cispo"]) == "weight capped at 5, no gradient clipped"
    # an objective without a label of its own is named with its bounds (no error after training)
    assert bound(PRESETS["topr"]) == "topr, clip_low 0.2, clip_high 0.2"


def test_a_training_arm_reads_every_step_and_skips_evaluations(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.1},
            {"step": 1, "policy/entropy": 1.5, "policy/clip_frac_high": 0.25, "reward/mean": 0.0},
            {"step": 2, "reward/mean": 1.0},   # an all-equal batch: no update, no policy metrics
            {"step": 2, "eval/accuracy": 0.4}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = per_step(path)
    assert got["step"] == [1, 2] and got["entropy"] == [1.5, None]
    assert got["clip_frac_high"] == [0.25, None] and got["reward"] == [0.0, 1.0]
    assert mean_of([None, 1.0, 3.0]) == 2.0 and mean_of([None]) is None


def test_an_unknown_experiment_or_too_few_repeats_is_refused(tiny_dir, tmp_path, capsys):
    out = tmp_path / "refused"
    assert main(["experiment", "baselines", "--repeats", "2", "--out", str(out),
                 "--model.path", str(tiny_dir)]) == 2
    assert "needs at least 3" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        main(["experiment", "no-such-thing"])


def _length_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One group of 4 answers: correct (2 tokens), wrong (1), wrong (3), correct (4); L_max 4."""
    rewards_P_G = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0, 0], [1.0, 0, 0, 0], [1.0, 1.0, 1.0, 0], [1.0, 1.0, 1.0, 1.0]])
    return rewards_P_G, mask


def test_token_weights_are_the_aggregations_per_token_weights_by_hand():
    rewards_P_G, mask = _length_batch()
    logp = torch.full((4, 4), -1.0) * mask
    # Dr. GRPO: A = r - mean = +-0.5, every token weighs A / (B L_max) = A / 16
    w = token_weights(arm_algorithm("dr_grpo"), rewards_P_G, mask, logp, 4.0)
    assert torch.allclose(w, torch.tensor([[0.5], [-0.5], [-0.5], [0.5]]) / 16 * mask)
    # GRPO: A / (B |o_i|): the 3-token wrong answer's tokens weigh a third of the 1-token one's
    w = token_weights(arm_algorithm("grpo"), rewards_P_G, mask, logp, 4.0)
    assert float(w[1, 0] / w[2, 0]) == pytest.approx(3.0) and float(w[1, 0]) < 0
    assert float((w[1].sum() - w[2].sum()).abs()) < 1e-7   # each answer's total: the same
    # token mean: A / sum |o| = A / 10 on every token
    w = token_weights(arm_algorithm("grpo_token_mean"), rewards_P_G, mask, logp, 4.0)
    assert float(w[2, 0]) == pytest.approx(float(w[1, 0])) and float(w[0, 0]) == pytest.approx(-float(w[1, 0]))
    assert float(w.abs().sum()) == pytest.approx(float(w[1, 0].abs()) * 10)   # 10 tokens, |A| / 10 each


def test_length_slope_is_minus_one_for_grpo_and_zero_without_the_bias():
    rewards_P_G, mask = _length_batch()
    logp = torch.full((4, 4), -1.0) * mask
    wrong = torch.tensor([False, True, True, False])
    scale = torch.tensor([0.5, -0.5, -0.5, 0.5])   # r - the group's mean
    slopes = {}
    for arm in ("grpo", "dr_grpo", "grpo_token_mean", "gspo"):
        w = token_weights(arm_algorithm(arm), rewards_P_G, mask, logp, 4.0)
        x, y = length_slope(w, mask, wrong, scale)
        assert torch.equal(x.exp().round(), torch.tensor([1.0, 3.0]))   # the two wrong answers
        slopes[arm] = least_squares_slope(x, y)
    assert slopes["grpo"] == pytest.approx(-1.0) and slopes["gspo"] == pytest.approx(-1.0)
    assert slopes["dr_grpo"] == pytest.approx(0.0, abs=1e-9)
    assert slopes["grpo_token_mean"] == pytest.approx(0.0, abs=1e-9)
    assert least_squares_slope(torch.tensor([1.0]), torch.tensor([2.0])) is None


def test_on_policy_gspo_gmpo_step_as_grpo_and_cispo_sapo_as_token_mean():
    rewards_P_G, mask = _length_batch()
    logp = torch.tensor([-0.3, -1.2, -2.0, -0.7]).expand(4, 4) * mask
    weights = {arm: token_weights(arm_algorithm(arm), rewards_P_G, mask, logp, 4.0) for arm in ARMS}
    twins = {arm: same_weights_as(weights, arm) for arm in ARMS}
    assert twins == {"grpo": None, "grpo_token_mean": None, "dr_grpo": None, "gspo": "grpo",
                     "gmpo": "grpo", "cispo": "grpo_token_mean", "sapo": "grpo_token_mean"}


def test_importance_weighted_lengths_and_accuracy_by_hand():
    class Batch:   # lengths 2, 1, 3, 4; answers 0 and 3 correct
        loss_mask_B_T = _length_batch()[1]
        correct_B = torch.tensor([1, 0, 0, 1])
    w = torch.tensor([1.0, 3.0, 1.0, 1.0], dtype=torch.float64)   # the 1-token wrong answer x3
    after, before = weighted_sums(Batch, w), weighted_sums(Batch, torch.ones(4, dtype=torch.float64))
    assert before.tolist() == [2.0, 4.0, 2.0, 6.0, 4.0]
    assert after.tolist() == [4.0, 6.0, 2.0, 6.0, 6.0]
    p = pooled(after)
    assert float(p["len_wrong"]) == 1.5 and float(p["len_correct"]) == 3.0
    assert float(p["accuracy"]) == pytest.approx(1 / 3)
    # two identical pairs: the change pooled over pairs, no spread between them
    s = arm_summary(torch.stack([after, after]), torch.stack([before, before]),
                    torch.stack([before, after]), torch.tensor([0.0]), torch.tensor([0.0]), [0.1, 0.3])
    assert s["delta_len_wrong"] == pytest.approx(1.5 - 2.0) and s["delta_len_wrong_se"] == 0.0
    assert s["delta_accuracy"] == pytest.approx(1 / 3 - 1 / 2) and s["mean_abs_delta_logp"] == 0.2
    # against a reference that moved in one pair of two: pooled 10/6 wrong-answer tokens
    assert s["vs_reference_len_wrong"] == pytest.approx(1.5 - 10 / 6)
    assert s["vs_reference_len_wrong_se"] > 0 and s["vs_reference_len_correct"] == 0.0


def test_step_along_moves_the_parameters_the_given_distance_along_their_gradient():
    layer = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in layer.parameters()]
    layer(torch.ones(1, 3)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in layer.parameters()])
    step_along(layer, 0.5)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(layer.parameters(), before)])
    assert float(moved.norm()) == pytest.approx(0.5)
    assert torch.allclose(moved, 0.5 * grads / grads.norm())
    assert all(p.grad is None for p in layer.parameters())
    for p in layer.parameters():   # a batch with no signal: zero gradient, no step (not NaN)
        p.grad = torch.zeros_like(p)
    kept = [p.detach().clone() for p in layer.parameters()]
    step_along(layer, 0.5)
    assert all(torch.equal(p, k) for p, k in zip(layer.parameters(), kept))


def test_evaluations_read_each_held_out_accuracy_with_the_training_minutes_before_it(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.1},
            {"step": 1, "perf/step_s": 60.0}, {"step": 2, "perf/step_s": 30.0},
            {"step": 2, "eval/accuracy": 0.4}, {"step": 3, "perf/step_s": 90.0},
            {"step": 3, "eval/accuracy": 0.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = evaluations(path, per_step(path))
    assert got == {"eval_steps": [0, 2, 3], "eval_accuracy": [0.1, 0.4, 0.5],
                   "eval_minutes": [0.0, 1.5, 3.0]}


def test_first_reaching_is_the_first_evaluation_at_or_above_the_target():
    steps, acc, minutes = [2, 4, 6], [0.5, 0.7, 0.69], [1.0, 2.0, 3.0]
    assert first_reaching(steps, acc, minutes, 0.7) == {"step": 4, "minutes": 2.0}
    assert first_reaching(steps, acc, minutes, 0.5) == {"step": 2, "minutes": 1.0}
    assert first_reaching(steps, acc, minutes, 0.71) == {"step": None, "minutes": None}


def test_answer_collapse_is_the_share_of_problems_given_the_commonest_answer(tmp_path):
    evals = [{"step": 0, "samples": [{"completion": "1 + 2 = 3"}, {"completion": "2 + 2 = 5"}]},
             {"step": 5, "samples": [{"completion": "100"}, {"completion": " 100\n"},
                                     {"completion": "7"}, {"completion": "100"}]}]
    path = tmp_path / "eval_samples.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in evals) + "\n")
    got = answer_collapse(path)
    assert got[0]["top_share"] == 0.5 and got[0]["step"] == 0
    assert got[1] == {"step": 5, "top_completion": "100", "top_share": 0.75}   # stripped alike


def test_an_experiments_budget_ends_its_loops_and_names_them_for_the_record():
    """Progress.range: past the deadline a loop ends after its first item and is named in
    `cut` (the record's max_minutes_cut); without one every item runs. No module globals: two
    experiments in one process have budgets of their own."""
    import time
    from posttrain.experiments.common import Progress
    spent, free = Progress(False, deadline=time.monotonic() - 1), Progress(False)
    assert list(spent.range(5, "arm a")) == [0] and spent.cut == ["arm a: 1 of 5"]
    assert list(free.range(3, "arm b")) == [0, 1, 2] and free.cut == [] and not free
