"""The step broadcast: one scheduler decision as two tensors, a fixed header then one int32 payload.

header  int64[HEADER_LEN]: kind, message number, then the payload's sizes (ALLOCATE reuses their
        slots).
payload int32: the step as ModelRunner runs it locally (layout: kvpage.model.step_inputs).
Every rank, the driver included, runs the step from the unpacked tensors, so all run identical inputs;
none of them sees a Python object per sequence. Cost: 8 * HEADER_LEN + 4 * len(payload) bytes.
"""
from __future__ import annotations

import pickle
from dataclasses import fields
from enum import IntEnum

import torch

from kvpage.model.cuda_graphs import CudaGraphConfig
from kvpage.model.runner import KV_CACHE_DTYPES, MATMUL_PRECISIONS
from kvpage.model.runner import WEIGHT_DTYPES as WEIGHT_DTYPE_NAMES
from kvpage.model.step_inputs import PayloadSizes, Step, pack_payload, unpack_payload


class Kind(IntEnum):
    STEP = 1
    ALLOCATE = 2  # size the KV caches (no payload)
    SHUTDOWN = 3
    # [kv tier] a KV connector's message (kvpage.kv_offload.tp): a pickled object, answered by `reply_len`
    # ints from every rank (an all_gather) where reply_len > 0 (object_message).
    KV_CONNECTOR = 4


# Header slots.
_SLOTS = ("kind", "message", "num_seqs", "num_tokens", "width", "num_sampled", "swap_out", "swap_in", "copy",
          "max_query_len", "max_seq_len", "num_groups", "payload_len")
KIND, MESSAGE, NUM_SEQS, NUM_TOKENS, WIDTH, NUM_SAMPLED, SWAP_OUT, SWAP_IN, COPY, MAX_QUERY_LEN, MAX_SEQ_LEN, \
    NUM_GROUPS, PAYLOAD_LEN = range(len(_SLOTS))
HEADER_LEN = len(_SLOTS)
_SIZE_SLOTS = tuple(f.name for f in fields(PayloadSizes))  # in PayloadSizes' order
# An ALLOCATE message's fields, in size slots (KV_CACHE_DTYPE: an index into CACHE_DTYPES, WEIGHT_DTYPE
# into WEIGHT_DTYPES; BLOCK_SIZE a rank's physical block; DCP_INTERLEAVE: dcp_kv_cache_interleave_size;
# MODEL_KV_CACHE_GROUPS: 1 where the caches are laid out in the model's KV-cache groups, which every rank
# derives from its config (kvpage.model.runner.model_kv_cache_layout), 0 for one group of all layers;
# GRAPH_MAX_NUM_SEQS / GRAPH_MAX_MODEL_LEN: the ranks' CudaGraphConfig, 0 for none: eager).
NUM_KV_BLOCKS, BLOCK_SIZE, NUM_HOST_BLOCKS, KV_CACHE_DTYPE, WEIGHT_DTYPE, MATMUL_PRECISION, DCP_INTERLEAVE, \
    MODEL_KV_CACHE_GROUPS, GRAPH_MAX_NUM_SEQS, GRAPH_MAX_MODEL_LEN = \
    NUM_SEQS, NUM_TOKENS, WIDTH, NUM_SAMPLED, SWAP_OUT, SWAP_IN, COPY, MAX_QUERY_LEN, MAX_SEQ_LEN, NUM_GROUPS
# ModelRunner's dtype choices by index, None first (the model's own; the weights as loaded).
CACHE_DTYPES = tuple(dict.fromkeys(KV_CACHE_DTYPES.values()))
WEIGHT_DTYPES = tuple(dict.fromkeys(WEIGHT_DTYPE_NAMES.values()))


def header(kind: Kind, message: int, **sizes: int) -> torch.Tensor:
    """sizes: header slots by name (see _SLOTS)."""
    values = [0] * HEADER_LEN
    values[KIND], values[MESSAGE] = int(kind), message
    for name, value in sizes.items():
        values[_SLOTS.index(name)] = value
    return torch.tensor(values, dtype=torch.int64)


def allocate_header(message: int, num_kv_blocks: int, block_size: int, num_host_blocks: int,
                    cache_dtype: torch.dtype | None, weight_dtype: torch.dtype | None, matmul_precision: str,
                    dcp_interleave: int, model_kv_cache_groups: bool, cuda_graphs: CudaGraphConfig | None) -> torch.Tensor:
    """TensorParallelExecutor.allocate's arguments (the ModelRunner's, on every rank) as an ALLOCATE header."""
    graphs = (cuda_graphs.max_num_seqs, cuda_graphs.max_model_len) if cuda_graphs is not None else (0, 0)
    return header(Kind.ALLOCATE, message, num_seqs=num_kv_blocks, num_tokens=block_size, width=num_host_blocks,
                  num_sampled=CACHE_DTYPES.index(cache_dtype), swap_out=WEIGHT_DTYPES.index(weight_dtype),
                  swap_in=MATMUL_PRECISIONS.index(matmul_precision), copy=dcp_interleave,
                  max_query_len=int(model_kv_cache_groups), max_seq_len=graphs[0], num_groups=graphs[1])


def cuda_graphs_of(h: torch.Tensor) -> CudaGraphConfig | None:
    """An ALLOCATE header's CudaGraphConfig (None: eager decode steps)."""
    max_num_seqs = int(h[GRAPH_MAX_NUM_SEQS])
    return CudaGraphConfig(max_num_seqs, int(h[GRAPH_MAX_MODEL_LEN])) if max_num_seqs else None


def cache_dtype_of(h: torch.Tensor) -> torch.dtype | None:
    """An ALLOCATE header's cache dtype (None: the model's)."""
    return CACHE_DTYPES[int(h[KV_CACHE_DTYPE])]


def weight_dtype_of(h: torch.Tensor) -> torch.dtype | None:
    """An ALLOCATE header's weight storage dtype (None: the weights as loaded)."""
    return WEIGHT_DTYPES[int(h[WEIGHT_DTYPE])]


def matmul_precision_of(h: torch.Tensor) -> str:
    return MATMUL_PRECISIONS[int(h[MATMUL_PRECISION])]


def pack_step(batch, message: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a SchedulerOutput or ModelInput. Raises ValueError for a malformed step, before
    anything is sent, so no rank ever runs it."""
    sizes, payload = pack_payload(batch, block_size)
    h = header(Kind.STEP, message, payload_len=payload.numel(),
               **{name: getattr(sizes, name) for name in _SIZE_SLOTS})
    return h, payload


def unpack_step(h: torch.Tensor, payload: torch.Tensor, device: torch.device) -> Step:
    """Views into the payload (one host-to-device copy on CUDA), in pack_payload's order."""
    values = h.tolist()
    return unpack_payload(PayloadSizes(*(values[_SLOTS.index(name)] for name in _SIZE_SLOTS)), payload, device)


def object_message(message: int, obj, reply_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[kv tier] A KV_CONNECTOR message: obj pickled (the driver's and its own workers' processes only), padded
    to whole int32s; NUM_SEQS holds its byte length, NUM_TOKENS the reply's length."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    padded = data + bytes(-len(data) % 4)
    payload = torch.frombuffer(bytearray(padded), dtype=torch.int32) if padded else torch.empty(0, dtype=torch.int32)
    return header(Kind.KV_CONNECTOR, message, num_seqs=len(data), num_tokens=reply_len,
                  payload_len=payload.numel()), payload


def object_of(h: torch.Tensor, payload: torch.Tensor) -> tuple[object, int]:
    """[kv tier] (the object, reply length) of a KV_CONNECTOR message."""
    data = payload.contiguous().view(torch.uint8).numpy().tobytes()[:int(h[NUM_SEQS])]
    return pickle.loads(data), int(h[NUM_TOKENS])


def broadcast_message(h: torch.Tensor, payload: torch.Tensor | None, group) -> None:
    """Driver side (group: a Collectives): the header, then the payload if the header announces one."""
    group.broadcast(h)
    if payload is not None and payload.numel():
        group.broadcast(payload)


def receive_message(group) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker side: (header, payload); the payload is empty for messages without one."""
    h = torch.empty(HEADER_LEN, dtype=torch.int64)
    group.broadcast(h)
    payload = torch.empty(int(h[PAYLOAD_LEN]), dtype=torch.int32)
    if payload.numel():
        group.broadcast(payload)
    return h, payload


def message_bytes(h: torch.Tensor, payload: torch.Tensor | None) -> int:
    return h.numel() * h.element_size() + (payload.numel() * payload.element_size() if payload is not None else 0)
