"""Inside a step nothing reads index data back to the host: eager decode steps make no device sync but the
sampler's read of the sampled tokens, and with the range-check switch off (the default outside the test
suite: kvpage.ops.config) no op runs a range check, the checks that copy index tensors to the host.

The CPU case runs everywhere and proves the second half with the extension's range-check counter; the CUDA
case (skipped without a GPU) runs the same steps under torch.cuda.set_sync_debug_mode("error"), where any
sync outside the sampler's marked read raises."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import kvpage
from kvpage import SamplingParams, ops
from kvpage.ops.config import range_checks_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import random_prompts, tiny_model  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_check.sh runs it)")


@contextlib.contextmanager
def syncs_raise(device: str):
    """On a GPU, every device sync inside raises (torch's sync debug mode); a CPU has none to catch."""
    if device != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_eager_decode_steps_neither_sync_nor_range_check(device):
    llm = kvpage.LLM(model=tiny_model("llama").to(device), enforce_eager=True, num_kv_blocks=64, max_num_seqs=4,
                     enable_prefix_caching=False)
    prompts = random_prompts([5, 17, 33])
    params = SamplingParams(temperature=0, max_tokens=12)  # 12 tokens: decode steps cross a 16-token block
    llm.generate(prompts, params, use_tqdm=False)  # first-call allocations and lazy initialisation
    with ops.range_checks(False):
        before = range_checks_run()
        with syncs_raise(device):
            unchecked = llm.generate(prompts, params, use_tqdm=False)
        assert range_checks_run() == before, "a step ran range checks with the switch off"
    with ops.range_checks(True):  # the switch on: every attention layer of every step checks its indices
        checked = llm.generate(prompts, params, use_tqdm=False)
    assert range_checks_run() > before
    assert _token_ids(unchecked) == _token_ids(checked)
