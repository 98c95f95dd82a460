"""The field's current objectives (docs/algorithms.md §11), KL estimators and off-policy corrections:
values and gradients against hand computations (math on scalars, never the library's own
functions), on a batch with a full row, a padded row and an all-zero row."""

import math

import pytest
import torch

from posttrain.losses.aggregation import AGGREGATIONS, aggregate
from posttrain.losses.common import entropy_from_logits
from posttrain.losses.correction import OFF_POLICY_CORRECTIONS
from posttrain.losses.kl import KL_ESTIMATORS, KL_GRADIENT_OF, entropy_bonus_loss
from posttrain.losses.policy import POLICY_LOSSES, ObjectiveParams, PolicyInputs

close = torch.testing.assert_close
ln = math.log

# row 0: three tokens, ratios 1.1, 0.5, 1.5;  row 1: two tokens and padding, ratios 0.9, 1.3;
# row 2: no token at all (an empty response), whatever its numbers
RATIOS = [[1.1, 0.5, 1.5], [0.9, 1.3, 7.0], [1.2, 1.2, 1.2]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)


def batch(adv_rows, ratios=RATIOS):
    logp = torch.tensor([[ln(r) for r in row] for row in ratios], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor(adv_rows, dtype=torch.float64)[:, None].expand(3, 3).clone()
    return logp, PolicyInputs(logp, torch.zeros(3, 3, dtype=torch.float64), adv, MASK, group_size=3)


def run(name, x, logp, **params):
    """Per-token loss, and the gradient of sum_t loss_t over the masked tokens."""
    term = POLICY_LOSSES[name](x, ObjectiveParams(**params))
    grad, = torch.autograd.grad((term.loss_B_T * MASK).sum(), logp)
    return term.loss_B_T.detach(), grad, term.metrics


def expect_rows(loss, grad, rows):
    """rows: {row: (per-token loss values, per-token gradients)} over that row's masked tokens."""
    for i, (values, grads) in rows.items():
        n = len(values)
        close(loss[i, :n], torch.tensor(values, dtype=torch.float64), rtol=1e-9, atol=1e-9)
        close(grad[i, :n], torch.tensor(grads, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert torch.all(grad[MASK == 0] == 0)


# --- GSPO -------------------------------------------------------------------------------------

def test_gspo_unclipped_by_hand():
    logp, x = batch([1.0, -1.0, 2.0])
    loss, grad, _ = run("gspo", x, logp, clip_low=0.2, clip_high=0.2)
    s0 = math.exp((ln(1.1) + ln(0.5) + ln(1.5)) / 3)          # 0.93789: inside [0.8, 1.2]
    s1 = math.exp((ln(0.9) + ln(1.3)) / 2)                     # 1.08167
    # L_i = -s_i A_i on each token; d(sum_t L_i)/dlogp_t = |o_i| * (-A_i s_i / |o_i|) = -A_i s_i
    expect_rows(loss, grad, {0: ([-s0] * 3, [-s0] * 3), 1: ([s1] * 2, [s1] * 2)})


def test_gspo_clips_whole_sequences_by_hand():
    logp, x = batch([-1.0, 1.0, 2.0])                          # A < 0 with s < 1 - eps, A > 0 with s > 1 + eps
    loss, grad, metrics = run("gspo", x, logp, clip_low=0.05, clip_high=0.05)
    expect_rows(loss, grad, {0: ([0.95] * 3, [0.0] * 3), 1: ([-1.05] * 2, [0.0] * 2)})
    assert abs(metrics["policy/clip_frac_low"].item() - 3 / 5) < 1e-7
    assert abs(metrics["policy/clip_frac_high"].item() - 2 / 5) < 1e-7


def test_gspo_token_equals_gspo_for_one_advantage_per_row_and_uses_token_advantages():
    logp, x = batch([1.0, -1.0, 2.0])
    seq, g_seq, _ = run("gspo", x, logp, clip_low=0.2, clip_high=0.2)
    tok, g_tok, _ = run("gspo_token", x, logp, clip_low=0.2, clip_high=0.2)
    close(seq * MASK, tok * MASK)
    close(g_seq, g_tok)
    adv = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    x2 = PolicyInputs(logp, x.old_logp_B_T, adv, MASK, 3)
    loss, grad, _ = run("gspo_token", x2, logp, clip_low=0.2, clip_high=0.2)
    s0 = math.exp((ln(1.1) + ln(0.5) + ln(1.5)) / 3)
    # s_it has value s_0 and gradient s_0 grad logp_t: L_t = -s_0 A_t, dL_t/dlogp_t = -s_0 A_t
    expect_rows(loss, grad, {0: ([-s0, 2 * s0, -0.5 * s0], [-s0, 2 * s0, -0.5 * s0])})


# --- CISPO ------------------------------------------------------------------------------------

def test_cispo_keeps_every_gradient_with_a_capped_constant_weight():
    logp, x = batch([1.0, -1.0, 2.0])
    loss, grad, metrics = run("cispo", x, logp, clip_low=1.0, clip_high=0.2)
    w0, w1 = [1.1, 0.5, 1.2], [0.9, 1.2]                       # min(rho, 1.2); no lower bound
    expect_rows(loss, grad, {
        0: ([-w * ln(r) for w, r in zip(w0, [1.1, 0.5, 1.5])], [-w for w in w0]),
        1: ([w * ln(r) for w, r in zip(w1, [0.9, 1.3])], w1)})
    # the token at rho 1.5 with A > 0 keeps a gradient (PPO's clip would drop it)
    assert grad[0, 2] == -1.2
    assert abs(metrics["policy/is_weight_capped_frac"].item() - 2 / 5) < 1e-7


# --- SAPO -------------------------------------------------------------------------------------

def sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


def test_sapo_soft_gate_by_hand():
    logp, x = batch([1.0, -1.0, 2.0])
    loss, grad, _ = run("sapo", x, logp, sapo_tau_pos=1.0, sapo_tau_neg=1.05)

    def token(r, a, tau):   # L = -(4/tau) sigmoid(tau (r-1)) A;  dL/dlogp = -4 s (1-s) r A
        s = sigmoid(tau * (r - 1.0))
        return -(4.0 / tau) * s * a, -4.0 * s * (1.0 - s) * r * a
    row0 = [token(r, 1.0, 1.0) for r in (1.1, 0.5, 1.5)]
    row1 = [token(r, -1.0, 1.05) for r in (0.9, 1.3)]
    expect_rows(loss, grad, {0: ([v for v, _ in row0], [g for _, g in row0]),
                             1: ([v for v, _ in row1], [g for _, g in row1])})
    assert abs(token(1.0, 1.0, 1.0)[1] + 1.0) < 1e-12     # on-policy: the plain policy gradient


# --- GMPO -------------------------------------------------------------------------------------

def test_gmpo_geometric_mean_with_pessimistic_log_ratio_clip_by_hand():
    logp, x = batch([1.0, -1.0, 2.0])
    loss, grad, _ = run("gmpo", x, logp, clip_low=0.4, clip_high=0.4)
    # row 0, A > 0: min(log r, clip(log r)) = (ln 1.1, ln 0.5, 0.4): the third is clipped (no grad)
    g0 = math.exp((ln(1.1) + ln(0.5) + 0.4) / 3)
    # row 1, A < 0: max(log r, clip(log r)) = log r (both inside the band)
    g1 = math.exp((ln(0.9) + ln(1.3)) / 2)
    # d(sum_t L_i)/dlogp_t = |o_i| * (-A_i g_i / |o_i|) on unclipped tokens
    expect_rows(loss, grad, {0: ([-g0] * 3, [-g0, -g0, 0.0]), 1: ([g1] * 2, [g1, g1])})


# --- TOPR -------------------------------------------------------------------------------------

def test_topr_tapers_only_negative_answers_by_their_truncated_sequence_ratio():
    # row 1's sequence ratio over its two tokens is 0.5 * 1.2 = 0.6 (its padding's 7.0 not counted)
    logp, x = batch([1.0, -1.0, 2.0], ratios=[[1.1, 0.5, 1.5], [0.5, 1.2, 7.0], [1.2, 1.2, 1.2]])
    loss, grad, metrics = run("topr", x, logp)
    # row 0, A > 0: plain REINFORCE, weight 1 although its sequence ratio is 0.825
    # row 1, A < 0: L_t = -0.6 * (-1) * log pi_t, gradient 0.6 on each token
    expect_rows(loss, grad, {0: ([-ln(r) for r in (1.1, 0.5, 1.5)], [-1.0] * 3),
                             1: ([0.6 * ln(0.5), 0.6 * ln(1.2)], [0.6, 0.6])})
    assert abs(metrics["policy/topr_tapered_frac"].item() - 2 / 5) < 1e-7
    # a negative answer whose sequence ratio is above 1 (0.9 * 1.3 = 1.17) is truncated at 1
    logp, x = batch([1.0, -1.0, 2.0])
    loss, grad, metrics = run("topr", x, logp)
    expect_rows(loss, grad, {1: ([ln(0.9), ln(1.3)], [1.0, 1.0])})
    assert metrics["policy/topr_tapered_frac"].item() == 0.0

# --- Clip-Cov and KL-Cov ----------------------------------------------------------------------

def cov_batch():
    """logp (0, -3 | -1, -1), advantages 2 (row 0) and 0 (row 1): per-token covariances
    (lp - mean lp)(A - mean A) = (1.25)(1), (-1.75)(1), (0.25)(-1), (0.25)(-1)."""
    logp = torch.tensor([[0.0, -3.0], [-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    return logp, adv, torch.ones(2, 2, dtype=torch.float64)


def test_clip_cov_detaches_the_token_in_the_covariance_band():
    logp, adv, mask = cov_batch()
    x = PolicyInputs(logp, logp.detach(), adv, mask, 2, torch.Generator().manual_seed(0))
    term = POLICY_LOSSES["clip_cov"](x, ObjectiveParams(cov_frac=1e-4, cov_low=1.0, cov_high=5.0))
    grad, = torch.autograd.grad(term.loss_B_T.sum(), logp)
    # only token (0, 0) has 1 < cov < 5: its gradient is removed; the others keep -A (ratio 1)
    close(grad, torch.tensor([[0.0, -2.0], [0.0, 0.0]], dtype=torch.float64))
    close(term.loss_B_T.detach(), torch.tensor([[0.0, -2.0], [0.0, 0.0]], dtype=torch.float64))


def test_kl_cov_penalises_the_largest_covariance_token_by_hand():
    logp, adv, mask = cov_batch()
    old = logp.detach() - 0.1                                  # every ratio e^0.1
    x = PolicyInputs(logp, old, adv, mask, 2)
    term = POLICY_LOSSES["kl_cov"](x, ObjectiveParams(cov_frac=1e-4, kl_cov_coef=1.0))
    grad, = torch.autograd.grad(term.loss_B_T.sum(), logp)
    r = math.exp(0.1)
    # L_t = -r A_t (+ |log r| on token (0, 0), the largest covariance): dL/dlogp = -r A (+ 1)
    close(grad, torch.tensor([[-2 * r + 1.0, -2 * r], [0.0, 0.0]], dtype=torch.float64))
    close(term.loss_B_T.detach(), torch.tensor([[-2 * r + 0.1, -2 * r], [0.0, 0.0]], dtype=torch.float64))


# --- on-policy, every objective is the policy gradient ------------------------------------------

# (Clip-Cov and KL-Cov act on the covariance, not the ratio: they differ from it by design)
@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES.names() if n not in ("clip_cov", "kl_cov")])
def test_every_objective_is_the_policy_gradient_at_ratio_one(name):
    """With one update (pi_old = pi_theta), aggregated with 1/(B |o_i|) weights, each objective's
    gradient is REINFORCE's: -A_i / (B |o_i|) on each token (B counts non-empty rows)."""
    logp = torch.tensor([[-0.3, -1.2, -0.7], [-2.0, -0.1, -5.0], [-1.0, -1.0, -1.0]],
                        dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.5] * 3, [-0.5] * 3, [3.0] * 3], dtype=torch.float64)
    x = PolicyInputs(logp, logp.detach(), adv, MASK, 3)
    weights = AGGREGATIONS["seq_mean_token_mean"](MASK, 3.0)
    params = ObjectiveParams(clip_low=1.0 if name == "cispo" else 0.2)
    grad, = torch.autograd.grad(aggregate(POLICY_LOSSES[name](x, params).loss_B_T, weights), logp)
    expected = torch.tensor([[-1.5 / 6] * 3, [0.5 / 4, 0.5 / 4, 0.0], [0.0] * 3], dtype=torch.float64)
    close(grad, expected)


# --- KL estimators ----------------------------------------------------------------------------

def test_kl_estimator_values_and_gradients_by_hand():
    logp = torch.tensor([ln(0.5)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([ln(0.25)], dtype=torch.float64)
    r = 0.25 / 0.5
    hand = {"k1": (ln(2), 1.0), "k2": (0.5 * ln(2) ** 2, ln(2)),
            "k3": (r - ln(r) - 1, 1 - r), "k3_st": (r - ln(r) - 1, ln(2))}
    for name, (value, slope) in hand.items():
        k = KL_ESTIMATORS[name](logp, ref)
        g, = torch.autograd.grad(k.sum(), logp)
        assert abs(k.item() - value) < 1e-12 and abs(g.item() - slope) < 1e-12, name
    # past k3's cap (10 per token) neither k3 nor k3_st pulls: one drifted token carries nothing
    far = torch.tensor([-25.0], dtype=torch.float64, requires_grad=True)   # pi_ref / pi = e^24
    for name in ("k3", "k3_st"):
        k = KL_ESTIMATORS[name](far, torch.tensor([-1.0], dtype=torch.float64))
        g, = torch.autograd.grad(k.sum(), far)
        assert k.item() == 10.0 and g.item() == 0.0, name


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_estimator_gradients_in_the_loss_follow_the_divergence_they_claim(name):
    """Exact enumeration over a 4-token vocabulary: E_{y~pi}[grad k(y)] (samples not
    differentiated, as in the loss) against autograd of the true KL(pi||pi_ref) or KL(pi_ref||pi)."""
    theta = torch.tensor([0.3, -0.8, 1.1, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.5, 0.2, -0.4, 0.9], dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    k = KL_ESTIMATORS[name](logp, ref)
    expected_grad, = torch.autograd.grad((logp.exp().detach() * k).sum(), theta, retain_graph=True)
    p, q = logp.exp(), ref.exp()
    target = {None: None, "KL(pi || pi_ref)": "reverse", "KL(pi_ref || pi)": "forward"}[KL_GRADIENT_OF[name]]
    if target is None:
        close(expected_grad, torch.zeros(4, dtype=torch.float64), atol=1e-12, rtol=0)
        return
    true = (p * (logp - ref)).sum() if target == "reverse" else (q * (ref - logp)).sum()
    true_grad, = torch.autograd.grad(true, theta)
    close(expected_grad, true_grad, atol=1e-12, rtol=1e-9)


# --- off-policy corrections -------------------------------------------------------------------

def test_off_policy_corrections_by_hand():
    engine = torch.zeros(2, 3, dtype=torch.float64)
    trainer = torch.tensor([[ln(1.5), ln(0.3), ln(3.0)], [ln(0.8), ln(1.1), 99.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    band, cap = (0.5, 2.0), 2.0

    def w(name):
        return OFF_POLICY_CORRECTIONS[name](trainer, engine, mask, cap, band) * mask
    t = lambda *rows: torch.tensor(rows, dtype=torch.float64)   # noqa: E731
    close(w("token_tis"), t([1.5, 0.3, 2.0], [0.8, 1.1, 0.0]))
    seq0, seq1 = 1.5 * 0.3 * 3.0, 0.8 * 1.1                    # 1.35, 0.88
    close(w("seq_tis"), t([seq0] * 3, [seq1, seq1, 0.0]))
    close(w("token_mis"), t([1.5, 0.0, 0.0], [0.8, 1.1, 0.0]))
    close(w("seq_mis"), t([seq0] * 3, [seq1, seq1, 0.0]))
    close(OFF_POLICY_CORRECTIONS["seq_mis"](trainer, engine, mask, cap, (0.9, 1.2)) * mask,
          t([0.0] * 3, [0.0] * 3))                            # 1.35 above, 0.88 below the band
    close(w("icepop"), w("token_mis"))                       # IcePop: M(k) = k inside the band


# --- entropy bonus ----------------------------------------------------------------------------

def test_entropy_bonus_value_and_direction():
    logits = torch.tensor([[2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    h = entropy_from_logits(logits)
    p = math.exp(2) / (math.exp(2) + 1)
    assert abs(h.item() + p * ln(p) + (1 - p) * ln(1 - p)) < 1e-12
    loss = entropy_bonus_loss(h, 0.1)
    assert abs(loss.item() + 0.1 * h.item()) < 1e-12
    g, = torch.autograd.grad(loss.sum(), logits)
    stepped = logits.detach() - 1.0 * g                      # one gradient step on the loss
    assert entropy_from_logits(stepped).item() > h.item()     # raises the entropy
