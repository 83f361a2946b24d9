"""`kvpage serve --speculative-config '{...}'`: the flag reaches the engine, greedy completions are the offline
engine's without speculation, and /metrics exports the acceptance counters (vLLM's spec_decode names)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpage
from kvpage import SamplingParams

from server_helpers import _free_port, post, scrape, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repeated text: the n-gram proposer finds matches in it (and the model below repeats itself on the last).
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a",
           "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok) -> Path:
    """A tiny random Llama at transformers' default init scale, whose greedy text falls into repeats (unlike
    the conftest's model, made to vary), saved with the tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=tok.eos_token_id,
                         max_position_embeddings=512)
    directory = tmp_path_factory.mktemp("tiny_spec")
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _serve(directory, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "kvpage", "serve", str(directory), *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_serve_with_speculation(model_dir):
    params = SamplingParams(temperature=0, max_tokens=32)
    offline = kvpage.LLM(model=str(model_dir), num_kv_blocks=128, block_size=4, swap_space_gib=0)
    expected = [out.outputs[0].text for out in offline.generate(PROMPTS, params, use_tqdm=False)]
    port = _free_port()
    process = _serve(model_dir, "--port", str(port), "--num-kv-blocks", "128", "--block-size", "4",
                     "--swap-space-gib", "0", "--served-model-name", "t", "--speculative-config", json.dumps(NGRAM))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        got = []
        for prompt in PROMPTS:
            status, body = post(url + "/v1/completions", {"model": "t", "prompt": prompt, "max_tokens": 32,
                                                          "temperature": 0})
            assert status == 200, body
            got.append(body["choices"][0]["text"])
        assert got == expected
        metrics = scrape(url)
        assert metrics["kvpage:spec_decode_num_drafts_total"] > 0
        accepted = metrics["kvpage:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= metrics["kvpage:spec_decode_num_draft_tokens_total"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serve_refuses_a_bad_config_naming_the_key(model_dir):
    process = _serve(model_dir, "--port", str(_free_port()),
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}')
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2 and "num_speculative_tokens" in output, output
