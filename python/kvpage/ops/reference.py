"""Plain-torch versions of every kvpage op: the ground truth tests and benchmarks compare against.

Written for clarity, not speed: gather each sequence's K/V from its block table into a contiguous
tensor, then run textbook attention in float32."""
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x, scale=1.0):
    """What an fp8 cache stores for x: x * (1 / scale) in float32, saturated to +-448, rounded to
    nearest even (torch's own conversion)."""
    inverse = torch.tensor(1.0 / scale, dtype=torch.float32)
    return (x.float() * inverse.to(x.device)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(cache, scale=1.0):
    """A cache's values in float32 (fp8 codes times their scale; other dtypes as they are)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.float() * torch.tensor(scale, dtype=torch.float32).to(cache.device)
    return cache.float()


def round_through_cache(x, cache_dtype):
    """x as a cache of cache_dtype holds it, read back in x's dtype: fp8 codes at scale 1.0
    (quantize_fp8), a 16-bit cache rounded to nearest even, x's own dtype unchanged."""
    if cache_dtype == torch.float8_e4m3fn:
        return quantize_fp8(x).to(x.dtype)
    return x.to(cache_dtype).to(x.dtype)


def hf_rounded_kv_attention(cache_dtype):
    """transformers' sdpa attention over K/V rounded through a cache of cache_dtype: the reference for
    generation with kv_cache_dtype="fp8" / "bfloat16" / "float16" (register_hf_rounded_kv_attention).
    Re-rounding K/V already rounded is a no-op, so it may see the whole past at every step."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        key, value = (round_through_cache(t, cache_dtype).to(query.dtype) for t in (key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


# hf_rounded_kv_attention for an fp8 cache.
hf_fp8_kv_attention = hf_rounded_kv_attention(torch.float8_e4m3fn)


def register_hf_rounded_kv_attention(cache_dtype, name=None):
    """Registers hf_rounded_kv_attention(cache_dtype), with sdpa's mask builder (a padded batch needs
    its mask), as attn_implementation `name`; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = name or f"kvpage_reference_{str(cache_dtype).removeprefix('torch.')}_kv_sdpa"
    AttentionInterface.register(name, hf_rounded_kv_attention(cache_dtype))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


def register_hf_fp8_kv_attention(name="kvpage_reference_fp8_kv_sdpa"):
    """register_hf_rounded_kv_attention for an fp8 cache."""
    return register_hf_rounded_kv_attention(torch.float8_e4m3fn, name)


def gather_kv(cache, block_table, seq_len, scale=1.0, first_block=0):
    """[seq_len - first_block * block_size, num_kv_heads, head_size] of one sequence's positions from
    first_block's on, from a [num_blocks, H, bs, D] cache, in float32 for an fp8 cache (dequantised
    with scale). The table entries before first_block are not read."""
    block_size = cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    tiles = cache[block_table[first_block:num_blocks].long()]  # [nb, H, bs, D]
    if cache.dtype == torch.float8_e4m3fn:
        tiles = dequantize(tiles, scale)
    return tiles.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[: seq_len - first_block * block_size]


def first_visible_block(first_query_position, block_size, sliding_window=None):
    """The block holding the first key a sliding window lets the earliest query see (0 without one)."""
    if sliding_window is None:
        return 0
    return max(0, first_query_position - sliding_window + 1) // block_size


def attention(query, key, value, scale, query_positions, return_lse=False, *, key_start=0, sliding_window=None,
              softcap=None, sinks=None):
    """query [q, Hq, D]; key/value [k, Hkv, D] at positions key_start, key_start + 1, ...; query i sees
    keys at positions <= query_positions[i] and, with a sliding window W, > query_positions[i] - W.
    softcap c: scores -> c * tanh(scores / c) after the scale; sinks (float32 [Hq]): one more logit per
    head in the softmax denominator with no value (HF's gpt-oss eager_attention_forward).
    return_lse: also the natural log of each row's softmax denominator (sink included), float32 [q, Hq]."""
    group = query.shape[1] // key.shape[1]
    q = query.float().transpose(0, 1)  # [Hq, q, D]
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) * scale  # [Hq, q, k]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    key_positions = torch.arange(key_start, key_start + key.shape[0], device=query.device)
    visible = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # a column of logits that softmax counts and that multiplies no value
        scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
        v = torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[2])], dim=1)
    out = (scores.softmax(dim=-1) @ v).transpose(0, 1).to(query.dtype)
    return (out, torch.logsumexp(scores, dim=-1).transpose(0, 1)) if return_lse else out


def _with_lse(out, lse, return_lse):
    return (out, lse) if return_lse else out


def _paged_rows(query, key_cache, value_cache, block_table, seq_len, scale, k_scale, v_scale, sliding_window,
                 **options):
    """(out, lse) of the query tokens [q, Hq, D] that end one sequence of seq_len tokens; only its
    table entries from the earliest query's window on are read (as the kernels do)."""
    positions = torch.arange(seq_len - query.shape[0], seq_len, device=query.device)
    first_block = first_visible_block(seq_len - query.shape[0], key_cache.shape[2], sliding_window)
    key = gather_kv(key_cache, block_table, seq_len, k_scale, first_block)
    value = gather_kv(value_cache, block_table, seq_len, v_scale, first_block)
    return attention(query, key, value, scale, positions, return_lse=True, key_start=first_block * key_cache.shape[2],
                     sliding_window=sliding_window, **options)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=None, k_scale=1.0,
                    v_scale=1.0, return_lse=False, *, sliding_window=None, softcap=None, sinks=None):
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    for s, seq_len in enumerate(seq_lens.tolist()):
        o, row_lse = _paged_rows(query[s : s + 1], key_cache, value_cache, block_tables[s], seq_len, scale, k_scale,
                                 v_scale, sliding_window, softcap=softcap, sinks=sinks)
        out[s], lse[s] = o[0], row_lse[0]
    return _with_lse(out, lse, return_lse)


def paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                            scale=None, k_scale=1.0, v_scale=1.0, return_lse=False, *, sliding_window=None,
                            softcap=None, sinks=None):
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[s], starts[s + 1])
        if rows.start == rows.stop:
            continue
        out[rows], lse[rows] = _paged_rows(query[rows], key_cache, value_cache, block_tables[s], seq_len, scale,
                                           k_scale, v_scale, sliding_window, softcap=softcap, sinks=sinks)
    return _with_lse(out, lse, return_lse)


def merge_attention_states(outputs, lses):
    """outputs [P, T, H, D], lses [P, T, H]: attention over the union of the partials' disjoint key
    sets, one row at a time. Each partial's softmax mass is exp(lse); a partial with lse -inf has
    none, and its output (possibly garbage) is never read."""
    P, T, H, _ = outputs.shape
    out = torch.zeros(outputs.shape[1:], dtype=torch.float32, device=outputs.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=outputs.device)
    for t in range(T):
        for h in range(H):
            live = [p for p in range(P) if lses[p, t, h] != float("-inf")]
            if not live:
                continue
            row_lse = torch.logsumexp(lses[live, t, h].double(), dim=0)
            for p in live:
                out[t, h] += (torch.exp(lses[p, t, h].double() - row_lse) * outputs[p, t, h].double()).float()
            lse[t, h] = row_lse.float()
    return out.to(outputs.dtype), lse


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    block_size = key_cache.shape[2]
    if key_cache.dtype == torch.float8_e4m3fn:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, :, slot % block_size] = key[t]
        value_cache[slot // block_size, :, slot % block_size] = value[t]


def copy_blocks(key_caches, value_caches, block_mapping):
    for src, dst in block_mapping.tolist():
        for cache in list(key_caches) + list(value_caches):
            cache[dst] = cache[src]


def swap_blocks(src, dst, block_mapping):
    src = [src] if isinstance(src, torch.Tensor) else src
    dst = [dst] if isinstance(dst, torch.Tensor) else dst
    for s, d in block_mapping.tolist():
        for src_tensor, dst_tensor in zip(src, dst):
            dst_tensor[d] = src_tensor[s].to(dst_tensor.device)


def rms_norm(input, weight, epsilon):
    """HF LlamaRMSNorm in fp32."""
    x = input.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)).to(input.dtype)


def silu_and_mul(gate, up):
    return torch.nn.functional.silu(gate) * up


def greedy_sample(logits):
    """(argmax, its log-softmax) per row."""
    tokens = logits.argmax(dim=-1)
    return tokens, torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def linear(input, weight, bias=None):
    """input @ weight.T + bias, summed in float64 (what packed_linear approximates in fp32)."""
    out = input.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(input.dtype)


def rotary_embedding(query, key, cos, sin):
    """HF's apply_rotary_pos_emb (rotate-half form) on [tokens, heads, d] with cos/sin [tokens, d]."""
    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]
    return rotate(query), rotate(key)
