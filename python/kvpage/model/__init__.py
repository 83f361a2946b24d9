"""The model side of kvpage: kvpage's own forward for Llama-family decoders, the "kvpage" attention function
for transformers (every other model), model loading, the runner."""
from .attention import (ATTN_IMPLEMENTATION, HFForward, kvpage_attention_forward, paged_attention_forward,
                        validate_config)
from .llama import LlamaForward, llama_family_mismatch
from .loader import DefaultModelMissing, default_gguf_path, load_default_model, load_model, set_kvpage_attention
from .metadata import AttentionMetadata, ForwardContext, get_forward_context, set_forward_context
from .runner import (KV_CACHE_DTYPES, WEIGHT_DTYPES, ModelInput, ModelRunner, SequenceInput,
                     kv_cache_bytes_per_block, kv_cache_dtype_from_name, num_blocks_for_memory,
                     weight_dtype_from_name)
from .tensor_parallel import ShardPlan, shard_model

__all__ = [
    "ATTN_IMPLEMENTATION", "AttentionMetadata", "DefaultModelMissing", "ForwardContext", "HFForward",
    "LlamaForward", "llama_family_mismatch", "ModelInput",
    "KV_CACHE_DTYPES", "ModelRunner", "SequenceInput", "default_gguf_path", "get_forward_context",
    "kv_cache_bytes_per_block", "kv_cache_dtype_from_name", "WEIGHT_DTYPES", "weight_dtype_from_name",
    "kvpage_attention_forward", "load_default_model", "load_model", "num_blocks_for_memory",
    "paged_attention_forward", "set_forward_context", "set_kvpage_attention", "validate_config",
    "ShardPlan", "shard_model",
]
