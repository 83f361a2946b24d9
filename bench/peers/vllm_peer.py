"""vLLM's CPU backend on kvpage's benchmark workload: runs INSIDE the vLLM venv (bench/peers/setup_vllm.sh).

    $VENV/bin/python bench/peers/vllm_peer.py spec.json

spec.json (written by bench/peers/vllm_launcher.py): model directory, output lengths, a warm-up set of
prompts (token ids) with the workload's shapes but its own tokens (so the warm-up neither hits the
prefix cache of a timed run nor leaves its one-time costs in it), and the engine settings. After the
warm-up the peer serves timed runs, so the benchmark can alternate them with kvpage's: each line on
stdin names a JSON file of prompts (token ids); the reply is one stdout line, DONE_MARKER + the
result as JSON. An empty line or EOF ends it.
Time to first token is the time from the start of the timed run to the first step that returns a
token for the request, as kvpage measures it; every request is added before the first step.
"""
import json
import sys
import time

from vllm_launcher import DONE_MARKER  # this script's directory is on sys.path; it imports no vLLM


def run(engine, prompts, output_lens, SamplingParams) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, p)
    first, tokens = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, time.perf_counter() - start)
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    ttfts = sorted(first.values())
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "ttft_p50_s": ttfts[round(0.50 * (len(ttfts) - 1))], "ttft_p99_s": ttfts[round(0.99 * (len(ttfts) - 1))]}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    import vllm

    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), block_size=spec["block_size"],
              enable_prefix_caching=spec["enable_prefix_caching"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], seed=0)
    engine = llm.llm_engine
    # The output kind must be cumulative so out.outputs[0].token_ids is the whole completion at the end.
    run(engine, spec["warmup_prompts"], spec["output_lens"], SamplingParams)
    print(DONE_MARKER + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        prompts = json.loads(open(line.strip()).read())
        result = run(engine, prompts, spec["output_lens"], SamplingParams)
        result.update(vllm_version=vllm.__version__, block_size=spec["block_size"],
                      enable_prefix_caching=spec["enable_prefix_caching"])
        print(DONE_MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from re-running main
    main()
