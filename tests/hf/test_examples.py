"""The examples run as scripts (`python examples/X.py`), and what they generate matches HF generate."""
from __future__ import annotations

import importlib.util
import re
import runpy
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    try:
        runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0


def test_paged_decode_loop_matches_greedy_generate(default_model):
    model, tokenizer = default_model
    loop = load_example("paged_decode_loop")
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "1, 2, 3, 4,", "Hello")]
    outputs = loop.generate(model, prompts, max_new_tokens=20)  # 20 + 5 tokens: crosses a block boundary
    model.set_attn_implementation("sdpa")
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                                  min_new_tokens=20)
        assert output == want[0, len(prompt):].tolist()


def test_paged_decode_loop_script(monkeypatch, capsys):
    assert run_script("paged_decode_loop", monkeypatch, "--max-new-tokens", "6") == 0
    assert "same tokens as greedy model.generate: True" in capsys.readouterr().out


def test_hf_generate_paged_script(default_model, monkeypatch, capsys):
    model, tokenizer = default_model
    example = load_example("hf_generate_paged")
    assert run_script("hf_generate_paged", monkeypatch, "--max-new-tokens", "8") == 0
    out = capsys.readouterr().out
    assert "A: The capital of France is" in out and "copy-on-write" in out
    # The same answers as the unchanged code: HF's DynamicCache and attention.
    model.set_attn_implementation("sdpa")
    chats = [[{"role": "user", "content": q}] for q in example.QUESTIONS]
    inputs = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt", padding=True,
                                           return_dict=True)
    with torch.inference_mode():
        want = model.generate(**inputs, cache=DynamicCache(config=model.config), max_new_tokens=8, do_sample=False)
    for answer in tokenizer.batch_decode(want[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True):
        assert f"A: {answer.strip()}\n" in out


def test_hf_generate_paged_beam_search(monkeypatch, capsys):
    assert run_script("hf_generate_paged", monkeypatch, "--max-new-tokens", "4", "--num-beams", "2") == 0
    copies = re.search(r"(\d+) copy-on-write block copies", capsys.readouterr().out)
    assert copies and int(copies.group(1)) > 0  # the beams shared blocks, and copied one only to write it
