"""The examples take --model DIR, as the README says every example does (tests/bench runs them on the default
model): here on the tiny random Llama, as scripts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["examples/hf_generate_paged.py", "examples/paged_decode_loop.py"])
def test_example_runs_on_another_model(script, tiny_model_dir):
    run = subprocess.run([sys.executable, script, "--model", str(tiny_model_dir), "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    if "paged_decode_loop" in script:  # it checks itself against greedy model.generate
        assert "same tokens as greedy model.generate: True" in run.stdout, run.stdout
