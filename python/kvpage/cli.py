"""The `kvpage` command: generate, chat, demo, bench, plan (and serve, kvpage.server.cli_args).

Every flag is checked before the model loads (15-30 s for the default model), without importing torch,
so a mistake comes back as one line at once, a mistyped flag with a suggestion; `--help` shows each default.
The engine's flags are generated from their one declaration, kvpage.engine.arg_utils."""
from __future__ import annotations

import argparse
import re
import sys
from contextlib import contextmanager
from pathlib import Path

from kvpage.engine.arg_utils import add_engine_args, engine_kwargs, engine_options, with_defaults

# Ollama's default: it keeps the 135M default model from looping and from repeating its previous answer
# in a conversation (HF generate loops the same way at 1.0). vLLM's default, 1.0, turns it off.
REPETITION_PENALTY = 1.1
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "repetition_penalty",
                   "presence_penalty", "frequency_penalty")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default to its help, unless the help already says it in words (a None
    default: what happens then)."""

    def _get_help_string(self, action):
        return action.help if "(default:" in (action.help or "") else super()._get_help_string(action)


class SuggestingParser(argparse.ArgumentParser):
    """An unknown flag or subcommand gets a "did you mean" from the known ones (Python 3.11's argparse has no
    suggest_on_error)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized_message(extras, self._option_string_actions))
        return namespace, extras

    def error(self, message):
        choice = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            message += did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        self.fail(message)

    def fail(self, message):
        super().error(message)


class CommandParser(SuggestingParser):
    """A subcommand's parser: --help shows every default, and an unknown flag is reported with this
    command's usage (argparse otherwise hands leftovers to the top-level parser, whose usage says nothing
    about the command's flags)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def fail(self, message):
        """argparse's error, under a one-line usage (the full one, every option, is --help's)."""
        positionals = "".join(f" {a.metavar or a.dest}" for a in self._actions if not a.option_strings)
        self.exit(2, f"usage: {self.prog} [options]{positionals}   (--help lists the options)\n"
                     f"{self.prog}: error: {message}\n")


def did_you_mean(word: str, known) -> str:
    import difflib
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unrecognized_message(extras: list[str], known_flags) -> str:
    """Only the unknown flags, each with a suggestion: the words after a mistyped flag are not its value
    (argparse cannot know that), so naming them too would blame the prompt."""
    flags = [word for word in extras if word.startswith("-") and word != "-"]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    names = [f"{flag}{did_you_mean(flag.split('=', 1)[0], known_flags)}" for flag in flags]
    return f"unrecognized arguments: {', '.join(names)}"


def flag_words(message: str) -> str:
    """SamplingParams names its fields (top_p); the user typed flags (--top-p)."""
    return re.sub(rf"\b({'|'.join(SAMPLING_FIELDS)})\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


def sampling_params(args):
    """The sampling flags as SamplingParams, checked (pure Python: no torch, no model)."""
    from kvpage.engine.sampling_params import SamplingParams
    try:
        return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FIELDS if hasattr(args, name)})
    except (ValueError, TypeError) as e:
        raise ValueError(flag_words(str(e))) from None


def check_model_dir(model: str | None) -> None:
    if model is not None and not (Path(model) / "config.json").is_file():
        raise ValueError(f"--model {model}: not a local HF model directory (it has no config.json); nothing is"
                         f" downloaded, leave --model out for the embedded default")


def _llm(args):
    check_model_dir(args.model)
    # On stderr, so that stdout holds only the answer; the first load converts the wheel's GGUF.
    print(f"kvpage: loading {args.model or 'the default model, SmolLM2-135M-Instruct'} ...",
          file=sys.stderr, flush=True)
    import kvpage
    return kvpage.LLM(**engine_kwargs(args))


@contextmanager
def _serving_llm(args):
    """The command's LLM, shut down when the command ends (tensor-parallel workers stop with it)."""
    llm = _llm(args)
    try:
        yield llm
    finally:
        llm.shutdown()


def cmd_generate(args) -> None:
    """One prompt, its answer streamed (kvpage.commands.generate); a prompt longer than the model's context
    is refused before the model loads."""
    from kvpage.commands.generate import check_prompt_fits, run_generate
    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    params = sampling_params(args)
    check_model_dir(args.model)
    check_prompt_fits(args.model, args.prompt, args.raw, args.max_model_len)
    with _serving_llm(args) as llm:
        run_generate(llm, args.prompt, params, raw=args.raw, stream=not args.no_stream, show_prompt=args.show_prompt)


def cmd_chat(args) -> None:
    from kvpage.commands.chat import run_chat
    params = sampling_params(args)
    with _serving_llm(args) as llm:
        run_chat(llm, params, show_prompt=args.show_prompt)


def cmd_demo(args) -> None:
    from kvpage.commands.demo import run_demo
    params = sampling_params(args)
    with _serving_llm(args) as llm:
        run_demo(llm, params)


def cmd_bench(args) -> None:
    """kvpage on the benchmark workload; --peers adds the HF baselines and --peer vllm vLLM's CPU backend,
    via bench/engine.py (a source checkout)."""
    if args.peers or args.peer:
        import runpy
        script = Path(__file__).resolve().parents[2] / "bench" / "engine.py"
        if not script.is_file():
            sys.exit("--peers needs a source checkout (bench/engine.py)")
        sys.argv = ([str(script)] + (["--quick"] if args.quick else []) + (["--vllm"] if args.peer == "vllm" else [])
                    + ([] if args.peers else ["--no-hf"]))
        runpy.run_path(str(script), run_name="__main__")
        return
    from kvpage.engine.workload import make_workload, quick_workload, run_kvpage
    with _serving_llm(args) as llm:
        res = run_kvpage(llm, quick_workload() if args.quick else make_workload())
    print(f"{res['output_tokens']} output tokens in {res['seconds']:.2f}s: {res['output_tok_s']:.1f} tok/s;"
          f" TTFT p50 {res['ttft_p50_s']:.3f}s p99 {res['ttft_p99_s']:.3f}s;"
          f" prefix-cache hit rate {res['prefix_cache_hit_rate']:.0%}; preemptions {res['num_preemptions']}")


def cmd_plan(args) -> None:
    """The cost model (kvpage.costmodel) for a model on a device: no model is loaded."""
    from kvpage import costmodel

    dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4, None: None}[args.dtype]
    o = with_defaults(engine_options("plan", engine_kwargs(args)))  # the engine's flags, with the engine's defaults
    workload = costmodel.Workload(
        context_len=args.context, block_size=o.block_size, mean_len=args.mean_len,
        memory_utilization=args.memory_utilization, dtype_bytes=dtype_bytes, prefix_requests=args.prefix_requests,
        prefix_shared_tokens=args.prefix_tokens, max_num_batched_tokens=o.max_num_batched_tokens,
        tensor_parallel_size=o.tensor_parallel_size, decode_context_parallel_size=o.decode_context_parallel_size,
        dcp_kv_cache_interleave_size=o.dcp_kv_cache_interleave_size, decode_batch_size=args.decode_batch_size)
    print(costmodel.plan_text(costmodel.get_model(args.model), costmodel.get_device(args.device), workload))


def _add_engine_flags(p) -> None:
    """Every engine option (kvpage.engine.arg_utils, their one declaration) but the engine's seed: these
    commands' --seed is the sampling seed."""
    add_engine_args(p, skip=("seed",))


def _add_sampling_flags(p, max_tokens: int) -> None:
    """SamplingParams' options under vLLM's names."""
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens in a reply")
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top one's")
    p.add_argument("--repetition-penalty", type=float, default=REPETITION_PENALTY,
                   help="over prompt and output (HF's rule; 1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="over the output, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="over the output, in [-2, 2]")
    p.add_argument("--seed", type=int, default=None, help="a fixed seed repeats a sampled reply"
                   " (default: none, a fresh random stream)")
    p.add_argument("--show-prompt", action="store_true",
                   help="print the full prompt the model reads (chat template applied) before the reply")


def _add_command(sub, name: str, fn, help_: str, **kwargs):
    p = sub.add_parser(name, help=help_, description=help_, **kwargs)
    p.set_defaults(fn=fn)
    return p


def _add_generate_parser(sub) -> None:
    p = _add_command(sub, "generate", cmd_generate, "answer one prompt (a question through the chat template)")
    p.add_argument("prompt", help="the question, or with --raw the text to continue")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template:"
                   " the model continues the text")
    p.add_argument("--no-stream", action="store_true", help="print the answer once, whole, when it is done"
                   " (for scripts), instead of token by token as it comes")
    _add_sampling_flags(p, max_tokens=128)
    _add_engine_flags(p)


def _add_chat_parser(sub) -> None:
    p = _add_command(sub, "chat", cmd_chat, "a conversation, streamed token by token (/help inside)")
    _add_sampling_flags(p, max_tokens=256)
    _add_engine_flags(p)


def _add_demo_parser(sub) -> None:
    p = _add_command(sub, "demo", cmd_demo, "a batch of questions answered at once, greedy, then a summary")
    p.set_defaults(temperature=0.0)
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens in an answer")
    p.add_argument("--repetition-penalty", type=float, default=REPETITION_PENALTY,
                   help="over prompt and output (HF's rule; 1: off)")
    _add_engine_flags(p)


def _add_bench_parser(sub) -> None:
    p = _add_command(sub, "bench", cmd_bench, "throughput on the benchmark workload")
    p.add_argument("--quick", action="store_true", help="a small smoke run")
    p.add_argument("--peers", action="store_true", help="also run the HF baselines (bench/engine.py)")
    p.add_argument("--peer", choices=["vllm"], default=None,
                   help="also run vLLM's CPU backend (its venv: bash bench/peers/setup_vllm.sh),"
                        " prefix caching on and off (bench/engine.py --vllm)")
    _add_engine_flags(p)


def _add_plan_parser(sub) -> None:
    p = _add_command(sub, "plan", cmd_plan, "the cost model's numbers for a model on a device (docs/mathlab.md)")
    p.add_argument("--model", default="llama-3-8b", help="llama-3-8b, smollm2-135m, gemma-2b (MQA)"
                   " or a local HF model directory")
    p.add_argument("--device", default="h100", help="h100, h200, a100, or 'this' (measured now, a few seconds)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="KV and weights dtype (default: bf16 on GPUs, fp32 on 'this')")
    p.add_argument("--context", type=int, default=8192, help="context length reserved per sequence")
    p.add_argument("--mean-len", type=float, default=500.0, help="mean tokens per sequence under paging")
    p.add_argument("--memory-utilization", type=float, default=0.9, help="fraction of device memory for KV")
    p.add_argument("--prefix-requests", type=int, default=50, help="requests sharing one system prompt")
    p.add_argument("--prefix-tokens", type=int, default=2000, help="shared system-prompt tokens")
    add_engine_args(p, only=("block_size", "max_num_batched_tokens", "tensor_parallel_size",
                             "decode_context_parallel_size", "dcp_kv_cache_interleave_size"))
    p.add_argument("--decode-batch-size", type=int, default=1, help="decode tokens per step, for DCP's bytes moved")


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(prog="kvpage", description="paged KV-cache LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    _add_generate_parser(sub)
    _add_chat_parser(sub)
    _add_demo_parser(sub)
    _add_bench_parser(sub)
    _add_plan_parser(sub)
    from kvpage.server.cli_args import add_serve_parser
    add_serve_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, TypeError) as e:
        print(f"kvpage {args.command}: error: {e}", file=sys.stderr)
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
