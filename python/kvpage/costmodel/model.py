"""A model's shape, as much of it as the cost model needs: from a named preset or a HF config.json.

Pure Python (no transformers import): a local HF directory is read as JSON, so `kvpage plan` works
without loading a model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from kvpage.core.kv_cache_groups import KVCacheLayout, kv_cache_layout


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    # Each layer's sliding window (None: full attention); () for a model without windows (every layer full).
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows must name each of the {self.num_layers} layers, got {len(self.layer_windows)}")

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """The KV-cache groups the engine lays the cache out in (kvpage.core.kv_cache_groups): one group of
        every layer without windows; with them, equal groups of full and window layers (a block id is
        group_size layers' block, and a window group keeps only the blocks its window still reads)."""
        return kv_cache_layout(self.layer_windows or [None] * self.num_layers)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights one decoder layer multiplies per token: q, k, v, o, the gated MLP, two RMSNorms."""
        h = self.hidden_size
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        mlp = 3 * h * self.intermediate_size
        return attention + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + head

    @property
    def flops_per_token(self) -> int:
        """Linear-layer FLOPs of one prefill token: 2 per weight of every layer. The embedding is a
        lookup, and the LM head runs only for the sampled last token, so neither is counted."""
        return 2 * self.num_layers * self.layer_params

    def attention_flops(self, num_new_tokens: int, num_cached_tokens: int = 0) -> int:
        """QK^T and AV FLOPs (4 * q_dim per query-key pair per layer) for new tokens attending
        causally over a cached prefix plus themselves."""
        q, c = num_new_tokens, num_cached_tokens
        pairs = q * c + q * (q + 1) // 2
        return 4 * self.num_layers * self.q_dim * pairs

    def weight_bytes(self, dtype_bytes: int) -> int:
        return self.num_params * dtype_bytes


# Shapes from the models' config.json files.
PRESETS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                             head_dim=128, intermediate_size=14336, vocab_size=128256,
                             tie_word_embeddings=False, max_position_embeddings=8192),
    "smollm2-135m": ModelShape("smollm2-135m", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
                               head_dim=64, intermediate_size=1536, vocab_size=49152,
                               tie_word_embeddings=True, max_position_embeddings=8192),
    # Multi-query attention (one KV head) in a Llama-shaped decoder: google/gemma-2b's config.json. Its GeGLU
    # MLP has the same three matrices as Llama's SwiGLU, so the parameter count holds (2.51 B).
    "gemma-2b": ModelShape("gemma-2b", num_layers=18, hidden_size=2048, num_heads=8, num_kv_heads=1,
                           head_dim=256, intermediate_size=16384, vocab_size=256000,
                           tie_word_embeddings=True, max_position_embeddings=8192),
    # google/gemma-3-27b-it's text config: five sliding-window layers (1,024 tokens) per full-attention layer
    # (layer l is full where (l + 1) % 6 == 0); its GeGLU MLP has Llama's three matrices.
    "gemma-3-27b": ModelShape("gemma-3-27b", num_layers=62, hidden_size=5376, num_heads=32, num_kv_heads=16,
                              head_dim=128, intermediate_size=21504, vocab_size=262208, tie_word_embeddings=True,
                              max_position_embeddings=131072,
                              layer_windows=tuple(None if (l + 1) % 6 == 0 else 1024 for l in range(62))),
}


def _layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's window as the engine decides it (engine.model_config.layer_sliding_windows, imported only
    for a config that has a window: it loads torch); () without one."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    if not get("sliding_window"):
        return ()
    from kvpage.engine.model_config import layer_sliding_windows

    windows = tuple(layer_sliding_windows(SimpleNamespace(**config) if isinstance(config, dict) else config))
    return windows if any(w is not None for w in windows) else ()


def from_hf_config(config, name: str | None = None) -> ModelShape:
    """A ModelShape from a HF config (a PretrainedConfig or the dict of its config.json)."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                           "vocab_size") if get(k) is None]
    if missing:
        raise ValueError(f"config lacks {', '.join(missing)}: not a Llama-family decoder config")
    heads = get("num_attention_heads")
    return ModelShape(
        name=name or get("_name_or_path") or get("model_type") or "model",
        num_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"), num_heads=heads,
        num_kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or get("hidden_size") // heads,
        intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        max_position_embeddings=get("max_position_embeddings"), layer_windows=_layer_windows(config))


def get_model(name_or_path) -> ModelShape:
    """A preset by name ("llama-3-8b", "smollm2-135m", "gemma-2b", "gemma-3-27b"), a local HF model directory,
    or a ModelShape."""
    if isinstance(name_or_path, ModelShape):
        return name_or_path
    key = str(name_or_path).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if (path / "config.json").is_file():
        return from_hf_config(json.loads((path / "config.json").read_text()), name=path.name)
    raise ValueError(f"model must be one of {sorted(PRESETS)} or a local HF model directory with config.json,"
                     f" got {str(name_or_path)!r}")
