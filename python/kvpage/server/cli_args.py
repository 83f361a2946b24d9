"""`kvpage serve [MODEL]`: the subcommand's flags (vLLM's names where vLLM has them) and its run."""
from __future__ import annotations

import argparse
import logging
import socket

from kvpage.engine.arg_utils import SERVE_DEFAULTS, add_engine_args, engine_kwargs, positive_int

logger = logging.getLogger("kvpage.server")


def _port(text: str) -> int:
    """argparse type: a TCP port, so that --port 99999 ends at parse time naming the flag (uvicorn's
    OverflowError came only after the model had loaded)."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {value}")
    return value


def _api_key(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """The server's own flags; the engine's come from their one declaration (kvpage.engine.arg_utils)."""
    what = "an OpenAI-compatible HTTP server (completions, chat, metrics)"
    p = subparsers.add_parser("serve", help=what, description=what)
    p.set_defaults(fn=run_server)
    p.add_argument("model", nargs="?", default=None,
                   help="local HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_port, default=8000, help="the port to listen on")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL's)")
    p.add_argument("--api-key", type=_api_key, default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: none, open)")
    p.add_argument("--metrics-without-auth", action="store_true",
                   help="with --api-key: serve /metrics without the key too (a Prometheus scraper that sends none)")
    p.add_argument("--max-request-body-bytes", type=positive_int, default=None,
                   help="answer 413 to a larger request body, before reading the rest of it (default: 256 bytes"
                        " per token of the context length, at least 1 MiB)")
    p.add_argument("--max-waiting-requests", type=positive_int, default=None,
                   help="answer 503 while this many requests wait to run (default: unbounded)")
    p.add_argument("--engine-core", choices=("process", "inprocess"), default="process",
                   help="where the engine core (scheduler, runner, detokenizer) runs: a process of its own, so that"
                        " HTTP never competes with a step for the GIL (default), or a thread of the server's"
                        " process")
    add_engine_args(p, skip=("model",), defaults=SERVE_DEFAULTS)  # the server's own budgets
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

    from kvpage.engine.core_client import make_engine_core_client
    from kvpage.engine.generation_defaults import describe as describe_sampling_defaults
    from .app import build_app

    sock = bind(args.host, args.port)  # before the model loads: a busy port is told in a second, not a minute
    try:
        # The options' refusals (ValueError / TypeError) come back from a process core as they are (status 2).
        try:
            client = make_engine_core_client(args.engine_core, args.model, engine_kwargs(args))
        except RuntimeError as e:  # the engine core did not start: its reason, in one line
            raise SystemExit(f"kvpage serve: error: {e}") from None
        died: list[Exception] = []

        def exit_on_engine_death(error: Exception) -> None:
            # Its requests were failed already; uvicorn closes the connections and returns: status 1 below,
            # so that a supervisor restarts the server rather than it answering 503 forever.
            died.append(error)
            server.should_exit = True
        try:
            app = build_app(client, model_name(args), api_key=args.api_key,
                            max_waiting_requests=args.max_waiting_requests,
                            max_request_body_bytes=args.max_request_body_bytes,
                            metrics_without_auth=args.metrics_without_auth, on_engine_dead=exit_on_engine_death)
            logger.warning("kvpage serve: %s on http://%s:%d/v1 (engine core: %s)", model_name(args), args.host,
                           args.port, args.engine_core)
            logger.warning("kvpage serve: %s", describe_sampling_defaults(client.info.sampling_defaults))
            server = uvicorn.Server(uvicorn.Config(app, log_level="info"))
            server.run(sockets=[sock])
            if died:
                raise SystemExit(f"kvpage serve: error: {died[0]}")
        finally:
            client.shutdown()
            if getattr(client, "llm", None) is not None:
                client.llm.shutdown()
    finally:
        sock.close()


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound but not yet listening (nobody connects before the app is up). A busy
    port or an unknown host ends the command with one line (status 1) before anything loads."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise SystemExit(f"kvpage serve: error: cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise SystemExit(f"kvpage serve: error: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
