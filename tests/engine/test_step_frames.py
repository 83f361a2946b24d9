"""How deep a decode step goes: the Python frames from LLM.generate down to the attention op and back to the
sampler, seen by a profile hook while a tiny Llama generates, held to <= 12 and to docs/internals.md's list."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

import kvpage
from kvpage.engine.llm import LLM
from kvpage.engine.sampler import Sampler
from kvpage.ops import attention as ops_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import tiny_model  # noqa: E402

MAX_FRAMES = 12
DOC = Path(__file__).resolve().parents[2] / "docs" / "internals.md"


def _chain(frame, top) -> list:
    """The code objects from `top` (outermost) down to frame's."""
    codes = []
    while frame is not None:
        codes.append(frame.f_code)
        if frame.f_code is top:
            return codes[::-1]
        frame = frame.f_back
    raise AssertionError(f"{top.co_qualname} is not on the stack")


def _decode_step_chains(llm) -> tuple[list, list]:
    """(frames down to ops.paged_attention, frames down to Sampler.__call__) during a decode step."""
    generate = LLM.generate.__code__
    attention = ops_attention.paged_attention.__code__
    sampler = getattr(Sampler.__call__, "__wrapped__", Sampler.__call__).__code__
    seen: dict = {}

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in (attention, sampler) and frame.f_code not in seen:
            seen[frame.f_code] = _chain(frame, generate)

    prompts = [[1, 5, 9, 3], [2, 4, 6]]
    sys.setprofile(hook)
    try:
        llm.generate(prompts, kvpage.SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    finally:
        sys.setprofile(None)
    return seen[attention], seen[sampler]


def _documented_frames() -> list[str]:
    """docs/internals.md's numbered list under "One decode step, frame by frame": each line's first name."""
    section = DOC.read_text().split("## One decode step, frame by frame", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)


def test_decode_step_frames_within_budget_and_documented():
    # bfloat16 on a CPU runs kvpage's composed layers (the float32 CPU default fuses each layer into one op):
    # the path an eager GPU step takes, down to the paged attention op.
    llm = kvpage.LLM(model=tiny_model("llama").to(torch.bfloat16), num_kv_blocks=64, enforce_eager=True)
    down, to_sampler = _decode_step_chains(llm)
    shared = next(i for i, (a, b) in enumerate(zip(down, to_sampler)) if a is not b)
    frames = down + to_sampler[shared:]
    names = [code.co_qualname for code in frames]
    assert len(frames) <= MAX_FRAMES, f"{len(frames)} frames per decode step: {names}"
    documented = _documented_frames()
    assert [name.rsplit(".", 1)[-1] for name in documented] == [code.co_name for code in frames], (
        f"docs/internals.md lists {documented}; a decode step runs {names}")
