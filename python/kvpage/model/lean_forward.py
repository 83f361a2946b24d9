"""The base model's forward during kvpage's CPU steps, once every decoder layer is one C++ op.

With fast_decoder_layer's op in every layer, what is left of a step in HF's model forward is Python:
building a causal mask the "kvpage" attention never reads, the output-capturing wrappers, and per
layer a module call plus _fast_forward's argument checks: ~1.2 ms of a ~45 ms decode step of
SmolLM2 (2-3% of the engine's time). The lean forward keeps the arithmetic and its order (embed the
tokens, the rotary tables, each layer's op, the final norm) and drops the rest. It is installed only
where a probe on a small prefill reproduces the model's own forward to the bit; anything it does not
recognise (another family's extra steps, a layer left to its own code) keeps HF's forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.ops.config import range_checks_enabled

from . import fast_decoder_layer as fdl
from .metadata import ForwardContext


@dataclass(frozen=True)
class LeanForward:
    base: torch.nn.Module  # the model's base model (LlamaModel, Qwen2Model, ...)
    layers: list[fdl._LayerArgs]  # in layer order

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """Hidden states [1, T, hidden] of the flat batch input_ids / positions [1, T]."""
        base = self.base
        hidden = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(hidden, positions)
        x, check_ranges = hidden[0], range_checks_enabled()
        for layer in self.layers:
            x = fdl.run_layer(layer, x, cos[0], sin[0], context, check_ranges)
        return base.norm(x.unsqueeze(0))


def _candidate(model: torch.nn.Module) -> LeanForward | None:
    """Every decoder layer on the op, and the base model's parts where HF's forward names them."""
    base = model.base_model
    parts = [getattr(base, n, None) for n in ("embed_tokens", "rotary_emb", "layers", "norm")]
    if any(p is None for p in parts) or not isinstance(base.layers, torch.nn.ModuleList):
        return None
    if len(base.layers) != getattr(model.config, "num_hidden_layers", -1):
        return None
    args = []
    for layer in base.layers:
        installed = getattr(vars(layer).get("forward"), "__func__", None) is fdl._fast_forward
        entry = fdl._LAYER_ARGS.get(layer)
        if not installed or entry is None:
            return None
        args.append(entry)
    return LeanForward(base, args)


@torch.inference_mode()
def _reproduces(model: torch.nn.Module, lean: LeanForward, block_size: int = 16, tokens: int = 5) -> bool:
    """The model's own forward and the lean one on a prefill of `tokens` random token ids into scratch
    caches: bit-identical hidden states."""
    config = model.config
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (1, tokens), generator=g)
    positions = torch.arange(tokens).unsqueeze(0)
    attn = lean.base.layers[0].self_attn
    num_kv_heads = attn.k_proj.out_features // attn.head_dim
    outputs = []
    for lean_pass in (False, True):
        with fdl.scratch_prefill(tokens, len(lean.layers), num_kv_heads, attn.head_dim, block_size) as context:
            if lean_pass:
                outputs.append(lean(input_ids, positions, context))
            else:
                outputs.append(lean.base(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state)
    return torch.equal(outputs[0], outputs[1])


def lean_forward_for(model: torch.nn.Module) -> LeanForward | None:
    """The lean forward of a CPU fp32 `model` after install_fast_decoder_layers, or None where it
    would not reproduce the model's own forward."""
    lean = _candidate(model)
    if lean is None:
        return None
    try:
        return lean if _reproduces(model, lean) else None
    except Exception:  # a base model whose forward wants other arguments: leave it to its code
        return None
