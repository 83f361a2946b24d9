"""`kvpage serve [MODEL]`: the subcommand's flags (vLLM's names where vLLM has them) and its run."""
from __future__ import annotations

import argparse
import logging

logger = logging.getLogger("kvpage.server")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.set_defaults(fn=run_server)
    p.add_argument("model", nargs="?", default=None,
                   help="local HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL's)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--max-waiting-requests", type=_positive, default=None,
                   help="answer 503 while this many requests wait to run (default: unbounded)")
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="context limit (prompt + output), at most the model's")
    p.add_argument("--max-num-seqs", type=_positive, default=None)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tensor-parallel-size", type=_positive, default=1)
    p.add_argument("--decode-context-parallel-size", type=_positive, default=1,
                   help="ranks sharing KV heads split each sequence's positions instead (divides the TP size)")
    p.add_argument("--dcp-kv-cache-interleave-size", type=_positive, default=1,
                   help="consecutive positions kept on one DCP rank (divides --block-size)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "bfloat16", "float16"), default="auto")
    p.add_argument("--num-kv-blocks", type=_positive, default=None, help="KV-cache blocks (default: 1 GiB on CPU)")
    p.add_argument("--weight-dtype", choices=("auto", "bfloat16", "float16"), default="auto")
    p.add_argument("--matmul-precision", choices=("highest", "medium"), default="highest")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (GPU only)")
    p.add_argument("--seed", type=int, default=0)
    return p


def model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model:
        from pathlib import Path
        return Path(args.model).name
    return "SmolLM2-135M-Instruct"


def run_server(args) -> None:
    import uvicorn

    import kvpage
    from .app import build_app

    llm = kvpage.LLM(model=args.model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                     enable_prefix_caching=args.enable_prefix_caching,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                     tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
                     kv_cache_dtype=args.kv_cache_dtype, weight_dtype=args.weight_dtype,
                     matmul_precision=args.matmul_precision, max_model_len=args.max_model_len,
                     enforce_eager=args.enforce_eager,
                     decode_context_parallel_size=args.decode_context_parallel_size,
                     dcp_kv_cache_interleave_size=args.dcp_kv_cache_interleave_size)
    try:
        app = build_app(llm, model_name(args), api_key=args.api_key,
                        max_waiting_requests=args.max_waiting_requests)
        logger.warning("kvpage serve: %s on http://%s:%d/v1", model_name(args), args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        llm.shutdown()
