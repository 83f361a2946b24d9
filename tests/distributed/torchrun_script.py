"""Run as `torchrun --standalone --nproc-per-node 2 torchrun_script.py` (test_tp_failure.py does): every rank
builds the same seeded model and calls kvpage.LLM(tensor_parallel_size=2); rank 0 gets the LLM and prints the
greedy token ids, rank 1 serves inside the constructor and exits when rank 0 shuts down."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SEED = 11
PROMPT_LENGTHS = [5, 23, 40]


def params():
    import kvpage

    return kvpage.SamplingParams(temperature=0.0, max_tokens=12)


def main() -> None:
    import kvpage
    from tp_helpers import random_prompts, tiny_llama

    llm = kvpage.LLM(model=tiny_llama(seed=SEED), num_kv_blocks=64, tensor_parallel_size=2)
    out = llm.generate(random_prompts(PROMPT_LENGTHS), params(), use_tqdm=False)
    print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in out]), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
