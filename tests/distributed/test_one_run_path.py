"""One run path: a tensor-parallel rank runs the step it unpacks from the broadcast through the same
ModelRunner.execute as a local step, and the ranks get the driver's CUDA-graph choice (enforce_eager) with
their caches. In one process (no workers)."""
from __future__ import annotations

import pytest
import torch

from kvpage.distributed import protocol
from kvpage.model import ModelInput, ModelRunner, SequenceInput
from kvpage.model.cuda_graphs import CudaGraphConfig

from tp_helpers import random_prompts, tiny_llama

BLOCK = 16


def _steps():
    """A prefill of two prompts (one not sampled), then a decode step of both, each with a block move."""
    prompts = random_prompts([7, 20])
    slots = [list(range(4 * BLOCK, 4 * BLOCK + 7)), list(range(20))]
    prefill = ModelInput([SequenceInput(prompts[0], 0, [4], slots[0]),
                          SequenceInput(prompts[1], 0, [0, 1], slots[1], do_sample=False)], blocks_to_copy=[(9, 10)])
    decode = ModelInput([SequenceInput([5], 7, [4], [4 * BLOCK + 7]), SequenceInput([6], 20, [0, 1], [20])],
                        blocks_to_copy=[(4, 11)])
    return prefill, decode


def test_a_broadcast_step_runs_through_the_same_execute_as_a_local_one():
    model = tiny_llama()
    local, rank = ModelRunner(model, 16, BLOCK), ModelRunner(tiny_llama(), 16, BLOCK)
    for message, batch in enumerate(_steps()):
        want = local.execute(batch)
        got = rank.execute(protocol.unpack_step(*protocol.pack_step(batch, message, BLOCK), torch.device("cpu")))
        assert torch.equal(got, want)
        for (k0, v0), (k1, v1) in zip(local.kv_cache_pairs, rank.kv_cache_pairs):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_a_step_that_samples_nothing_returns_no_rows():
    runner = ModelRunner(tiny_llama(), 16, BLOCK)
    prefill, _ = _steps()
    prefill.scheduled[0].do_sample = False
    assert runner.execute(prefill).shape == (0, runner.vocab_size)
    assert runner.execute(ModelInput(blocks_to_copy=[(1, 2)])).shape == (0, runner.vocab_size)


@pytest.mark.parametrize("graphs", [None, CudaGraphConfig(max_num_seqs=24, max_model_len=512)])
def test_every_rank_gets_the_drivers_cuda_graph_choice(graphs):
    """enforce_eager (None) or the graphs' sizes travel in the ALLOCATE message, so no rank decides alone."""
    h = protocol.allocate_header(0, 100, BLOCK, 0, None, None, "highest", 1, False, graphs)
    assert protocol.cuda_graphs_of(h) == graphs
    assert protocol.cache_dtype_of(h) is None and protocol.weight_dtype_of(h) is None
