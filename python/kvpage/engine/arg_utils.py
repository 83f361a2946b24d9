"""Every engine option declared once (vLLM's EngineArgs pattern): name, type, default and help, from which
LLM(...)'s keywords, defaults and signature, and the flags of `kvpage serve / generate / chat / bench / demo`
with their `--help`, are generated.

Pure Python (no torch): the command line checks its flags with it before the model loads. The values are
checked again, with the messages users of `LLM(...)` get, by LLM itself."""
from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, field, make_dataclass, replace

from kvpage.spec_decode.config import speculative_config_arg  # [spec decode] pure Python

# The scheduler's budgets where LLM(...) is given None.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256
# `kvpage serve`'s own defaults where they differ (vLLM's defaults per usage context): every stream waits for each
# step, so a step's prompt tokens are every stream's inter-token gap. While prompts keep arriving, a full budget is
# mostly prompt tokens, and a long step lets in the prompts that fill the next one; a smaller budget bounds the gap
# for a few more (cheap) steps. Offline generation keeps the larger budget.
SERVE_DEFAULTS = {"max_num_batched_tokens": 768}
# Tokens per KV block where block_size is None.
DEFAULT_BLOCK_SIZE = 16
# The host pool for swap preemption where swap_space_gib is None.
DEFAULT_SWAP_SPACE_GIB = 0.5
# The dtype options' names (vLLM's), each with the torch dtype it names (None: the model's own, the weights as
# loaded): the one table, which kvpage.model.runner turns into torch dtypes.
KV_CACHE_DTYPE_NAMES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "bfloat16": "bfloat16",
                        "float16": "float16"}
WEIGHT_DTYPE_NAMES = {"auto": None, "bfloat16": "bfloat16", "float16": "float16"}
MATMUL_PRECISIONS = ("highest", "medium")  # torch.set_float32_matmul_precision's names


def positive_int(text: str) -> int:
    """argparse type: checked at parse time, so the error names the flag and shows the command's usage."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


@dataclass(frozen=True)
class EngineOption:
    """One LLM(...) keyword. type: the command line's parser for it (bool: a switch); a help whose default
    is not the value itself (None: something chosen later) says it in words, "(default: ...)"."""
    name: str
    type: object
    default: object
    help: str
    choices: tuple | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


ENGINE_OPTIONS = (
    EngineOption("model", str, None, "a local HF model directory; nothing is downloaded (default: the embedded"
                 " SmolLM2-135M-Instruct)"),
    EngineOption("block_size", positive_int, DEFAULT_BLOCK_SIZE, "tokens per KV block (a power of two up to 256)"),
    EngineOption("num_kv_blocks", positive_int, None, "KV-cache blocks (default: what the memory budget holds:"
                 " 1 GiB on a CPU, half the free memory on a GPU)"),
    EngineOption("enable_prefix_caching", bool, True, "reuse the KV blocks of a prompt prefix computed before"),
    EngineOption("max_num_batched_tokens", positive_int, None,
                 f"tokens one step may compute (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})"),
    EngineOption("max_num_seqs", positive_int, None,
                 f"sequences one step may run (default: {DEFAULT_MAX_NUM_SEQS})"),
    EngineOption("max_model_len", positive_int, None, "context limit, prompt + output, at most the model's"
                 " (default: the model's max_position_embeddings)"),
    EngineOption("preemption_mode", str, None, "how a preempted sequence gives back its blocks (default: per"
                 " victim, whichever the measured cost model says is cheaper)", ("swap", "recompute")),
    EngineOption("swap_space_gib", non_negative_float, None, "host memory for swapped-out KV blocks, GiB"
                 f" (default: {DEFAULT_SWAP_SPACE_GIB})"),
    EngineOption("dtype", str, None, "the model's dtype (default: auto, as its weights are stored)",
                 ("auto", "float32", "float16", "bfloat16")),
    EngineOption("kv_cache_dtype", str, "auto", "fp8: K/V stored as float8_e4m3fn, 4x the tokens of fp32;"
                 " bfloat16 / float16: 2x (CPU, float32 model); neither is token-identical",
                 tuple(KV_CACHE_DTYPE_NAMES)),
    EngineOption("weight_dtype", str, "auto", "bfloat16 / float16: the weights rounded to and stored in 16 bits,"
                 " computed in float32 (CPU, float32 model): half the bytes a decode step streams",
                 tuple(WEIGHT_DTYPE_NAMES)),
    EngineOption("matmul_precision", str, "highest", "medium: the linear layers compute with bf16 dot products"
                 " where the CPU has AVX512-BF16 (weights and inputs rounded to bf16), not token-identical",
                 MATMUL_PRECISIONS),
    EngineOption("enforce_eager", bool, False, "no CUDA graphs for decode steps (GPU only; the CPU always runs"
                 " eagerly)"),
    EngineOption("tensor_parallel_size", positive_int, 1, "processes splitting each layer's heads (one per GPU;"
                 " on a CPU, the cores shared out)"),
    EngineOption("decode_context_parallel_size", positive_int, 1, "ranks sharing KV heads split each sequence's"
                 " positions instead (divides the TP size)"),
    EngineOption("dcp_kv_cache_interleave_size", positive_int, 1, "consecutive positions kept on one DCP rank"
                 " (divides --block-size)"),
    EngineOption("max_logprobs", int, 20, "the most logprobs a request may ask for (-1: no cap)"),
    EngineOption("seed", int, 0, "the engine's sampling seed: the same workload gives the same tokens"),
    # [kv tier] (kvpage.kv_offload)
    EngineOption("kv_offloading_size", non_negative_float, None, "GiB of a second KV tier behind the prefix cache,"
                 " holding the blocks its LRU evicts: files under --kv-offloading-dir, else host memory (default:"
                 " 4 with a directory, else no tier)"),
    EngineOption("kv_offloading_dir", str, None, "a directory for the KV tier's block files, kept across restarts"
                 " (a new server with the same model starts warm; default: no disk tier)"),
    # [spec decode] (kvpage.spec_decode)
    EngineOption("speculative_config", speculative_config_arg, None, "speculative decoding, vLLM's JSON:"
                 ' {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": A, "prompt_lookup_max": B}'
                 ' or {"method": "draft_model", "model": DIR, "num_speculative_tokens": K} (default: none)'),
)
OPTIONS = {option.name: option for option in ENGINE_OPTIONS}
# What LLM(...) takes when a keyword is left out (tests/cli/test_engine_args.py holds LLM's signature to it).
ENGINE_DEFAULTS = {option.name: option.default for option in ENGINE_OPTIONS}

# One LLM's option values: a field per declared option, with its default.
EngineOptions = make_dataclass("EngineOptions", [(o.name, object, field(default=o.default)) for o in ENGINE_OPTIONS],
                               frozen=True)


def engine_options(caller: str, kwargs: dict) -> EngineOptions:
    """kwargs as EngineOptions; a keyword that is no engine option is a TypeError naming it, as Python's own."""
    for name in kwargs:
        if name not in OPTIONS:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    return EngineOptions(**kwargs)


# The constant each None default above stands for (the other None defaults are chosen from the model or machine).
FALLBACKS = {"max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS, "max_num_seqs": DEFAULT_MAX_NUM_SEQS,
             "swap_space_gib": DEFAULT_SWAP_SPACE_GIB}


def with_defaults(options: EngineOptions) -> EngineOptions:
    """options with FALLBACKS in place of None: the one place those defaults are applied."""
    return replace(options, **{name: value for name, value in FALLBACKS.items() if getattr(options, name) is None})


def engine_signature(first: str, *extra: inspect.Parameter) -> inspect.Signature:
    """The signature of a method taking every engine option as a keyword (the option named first also by
    position), then the extra parameters: what help() and IDEs show for LLM(...)."""
    kinds = {first: inspect.Parameter.POSITIONAL_OR_KEYWORD}
    params = [inspect.Parameter(o.name, kinds.get(o.name, inspect.Parameter.KEYWORD_ONLY), default=o.default)
              for o in sorted(ENGINE_OPTIONS, key=lambda o: o.name != first)]
    return inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params, *extra])


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
                    defaults: dict | None = None) -> None:
    """The engine's flags on a command's parser: the options named in only (None: all), less those in skip (a
    command whose own flag has that name, or serve's positional MODEL); defaults: the command's own default for
    an option (SERVE_DEFAULTS), which its --help shows."""
    options = [option for option in ENGINE_OPTIONS if option.name not in skip and (only is None or option.name in only)]
    parser.set_defaults(engine_options=tuple(option.name for option in options))
    for option in options:
        default, text = option.default, option.help
        if defaults and option.name in defaults:
            default = defaults[option.name]
            text = f"{text.split(' (default: ')[0]} (default: {default})"
        if option.type is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(option.flag, action=action, default=default, help=text)
        else:
            parser.add_argument(option.flag, type=option.type, default=default, choices=option.choices, help=text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...)'s keywords from a parsed command line: the engine options add_engine_args gave its command."""
    return {name: getattr(args, name) for name in args.engine_options}
