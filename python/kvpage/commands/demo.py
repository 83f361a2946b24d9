"""`kvpage demo`: a batch of questions answered at once on the default model, then a summary.

The questions are ones the 135M default model answers sensibly under greedy decoding with a
repetition penalty of 1.1 (without it, several loop); they share the chat template's system prompt,
which the prefix cache computes once."""
from __future__ import annotations

import statistics
import time

DEMO_QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one sentence.", "Name three primary colours.",
    "What is a prime number?", "What do plants need to grow?", "Why do we need sleep?",
    "Give me three tips for staying focused.", "What is machine learning?",
    "What is the difference between weather and climate?", "Write a Python function that adds two numbers.",
    "Give two benefits of regular exercise.", "What does a CPU do?", "Describe a rainbow to a child.",
    "How do bees make honey?", "Tell me a fun fact about octopuses.", "Give me a tip for learning to cook.",
]
NEXT_STEPS = [
    ("kvpage chat", "a conversation, streamed token by token (/help inside)"),
    ('kvpage generate "What is the capital of France?"', "one answer; --raw continues text instead"),
    ("kvpage serve", "an OpenAI-compatible HTTP server on the same engine"),
    ("kvpage bench --quick", "throughput on the benchmark workload (--peers: against HF transformers)"),
]


def run_demo(llm, params, questions=DEMO_QUESTIONS) -> list:
    conversations = [[{"role": "user", "content": q}] for q in questions]
    print(f"kvpage demo: {len(questions)} questions in one batch, greedy, repetition_penalty"
          f" {params.repetition_penalty:g}, up to {params.max_tokens} tokens each\n", flush=True)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=True)  # a progress bar on stderr while the batch runs
    elapsed = time.perf_counter() - start
    for q, out in zip(questions, outputs):
        completion = out.outputs[0]
        cut = " ..." if completion.finish_reason == "length" else ""
        print(f"Q: {q}\nA: {completion.text.strip()}{cut}\n")
    print("\n".join(summary_lines(outputs, elapsed, llm.stats())))
    return outputs


def summary_lines(outputs, elapsed: float, stats: dict) -> list[str]:
    """The engine's numbers for the batch, one fact a line, then where to go next."""
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [o.metrics["ttft"] for o in outputs]
    # This batch's prompts, not the engine's lifetime (an LLM passed in may have served others).
    queried = sum(len(o.prompt_token_ids) for o in outputs)
    hit = sum(o.num_cached_tokens or 0 for o in outputs)
    rows = [
        ("throughput", f"{tokens / elapsed:.1f} tokens/s ({tokens} tokens, {len(outputs)} requests"
                       f" in {elapsed:.1f} s)"),
        ("first token", f"median {statistics.median(ttfts):.2f} s, slowest {max(ttfts):.2f} s (all requests"
                        f" arrive at once)"),
        ("prefix cache", f"{hit} of {queried} prompt tokens reused ({hit / max(queried, 1):.0%}):"
                         f" the shared system prompt is computed once"),
        ("KV cache", f"peak {stats['max_kv_blocks_used']} of {stats['num_kv_blocks']} blocks"
                     f" ({stats['block_size']} tokens each)"),
        ("preemptions", str(stats["num_preemptions"])),
    ]
    width = max(len(name) for name, _ in rows)
    lines = ["Summary"] + [f"  {name:<{width}}  {value}" for name, value in rows]
    width = max(len(cmd) for cmd, _ in NEXT_STEPS)
    return lines + ["", "Next"] + [f"  {cmd:<{width}}  {what}" for cmd, what in NEXT_STEPS]
