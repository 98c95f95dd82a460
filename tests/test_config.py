"""Configs: presets, overrides, and errors that name the field before any model loads."""

import pytest

from posttrain.config.commands import ConfigError
from posttrain.config.options import load_config, parse_overrides
from posttrain.config.presets import PRESETS


def test_presets_are_configurations_of_the_parts():
    grpo, dapo, dr = PRESETS["grpo"], PRESETS["dapo"], PRESETS["dr_grpo"]
    assert (grpo.advantage, grpo.aggregation, grpo.kl_in) == ("group", "seq_mean_token_mean", "loss")
    assert dapo.clip_high > dapo.clip_low and dapo.aggregation == "token_mean" and dapo.dynamic_sampling
    assert not dr.scale_by_std and dr.aggregation == "seq_mean_token_sum_norm"
    assert PRESETS["rloo"].advantage == "rloo"
    assert PRESETS["reinforce"].policy_loss == "vanilla"
    assert PRESETS["opd"].advantage == "reverse_kl" and PRESETS["opd"].kl_in == "none"
    ppo = PRESETS["ppo"]
    assert (ppo.advantage, ppo.kl_in, ppo.kl_estimator, ppo.whiten_advantages) == ("gae", "reward", "k1", True)


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: dapo\noptim:\n  lr: 2.0e-5\nalgorithm:\n  clip_high: 0.3\n")
    cfg = load_config(f, ["--optim.lr", "3e-5", "--rollout.group_size=8", "--algorithm.kl_coef", "0"])
    assert cfg.optim.lr == 3e-5 and cfg.rollout.group_size == 8
    assert cfg.algo.clip_high == 0.3 and cfg.algo.dynamic_sampling
    assert parse_overrides(["--data.system_prompt", "null"]) == {"data": {"system_prompt": None}}


@pytest.mark.parametrize("overrides,msg", [
    (["--preset", "ppo2"], "preset='ppo2' is not valid; accepted: \\['cispo', 'dapo'"),
    (["--optim.lrr", "1"], "optim.lrr is not a config field; known: .*'lr'"),
    (["--optim.lr", "fast"], "optim.lr='fast' must be a number"),
    (["--rollout.group_size", "1"], "rollout.group_size=1 must be >= 2"),
    (["--algorithm.clip_hi", "0.3"], "algorithm.clip_hi is not a field"),
    (["--algorithm.aggregation", "mean"], "algorithm.aggregation='mean' is not valid; accepted: "
                                          "\\['seq_mean_token_mean'"),
    (["--critic.clip", "0"], "critic.clip=0.0 must be > 0"),
    (["--preset", "ppo", "--critic.path", "/nonexistent"], "critic.path='/nonexistent' is not a folder"),
    (["--critic.path", ".", "--critic.shared_backbone", "true"], "cannot be combined"),
    (["--algorithm.kl_in", "reward"], "kl_in='reward'"),
    (["--rollout.temperature", "0"], "rollout.temperature=0.0 must be > 0"),
    (["--optim.minibatches", "3"], "optim.minibatches=3 must split"),
    (["--preset", "reinforce", "--optim.epochs", "2"], "on-policy only"),
    (["--data.task", "file"], "data.task='file' needs data.train_path"),
    (["--model.dtype", "fp8"], "model.dtype='fp8' is not valid"),
    (["lr", "1"], "unexpected argument 'lr'"),
    (["--algorithm.distill_loss", "kl"], "algorithm.distill_loss='kl' is not valid; accepted: "
                                         "\\['exact', 'forward', 'sampled'\\]"),
    (["--steps", "3.5"], "steps=3.5 must be an integer"),
    (["--steps", "true"], "steps=True must be an integer"),      # a bool is no number
    (["--optim.lr", "false"], "optim.lr=False must be a number"),
    (["--tensorboard", "maybe"], "tensorboard='maybe' must be true or false"),
    (["--data.system_prompt", "3"], "data.system_prompt=3 must be a string"),
    (["--max_minutes", "0"], "max_minutes=0.0 must be > 0"),
    (["--checkpoint.every_minutes", "-1"], "checkpoint.every_minutes=-1.0 must be > 0"),
    (["--checkpoint.keep", "0"], "checkpoint.keep=0 must be >= 1"),
    (["--eval_batch_size", "0"], "eval_batch_size=0 must be >= 1"),
])
def test_invalid_configs_name_the_field(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)


@pytest.mark.parametrize("option,value,msg", [("lr", "0", "optim.lr=0.0 must be > 0"),
                                              ("beta2", "1.5", "optim.beta2=1.5 must be <= 1"),
                                              ("max_grad_norm", "0", "optim.max_grad_norm=0.0 must be > 0")])
def test_train_and_the_stages_check_the_optimizer_alike(option, value, msg):
    """One OptimConfig.validate for every command: the same value is refused with the same line."""
    from posttrain.config.options import load_stage_config
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [f"--optim.{option}", value])
    with pytest.raises(ConfigError, match=msg):
        load_stage_config(None, [f"--optim.{option}", value])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_every_packaged_recipe_loads_and_validates():
    from pathlib import Path

    from posttrain import recipes as package
    recipes = sorted(Path(package.__file__).parent.glob("*.yaml"))
    assert len(recipes) >= 4
    for recipe in recipes:
        extra = ["--teacher.path", "smollm2-135m-instruct"] if recipe.name == "addition_opd.yaml" else []
        cfg = load_config(recipe, extra)
        task = {"calculator_multiplication": "multiplication", "guess_number": "guess_number"}
        assert cfg.data.task == task.get(recipe.stem, "addition"), recipe


def test_preset_table_runs_each_preset_as_defined():
    """benchmarks/learning.py --presets runs each algorithm on the default recipe, whose algorithm
    block overrides GRPO's aggregation: every row must get its own preset's loss back."""
    from dataclasses import replace

    from posttrain.config.options import DEFAULT_RECIPE, recipe_path
    from tests.conftest import ROOT, benchmark_module

    learning = benchmark_module("learning")
    default = load_config(recipe_path(DEFAULT_RECIPE))
    assert set(learning.table_presets()) == set(PRESETS) - {"opd"}
    assert set(learning.PRESET_ARGS) <= set(learning.table_presets())
    for name in learning.table_presets():
        args = learning.preset_args(name)
        path = recipe_path(DEFAULT_RECIPE)
        if "--config" in args:
            i = args.index("--config")
            path, args = ROOT / args[i + 1], args[:i] + args[i + 2:]
        cfg = load_config(path, args)
        assert cfg.preset == name
        if name == "grpo":          # the default job: GRPO with token-mean and no KL
            assert cfg.algo == replace(PRESETS["grpo"], aggregation="token_mean", kl_coef=0.0)
        elif name != "ppo":         # PPO's recipe sets its own KL and whitening
            assert cfg.algo == PRESETS[name], name
        assert cfg.algo.aggregation == PRESETS[name].aggregation or name == "grpo"
        # the same sampling and optimizer as the default job
        assert (cfg.rollout, cfg.optim.lr, cfg.optim.schedule, cfg.optim.beta2, cfg.model.autocast) == (
            default.rollout, default.optim.lr, default.optim.schedule, default.optim.beta2,
            default.model.autocast), name


def test_memory_estimate_counts_what_the_run_holds(tmp_path):
    """The estimate printed before training: weights + gradients + AdamW's two moments in float32
    (16 bytes a parameter), a reference copy only with the KL on, and the bf16 sampler copy (2 bytes
    a parameter) only with rollout.weights=bfloat16."""
    from types import SimpleNamespace
    from posttrain.model.memory import estimate
    mc = SimpleNamespace(hidden_size=8, num_hidden_layers=2, vocab_size=100, tie_word_embeddings=True,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    n = 10_000
    base = estimate(load_config(None, ["--algorithm.kl_coef", "0"]), mc, n)
    assert base.parts["policy weights"] + base.parts["gradients"] + base.parts["AdamW moments (2)"] == 16 * n
    assert "reference policy" not in base.parts and "bf16 sampler copy" not in base.parts
    kl = estimate(load_config(None, ["--algorithm.kl_coef", "0.04"]), mc, n)
    assert kl.parts["reference policy"] == 4 * n
    copy = estimate(load_config(None, ["--algorithm.kl_coef", "0", "--rollout.weights", "bfloat16"]), mc, n)
    assert copy.parts["bf16 sampler copy"] == 2 * n
    assert copy.parts["KV cache (generation)"] * 2 == base.parts["KV cache (generation)"]
    assert {k: v for k, v in copy.parts.items() if k not in ("bf16 sampler copy", "KV cache (generation)")} \
        == {k: v for k, v in base.parts.items() if k != "KV cache (generation)"}
    # episodes: a response is up to env.max_tokens long, and the micro-batch is cut to
    # optim.micro_batch_tokens decoder positions, in whole groups: one group of 8, its 64-token
    # prompt once and 8 episodes of 256 (2112 positions; two would pass 4096)
    cfg = load_config(None, ["--algorithm.kl_coef", "0", "--env.max_tokens", "256",
                             "--rollout.group_size", "8", "--optim.micro_batch_tokens", "4096"])
    ep = estimate(cfg, mc, n, episodes=True)
    assert ep.parts["activations (1 micro-batch)"] == (64 + 8 * 256) * 2 * 8 * 17 * 4 + 8 * 256 * 100 * 16


def test_sampling_that_is_not_the_trainers_float32_policy_is_off_the_trainer():
    """bf16 autocast while sampling, or a top-p nucleus: the recorded log-probs are not pi_old,
    so the trainer recomputes pi_old and corrects (truncated IS) as for vLLM."""
    from posttrain.config.rollout import RolloutConfig
    assert not RolloutConfig().off_trainer
    assert RolloutConfig(autocast="bfloat16").off_trainer
    assert RolloutConfig(top_p=0.9).off_trainer
    assert RolloutConfig(weights="bfloat16").off_trainer


def test_k1_in_the_loss_is_refused_with_its_reason():
    with pytest.raises(ConfigError, match="k1.*zero in expectation"):
        load_config(None, ["--algorithm.kl_estimator", "k1", "--algorithm.kl_in", "loss",
                           "--algorithm.kl_coef", "0.1"])
    load_config(None, ["--algorithm.kl_estimator", "k3_st", "--algorithm.kl_coef", "0.1"])
    load_config(None, ["--preset", "ppo"])        # k1 folded into the reward stays allowed


@pytest.mark.parametrize("preset", ["gspo", "cispo", "sapo", "gmpo"])
def test_the_new_presets_load_and_name_their_objective(preset):
    cfg = load_config(None, ["--preset", preset])
    assert cfg.algo.policy_loss == preset and cfg.algo.kl_coef == 0.0


def test_recipe_path_runs_the_default_job_from_python(tmp_path):
    """posttrain.load_config(posttrain.recipe_path()) is what `posttrain train` runs without
    --config (load_config(None) is TrainConfig's own defaults, which differ from the recipe);
    an unknown recipe is refused naming the packaged ones."""
    import posttrain

    job = posttrain.load_config(posttrain.recipe_path(), ["--run_dir", str(tmp_path)])
    assert job.algo.aggregation == "token_mean" and job.optim.schedule == "cosine"
    assert job.max_minutes == 10 and job.steps == 90
    assert posttrain.load_config(None).optim.schedule != job.optim.schedule
    with pytest.raises(ConfigError, match="no packaged recipe 'nope.yaml'; known: .*addition_grpo.yaml"):
        posttrain.recipe_path("nope.yaml")


@pytest.mark.parametrize("native", [True, False])
def test_autocast_auto_is_bf16_only_where_the_device_multiplies_bf16_natively(monkeypatch, native):
    """The recipes say `autocast: auto`: bf16 on a GPU with bf16 or an AVX-512 CPU, float32 on an
    AVX2-only CPU (whose bf16 matmul is a plain loop); the loaded config holds the choice."""
    import posttrain.util.perf as perf
    from posttrain.config.options import DEFAULT_RECIPE, recipe_path
    monkeypatch.setattr(perf, "native_bf16", lambda device="auto": native)
    recipe = recipe_path(DEFAULT_RECIPE)
    assert load_config(recipe, []).model.autocast == ("bfloat16" if native else "none")
    assert load_config(recipe, ["--model.autocast", "bfloat16"]).model.autocast == "bfloat16"
    assert load_config(None, ["--model.autocast", "auto"]).model.autocast == ("bfloat16" if native else "none")
    assert load_config(None, []).model.autocast == "none"      # (the dataclass default)


def test_native_bf16_tells_a_cpu_without_bf16_kernels(monkeypatch):
    import torch
    from posttrain.util.perf import native_bf16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert native_bf16() is False
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert native_bf16() is True
