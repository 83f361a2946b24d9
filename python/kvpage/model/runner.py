"""The model runner: executes one scheduler step on the paged KV cache.

A step is swap-out, swap-in, copy-on-write copies, then ONE forward pass over every scheduled token of
every sequence packed back to back (no padding). Each attention layer writes its new K/V by slot mapping
and attends over the paged cache (see attention.py); logits are computed only for the rows sampled.
"""
from __future__ import annotations

import weakref

import torch

from kvpage import ops
from kvpage.core import kv_cache_groups
from kvpage.core.kv_cache_groups import KVCacheLayout
from kvpage.engine.arg_utils import ENGINE_DEFAULTS, KV_CACHE_DTYPE_NAMES, MATMUL_PRECISIONS, WEIGHT_DTYPE_NAMES
from kvpage.engine.executor_base import Executor

from .attention import HFForward, head_dim_of, validate_config
from .cpu_layout import round_weights
from .context_parallel import ContextParallelAttention
from .cuda_graphs import CudaGraphConfig, DecodeGraphs
from .llama import LlamaForward, llama_family_mismatch
from .loader import set_kvpage_attention
from .metadata import AttentionMetadata, KVCache
from .step_inputs import ModelInput, SequenceInput, Step, pack_payload, unpack_payload

__all__ = ["ModelInput", "ModelRunner", "SequenceInput"]  # the step types live in step_inputs.py

# vLLM's kv_cache_dtype names: "auto" keeps the model's dtype; "fp8" (= "fp8_e4m3") stores K/V as
# float8_e4m3fn with per-tensor scales of 1.0 (vLLM's default without calibrated scales): a quarter
# of float32's memory, so four times the tokens in the same budget; "bfloat16" / "float16" store a
# float32 model's K/V in 16 bits on CPU (rounded to nearest even; attention computes in float32):
# half the memory and half the bytes decode attention reads.
KV_CACHE_DTYPES = {name: getattr(torch, t) if t else None for name, t in KV_CACHE_DTYPE_NAMES.items()}


# weight_dtype names: "auto" keeps the model's weights as they are; "bfloat16" / "float16" round a float32
# model's weights to 16 bits (every parameter, in place) and store its linear layers' packed slabs in 16
# bits on CPU, computing in float32: half the bytes a decode step streams (the modules keep
# their float32 weights, so resident memory does not shrink).
WEIGHT_DTYPES = {name: getattr(torch, t) if t else None for name, t in WEIGHT_DTYPE_NAMES.items()}


def weight_dtype_from_name(name) -> torch.dtype | None:
    """The weight storage dtype a weight_dtype name asks for; None for "auto"."""
    if not isinstance(name, str) or name not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {sorted(WEIGHT_DTYPES)}, got {name!r}")
    return WEIGHT_DTYPES[name]


def check_weight_dtype(weight_dtype: torch.dtype | None, dtype: torch.dtype, device: torch.device) -> None:
    """None, or a 16-bit storage dtype for a float32 model on CPU; else ValueError."""
    if weight_dtype is None:
        return
    if weight_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"weight_dtype must be None, torch.bfloat16 or torch.float16, got {weight_dtype!r}")
    if dtype != torch.float32 or device.type != "cpu":
        raise ValueError(f"weight_dtype {weight_dtype} needs a float32 model on CPU (16-bit storage, float32"
                         f" compute); got a {dtype} model on {device.type}")


# matmul_precision, in torch.set_float32_matmul_precision's names: "highest" multiplies in float32;
# "medium" lets the linear layers compute with bf16 dot products (weights and inputs rounded to bf16,
# sums in float32; twice the FMA rate), where the CPU has AVX512-BF16, and in float32 elsewhere (as
# torch's "medium" permits bf16, not requires it). Not token-identical to float32.
def check_matmul_precision_name(precision) -> None:
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {precision!r}")


def check_matmul_precision(precision, dtype: torch.dtype, device: torch.device) -> None:
    check_matmul_precision_name(precision)
    if precision == "medium" and (dtype != torch.float32 or device.type != "cpu"):
        raise ValueError(f"matmul_precision 'medium' needs a float32 model on CPU; got a {dtype} model on"
                         f" {device.type}")


def check_cache_dtype(cache_dtype: torch.dtype, dtype: torch.dtype, device: torch.device) -> None:
    """A cache dtype the kernels pair with compute in `dtype` on `device`, or ValueError."""
    narrowed = dtype == torch.float32 and cache_dtype in (torch.bfloat16, torch.float16) and device.type == "cpu"
    if cache_dtype not in (dtype, torch.float8_e4m3fn) and not narrowed:
        raise ValueError(f"kv_cache_dtype must be the model's dtype {dtype}, float8_e4m3fn or, for a float32"
                         f" model on CPU, bfloat16 / float16; got {cache_dtype} for a {dtype} model on {device.type}")


def kv_cache_dtype_from_name(name) -> torch.dtype | None:
    """The cache dtype a kv_cache_dtype name asks for; None for "auto" (the model's own)."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]


def kv_cache_bytes_per_block(config, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None,
                             layout: KVCacheLayout | None = None) -> int:
    """Bytes one block id takes, K and V (num_kv_heads: a tensor-parallel rank's own count): over all layers,
    or with a KV-cache layout over its group_size per-layer tensors (a block id is one block of one group)."""
    num_kv_heads = num_kv_heads or getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_layer = 2 * num_kv_heads * block_size * head_dim_of(config) * dtype.itemsize
    return per_layer * (config.num_hidden_layers if layout is None else layout.group_size)


def num_blocks_for_memory(config, gib: float, block_size: int, dtype: torch.dtype,
                          layout: KVCacheLayout | None = None) -> int:
    """How many blocks fit in `gib` GiB of KV cache (laid out as `layout`, default one group of all layers)."""
    return int(gib * 2**30) // kv_cache_bytes_per_block(config, block_size, dtype, layout=layout)


def model_kv_cache_layout(config) -> KVCacheLayout:
    """The KV-cache groups of a model: its layers grouped by sliding window (one group of every layer for a
    model without windows, today's layout). The engine and every tensor-parallel rank derive it alike."""
    from kvpage.engine.model_config import layer_sliding_windows

    return kv_cache_groups.kv_cache_layout(layer_sliding_windows(config))


def check_kv_cache_layout(layout: KVCacheLayout, num_layers: int) -> None:
    """A layout this runner can allocate for a model of num_layers layers, or ValueError naming the argument."""
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"kv_cache_layout must be a kvpage.core.KVCacheLayout or None, got {type(layout).__name__}")
    if sorted(l for g in layout.groups for l in g.layer_ids) != list(range(num_layers)):
        raise ValueError(f"kv_cache_layout must place each of the model's {num_layers} layers in exactly one group,"
                         f" got groups {[g.layer_ids for g in layout.groups]}")


# Models some runner serves: rounding one in place (weight_dtype) would change weights under that runner's
# forward, whose packed copies keep the unrounded values.
_SERVED_MODELS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def dtypes_from_names(kv_cache_dtype, weight_dtype, matmul_precision) -> tuple[torch.dtype | None, torch.dtype | None]:
    """LLM's dtype options by name (checked before the model loads): (cache dtype, weight dtype), None for
    "auto"; ValueError naming the option for a name that is none of them."""
    check_matmul_precision_name(matmul_precision)
    return kv_cache_dtype_from_name(kv_cache_dtype), weight_dtype_from_name(weight_dtype)


def check_dtypes(dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype, weight_dtype: torch.dtype | None,
                 matmul_precision: str) -> None:
    """ValueError naming the argument for dtypes the kernels cannot pair with a `dtype` model on `device`:
    the one check of them, by LLM before any rank starts and by every ModelRunner."""
    check_cache_dtype(cache_dtype, dtype, device)
    check_weight_dtype(weight_dtype, dtype, device)
    check_matmul_precision(matmul_precision, dtype, device)


def check_runner_dtypes(model, dtype: torch.dtype, cache_dtype: torch.dtype, weight_dtype: torch.dtype | None,
                        matmul_precision: str) -> None:
    """ValueError naming the argument for a combination of dtypes the runner cannot serve."""
    check_dtypes(dtype, next(model.parameters()).device, cache_dtype, weight_dtype, matmul_precision)
    if weight_dtype is not None and model in _SERVED_MODELS:
        raise ValueError(f"weight_dtype {weight_dtype}: this model already serves another kvpage runner, under"
                         f" which rounding its weights in place would change them; pass a freshly loaded model")
    validate_config(model.config, dtype)
    if model.dtype != dtype:
        # The kernels read query and cache in one dtype; a silent cast per layer would hide a slowdown.
        raise ValueError(f"dtype {dtype} must equal the model's dtype {model.dtype}"
                         f" (convert the model with model.to({dtype}))")


def build_forward(model, weight_dtype: torch.dtype | None, matmul_precision: str,
                  context_parallel: ContextParallelAttention | None = None) -> LlamaForward | HFForward:
    """kvpage's own forward where it implements the model's config (llama.py); else transformers'
    modules with kvpage's attention function. Decode context parallelism needs kvpage's own."""
    mismatch = llama_family_mismatch(model.config)
    if mismatch is None:
        return LlamaForward.build(model, weight_dtype or torch.float32, bf16_dot=matmul_precision == "medium",
                                  attention=context_parallel)
    if context_parallel is not None:
        raise ValueError(f"decode_context_parallel_size > 1 needs a Llama-family model: {mismatch}")
    return HFForward(model)


class ModelRunner(Executor):
    """Owns the paged KV cache (device pool, plus a host pool for swapping) and runs steps on a HF model,
    through kvpage's own forward for Llama-family models (llama.py), else through the model's modules.

    The model's attention is switched to "kvpage" in place: its own forward then only works inside a
    step (the attention layers need the step's block tables) or with a kvpage.PagedCache.
    """

    def __init__(self, model, num_kv_blocks: int, block_size: int = ENGINE_DEFAULTS["block_size"],
                 dtype: torch.dtype | None = None, num_host_blocks: int = 0, num_kv_heads: int | None = None,
                 kv_cache_dtype: torch.dtype | None = None, weight_dtype: torch.dtype | None = None,
                 matmul_precision: str = ENGINE_DEFAULTS["matmul_precision"], cuda_graphs: CudaGraphConfig | None = None,
                 context_parallel: ContextParallelAttention | None = None,
                 kv_cache_layout: KVCacheLayout | None = None) -> None:
        """num_kv_heads: the KV heads this process's caches hold, when a tensor-parallel shard of the model
        holds fewer than its config says (kvpage.model.tensor_parallel). kv_cache_dtype: the
        model's dtype (None, the default), float8_e4m3fn, or bfloat16 / float16 for a float32 model on
        CPU (see KV_CACHE_DTYPES). weight_dtype: None, or bfloat16 / float16 for a float32 model on CPU:
        its weights are rounded to it in place and its linears packed in it (see WEIGHT_DTYPES).
        matmul_precision: "highest" or "medium" (bf16 dot products in the linears; see MATMUL_PRECISIONS).
        cuda_graphs: where decode steps replay CUDA graphs (a GPU, kvpage's own forward); None: eager.
        context_parallel: this rank's part of a decode-context-parallel group (steps then arrive in virtual
        blocks of block_size * group size tokens; see context_parallel.py), or None. kv_cache_layout: the
        KV-cache groups (kvpage.core.kv_cache_groups; model_kv_cache_layout gives the model's own): the
        runner allocates group_size (key, value) pairs and layer l uses pair j where layout.layer_slot(l) is
        (g, j); every step then carries each group's block tables. None: one group of all layers."""
        self.dtype = dtype or model.dtype
        self.cache_dtype = kv_cache_dtype or self.dtype
        check_runner_dtypes(model, self.dtype, self.cache_dtype, weight_dtype, matmul_precision)
        set_kvpage_attention(model)
        self.model, self.config = model.eval(), model.config
        self.device = next(model.parameters()).device
        self.weight_dtype, self.matmul_precision = weight_dtype or self.dtype, matmul_precision
        if weight_dtype is not None:
            round_weights(model, weight_dtype)
        self.context_parallel = context_parallel
        self.forward = build_forward(model, weight_dtype, matmul_precision, context_parallel)
        _SERVED_MODELS.add(model)
        self.block_size = block_size
        self.num_kv_blocks, self.num_host_blocks = num_kv_blocks, num_host_blocks
        self.num_layers = self.config.num_hidden_layers
        self.layout = kv_cache_layout or kv_cache_groups.kv_cache_layout([None] * self.num_layers)
        check_kv_cache_layout(self.layout, self.num_layers)
        self.layer_groups = tuple(self.layout.layer_slot(l)[0] for l in range(self.num_layers))
        self.num_kv_heads = (num_kv_heads or getattr(self.config, "num_key_value_heads", None)
                             or self.config.num_attention_heads)
        self.head_dim = head_dim_of(self.config)
        # The group_size (key, value) pairs a block id indexes; kv_caches[l] is layer l's pair.
        self.kv_cache_pairs: list[KVCache] = self._allocate(num_kv_blocks, self.device)
        self.kv_caches: list[KVCache] = self._per_layer(self.kv_cache_pairs)
        # Pinned host memory lets a GPU's swaps run as asynchronous DMA instead of pageable copies.
        self.host_kv_caches: list[KVCache] = (self._allocate(num_host_blocks, "cpu", self.device.type == "cuda")
                                              if num_host_blocks else [])
        self.graphs = self._decode_graphs(cuda_graphs)

    def _decode_graphs(self, config: CudaGraphConfig | None) -> DecodeGraphs | None:
        """Graphs need a GPU and one static forward: kvpage's own, without Mistral's window check. The same
        rule at every tensor-parallel size: each rank captures the same buckets in the same order, so the
        all-reduces inside the graphs pair up."""
        # Run eagerly: several KV-cache groups (the graphs' buffers hold one group's tables) and decode context
        # parallelism (its per-step localize makes tensors shaped by the step, not by a bucket).
        if (config is None or self.device.type != "cuda" or not isinstance(self.forward, LlamaForward)
                or self.forward.sliding_window is not None or self.layout.num_groups > 1
                or self.context_parallel is not None):
            return None
        return DecodeGraphs(self.forward, self.kv_caches, config.max_num_seqs, config.max_model_len,
                            self.block_size, self.device)

    def _allocate(self, num_blocks: int, device, pin_memory: bool = False) -> list[KVCache]:
        return [ops.allocate_kv_cache(num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                                      dtype=self.cache_dtype, device=device, pin_memory=pin_memory)
                for _ in range(self.layout.group_size)]

    def _per_layer(self, pairs: list[KVCache]) -> list[KVCache]:
        """Layer l's (key, value) pair: pair j of the group it is the j-th layer of."""
        return [pairs[self.layout.layer_slot(l)[1]] for l in range(self.num_layers)]

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.config, self.block_size, self.cache_dtype, self.num_kv_heads, self.layout)

    def kv_cache_bytes_per_rank(self) -> list[int]:
        return [sum(t.numel() * t.element_size() for kv in self.kv_cache_pairs for t in kv)]

    def local_kv_caches(self) -> list[torch.Tensor]:
        return _flat(self.kv_cache_pairs)

    def num_blocks_for_memory(self, gib: float) -> int:
        return num_blocks_for_memory(self.config, gib, self.block_size, self.cache_dtype, self.layout)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    # -- one step ------------------------------------------------------------------------------

    def execute(self, step) -> torch.Tensor:
        """Run one step: a SchedulerOutput or ModelInput (packed here), or a step_inputs.Step a tensor-parallel
        rank unpacked from the driver's broadcast. Returns float32 logits [num sequences with do_sample, vocab]
        in step order, then the rows of each sequence's prompt_logit_positions (kvpage.core.logits_rows); a
        sharded LM head's rank-local part on tensor-parallel ranks other than 0."""
        # A with-block, not the decorator, and the forward called from here: the fewest Python frames per step
        # (docs/internals.md).
        with torch.inference_mode():
            if not isinstance(step, Step):
                step = unpack_payload(*pack_payload(step, self.block_size, self.device.type == "cuda"), self.device)
            self._move_blocks(step.blocks)
            metadata = step.metadata
            if metadata is None:
                return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
            self._set_layer_groups(metadata)
            if self.context_parallel is not None:
                metadata = self.context_parallel.localize(metadata, step.positions)
            if self.graphs is not None and self.graphs.fits(metadata):
                hidden = self.graphs(step.input_ids, step.positions, metadata)
            else:
                hidden = self.forward(step.input_ids, step.positions, metadata, self.kv_caches)
            if not step.sample_rows.numel():  # the same on every rank: the broadcast header carries the count
                return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
            # Only the rows asked for go through the vocab projection: [num_sampled, vocab], not [T, vocab].
            return self.forward.compute_logits(hidden.index_select(0, step.sample_rows)).float()

    def _set_layer_groups(self, metadata: AttentionMetadata) -> None:
        """Tell a step's metadata which group each layer reads (AttentionMetadata.for_layer); a step must
        carry exactly the runner's groups (one group: nothing to tell)."""
        if metadata.num_groups != self.layout.num_groups:
            raise ValueError(f"the step carries block tables of {metadata.num_groups} KV-cache group(s), the"
                             f" runner's kv_cache_layout has {self.layout.num_groups}")
        if metadata.num_groups > 1:
            metadata.layer_groups = self.layer_groups

    def _move_blocks(self, batch: ModelInput) -> None:
        """Swap out, then in (a block freed by a swap-out may be reused this step), then copy-on-write."""
        if batch.blocks_to_swap_out or batch.blocks_to_swap_in:
            if not self.host_kv_caches:
                raise ValueError("this step swaps blocks, but the runner has no host cache (num_host_blocks=0)")
            device, host = _flat(self.kv_cache_pairs), _flat(self.host_kv_caches)
            if batch.blocks_to_swap_out:
                ops.swap_blocks(device, host, batch.blocks_to_swap_out)
            if batch.blocks_to_swap_in:
                ops.swap_blocks(host, device, batch.blocks_to_swap_in)
        if batch.blocks_to_copy:
            keys, values = zip(*self.kv_cache_pairs)
            ops.copy_blocks(list(keys), list(values), batch.blocks_to_copy)


def _flat(kv_caches: list[KVCache]) -> list[torch.Tensor]:
    """[k0, v0, k1, v1, ...]: swap_blocks moves every layer's K and V in one call."""
    return [t for kv in kv_caches for t in kv]
