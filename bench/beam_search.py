"""Beam search through the scheduler: beam requests batched with sampling requests vs one at a time.

8 beam requests (width 4) and 56 sampling requests, paired on one LLM: "old" runs the 56 in one
generate and then each beam request alone (what kvpage did before beam search went through the
scheduler: one beam run at a time on an idle engine), "new" runs all 64 in one generate. The beams
must come out the same both ways; the ratio old / new is the speed-up. The two runs of a round take
turns going first, and the prefix cache is off: both runs compute the same prompts, and the second
would otherwise find them all cached by the first.

    python bench/beam_search.py           # 8 beam + 56 sampling requests, 32 tokens each, 2 rounds
    python bench/beam_search.py --quick   # 2 beam + 6 sampling, 4 tokens, 1 round: a smoke run
    python bench/beam_search.py --bf16 --matmul-precision medium   # 16-bit weights, bf16 dot products

The speed-up cannot pass old / (old's sampling part), which the table prints as the bound: where a
56-row decode step is compute-bound (fp32 on a few cores) the beams' rows cost their FLOPs either way;
where it is bound by reading the weights (a GPU, AMX) they ride along almost free.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kvpage  # noqa: E402


def workload(tokenizer, num_beam, num_sampling, prompt_len, max_tokens, beam_width, seed):
    prompts = [common.random_prompt(tokenizer, prompt_len, seed + i) for i in range(num_beam + num_sampling)]
    beam = kvpage.SamplingParams(beam_width=beam_width, max_tokens=max_tokens)
    sampling = kvpage.SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    return prompts[:num_beam], prompts[num_beam:], beam, sampling


def beams_of(outputs):
    return [[c.token_ids for c in out.outputs] for out in outputs]


def run_old(llm, beam_prompts, sampling_prompts, beam, sampling):
    """The sequential run's time, its beams, and the time of its sampling part alone: a batched run
    cannot take less than that, so old / sampling bounds the speed-up."""
    start = time.perf_counter()
    llm.generate(sampling_prompts, sampling, use_tqdm=False)
    sampling_s = time.perf_counter() - start
    outs = [llm.generate([p], beam, use_tqdm=False)[0] for p in beam_prompts]
    return time.perf_counter() - start, beams_of(outs), sampling_s


def run_round(llm, work, r: int, settle=lambda: None):
    """One round's (old, new) results, old first in even rounds and new first in odd ones."""
    runs = {}
    for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
        settle()
        runs[name] = (run_old if name == "old" else run_new)(llm, *work)
    return runs["old"], runs["new"]


def run_new(llm, beam_prompts, sampling_prompts, beam, sampling):
    start = time.perf_counter()
    outs = llm.generate(beam_prompts + sampling_prompts, [beam] * len(beam_prompts) + [sampling] * len(sampling_prompts),
                        use_tqdm=False)
    return time.perf_counter() - start, beams_of(outs[:len(beam_prompts)]), None


def matches_hf(llm, prompts, beam, beams) -> bool:
    """Whether `beams` are transformers' generate(num_beams=k) beams on the same weights (HF pads the
    shorter ones)."""
    import copy

    import torch
    model = copy.deepcopy(llm.model)
    model.set_attn_implementation("sdpa")
    pad = model.generation_config.pad_token_id
    for prompt, got in zip(prompts, beams):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=beam.beam_width,
                                 num_return_sequences=beam.beam_width, max_new_tokens=beam.max_tokens)
        for ref, tokens in zip(out[:, ids.shape[1]:].tolist(), got):
            if ref[:len(tokens)] != tokens or any(t != pad for t in ref[len(tokens):]):
                return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beam", type=int, default=8, help="beam-search requests")
    parser.add_argument("--sampling", type=int, default=56, help="sampling requests")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--pp", type=int, default=32, help="prompt tokens")
    parser.add_argument("--tg", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 beam + 6 sampling, 4 tokens, 1 round (smoke run)")
    parser.add_argument("--no-hf", action="store_true", help="skip the check against HF generate(num_beams=k)")
    parser.add_argument("--bf16", action="store_true", help="weights and KV cache in bfloat16 (weight_dtype and"
                        " kv_cache_dtype), as bench/engine.py --bf16")
    parser.add_argument("--matmul-precision", choices=("highest", "medium"), default="highest",
                        help="kvpage's matmul_precision (medium: bf16 dot products where the CPU has AVX512-BF16;"
                             " with AMX a 56-row decode step stops being compute-bound)")
    common.add_model_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.beam, args.sampling, args.tg, args.rounds = 2, 6, 4, 1
    storage = dict(weight_dtype="bfloat16", kv_cache_dtype="bfloat16") if args.bf16 else {}
    llm = kvpage.LLM(model=args.model, enable_prefix_caching=False, matmul_precision=args.matmul_precision,
                     **storage, **(common.QUICK_ENGINE_ARGS if args.quick else {}))
    run_new(llm, *workload(llm.tokenizer, 1, 2, args.pp, 4, args.beam_width, 99))  # warm-up
    pairs = []
    for r in range(args.rounds):
        work = workload(llm.tokenizer, args.beam, args.sampling, args.pp, args.tg, args.beam_width, 1000 * r)
        settle = (lambda: None) if args.quick else common.wait_until_idle
        (old, old_beams, sampling_s), (new, new_beams, _) = run_round(llm, work, r, settle)
        if old_beams != new_beams:
            sys.exit(f"round {r}: the beams differ between the sequential and the batched runs")
        if not args.no_hf and r == 0 and not matches_hf(llm, work[0], work[2], new_beams):
            sys.exit("the beams differ from HF generate(num_beams=k)")
        pairs.append((old, new, sampling_s))
        print(f"round {r}: old {old:.2f} s (sampling {sampling_s:.2f} s), new {new:.2f} s, {old / new:.2f}x", flush=True)
    ratios = [old / new for old, new, _ in pairs]
    columns = ["round", "old s", "of which sampling s", "new s", "old/new", "bound old/sampling"]
    common.print_table([dict(zip(columns, (i, f"{o:.2f}", f"{s:.2f}", f"{n:.2f}", f"{o / n:.2f}x", f"{o / s:.2f}x")))
                        for i, (o, n, s) in enumerate(pairs)], columns)
    print(f"speed-up (median): {statistics.median(ratios):.2f}x;"
          f" bound (median): {statistics.median(o / s for o, _, s in pairs):.2f}x")
    common.write_json(("beam_search_quick" if args.quick else "beam_search") + ("_bf16" if args.bf16 else ""), {
        "bf16": args.bf16, "matmul_precision": args.matmul_precision,
        "beam": args.beam, "sampling": args.sampling, "beam_width": args.beam_width, "pp": args.pp, "tg": args.tg,
        "old_s": [p[0] for p in pairs], "new_s": [p[1] for p in pairs], "old_sampling_s": [p[2] for p in pairs],
        "speedup_median": statistics.median(ratios),
        "machine": common.machine_info()})


if __name__ == "__main__":
    main()
