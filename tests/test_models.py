"""Loading: the embedded GGUF conversion cache (real code path) and local folders."""

import json

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
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")


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
