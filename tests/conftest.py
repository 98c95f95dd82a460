"""Shared fixtures: the real SmolLM2 tokenizer (from the embedded GGUF) and tiny random models."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

ROOT = Path(__file__).resolve().parent.parent


def benchmark_module(name: str):
    """A script under benchmarks/ imported as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _no_end_of_run_plot(request, monkeypatch):
    """A training run's end-of-run plot (logs/metrics.plot_run: about 1 s of matplotlib, some
    200 runs in the suite) is drawn only in tests marked `plots`; the others get its path.
    tests/test_logging.py draws the plot itself."""
    if "plots" not in request.keywords:
        import posttrain.rl.job as job
        monkeypatch.setattr(job, "plot_run", lambda run_dir: run_dir / "training_curves.png")


@pytest.fixture(scope="session")
def embedded_dir(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct converted by the real code path, once per session."""
    from posttrain.model.loading import prepare_embedded
    return prepare_embedded(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tokenizer(embedded_dir):
    from posttrain.model.loading import load_tokenizer
    return load_tokenizer(embedded_dir)


def init_weights(model: torch.nn.Module, seed: int, std: float) -> torch.nn.Module:
    """Every weight drawn here, in the parameters' name order, from one seeded generator: norms
    1, everything else N(0, std). The tiny models' weights then depend on the seed alone, not on
    the order in which a transformers release's own initialisation visits the modules (a change
    of that order once moved every tiny model the tests use)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):   # tied weights appear once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        for module in model.modules():   # the padding token's embedding row is 0, as transformers has it
            if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
    return model


def make_tiny_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 32,
                    init_range: float = 0.02):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, initializer_range=init_range)
    model = init_weights(LlamaForCausalLM(cfg), seed, init_range)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)   # what a test draws next does not depend on transformers' own draws
    return model


def make_tiny_reward_model(tokenizer, tied: bool = False):
    """A tiny AutoModelForSequenceClassification (one label): a reward model to train (`tied`:
    its body's LM head would be the input embedding, as SmolLM2's is)."""
    from transformers import AutoModelForSequenceClassification
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, num_labels=1, pad_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=tied)
    model = init_weights(AutoModelForSequenceClassification.from_config(cfg), 0, 0.02)
    torch.manual_seed(0)
    return model


@pytest.fixture
def tiny_model(tokenizer):
    return make_tiny_model(tokenizer)


@pytest.fixture(scope="session")
def tiny_dir(tokenizer, tmp_path_factory):
    """A tiny random model saved as a model folder (`--model.path` of a command run in a test)."""
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# where each short keyword of `stage_config` lives in the nested StageConfig
_STAGE_FIELDS = {"model": ("model", "path"), "autocast": ("model", "autocast"),
                 "data": ("data", "train_path"), "eval_data": ("data", "eval_path"),
                 "lr": ("optim", "lr"), "epochs": ("optim", "epochs"), "schedule": ("optim", "schedule"),
                 "warmup_steps": ("optim", "warmup_steps"), "strategy": ("parallel", "strategy"),
                 "checkpoint_every": ("checkpoint", "every_steps"), "lora_rank": ("lora", "rank"),
                 "lora_targets": ("lora", "target_modules"),
                 **{k: ("data", k) for k in ("prompt_field", "response_field", "chosen_field",
                                             "rejected_field", "system_prompt", "synthetic", "n_pairs",
                                             "terse_wrong_share", "eval_size")}}


def learner_for(cfg, model, optimizer, scheduler=None, generator=None, **parts):
    """The PolicyLearner `update_policy` takes, over a test's own model and optimizer (a constant
    schedule and a seed-0 generator unless given); `parts`: teachers, critic, ref_model."""
    from posttrain.rl.learner import PolicyLearner
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    return PolicyLearner(model=model, tokenizer=None, optimizer=optimizer, optim=cfg.optim,
                         scheduler=scheduler, cfg=cfg,
                         generator=generator or torch.Generator().manual_seed(0), **parts)


def stage_config(**kw):
    """A StageConfig from short keywords (lr=..., synthetic=...), the tests' shorthand for the
    nested sections (optim.lr, data.synthetic, ...); not validated, as a library user's is not."""
    from dataclasses import replace
    from posttrain.config.commands import StageConfig
    cfg, sections = StageConfig(), {}
    for k, v in kw.items():
        if k in _STAGE_FIELDS:
            section, name = _STAGE_FIELDS[k]
            sections.setdefault(section, {})[name] = v
        else:
            cfg = replace(cfg, **{k: v})
    return replace(cfg, **{s: replace(getattr(cfg, s), **f) for s, f in sections.items()})


def pytest_terminal_summary(terminalreporter):
    """The fuzz test's count of bad invocations, each refused in one line."""
    import sys
    module = sys.modules.get("tests.test_bad_input") or sys.modules.get("test_bad_input")
    if module is not None and module.REFUSED["invocations"]:
        terminalreporter.write_line(f"bad input: {module.REFUSED['invocations']} invocations "
                                    "refused in one line, exit code 2, nothing loaded")
