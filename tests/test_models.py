"""Loading: the embedded GGUF conversion cache (real code path) and local folders."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.model.loading import (_cache_is_complete, embedded_gguf_path, prepare_embedded,
                              resolve_model_path, save_model)


def test_embedded_conversion_is_cached_complete_and_loadable(embedded_dir):
    assert _cache_is_complete(embedded_dir, embedded_gguf_path())
    cfg = json.loads((embedded_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 30
    assert prepare_embedded(embedded_dir.parent) == embedded_dir     # second call: no work


def test_corrupt_cache_is_detected(tmp_path, embedded_dir):
    import shutil
    copy = tmp_path / "smollm2-135m-instruct"
    shutil.copytree(embedded_dir, copy)
    weights = copy / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert not _cache_is_complete(copy, embedded_gguf_path())
    (copy / "posttrain-complete.json").write_text("{not json")
    assert not _cache_is_complete(copy, embedded_gguf_path())


def test_local_folder_roundtrip_and_clear_errors(tmp_path, tiny_model, tokenizer):
    save_model(tiny_model, tokenizer, tmp_path / "m")
    assert resolve_model_path(str(tmp_path / "m")) == tmp_path / "m"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    for (k, a), b in zip(tiny_model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b)
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        resolve_model_path(str(tmp_path / "not-a-model"))


def hub_cache(root, tokenizer, repo_id: str, commits: list[str]):
    """A Hugging Face hub cache as `hf download` leaves it: models--ORG--NAME/snapshots/<commit>/
    for each commit (a tiny model of seed i), refs/main naming the last."""
    from tests.conftest import make_tiny_model
    repo = root / ("models--" + repo_id.replace("/", "--"))
    for seed, commit in enumerate(commits):
        make_tiny_model(tokenizer, seed=seed).save_pretrained(repo / "snapshots" / commit)
        tokenizer.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commits[-1])
    return repo


def test_a_hub_id_in_the_cache_is_the_snapshot_transformers_reads(tmp_path, tokenizer, monkeypatch):
    """`--model.path ORG/NAME` offline: the snapshot refs/main names, as transformers resolves
    the same id from the same cache (two snapshots: the older one is not it)."""
    from huggingface_hub import constants
    from transformers.utils import cached_file
    repo = hub_cache(tmp_path / "hub", tokenizer, "org/tiny", ["a" * 40, "b" * 40])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    found = resolve_model_path("org/tiny")
    assert found == repo / "snapshots" / ("b" * 40)
    theirs = cached_file("org/tiny", "config.json", cache_dir=tmp_path / "hub", local_files_only=True)
    assert found == type(found)(theirs).parent


def test_a_hub_id_not_in_the_cache_names_the_cache_and_the_command(tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", where="teacher.path")
    text = str(e.value)
    assert text.startswith("teacher.path='HuggingFaceTB/SmolLM2-135M-Instruct' is not in the "
                           f"Hugging Face cache {tmp_path / 'hub'}")
    assert "`hf download HuggingFaceTB/SmolLM2-135M-Instruct`" in text and "\n" not in text


def test_a_local_folder_wins_over_a_cached_hub_id_of_the_same_spelling(tmp_path, tokenizer,
                                                                       monkeypatch):
    from huggingface_hub import constants
    hub_cache(tmp_path / "hub", tokenizer, "org/tiny", ["a" * 40])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    save_model(make_tiny_model_for(tokenizer), tokenizer, tmp_path / "org" / "tiny")
    assert resolve_model_path("org/tiny") == Path("org/tiny")


def make_tiny_model_for(tokenizer):
    from tests.conftest import make_tiny_model
    return make_tiny_model(tokenizer, seed=7)


def test_sft_trains_a_model_named_by_its_hub_id(tmp_path, tokenizer, monkeypatch):
    """The whole command from a cached Hub id: the policy it starts from is the cached one."""
    from huggingface_hub import constants
    from posttrain.stages.sft import sft
    from tests.conftest import stage_config
    hub_cache(tmp_path / "hub", tokenizer, "org/tiny", ["c" * 40])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    rows = [{"prompt": f"What is {a} + {a}?", "response": f"{2 * a}"} for a in range(10, 14)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = sft(stage_config(model="org/tiny", data=str(tmp_path / "sft.jsonl"), epochs=1,
                           batch_size=4, run_dir=str(tmp_path / "run")), show_progress=False)
    assert out["first_loss"] > 0 and (tmp_path / "run" / "final_model" / "config.json").is_file()


def test_tiny_models_depend_on_their_seed_alone(tokenizer, monkeypatch):
    """The tests' tiny models draw their own weights (conftest.init_weights): the same seed gives
    the same weights whatever transformers' own initialisation does, and another seed others."""
    from transformers import PreTrainedModel

    from tests.conftest import make_tiny_model

    def another_release(self, module):   # other draws in another order: what an update may do
        for param in reversed(list(module.parameters(recurse=False))):
            param.data.uniform_(-0.5, 0.5)

    first = make_tiny_model(tokenizer, seed=3).state_dict()
    monkeypatch.setattr(PreTrainedModel, "_init_weights", another_release)
    again = make_tiny_model(tokenizer, seed=3).state_dict()
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = make_tiny_model(tokenizer, seed=4).state_dict()
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
