"""DPPO (losses/policy.py): its divergences, masks, loss and gradient against a hand computation
on a padded batch, and how the update wires it (the sampler's log-probs, no second correction)."""

import math

import pytest
import torch

from posttrain.losses.policy import POLICY_LOSSES, ObjectiveParams, PolicyInputs
from posttrain.losses.policy_selective import binary_kl, binary_tv

# two responses: row 0 (A = +1) has three tokens, row 1 (A = -1) two and one padding column
PI = [[0.5, 0.9, 0.2], [0.1, 0.5, 0.7]]
MU = [[0.4, 0.6, 0.3], [0.4, 0.55, 1.0]]     # (the padding's mu is an engine's filler: 1)
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]


def inputs(behaviour: bool = True):
    logp = torch.tensor(PI).log().requires_grad_(True)
    mu = torch.tensor(MU).log()
    x = PolicyInputs(logp, torch.full_like(mu, -9.0), torch.tensor(ADV), torch.tensor(MASK), 1,
                     behaviour_logp_B_T=mu if behaviour else None)
    return logp, x


def test_the_binary_divergences_by_hand():
    pi, mu = torch.tensor([[0.5, 0.9]]).log(), torch.tensor([[0.4, 0.6]]).log()
    assert binary_tv(pi, mu).tolist()[0] == pytest.approx([0.1, 0.3], abs=1e-6)
    kl = [0.4 * math.log(0.4 / 0.5) + 0.6 * math.log(0.6 / 0.5),
          0.6 * math.log(0.6 / 0.9) + 0.4 * math.log(0.4 / 0.1)]
    assert binary_kl(pi, mu).tolist()[0] == pytest.approx(kl, abs=1e-6)
    assert binary_kl(mu, mu).abs().max() < 1e-6      # no move, no divergence


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_masks_loss_and_gradient_by_hand(name):
    """Masked by hand (delta 0.2 both sides): row 0 token 1 rose 0.6 -> 0.9 with A > 0 (TV 0.3,
    binary KL 0.311): masked; row 1 token 0 fell 0.4 -> 0.1 with A < 0: masked; row 0 token 2
    fell with A > 0: kept (moving back is never masked). Kept tokens: -A min(pi/mu, 2) log pi."""
    logp, x = inputs()
    term = POLICY_LOSSES[name](x, ObjectiveParams(dppo_delta_low=0.2, dppo_delta_high=0.2,
                                                  dppo_ratio_cap=2.0))
    mask = torch.tensor(MASK)
    keep = [[1, 0, 1], [0, 1]]
    rho = [[0.5 / 0.4, 0.9 / 0.6, 0.2 / 0.3], [0.1 / 0.4, 0.5 / 0.55]]
    want = [[-ADV[r][t] * rho[r][t] * math.log(PI[r][t]) * keep[r][t] for t in range(len(keep[r]))]
            for r in range(2)]
    got = (term.loss_B_T * mask).tolist()
    assert got[0] == pytest.approx(want[0], abs=1e-6)
    assert got[1][:2] == pytest.approx(want[1], abs=1e-6) and got[1][2] == 0.0
    (term.loss_B_T * mask).sum().backward()
    grad = [[-ADV[r][t] * rho[r][t] * keep[r][t] for t in range(len(keep[r]))] for r in range(2)]
    assert logp.grad[0].tolist() == pytest.approx(grad[0], abs=1e-6)
    assert logp.grad[1].tolist() == pytest.approx(grad[1] + [0.0], abs=1e-6)
    assert term.metrics["policy/dppo_masked_frac"].item() == pytest.approx(2 / 5)
    assert term.clipped_B_T.tolist() == [[0, 1, 0], [-1, 0, 0]]


def test_the_ratio_cap_bounds_the_weight_and_none_leaves_it():
    logp, x = inputs()
    x = PolicyInputs(torch.tensor([[0.3]]).log(), x.old_logp_B_T[:1, :1], torch.tensor([[1.0]]),
                     torch.ones(1, 1), 1, behaviour_logp_B_T=torch.tensor([[0.1]]).log())
    wide = ObjectiveParams(dppo_delta_high=0.5)
    capped = POLICY_LOSSES["dppo_tv"](x, ObjectiveParams(dppo_delta_high=0.5, dppo_ratio_cap=2.0))
    free = POLICY_LOSSES["dppo_tv"](x, ObjectiveParams(dppo_delta_high=0.5, dppo_ratio_cap=None))
    assert capped.loss_B_T.item() == pytest.approx(-2.0 * math.log(0.3), abs=1e-6)
    assert free.loss_B_T.item() == pytest.approx(-3.0 * math.log(0.3), abs=1e-6)
    assert wide.dppo_ratio_cap == 10.0


def test_the_default_ratio_cap_is_the_reference_implementations():
    """C = 10, sail-sg/Stable-RL's clip_ratio_c (a cap of 2 truncated the weight of every token
    whose probability more than doubled: the bias the cap exists to keep small), the same in the
    objective's parameters, the algorithm's field and docs/algorithms.md."""
    from pathlib import Path
    from posttrain.config.presets import AlgorithmConfig
    assert ObjectiveParams().dppo_ratio_cap == AlgorithmConfig().dppo_ratio_cap == 10.0
    assert AlgorithmConfig().objective_params().dppo_ratio_cap == 10.0
    docs = (Path(__file__).parent.parent / "docs" / "algorithms.md").read_text()
    assert "`C = algorithm.dppo_ratio_cap`\n  (10," in docs


def test_the_icepop_help_says_what_its_weight_is():
    """IcePop keeps the ratio inside the band (masked IS), not 1: the option's description says
    so, as the code does."""
    from posttrain.config.options import field_docs
    from posttrain.config.rollout import RolloutConfig
    from posttrain.losses.correction import OFF_POLICY_CORRECTIONS
    text = field_docs(RolloutConfig)["correction"]
    assert "1 inside" not in text and "icepop (token_mis" in text
    rho = torch.tensor([[3.0, 1.5, 0.2]])
    w = OFF_POLICY_CORRECTIONS["icepop"](rho.log(), torch.zeros(1, 3), torch.ones(1, 3), 2.0,
                                         (0.5, 5.0))
    assert w[0].tolist() == pytest.approx([3.0, 1.5, 0.0])


def test_without_a_separate_sampler_dppo_reads_pi_old():
    """On-policy (no behaviour log-probs given), mu is pi_old."""
    logp, x = inputs(behaviour=False)
    x = PolicyInputs(x.logp_B_T, torch.tensor(MU).log(), x.adv_B_T, x.mask_B_T, 1)
    a = POLICY_LOSSES["dppo_tv"](x, ObjectiveParams()).loss_B_T
    b = POLICY_LOSSES["dppo_tv"](inputs()[1], ObjectiveParams()).loss_B_T
    assert torch.equal(a, b)


def tiny_batch():
    from posttrain.sampling.batch import ScoredBatch
    from posttrain.data.tasks import Problem
    from posttrain.rollout.base import Rollout
    ones = torch.ones(2, 3)
    ro = Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1), torch.ones(2, 3, dtype=torch.long),
                 ones, torch.tensor(MU).log(), torch.zeros(2, dtype=torch.bool), 2)
    return ScoredBatch(ro, [Problem("p", "1")] * 2, ["a", "b"], torch.zeros(2), torch.zeros(2),
                       ones, trainer_old_logp_B_T=torch.tensor(PI).log())


def test_dppo_takes_no_second_correction_and_may_update_several_times(tmp_path):
    from posttrain.rl.loss_terms import update_terms
    from tests.test_trainer import toy_config
    cfg = toy_config(tmp_path, "--rollout.backend", "vllm", "--optim.epochs", "2",
                     "--algorithm.policy_loss", "dppo_tv")
    assert update_terms(tiny_batch(), cfg, cfg.algo, None).correction is None
    cfg = toy_config(tmp_path, "--rollout.backend", "vllm", "--optim.epochs", "2")
    assert update_terms(tiny_batch(), cfg, cfg.algo, None).correction is not None
