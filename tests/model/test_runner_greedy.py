"""ModelRunner + BlockManager greedy decoding, token for token against HF generate on the same weights.

Two families (Llama; Qwen2 with q/k/v biases and a different head_dim), fp32. Where kvpage and HF pick
different tokens whose logits are within greedy_driver.TIE_TOLERANCE (1e-4), either is accepted and the
rest of that sequence is not compared: see assert_same_greedy.
"""
from types import SimpleNamespace

import pytest

from greedy_driver import assert_same_greedy, hf_greedy, run_greedy
from kvpage.model import ModelRunner
from tiny_models import model_pair, random_prompts

LENGTHS = (5, 17, 33, 1, 40, 24)
MAX_NEW = 12
BLOCK = 8


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request):
    reference, model = model_pair(request.param)
    prompts = random_prompts(LENGTHS)
    return SimpleNamespace(name=request.param, reference=reference, model=model, prompts=prompts,
                           expected=hf_greedy(reference, prompts, MAX_NEW))


def make_runner(model, num_kv_blocks=96, num_host_blocks=0):
    return ModelRunner(model, num_kv_blocks=num_kv_blocks, block_size=BLOCK, num_host_blocks=num_host_blocks)


def test_all_prompts_prefilled_in_one_step_then_decoded(family):
    run = run_greedy(make_runner(family.model), family.prompts, MAX_NEW)
    assert run.num_steps == MAX_NEW  # one prefill step for all, then pure decode steps
    assert run.max_tokens_per_step == sum(LENGTHS)
    assert_same_greedy(run, family.expected)


def test_chunked_prefill_mixed_with_decodes(family):
    run = run_greedy(make_runner(family.model), family.prompts, MAX_NEW, token_budget=16,
                     arrivals=[0, 0, 2, 3, 5, 6])
    assert run.max_tokens_per_step <= 16 < max(LENGTHS)  # long prompts really were split
    assert run.mixed_steps > 0
    assert_same_greedy(run, family.expected)


def test_prefix_cache_hits(family):
    shared = random_prompts([3 * BLOCK + 3], seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([4, 9, 1, 13], seed=8)] + [shared[:BLOCK + 2]]
    # The first prompt computes the shared blocks; the later ones, arriving after, hit them.
    run = run_greedy(make_runner(family.model), prompts, MAX_NEW, arrivals=[0, 2, 2, 4, 4],
                     enable_prefix_caching=True)
    stats = run.block_manager.stats()
    assert stats.prefix_cache_hit_tokens >= 3 * 3 * BLOCK + BLOCK
    assert_same_greedy(run, hf_greedy(family.reference, prompts, MAX_NEW))


def test_a_full_prefix_hit_recomputes_only_the_last_token(family):
    # Block-aligned prompts asked again: every block is a hit, only the last token runs (for its
    # logits) and its K/V are not rewritten into the shared block (slot -1).
    aligned = random_prompts([2 * BLOCK, BLOCK, 3 * BLOCK], seed=9)
    prompts = aligned + aligned + [aligned[0]]
    # Repeats 3-4 arrive while their originals decode (shared blocks); 5 after those finished (cached).
    arrivals = [0, 0, 0, 2, 2, 3, MAX_NEW + 6]
    run = run_greedy(make_runner(family.model), prompts, MAX_NEW, arrivals=arrivals, enable_prefix_caching=True)
    stats = run.block_manager.stats()
    repeats = prompts[len(aligned):]
    assert stats.prefix_cache_hit_tokens == sum(len(p) - 1 for p in repeats)
    assert_same_greedy(run, hf_greedy(family.reference, prompts, MAX_NEW))


def test_forked_sequences_copy_on_write(family):
    # Prompts of 17 and 33 tokens leave their last block part-full, so the children's first decode
    # writes into a shared block: copy-on-write must copy it (blocks_to_copy) or they read zeros.
    run = run_greedy(make_runner(family.model), family.prompts, MAX_NEW, forks={1: 2, 2: 1})
    assert run.num_copies >= 3
    expected = family.expected + [family.expected[1]] * 2 + [family.expected[2]]
    assert_same_greedy(run, expected)


def test_swap_out_and_back_in(family):
    run = run_greedy(make_runner(family.model, num_host_blocks=64), family.prompts, MAX_NEW,
                     swap_out={3: 1, 4: 4, 6: 2})
    assert run.num_swapped >= 3 + 5
    assert_same_greedy(run, family.expected)
