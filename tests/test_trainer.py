"""The training loop end to end on tiny random models with the real SmolLM2 tokenizer."""

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch

from posttrain.config.options import load_config
from posttrain.rewards import Scorer
from posttrain.rollout import SamplingParams, make_engine
from posttrain.sampling.batch import equal_reward_groups
from posttrain.model.distributed import SINGLE
from posttrain.sampling.collect import generate_and_score
from posttrain.sampling.setup import SamplingSetup
from posttrain.rl.loop import train
from posttrain.losses.policy import POLICY_LOSSES, objective_reads
from posttrain.rl.update import update_policy
from posttrain.data.source import PromptStream, build_task
from posttrain.model.prompts import encode_prompts
from posttrain.rollout.forward import frozen_logprobs
from tests.conftest import make_tiny_model, learner_for

TOY = ["--reward.verifier", "none", "--reward.functions", "tests.toy_rewards:first_letter_a_to_e",
       "--data.eval_size", "0", "--rollout.max_new_tokens", "3", "--data.system_prompt", "null",
       "--tensorboard", "false", "--threads", "2"]


def toy_config(tmp_path, *extra):
    return load_config(None, [*TOY, "--run_dir", str(tmp_path / "run"), *extra])


def reward_curve(run_dir):
    """Mean reward of everything generated (before dynamic sampling keeps informative groups)."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["reward/generated_mean"] for r in rows if "reward/generated_mean" in r]


@pytest.mark.parametrize("preset", ["reinforce", "rloo", "grpo", "dapo", "dr_grpo", "gspo", "cispo",
                                    "sapo", "gmpo", "topr"])
def test_every_preset_moves_the_policy_toward_its_own_advantages(tmp_path, tokenizer, preset):
    """Deterministic, whatever the seed: on one fixed batch with fixed rewards, the preset's own
    advantage estimator gives every rewarded answer of a mixed group a positive advantage and every
    unrewarded one a negative one, and one update (two minibatches where the preset allows, so the
    second is off-policy) raises the advantage-weighted log-likelihood sum_i w_i A_i log pi(y_i)
    under the preset's own aggregation weights w. To first order the change is lr |g|^2 > 0, so a
    wrong sign, a lost gradient or a broken estimator fails it."""
    from types import SimpleNamespace

    from posttrain.rollout.forward import sequence_logprobs
    from posttrain.losses.aggregation import AGGREGATIONS
    from posttrain.rl.advantage import compute_advantages
    from posttrain.rl.update import response_budget
    two = [] if preset == "reinforce" else ["--optim.minibatches", "2"]
    if preset == "dapo":   # (3-token answers are all "overlong"; shaping is tested on its own)
        two += ["--algorithm.overlong", "none"]
    cfg = toy_config(tmp_path, "--preset", preset, "--steps", "1", "--algorithm.kl_coef", "0", *two)
    model = make_tiny_model(tokenizer, seed=6)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg,
                                                engine=make_engine("hf", model, tokenizer),
                                                tokenizer=tokenizer, scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    G = batch.rollout.group_size
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * (len(batch.rewards_B) // 4))   # every group mixed
    batch = replace(batch, rewards_B=rewards, correct_B=rewards > 0)
    run = SimpleNamespace(cfg=cfg, algo=cfg.algo, critic=None, world=SINGLE)
    batch, _ = compute_advantages(run, batch)
    adv_row = (batch.adv_B_T * batch.loss_mask_B_T).sum(-1)
    has_tokens = batch.loss_mask_B_T.sum(-1) > 0
    assert G == 4 and (adv_row[(rewards > 0) & has_tokens] > 0).all()
    assert (adv_row[(rewards == 0) & has_tokens] < 0).all()
    weights = AGGREGATIONS[cfg.algo.aggregation](batch.loss_mask_B_T, response_budget(cfg, batch))
    rows = torch.arange(len(rewards))

    def objective_value():
        with torch.no_grad():
            logp = sequence_logprobs(model, batch.rollout, rows, cfg.rollout.temperature).logp
            return float((batch.adv_B_T * weights * logp).sum())
    before = objective_value()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    update_policy(learner_for(cfg, model, opt), batch)
    assert objective_value() > before


@pytest.mark.slow   # end to end on a tiny model; the test above is the deterministic check
@pytest.mark.parametrize("preset", ["reinforce", "rloo", "grpo", "dapo", "dr_grpo"])
def test_every_preset_learns_a_toy_reward(tmp_path, tokenizer, preset):
    """45 steps at a high lr on a tiny random model are chaotic, and one seed may stall whatever
    the algorithm: the reward gain is averaged over seeds 0, 1 and 2, none of them picked."""
    extra = ["--algorithm.kl_coef", "0.02"] if preset == "grpo" else []
    if preset == "dapo":   # 3-token answers are all "overlong"; shaping is tested on its own
        extra += ["--algorithm.overlong", "none"]
    gains = []
    for seed in (0, 1, 2):
        run = tmp_path / f"s{seed}"
        cfg = toy_config(run, "--preset", preset, "--steps", "45", "--optim.lr", "3e-2",
                         "--seed", str(seed), *extra)
        summary = train(cfg, model=make_tiny_model(tokenizer, seed=seed), tokenizer=tokenizer,
                        show_progress=False)
        curve = reward_curve(run / "run")
        gains.append(sum(curve[-5:]) / 5 - sum(curve[:5]) / 5)
        assert summary["steps"] == 45 and (run / "run" / "final_model" / "config.json").is_file()
    assert sum(gains) / 3 > 0.25, (preset, gains)


def test_recorded_old_logprobs_match_a_recomputed_forward(tokenizer, tiny_model):
    task = build_task(load_config(None, ["--data.eval_size", "4"]).data)
    engine = make_engine("hf", tiny_model, tokenizer)
    prompts = encode_prompts(tokenizer, task.eval_problems, "Be brief.")   # different lengths
    for temperature in (1.0, 0.7):
        rollout = engine.generate(prompts, 3, SamplingParams(6, temperature),
                                  torch.Generator().manual_seed(0))
        recomputed = frozen_logprobs(tiny_model, rollout, temperature, micro=5)
        torch.testing.assert_close(rollout.logp_B_T, recomputed, atol=2e-4, rtol=1e-4)
        assert (rollout.logp_B_T[rollout.response_mask_B_T == 0] == 0).all()
    # each group shares its prompt, and group members differ (sampled independently)
    assert torch.equal(rollout.prompt_ids_B_L[0], rollout.prompt_ids_B_L[2])
    assert len({tuple(r.tolist()) for r in rollout.response_ids_B_T[:3]}) > 1


def test_one_update_has_ratio_one_and_clipped_equals_vanilla(tmp_path, tokenizer):
    cfg = toy_config(tmp_path, "--steps", "1", "--optim.lr", "1e-2")
    model_a = make_tiny_model(tokenizer, seed=3)
    engine = make_engine("hf", model_a, tokenizer)
    task = build_task(cfg.data)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg, engine=engine, tokenizer=tokenizer,
                                                scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(task, 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    adv = torch.randn(batch.loss_mask_B_T.shape) * batch.loss_mask_B_T
    start = torch.cat([p.detach().flatten() for p in model_a.parameters()])

    def update(loss_name: str, minibatches: int) -> tuple[dict, torch.Tensor]:
        model = make_tiny_model(tokenizer, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
        c = replace(cfg, optim=replace(cfg.optim, minibatches=minibatches),
                    algorithm={**cfg.algorithm, "policy_loss": loss_name})
        stats = update_policy(learner_for(c, model, opt, sched),
                              replace(batch, adv_B_T=adv))
        return stats, torch.cat([p.detach().flatten() for p in model.parameters()])

    # one update on the batch it sampled: the recorded log-probs are the trainer's, ratio 1, no clip
    (clipped, p_clipped), (_, p_vanilla) = update("clipped", 1), update("vanilla", 1)
    assert clipped["policy/ratio_mean"] == 1.0 and clipped["policy/ratio_max"] == 1.0
    assert clipped.get("policy/clip_frac_low", 0.0) == 0.0 and clipped.get("policy/clip_frac_high", 0.0) == 0.0
    assert not torch.equal(p_clipped, start)
    torch.testing.assert_close(p_clipped, p_vanilla)
    # the second of two minibatches is sampled from the policy before the first update: its
    # ratio is off 1, and the clipped surrogate's update is no longer vanilla's
    (clipped, p_clipped), (_, p_vanilla) = update("clipped", 2), update("vanilla", 2)
    assert clipped["policy/ratio_max"] > 1.0 or clipped["policy/ratio_min"] < 1.0
    assert not torch.allclose(p_clipped, p_vanilla)


def test_several_epochs_move_the_ratio_and_clip(tmp_path, tokenizer):
    cfg = toy_config(tmp_path, "--steps", "1", "--optim.lr", "5e-2", "--optim.epochs", "3",
                     "--optim.minibatches", "2")
    model = make_tiny_model(tokenizer, seed=4)
    engine = make_engine("hf", model, tokenizer)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg, engine=engine, tokenizer=tokenizer,
                                                scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    adv = torch.randn(batch.loss_mask_B_T.shape) * batch.loss_mask_B_T
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    stats = update_policy(learner_for(cfg, model, opt, sched), replace(batch, adv_B_T=adv))
    assert stats["policy/ratio_max"] > 1.0
    assert stats["policy/clip_frac_low"] + stats["policy/clip_frac_high"] > 0


# every registered objective that can run several updates (one that reads no pi_old cannot)
@pytest.mark.parametrize("objective", [n for n in POLICY_LOSSES.names() if "old_logp" in objective_reads(n)])
def test_each_objective_moves_the_policy_toward_its_advantages(tmp_path, tokenizer, objective):
    """Two minibatches of plain SGD on one fixed batch (the second is off-policy): the
    advantage-weighted log-likelihood of the batch's own tokens rises, for every objective. To
    first order the change is lr |g|^2 > 0, so a wrong sign or a dropped gradient fails it."""
    from posttrain.rollout.forward import sequence_logprobs
    from posttrain.losses.aggregation import AGGREGATIONS
    cfg = toy_config(tmp_path, "--steps", "1", "--optim.minibatches", "2",
                     "--algorithm.policy_loss", objective, "--algorithm.cov_frac", "0.05")
    model = make_tiny_model(tokenizer, seed=6)
    engine = make_engine("hf", model, tokenizer)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg, engine=engine, tokenizer=tokenizer,
                                                scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(len(batch.rewards_B), 1, generator=g).expand_as(batch.loss_mask_B_T) * batch.loss_mask_B_T
    weights = AGGREGATIONS[cfg.algo.aggregation](batch.loss_mask_B_T, 3.0)
    rows = torch.arange(len(batch.rewards_B))

    def objective_value():
        with torch.no_grad():
            return float((adv * weights * sequence_logprobs(model, batch.rollout, rows, 1.0).logp).sum())
    before = objective_value()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    update_policy(learner_for(cfg, model, opt), replace(batch, adv_B_T=adv))
    assert objective_value() > before


def test_frozen_inputs_name_only_the_passes_the_terms_read(tmp_path):
    """rl/loss_terms.py::frozen_inputs: pi_ref only for a KL term, the trainer's own pi_old only where the
    sampler's numbers differ and a term reads pi_old (the ratio over several updates, the KL in
    PPO's rewards, a teacher's advantage)."""
    from posttrain.config.commands import ConfigError
    from posttrain.rl.loss_terms import frozen_inputs

    def needs(*args, teachers=False):
        cfg = toy_config(tmp_path, *args)
        return frozen_inputs(cfg, cfg.algo, teachers)
    assert needs("--algorithm.kl_coef", "0") == frozenset()
    assert needs("--algorithm.kl_coef", "0.1", "--algorithm.kl_in", "loss") == {"ref_logp"}
    assert needs("--algorithm.kl_coef", "0.1", "--algorithm.kl_in", "none") == frozenset()
    bf16 = ("--algorithm.kl_coef", "0", "--rollout.weights", "bfloat16")
    assert needs(*bf16) == frozenset()                              # one update: pi_old = pi_theta
    assert needs(*bf16, "--optim.minibatches", "2") == {"trainer_old_logp"}
    assert needs(*bf16, "--optim.minibatches", "2", "--rollout.tis_cap", "none") == {"trainer_old_logp"}
    # a bf16 trainer against a float32 sampler: other numbers too, though the sampler is the trainer's
    assert needs("--algorithm.kl_coef", "0", "--model.autocast", "bfloat16", "--optim.minibatches",
                 "2") == {"trainer_old_logp"}
    # distillation through the advantage reads the teacher's log-probs, and pi_old when it differs
    opd = ("--preset", "opd", "--teacher.path", "smollm2-135m-instruct", "--rollout.weights", "bfloat16")
    assert needs(*opd, teachers=True) == {"teacher_logp", "trainer_old_logp"}
    assert needs(*opd, "--rollout.weights", "shared", teachers=True) == {"teacher_logp"}
    assert needs(*opd, "--algorithm.distill_loss", "exact", "--rollout.weights", "shared",
                 teachers=True) == frozenset()
    # PPO's KL in the rewards reads pi_old (a single update too); with beta 0 there is no KL term
    ppo = ("--preset", "ppo", "--rollout.weights", "bfloat16", "--optim.minibatches", "1")
    assert needs(*ppo) == {"ref_logp", "trainer_old_logp"}
    assert needs(*ppo, "--algorithm.kl_coef", "0") == frozenset()
    # an objective that declares it reads no pi_old (REINFORCE) cannot run several updates
    assert POLICY_LOSSES.meta("vanilla")["reads"] == frozenset()
    with pytest.raises(ConfigError, match="'vanilla' reads no pi_old"):
        needs("--algorithm.policy_loss", "vanilla", "--optim.minibatches", "2")


@pytest.mark.parametrize("autocast,minibatches,recomputed", [("bfloat16", 2, True), ("none", 2, False),
                                                            pytest.param("bfloat16", 1, False,
                                                                         marks=pytest.mark.slow)])
def test_a_bf16_trainer_recomputes_pi_old_for_several_updates(tmp_path, tokenizer, autocast,
                                                               minibatches, recomputed):
    """A float32 sampler's log-probs are not a bf16 trainer's: with several updates per batch
    pi_old is the trainer's own forward (else the ratio starts off 1 by bf16 noise and a tight
    clip such as GSPO's drops most tokens); with one update the update's own forward is pi_old."""
    cfg = toy_config(tmp_path, "--steps", "1", "--model.autocast", autocast,
                     "--optim.minibatches", str(minibatches))
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    row = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert ("perf/old_logprobs_s" in row) == recomputed


def test_dynamic_sampling_never_trains_on_an_all_equal_group(tmp_path, tokenizer):
    cfg = load_config(None, [*TOY, "--run_dir", str(tmp_path / "run"), "--preset", "dapo",
                             "--reward.functions", "tests.toy_rewards:even_prompts_only",
                             "--algorithm.overlong", "none", "--rollout.group_size", "4"])
    model = make_tiny_model(tokenizer, seed=5)
    engine = make_engine("hf", model, tokenizer)
    sampler = PromptStream(build_task(cfg.data), 0)
    for _ in range(3):
        batch, stats = generate_and_score(SamplingSetup(cfg=cfg, engine=engine,
                                                        tokenizer=tokenizer,
                                                        scorer=Scorer(cfg.reward), prompts=sampler,
                                                        generator=torch.Generator().manual_seed(1)), Counter())
        assert len(batch.rewards_B) > 0
        assert not equal_reward_groups(batch.rewards_P_G).any()
        assert all(int(p.prompt.split()[2]) % 2 == 0 for p in batch.problems)
        assert stats["rollout/dynamic_rounds"] >= 1
        assert stats["rollout/equal_groups_frac"] > 0.0   # the odd-operand groups were all-equal


def test_steps_that_keep_no_group_still_log_and_evaluate_on_schedule(tmp_path, tokenizer):
    """Dynamic sampling that finds no group with a signal makes no update, but the step is logged
    and the evaluation due at it runs (it used to be skipped with the update)."""
    cfg = load_config(None, [*TOY, "--run_dir", str(tmp_path / "run"), "--preset", "dapo",
                             "--reward.functions", "tests.toy_rewards:always_one",
                             "--algorithm.overlong", "none", "--data.eval_size", "4",
                             "--steps", "3", "--eval_every", "2", "--rollout.prompts_per_step", "2",
                             "--rollout.group_size", "2", "--optim.schedule", "linear",
                             "--optim.lr", "3e-4"])
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r["step"] for r in rows if "perf/step_s" in r]
    evals = [r["step"] for r in rows if "eval/accuracy" in r]
    assert steps == [1, 2, 3] and not any("policy/grad_norm" in r for r in rows)
    assert evals == [0, 2, 3]
    # the schedule still advances one optimizer step per step: 3e-4 * (2/3, 1/3, 0)
    lrs = [r["optim/lr"] for r in rows if "perf/step_s" in r]
    assert lrs == pytest.approx([2e-4, 1e-4, 0.0], abs=1e-12)


@pytest.mark.parametrize("fn,status", [("raises", "error"), ("hangs", "timeout"),
                                       ("not_a_number", "nonfinite")])
def test_broken_reward_functions_are_survived(tmp_path, tokenizer, fn, status):
    cfg = toy_config(tmp_path, "--steps", "2", "--reward.functions",
                     f"tests.toy_rewards:first_letter_a_to_e,tests.toy_rewards:{fn}",
                     "--reward.timeout_s", "0.2", "--reward.fallback", "-0.5",
                     "--rollout.prompts_per_step", "2", "--rollout.group_size", "2")
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r[f"reward/failures_{status}"] for r in rows] == [4, 4]
    assert all(r["reward/mean"] <= 0.5 for r in rows)   # fallback -0.5 + at most 1


@pytest.mark.parametrize("preset,extra", [("grpo", []),   # (ppo and retries: the full suite)
                                          pytest.param("ppo", [], marks=pytest.mark.slow),
                                          pytest.param("grpo", ["--data.retry_unsolved", "2"],
                                                       marks=pytest.mark.slow)])
def test_checkpoint_resume_continues_identically(tmp_path, tokenizer, preset, extra):
    common = ["--steps", "4", "--checkpoint.every_steps", "2", "--optim.lr", "1e-2",
              "--algorithm.kl_coef", "0.05", "--preset", preset, "--optim.minibatches", "2", *extra]
    full = toy_config(tmp_path / "a", *common)
    train(full, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)

    part = toy_config(tmp_path / "b", *common[:1], "2", *common[2:])
    train(part, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    resumed_cfg = load_config(None, base=json.loads((tmp_path / "b" / "run" / "config.json").read_text()),
                              overrides=["--steps", "4"])
    train(resumed_cfg, resume=tmp_path / "b" / "run", model=make_tiny_model(tokenizer, seed=99),
          tokenizer=tokenizer, show_progress=False)

    a = reward_curve(tmp_path / "a" / "run")
    b = reward_curve(tmp_path / "b" / "run")
    assert a == b and len(a) == 4
    from transformers import AutoModelForCausalLM
    wa = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "run" / "final_model").state_dict()
    wb = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "run" / "final_model").state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    if preset == "ppo":   # the value model and its optimizer resume too
        from transformers import AutoModelForTokenClassification
        va = AutoModelForTokenClassification.from_pretrained(tmp_path / "a" / "run" / "final_value_model")
        vb = AutoModelForTokenClassification.from_pretrained(tmp_path / "b" / "run" / "final_value_model")
        for k, v in va.state_dict().items():
            torch.testing.assert_close(v, vb.state_dict()[k], rtol=0, atol=0)


def test_bf16_autocast_keeps_logprobs_close_and_head_in_float32(tokenizer, tiny_model):
    task = build_task(load_config(None, ["--data.eval_size", "3"]).data)
    engine = make_engine("hf", tiny_model, tokenizer)
    rollout = engine.generate(encode_prompts(tokenizer, task.eval_problems, None), 2,
                              SamplingParams(5), torch.Generator().manual_seed(0))
    fp32 = frozen_logprobs(tiny_model, rollout, 1.0, micro=4)
    bf16 = frozen_logprobs(tiny_model, rollout, 1.0, micro=4, autocast="bfloat16")
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, fp32, atol=0.05, rtol=0.0)
    assert not torch.equal(bf16, fp32)   # the body really ran in bf16


def test_skipping_zero_advantage_groups_gives_the_same_update(tmp_path, tokenizer):
    """All-equal groups are not run through the model, yet the step equals the full-batch step."""
    from posttrain.losses.aggregation import AGGREGATIONS, aggregate
    from posttrain.losses.policy import clipped_surrogate_loss
    from posttrain.rollout.forward import sequence_logprobs
    cfg = toy_config(tmp_path, "--steps", "1", "--optim.max_grad_norm", "1e9")
    model = make_tiny_model(tokenizer, seed=8)
    engine = make_engine("hf", model, tokenizer)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg, engine=engine, tokenizer=tokenizer,
                                                scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    adv = torch.randn(batch.loss_mask_B_T.shape) * batch.loss_mask_B_T
    adv[:4] = 0.0                                     # the first group carries no signal

    skipped = make_tiny_model(tokenizer, seed=8)
    opt = torch.optim.SGD(skipped.parameters(), lr=1.0)
    stats = update_policy(learner_for(cfg, skipped, opt), replace(batch, adv_B_T=adv))
    assert stats["policy/skipped_rows_frac"] == 4 / len(batch.rewards_B)

    full = make_tiny_model(tokenizer, seed=8)
    rows = torch.arange(len(batch.rewards_B))
    logp = sequence_logprobs(full, batch.rollout, rows, 1.0).logp
    weights = AGGREGATIONS[cfg.algo.aggregation](batch.loss_mask_B_T, 3.0)
    aggregate(clipped_surrogate_loss(logp, logp.detach(), adv), weights).backward()
    torch.optim.SGD(full.parameters(), lr=1.0).step()
    for a, b in zip(skipped.parameters(), full.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_batch_without_any_signal_still_steps(tmp_path, tokenizer):
    cfg = toy_config(tmp_path, "--steps", "1")
    model = make_tiny_model(tokenizer, seed=9)
    engine = make_engine("hf", model, tokenizer)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg, engine=engine, tokenizer=tokenizer,
                                                scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    stats = update_policy(learner_for(cfg, model, opt, generator=torch.Generator()),
                          replace(batch, adv_B_T=torch.zeros_like(batch.loss_mask_B_T)))
    assert stats["policy/skipped_rows_frac"] == 1.0 and stats["policy/grad_norm"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # weight decay


@pytest.mark.parametrize("retry_if,expected", [("unsolved", [1, 2]), ("mixed", [1])])
def test_retry_if_picks_the_unsolved_or_the_mixed_groups(retry_if, expected):
    from posttrain.data.tasks import make_task
    from posttrain.sampling.collect import report_solved
    correct = torch.tensor([1, 1, 1, 0, 0, 0], dtype=torch.bool)   # G=2: solved, mixed, all wrong
    sampler = PromptStream(make_task("addition", 2), 0, retries=1)
    sampler.draw(3)
    report_solved(sampler, correct, 2, retry_if, SINGLE)
    assert [i for i, _ in sampler.waiting] == expected


def test_adamw_is_fused_on_cpu_and_takes_the_for_loops_steps():
    from posttrain.run.optim import make_adamw
    torch.manual_seed(0)
    start = [torch.randn(n) for n in (7, 50, 3)]
    fused_w = [torch.nn.Parameter(p.clone()) for p in start]
    loop_w = [torch.nn.Parameter(p.clone()) for p in start]
    fused = make_adamw(fused_w, 1e-2, (0.9, 0.99), 0.01)
    loop = torch.optim.AdamW(loop_w, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, foreach=False)
    assert fused.defaults["fused"] and not make_adamw(loop_w, 1e-2, sharded=True).defaults["fused"]
    for _ in range(5):
        for a, b in zip(fused_w, loop_w):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    for a, b, p0 in zip(fused_w, loop_w, start):
        assert (a - p0).abs().min() > 1e-5                          # every weight moved
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
