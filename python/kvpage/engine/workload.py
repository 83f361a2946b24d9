"""The throughput workload of `kvpage bench` and bench/engine.py, and the kvpage side of it.

Fixed seed 0: 64 requests sharing one ~120-token system prompt, each with its own short question,
output lengths drawn uniformly from 16..128, greedy, ignore_eos (so every system does the same work).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

SEED = 0
SYSTEM_PROMPT = (
    "You are a careful, friendly assistant for a public library. You answer questions from visitors of all "
    "ages about science, history, geography, literature and everyday life. Keep answers short and accurate, "
    "use plain words, give one concrete example when it helps, and say so honestly when you do not know. "
    "Never invent book titles or quotations. If a question is ambiguous, answer the most likely reading and "
    "mention the other briefly. Format lists with dashes. Do not repeat the question back.\n\nQuestion: "
)
_TOPICS = ["volcanoes", "the Roman empire", "photosynthesis", "black holes", "the printing press", "honey bees",
           "the water cycle", "Shakespeare", "electric cars", "the Great Wall of China", "vaccines", "glaciers",
           "the moon landing", "coral reefs", "prime numbers", "the violin"]
_TEMPLATES = ["What is the most surprising fact about {}?", "Explain {} to a ten-year-old.",
              "Why do people study {}?", "Give me three quick facts about {}."]


@dataclass
class Workload:
    prompts: list[str]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int = 64, min_out: int = 16, max_out: int = 128) -> Workload:
    rng = random.Random(SEED)
    questions = [t.format(topic) for topic in _TOPICS for t in _TEMPLATES]
    rng.shuffle(questions)
    prompts = [SYSTEM_PROMPT + questions[i % len(questions)] for i in range(num_requests)]
    return Workload(prompts, [rng.randint(min_out, max_out) for _ in range(num_requests)])


def quick_workload() -> Workload:
    return make_workload(num_requests=8, min_out=8, max_out=32)


def run_kvpage(llm, workload: Workload) -> dict:
    """Generate the workload on `llm`; output tokens/s, time to first token and the engine's stats."""
    from .sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttfts = sorted(o.metrics["ttft"] for o in outputs)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.stats()
    queried = stats["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    hits = stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    return {
        "seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs), "prefix_cache_hit_tokens": hits,
        "prefix_cache_hit_rate": hits / queried if queried else 0.0,
        "num_preemptions": stats["num_preemptions"] - before["num_preemptions"],
        "max_kv_blocks_used": stats["max_kv_blocks_used"], "num_kv_blocks": stats["num_kv_blocks"],
        "outputs": outputs,
    }


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]
