"""`kvpage serve [MODEL]`: the subcommand's flags (vLLM's names where vLLM has them) and its run."""
from __future__ import annotations

import argparse
import logging

from kvpage.engine.arg_utils import add_engine_args, engine_kwargs, positive_int

logger = logging.getLogger("kvpage.server")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """The server's own flags; the engine's come from their one declaration (kvpage.engine.arg_utils)."""
    what = "an OpenAI-compatible HTTP server (completions, chat, metrics)"
    p = subparsers.add_parser("serve", help=what, description=what)
    p.set_defaults(fn=run_server)
    p.add_argument("model", nargs="?", default=None,
                   help="local HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL's)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes"
                   " (default: none, open)")
    p.add_argument("--max-waiting-requests", type=positive_int, default=None,
                   help="answer 503 while this many requests wait to run (default: unbounded)")
    add_engine_args(p, skip=("model",))
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
    from kvpage.engine.generation_defaults import describe as describe_sampling_defaults
    from .app import build_app

    llm = kvpage.LLM(model=args.model, **engine_kwargs(args))
    try:
        app = build_app(llm, model_name(args), api_key=args.api_key,
                        max_waiting_requests=args.max_waiting_requests)
        logger.warning("kvpage serve: %s on http://%s:%d/v1", model_name(args), args.host, args.port)
        logger.warning("kvpage serve: %s", describe_sampling_defaults(llm.default_sampling_fields))
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        llm.shutdown()
