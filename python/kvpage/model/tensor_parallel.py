"""Tensor-parallel sharding of a HF Llama-family model, in place (Megatron-style, as vLLM does it).

Per decoder layer: q/k/v and gate/up are column-parallel (each rank keeps the output rows of its heads /
its slice of the MLP intermediate; plain nn.Linear, no communication), o_proj and down_proj are
row-parallel (each rank multiplies its input columns, then one all-reduce sums the partial outputs). The
embedding and the LM head are vocabulary-parallel: each rank holds a slice of the vocabulary's rows; the
embedding all-reduces (exactly one rank contributes a non-zero row per token), the LM head gathers its
slices of the sampled rows' logits to rank 0 only. Two all-reduces per layer plus one for the embedding.

Heads. The paged kernels map query head h to KV head h // (num_heads / num_kv_heads) on each rank, so every
rank's query heads must form whole groups of one uniform size over its KV heads. `ShardPlan.build` gives:
- num_kv_heads >= N: each rank gets whole KV-head groups, as evenly as possible. When N does not divide
  num_kv_heads the split is uneven: SmolLM2 (9 query / 3 KV heads) at N=2 runs 3 query heads + 1 KV head on
  rank 0 and 6 + 2 on rank 1. The alternative, 5 + 4 query heads, puts 3 heads of one group and 2 of another on
  a rank: groups of unequal size, which the uniform-GQA kernels can only run by giving that rank one KV head
  per query head (5 KV heads: more cache than TP=1 holds). Splitting every group in the same proportion
  instead keeps groups uniform but replicates every KV head on every rank (no memory saved). Whole groups keep
  the total KV cache at exactly TP=1's, with the largest rank at ceil(K/N)/K of it (2/3 for SmolLM2 at N=2,
  measured: 60 MiB + 120 MiB for 256 blocks vs 180 MiB at TP=1). The attention projections split 1:2 there;
  the MLP (1536 features) and the vocabulary (49152 rows), four fifths of the weights, split evenly.
- num_kv_heads < N: each KV head is replicated on the N/K ranks (as evenly as possible) that share its group,
  and the group's query heads are split between them (vLLM's rule, extended to uneven counts).
- N > num_attention_heads: ValueError, some rank would get no head.

Why own modules rather than torch.distributed.tensor.parallel (ColwiseParallel / RowwiseParallel) or
transformers' tp_plan (which is built on them): (1) both shard a weight into N equal row blocks (DTensor
Shard(0)), which cuts SmolLM2's 9 x 64 query rows at row 288, through the middle of head 4: the default model
cannot be split by them at all, and the group-aligned uneven split above cannot be expressed; (2) where they do
apply, DTensor's per-op dispatch costs time on every step. bench/tp.py --compare-torch-tp runs both on a random
SmolLM2-shaped model with 8 query / 2 KV heads, 2 CPU ranks x 1 thread, the same kvpage attention and runner
(logits agree within 2e-6): a decode step of 16 sequences took 194 ms with these modules and 797 ms with
DTensor (4.1x; 3.6x in an earlier run), a 4 x 128-token prefill 1292 ms and 2519 ms (1.9x; 1.5x) - on a shared
2-core machine (load 3-4), so the ratios are rough, but the cost is plainly measurable. The modules here are an
nn.Linear with a slice of the weight plus one collective, with no wrapper tensor type.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import head_dim_of


def _even_split(n: int, parts: int, index: int) -> range:
    """The index-th of `parts` contiguous ranges covering range(n), sizes differing by at most one."""
    return range(n * index // parts, n * (index + 1) // parts)


@dataclass(frozen=True)
class RankShard:
    """What one rank holds, as global indices (a replicated KV head appears in several ranks' kv_heads)."""

    rank: int
    q_heads: range
    kv_heads: range
    intermediate: range  # MLP intermediate features (gate/up output rows, down_proj input columns)
    vocab: range  # embedding / LM-head rows

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


@dataclass(frozen=True)
class ShardPlan:
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    ranks: tuple[RankShard, ...]

    @classmethod
    def build(cls, config, world_size: int, vocab_size: int | None = None) -> "ShardPlan":
        """The plan for a HF config over `world_size` ranks; ValueError naming tensor_parallel_size if the
        model cannot be split that many ways."""
        check_tensor_parallel_size(world_size)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        vocab_size = vocab_size or config.vocab_size
        intermediate = config.intermediate_size
        limit = min(num_heads, intermediate, vocab_size)
        if world_size > limit:
            raise ValueError(f"tensor_parallel_size={world_size} exceeds what this model splits into: every rank"
                             f" needs at least one of its {num_heads} attention heads (and of {intermediate} MLP"
                             f" features, {vocab_size} vocabulary rows); use at most {limit}")
        heads = _head_shards(num_heads, num_kv_heads, world_size)
        ranks = tuple(RankShard(r, q, kv, _even_split(intermediate, world_size, r),
                                _even_split(vocab_size, world_size, r)) for r, (q, kv) in enumerate(heads))
        plan = cls(world_size, num_heads, num_kv_heads, head_dim_of(config), intermediate, vocab_size, ranks)
        plan._check()
        return plan

    def _check(self) -> None:
        """Each rank's local GQA mapping must be the global one: local query head j uses local KV head
        j // (local heads / local kv heads), which must be global KV head (q_heads[j] // group) ."""
        group = self.num_heads // self.num_kv_heads
        for shard in self.ranks:
            assert shard.num_heads and shard.num_heads % shard.num_kv_heads == 0, shard
            local_group = shard.num_heads // shard.num_kv_heads
            for j, h in enumerate(shard.q_heads):
                assert shard.kv_heads[j // local_group] == h // group, (shard, j)
        assert sorted(h for s in self.ranks for h in s.q_heads) == list(range(self.num_heads))

    def kv_cache_fraction(self, rank: int) -> float:
        """This rank's KV cache as a fraction of the unsharded model's."""
        return self.ranks[rank].num_kv_heads / self.num_kv_heads


def _head_shards(num_heads: int, num_kv_heads: int, n: int) -> list[tuple[range, range]]:
    group = num_heads // num_kv_heads
    if num_kv_heads >= n:  # whole groups per rank
        out = []
        for r in range(n):
            kv = _even_split(num_kv_heads, n, r)
            out.append((range(kv.start * group, kv.stop * group), kv))
        return out
    out = []  # fewer KV heads than ranks: each KV head on a run of ranks that split its group's query heads
    for k in range(num_kv_heads):
        ranks = _even_split(n, num_kv_heads, k)
        for j in range(len(ranks)):
            q = _even_split(group, len(ranks), j)
            out.append((range(k * group + q.start, k * group + q.stop), range(k, k + 1)))
    return out


def check_tensor_parallel_size(value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {value!r}")


# -- communication -------------------------------------------------------------------------------


class CommTimer:
    """Seconds this process spends inside the model's collectives (for bench/tp.py; off by default, then
    it costs one attribute read per collective)."""

    enabled = False
    seconds = 0.0
    calls = 0

    @classmethod
    def reset(cls) -> None:
        cls.seconds, cls.calls = 0.0, 0


def _timed(fn, *args, **kwargs):
    if not CommTimer.enabled:
        return fn(*args, **kwargs)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    CommTimer.seconds += time.perf_counter() - start
    CommTimer.calls += 1
    return result


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    _timed(group.all_reduce, x)
    return x


# -- parallel modules ----------------------------------------------------------------------------


def _param(t: torch.Tensor) -> nn.Parameter:
    # clone: the slice must not keep the whole unsharded tensor alive.
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, cols].T) + b: the input arrives already split by the preceding
    column-parallel layer (heads / intermediate features), so no scatter is needed. The local product is a
    plain nn.Linear (`local`), so passes over a model's nn.Linear layers (the runner's CPU weight layout)
    reach it; the module itself is no nn.Linear, so nothing mistakes it for a whole projection."""

    def __init__(self, linear: nn.Linear, cols: range, group=None) -> None:
        super().__init__()
        self.local = _linear(linear.weight[:, cols.start:cols.stop])
        # The bias is added once, after the sum (on every rank, so all ranks keep identical activations).
        self.bias = _param(linear.bias) if linear.bias is not None else None
        self.group = group
        self.in_features, self.out_features = len(cols), linear.out_features

    @property
    def weight(self) -> nn.Parameter:
        return self.local.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.local(x))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's x_local @ W[:, cols].T (however it was computed)."""
        y = _all_reduce(partial, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding; a token outside them contributes zeros, so the all-reduce sum
    is exactly the one owning rank's row. A scaled embedding's factor (Gemma's embed_scale, sqrt(hidden))
    multiplies each rank's rows, zeros included, so the sum is still exactly the owning rank's scaled row."""

    def __init__(self, embedding: nn.Embedding, rows: range, group=None) -> None:
        super().__init__()
        self.weight = _param(embedding.weight[rows.start:rows.stop])
        self.start, self.stop = rows.start, rows.stop
        self.group = group
        self.embedding_dim = embedding.embedding_dim
        self.embed_scale = embedding_scale(embedding)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.stop)
        local = F.embedding(torch.where(mine, input_ids - self.start, 0), self.weight)
        if self.embed_scale is not None:  # as Gemma's ScaledWordEmbedding: in the weight's dtype
            local = local * self.embed_scale.to(local.dtype)
        return _all_reduce(local * mine.unsqueeze(-1).to(local.dtype), self.group)


def embedding_scale(embedding: nn.Module) -> torch.Tensor | None:
    """The factor a HF ScaledWordEmbedding multiplies its rows by (None for a plain nn.Embedding); ValueError
    for any other embedding module, whose forward a vocabulary shard would not reproduce."""
    if type(embedding) is nn.Embedding:
        return None
    scale = getattr(embedding, "embed_scale", None)
    if isinstance(embedding, nn.Embedding) and scale is not None:
        return torch.as_tensor(scale).detach().clone()
    raise ValueError(f"tensor_parallel_size > 1 cannot split the input embedding {type(embedding).__name__}: it is"
                     f" no nn.Embedding, nor one that only scales its rows (embed_scale)")


class ParallelLMHead(nn.Module):
    """Each rank projects onto its vocabulary rows; the slices are gathered on rank 0 only (the sampler's
    rank), which returns the full [rows, vocab] logits. Other ranks return their local slice (unused)."""

    def __init__(self, weight: nn.Parameter, plan: ShardPlan, bias=None, group=None) -> None:
        super().__init__()
        self.local = _linear(weight, bias)  # weight: shared with VocabParallelEmbedding when the model ties them
        self.sizes = [len(s.vocab) for s in plan.ranks]
        self.group = group

    @property
    def weight(self) -> nn.Parameter:
        return self.local.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(self.local(x))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full logits on rank 0 from each rank's x @ W_local.T (+ b_local); the local slice elsewhere."""
        width = max(self.sizes)  # gather needs equal shapes: pad an uneven slice, trim after
        if local.shape[-1] < width:
            local = F.pad(local, (0, width - local.shape[-1]))
        pieces = _timed(self.group.gather, local.contiguous(), 0)
        if pieces is None:
            return local
        return torch.cat([p[..., :n] for p, n in zip(pieces, self.sizes)], dim=-1)


# -- sharding a model ----------------------------------------------------------------------------


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear holding `weight` (a Parameter is kept as is, so a tied weight stays shared; any other
    tensor is copied) and `bias`."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    out.weight = weight if isinstance(weight, nn.Parameter) else _param(weight)
    if bias is not None:
        out.bias = bias if isinstance(bias, nn.Parameter) else _param(bias)
    return out


def _column_slice(linear: nn.Linear, rows: range) -> nn.Linear:
    bias = linear.bias[rows.start:rows.stop] if linear.bias is not None else None
    return _linear(linear.weight[rows.start:rows.stop], bias)


def _heads_to_rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def _set_submodule(model: nn.Module, target: nn.Module, new: nn.Module) -> None:
    for name, module in model.named_modules():
        if module is target:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
            return
    raise ValueError("module not found in the model")


def _layers(model) -> list[nn.Module]:
    layers = getattr(model.base_model, "layers", None)
    ok = layers is not None and all(
        all(hasattr(getattr(layer, "self_attn", None), p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and all(hasattr(getattr(layer, "mlp", None), p) for p in ("gate_proj", "up_proj", "down_proj"))
        for layer in layers)
    if not ok or not isinstance(getattr(model.config, "intermediate_size", None), int):
        raise ValueError(f"tensor_parallel_size > 1 supports HF Llama-family models (layers with"
                         f" self_attn.q/k/v/o_proj and mlp.gate/up/down_proj); {type(model).__name__} is not one")
    embedding_scale(model.get_input_embeddings())  # ValueError for an embedding a shard cannot reproduce
    head_dim = head_dim_of(model.config)
    for layer in layers:
        for name in ("q_norm", "k_norm"):  # per head (Qwen3) splits with the heads; over all heads (OLMo 2) not
            norm = getattr(layer.self_attn, name, None)
            weight = getattr(norm, "weight", None)
            if weight is not None and weight.numel() != head_dim:
                raise ValueError(f"tensor_parallel_size > 1 cannot split {type(model).__name__}: its attention's"
                                 f" {name} normalises across heads ({weight.numel()} features, not one head's"
                                 f" {head_dim})")
    return list(layers)


def check_shardable(model) -> None:
    """ValueError unless shard_model can split `model` (run before any worker starts)."""
    _layers(model)


def shard_model(model, plan: ShardPlan, rank: int, group=None):
    """Shard `model` in place for `rank` of `plan` and return it. `group`: the model's collectives (an object
    with all_reduce(t) and gather(t, dst), kvpage.distributed.group.Collectives); needed only once the model
    runs, so it may be set later with set_process_group."""
    shard = plan.ranks[rank]
    layers = _layers(model)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embedding.weight.shape[0] != plan.vocab_size or head.weight.shape[0] != plan.vocab_size:
        raise ValueError("tensor parallelism needs an embedding and an LM head of vocab_size rows each")
    tied = head.weight is embedding.weight
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, kv_rows = _heads_to_rows(shard.q_heads, plan.head_dim), _heads_to_rows(shard.kv_heads, plan.head_dim)
        attn.q_proj = _column_slice(attn.q_proj, q_rows)
        attn.k_proj = _column_slice(attn.k_proj, kv_rows)
        attn.v_proj = _column_slice(attn.v_proj, kv_rows)
        attn.o_proj = RowParallelLinear(attn.o_proj, q_rows, group)
        # Only sdpa/eager read it (repeat_kv); kvpage attention takes head counts from the tensors.
        attn.num_key_value_groups = shard.num_heads // shard.num_kv_heads
        mlp.gate_proj = _column_slice(mlp.gate_proj, shard.intermediate)
        mlp.up_proj = _column_slice(mlp.up_proj, shard.intermediate)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, shard.intermediate, group)
    new_embedding = VocabParallelEmbedding(embedding, shard.vocab, group)
    _set_submodule(model, embedding, new_embedding)
    head_weight = new_embedding.weight if tied else _param(head.weight[shard.vocab.start:shard.vocab.stop])
    head_bias = None
    if getattr(head, "bias", None) is not None:
        head_bias = _param(head.bias[shard.vocab.start:shard.vocab.stop])
    _set_submodule(model, head, ParallelLMHead(head_weight, plan, head_bias, group))
    model.kvpage_shard = shard  # what this rank holds, for the runner and stats
    return model


def set_process_group(model, group) -> None:
    """Point a sharded model's collectives at `group` (sharding may run before the group exists)."""
    for module in model.modules():
        if isinstance(module, (RowParallelLinear, VocabParallelEmbedding, ParallelLMHead)):
            module.group = group
