"""`kvpage serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine loop.

Imports are lazy: the CLI registers `serve` through cli_args without loading torch or FastAPI."""
from .cli_args import add_serve_parser


def __getattr__(name: str):
    if name == "build_app":
        from .app import build_app
        return build_app
    if name == "EngineLoop":
        from .engine_loop import EngineLoop
        return EngineLoop
    raise AttributeError(name)


__all__ = ["build_app", "add_serve_parser", "EngineLoop"]
