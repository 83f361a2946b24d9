"""The `kvpage` command: generate, chat, bench, demo, plan."""
from __future__ import annotations

import argparse
import sys
import time

DEMO_QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one sentence.", "Write a haiku about the sea.",
    "What is 17 times 3?", "Name three primary colours.", "Why is the sky blue?",
    "Give me a tip for learning to cook.", "What does a CPU do?", "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet turtle.", "What is a prime number?", "How many legs does a spider have?",
    "Describe a rainbow to a child.", "What is the largest planet in the solar system?",
    "Write a Python function that adds two numbers.", "What causes the seasons on Earth?",
    "Give two benefits of regular exercise.", "What is the opposite of 'ancient'?",
    "How do bees make honey?", "What language is spoken in Brazil?", "What is gravity?",
    "Tell me a fun fact about octopuses.",
]


def _params(args):
    from kvpage import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)


def _llm(args):
    import kvpage
    return kvpage.LLM(model=args.model, num_kv_blocks=args.num_kv_blocks, kv_cache_dtype=args.kv_cache_dtype,
                      weight_dtype=args.weight_dtype, matmul_precision=args.matmul_precision)


def cmd_generate(args) -> None:
    params = _params(args)  # bad sampling flags fail before the model loads
    out = _llm(args).generate(args.prompt, params, use_tqdm=False)[0].outputs[0]
    print(out.text)


def cmd_chat(args) -> None:
    """Interactive: each reply streams token by token through LLMEngine.step()."""
    params = _params(args)
    llm = _llm(args)
    engine, history = llm.llm_engine, []
    print("kvpage chat: empty line, Ctrl-D or Ctrl-C to quit (Ctrl-C during a reply stops the reply)")
    for turn in range(1 << 30):
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        text = llm.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        request_id = f"chat-{turn}"
        engine.add_request(request_id, text, params, prompt_token_ids=ids)
        history.append({"role": "assistant", "content": _stream_reply(engine, request_id)})


def _stream_reply(engine, request_id: str) -> str:
    """Print one reply as it grows; Ctrl-C ends it early (the request is aborted, its blocks freed) and
    what was shown so far stays in the history."""
    shown = ""
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                reply = out.outputs[0].text
                print(reply[len(shown):], end="", flush=True)
                shown = reply
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        print(" [stopped]", end="")
    print()
    return shown


def cmd_bench(args) -> None:
    """kvpage on the benchmark workload; --peers adds the HF baselines and --peer vllm vLLM's CPU backend,
    via bench/engine.py (a source checkout)."""
    if args.peers or args.peer:
        from pathlib import Path
        import runpy
        script = Path(__file__).resolve().parents[2] / "bench" / "engine.py"
        if not script.is_file():
            sys.exit("--peers needs a source checkout (bench/engine.py)")
        sys.argv = ([str(script)] + (["--quick"] if args.quick else []) + (["--vllm"] if args.peer == "vllm" else [])
                    + ([] if args.peers else ["--no-hf"]))
        runpy.run_path(str(script), run_name="__main__")
        return
    from kvpage.engine.workload import make_workload, quick_workload, run_kvpage
    llm = _llm(args)
    res = run_kvpage(llm, quick_workload() if args.quick else make_workload())
    print(f"{res['output_tokens']} output tokens in {res['seconds']:.2f}s: {res['output_tok_s']:.1f} tok/s;"
          f" TTFT p50 {res['ttft_p50_s']:.3f}s p99 {res['ttft_p99_s']:.3f}s;"
          f" prefix-cache hit rate {res['prefix_cache_hit_rate']:.0%}; preemptions {res['num_preemptions']}")


def cmd_demo(args) -> None:
    """A batch of varied questions, greedy, on the default model: answers, then a summary."""
    from kvpage import SamplingParams
    llm = _llm(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversations = [[{"role": "system", "content": "You are a concise, helpful assistant."},
                      {"role": "user", "content": q}] for q in DEMO_QUESTIONS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for q, out in zip(DEMO_QUESTIONS, outputs):
        print(f"Q: {q}\nA: {out.outputs[0].text.strip()}\n")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = sorted(o.metrics["ttft"] for o in outputs)
    s = llm.stats()
    print(f"{len(outputs)} requests, {tokens} output tokens in {elapsed:.2f}s = {tokens / elapsed:.1f} tok/s;"
          f" time to first token p50 {ttfts[len(ttfts) // 2]:.3f}s, max {ttfts[-1]:.3f}s")
    print(f"KV blocks: peak {s['max_kv_blocks_used']} of {s['num_kv_blocks']} ({s['block_size']} tokens each);"
          f" prefix-cache hit rate {s['prefix_cache_hit_rate']:.0%}"
          f" ({s['prefix_cache_hit_tokens']}/{s['prefix_cache_queried_tokens']} tokens);"
          f" preemptions {s['num_preemptions']}")


def cmd_plan(args) -> None:
    """The cost model (kvpage.costmodel) for a model on a device: no model is loaded."""
    from kvpage import costmodel

    dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4, None: None}[args.dtype]
    workload = costmodel.Workload(
        context_len=args.context, block_size=args.block_size, mean_len=args.mean_len,
        memory_utilization=args.memory_utilization, dtype_bytes=dtype_bytes, prefix_requests=args.prefix_requests,
        prefix_shared_tokens=args.prefix_tokens, max_num_batched_tokens=args.max_num_batched_tokens)
    print(costmodel.plan_text(costmodel.get_model(args.model), costmodel.get_device(args.device), workload))


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="the cost model's numbers for a model on a device (docs/mathlab.md)")
    p.set_defaults(fn=cmd_plan)
    p.add_argument("--model", default="llama-3-8b", help="llama-3-8b, smollm2-135m or a local HF model directory")
    p.add_argument("--device", default="h100", help="h100, h200, a100, or 'this' (measured now, a few seconds)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="KV and weights dtype (default: bf16 on GPUs, fp32 on 'this')")
    p.add_argument("--context", type=int, default=8192, help="context length reserved per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mean-len", type=float, default=500.0, help="mean tokens per sequence under paging")
    p.add_argument("--memory-utilization", type=float, default=0.9)
    p.add_argument("--prefix-requests", type=int, default=50)
    p.add_argument("--prefix-tokens", type=int, default=2000, help="shared system-prompt tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpage", description="paged KV-cache LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (("generate", cmd_generate, "complete one prompt"),
                            ("chat", cmd_chat, "interactive chat, streaming"),
                            ("bench", cmd_bench, "throughput on the benchmark workload"),
                            ("demo", cmd_demo, "a batch of questions with a summary")):
        p = sub.add_parser(name, help=help_)
        p.set_defaults(fn=fn)
        p.add_argument("--model", default=None, help="local HF model directory (default: SmolLM2-135M-Instruct)")
        p.add_argument("--num-kv-blocks", type=int, default=None)
        p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "bfloat16", "float16"),
                       default="auto", help="fp8: K/V stored as float8_e4m3fn, 4x the tokens of fp32; bfloat16 /"
                       " float16: 2x (CPU, float32 model); neither is token-identical")
        p.add_argument("--weight-dtype", choices=("auto", "bfloat16", "float16"), default="auto",
                       help="bfloat16 / float16: the weights rounded to and stored in 16 bits, computed in"
                       " float32 (CPU, float32 model): half the bytes a decode step streams")
        p.add_argument("--matmul-precision", choices=("highest", "medium"), default="highest",
                       help="medium: the linear layers compute with bf16 dot products where the CPU has"
                       " AVX512-BF16 (weights and inputs rounded to bf16), not token-identical")
        p.add_argument("--max-tokens", type=int, default=64 if name != "chat" else 256)
        p.add_argument("--temperature", type=float, default=0.0 if name in ("demo", "bench") else 0.7)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--min-p", type=float, default=0.0)
        p.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt and output (HF's rule)")
        p.add_argument("--presence-penalty", type=float, default=0.0, help="over the output, in [-2, 2]")
        p.add_argument("--frequency-penalty", type=float, default=0.0, help="over the output, in [-2, 2]")
        p.add_argument("--seed", type=int, default=None)
        if name == "generate":
            p.add_argument("prompt")
        if name == "bench":
            p.add_argument("--quick", action="store_true", help="a small smoke run")
            p.add_argument("--peers", action="store_true", help="also run the HF baselines (bench/engine.py)")
            p.add_argument("--peer", choices=["vllm"], default=None,
                           help="also run vLLM's CPU backend (its venv: bash bench/peers/setup_vllm.sh),"
                                " prefix caching on and off (bench/engine.py --vllm)")
    _add_plan_parser(sub)
    from kvpage.server.cli_args import add_serve_parser
    add_serve_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, TypeError) as e:
        print(f"kvpage: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvpage: interrupted", file=sys.stderr)
        return 130  # the shell's status for SIGINT
    except RuntimeError as e:
        # The default model's wheel missing is the environment, not a bug: what to install, no traceback.
        # (Looked up, not imported: `kvpage plan` never loads torch.)
        loader = sys.modules.get("kvpage.model.loader")
        if loader is None or not isinstance(e, loader.DefaultModelMissing):
            raise
        print(f"kvpage: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
