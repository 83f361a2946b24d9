"""kvpage's engine on a GPU against HF on the same GPU, in one run: issue 35's four targets and issue 34's beam target.

  python bench/engine_cuda.py                  # every row (~4 min on an H200, inside --budget)
  python bench/engine_cuda.py --rows decode_smollm2,prefix_ttft_8b --rounds 3
  python bench/engine_cuda.py --quick          # tiny shapes, a few tokens: a smoke run (on the CPU without a GPU)

Rows (random-weight HF Llama models built on the device from Llama-3-8B's and SmolLM2-135M's configs,
bf16; nothing is downloaded):
- decode_8b: batch-1 decode, Llama-3-8B shape, kvpage with CUDA graphs, against the weight-read limit:
  the bytes a decode step must read (every weight but the input embedding, of which it reads one row per
  token) over the device-to-device copy bandwidth this run measures (bytes read + written per second).
- decode_smollm2: batch-1 decode, SmolLM2 shape: kvpage with CUDA graphs, kvpage eager
  (enforce_eager=True) and HF `generate(cache_implementation="static")` (which torch.compiles its
  forward on a GPU: its first call, untimed, compiles).
- throughput_8b: 256 requests of 512 random prompt tokens and 256 output tokens each (greedy, no eos),
  Llama-3-8B shape: kvpage against HF `generate_batch` (transformers' continuous batching, its manager
  kept between rounds so only the first, untimed call sizes and warms it), output tokens/s.
- beam_smollm2 (issue 34's target, where decode is not compute-bound): 8 beam-search requests (width 4)
  with 56 sampling requests in one generate, against the 56 and then each beam request alone, SmolLM2
  shape (bench/beam_search.py's runs).
- prefix_ttft_8b: 64 requests sharing a 2,048-token prefix (each with 16 tokens of its own, 1 output
  token), Llama-3-8B shape: time to first token with prefix caching against without (a fresh prefix
  every round, so the cached run computes it once).
Time per output token (TPOT) is the time from a request's first token to its last over the tokens in
between, for kvpage and HF alike (HF's through a streamer), so neither includes its prefill.

Each row alternates its systems over --rounds rounds (median reported, every round kept) and gives a
ratio. Every row is time-boxed (its cap, or what --budget leaves after the later rows' reserves): a row
that times out or raises is recorded with "error" (and what it measured so far) and the run goes on.
The JSON ($OUT/engine_cuda.json, else bench/results/; engine_cuda_quick.json with --quick) is rewritten
after every row. Without CUDA only --quick runs, on the CPU (float32 tiny models): it proves the code.
"""
from __future__ import annotations

import argparse
import gc
import json
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

import kvpage  # noqa: E402
from kvpage import SamplingParams  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 tie_word_embeddings=False)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Sizes:
    """Token counts of every row: the issue's, or a smoke run's."""

    decode_prompt: int = 32
    decode_tokens: int = 128
    num_requests: int = 256
    prompt_len: int = 512
    output_len: int = 256
    prefix_requests: int = 64
    prefix_len: int = 2048
    suffix_len: int = 16
    beam_requests: int = 8
    beam_sampling: int = 56
    beam_len: int = 32  # prompt and max_tokens of every request in beam_smollm2


QUICK_SIZES = Sizes(decode_prompt=8, decode_tokens=8, num_requests=4, prompt_len=16, output_len=8, prefix_requests=4,
                    prefix_len=64, suffix_len=4, beam_requests=2, beam_sampling=6, beam_len=4)
# name -> (seconds it may take at most, seconds reserved for it while earlier rows run)
# Rows run in this order: throughput_8b, the longest (HF's continuous batching), last, where it gets what is left;
# decode_smollm2's box holds HF static generate's first call, which torch.compiles its forward.
ROW_CAPS = {"decode_8b": (60, 30), "prefix_ttft_8b": (60, 30), "decode_smollm2": (150, 60), "beam_smollm2": (40, 15),
            "throughput_8b": (300, 90)}


class RowTimeout(BaseException):
    """Raised by the alarm inside a row; a BaseException, so a peer's `except Exception` cannot swallow it."""


@dataclass
class Run:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    sizes: Sizes
    path: Path
    start: float = field(default_factory=time.perf_counter)
    result: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.result, indent=2, default=str))

    def config(self, shape: dict) -> dict:
        return TINY if self.args.quick else shape

    def model(self, name: str, shape: dict):
        """The random-weight model of `shape`, built once on the device (bf16 there, float32 on a CPU)."""
        if name not in self.models:
            from transformers import AutoModelForCausalLM, LlamaConfig

            config = LlamaConfig(**self.config(shape), eos_token_id=None, bos_token_id=None, pad_token_id=0)
            with torch.device(self.device):
                model = AutoModelForCausalLM.from_config(config, dtype=self.dtype).eval()
            model.generation_config.eos_token_id = None
            self.models[name] = model
        return self.models[name]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models and a few tokens (a smoke run; CPU without CUDA)")
    p.add_argument("--rows", default=",".join(ROW_CAPS), help="comma list of " + ",".join(ROW_CAPS))
    p.add_argument("--rounds", type=int, default=None, help="alternating timed rounds per row (default 2; 1 --quick)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: the rows' caps)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/engine_cuda.json or bench/results/)")
    args = p.parse_args(argv)
    unknown = set(args.rows.split(",")) - set(ROW_CAPS)
    if unknown:
        p.error(f"--rows: unknown {sorted(unknown)}; choose from {','.join(ROW_CAPS)}")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


# -- measuring --------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by one large copy on the device (median of 5)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        synchronize(device)
        t0 = time.perf_counter()
        b.copy_(a)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[1:])


def weight_read_bytes(model) -> int:
    """What one decode step reads: every parameter, but only a row of an input embedding that is not the LM head."""
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def kvpage_tpot(llm, prompt: list[int], n: int) -> float:
    """Seconds per output token of one greedy request, from its first token to its last."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
    end = time.perf_counter()
    assert len(out.outputs[0].token_ids) == n
    return (end - out.metrics["first_token_time"]) / (n - 1)


class _Stamps:
    """A generate() streamer that stamps every put: the prompt first, then each new token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_static_tpot(model, prompt: list[int], n: int) -> float:
    ids = torch.tensor([prompt], device=model.device)
    stamps = _Stamps()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, cache_implementation="static", streamer=stamps, pad_token_id=0)
    assert out.shape[1] - ids.shape[1] == n
    tokens = stamps.times[1:]  # the first put is the prompt
    return (tokens[-1] - tokens[0]) / (len(tokens) - 1)


def kvpage_batch(llm, prompts: list[list[int]], n: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [o.metrics["ttft"] for o in outputs]
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts)}


def hf_generate_batch(model, prompts: list[list[int]], n: int) -> dict:
    """transformers' continuous batching (generate_batch: in transformers 5.17 and 5.25 alike), its manager
    kept for the next call; output tokens/s. Its KV cache is sized for the workload
    (common.hf_continuous_batching_config)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    cb_config = common.hf_continuous_batching_config([len(p) for p in prompts], [n] * len(prompts))
    model.set_attn_implementation("sdpa")
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=config, progress_bar=False, persistent_manager=True,
                                   continuous_batching_config=cb_config)
    seconds = time.perf_counter() - start
    failed = [r for r in results.values() if r.error is not None]
    tokens = sum(len(r.generated_tokens) for r in results.values())
    if len(results) != len(prompts) or failed or tokens != n * len(prompts):
        raise RuntimeError(f"HF generate_batch returned {len(results)} of {len(prompts)} requests, {len(failed)}"
                           f" with errors, {tokens} of {n * len(prompts)} tokens")
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds}


def median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def timed_rounds(run: Run, row: dict, measure, summarize) -> None:
    """row["rounds"]: measure(r) for each round; summarize(row) after every round, so that a row cut short
    by its time box still reports the rounds it finished."""
    row["rounds"] = []
    for r in range(run.args.rounds):
        row["rounds"].append(measure(r))
        summarize(row)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the rows ---------------------------------------------------------------------------------------------


def _llm(run: Run, model, **kwargs) -> kvpage.LLM:
    return kvpage.LLM(model=model, block_size=BLOCK_SIZE, swap_space_gib=0, **kwargs)


def decode_8b(run: Run, row: dict) -> None:
    model = run.model("llama3_8b", LLAMA3_8B)
    s = run.sizes
    llm = _llm(run, model, max_num_seqs=1, num_kv_blocks=64)
    prompt = random_ids(s.decode_prompt, model.config.vocab_size, 0)
    kvpage_tpot(llm, prompt, s.decode_tokens)  # warm-up
    row["weight_read_bytes"] = weight_read_bytes(model)
    row["limit_tpot_s"] = row["weight_read_bytes"] / run.result["copy_bytes_per_s"]
    row["target"] = ">= 0.75 of the weight-read limit"
    timed_rounds(run, row, lambda r: {"kvpage_tpot_s": kvpage_tpot(
        llm, random_ids(s.decode_prompt, model.config.vocab_size, r + 1), s.decode_tokens)}, _summarize_decode_8b)


def _summarize_decode_8b(row: dict) -> None:
    row["kvpage_tpot_s"] = median(row["rounds"], "kvpage_tpot_s")
    row["kvpage_tok_s"] = 1 / row["kvpage_tpot_s"]
    row["fraction_of_weight_read_limit"] = row["limit_tpot_s"] / row["kvpage_tpot_s"]
    row["ratio"] = row["fraction_of_weight_read_limit"]


def decode_smollm2(run: Run, row: dict) -> None:
    model = run.model("smollm2", SMOLLM2)
    s = run.sizes
    engines = {"kvpage_graphs": _llm(run, model, max_num_seqs=1, num_kv_blocks=64),
               "kvpage_eager": _llm(run, model, max_num_seqs=1, num_kv_blocks=64, enforce_eager=True)}
    row["graphs_captured"] = engines["kvpage_graphs"].runner.graphs is not None

    def hf(prompt):
        model.set_attn_implementation("sdpa")  # kvpage's own forward does not read it
        return hf_static_tpot(model, prompt, s.decode_tokens)

    systems = {name: (lambda p, llm=llm: kvpage_tpot(llm, p, s.decode_tokens)) for name, llm in engines.items()}
    systems["hf_static"] = hf
    warm = random_ids(s.decode_prompt, model.config.vocab_size, 0)
    t0 = time.perf_counter()
    for fn in systems.values():  # warm-up: HF's compiles its forward here on a GPU
        fn(warm)
    row["warmup_s"] = time.perf_counter() - t0
    row["target"] = ">= 3x kvpage eager, >= 2x HF static generate (speed-ups, time per token)"

    def measure(r):
        prompt = random_ids(s.decode_prompt, model.config.vocab_size, r + 1)
        order = list(systems) if r % 2 == 0 else list(reversed(systems))  # alternate who goes first
        return {f"{name}_tpot_s": systems[name](prompt) for name in order}

    timed_rounds(run, row, measure, _summarize_decode_smollm2)


def _summarize_decode_smollm2(row: dict) -> None:
    for name in ("kvpage_graphs", "kvpage_eager", "hf_static"):
        row[f"{name}_tpot_s"] = median(row["rounds"], f"{name}_tpot_s")
    row["graphs_vs_eager"] = row["kvpage_eager_tpot_s"] / row["kvpage_graphs_tpot_s"]
    row["graphs_vs_hf_static"] = row["hf_static_tpot_s"] / row["kvpage_graphs_tpot_s"]
    row["ratio"] = row["graphs_vs_hf_static"]


def beam_smollm2(run: Run, row: dict) -> None:
    """Issue 34's beam target on a GPU, bench/beam_search.py's two runs: 8 beam requests (width 4) in one
    generate with 56 sampling requests ("new"), against the 56 and then each beam request alone ("old")."""
    import beam_search

    model = run.model("smollm2", SMOLLM2)
    s = run.sizes
    llm = _llm(run, model, enable_prefix_caching=False, num_kv_blocks=1024)  # both runs compute every prompt
    beam = SamplingParams(beam_width=4, max_tokens=s.beam_len)
    sampling = SamplingParams(temperature=0.8, seed=0, max_tokens=s.beam_len, ignore_eos=True)
    n = s.beam_requests

    def work(r):
        prompts = [random_ids(s.beam_len, model.config.vocab_size, 1000 * r + i) for i in range(n + s.beam_sampling)]
        return prompts[:n], prompts[n:], beam, sampling

    beam_search.run_new(llm, *work(99))  # warm-up
    row["target"] = ">= 3x (old / new time)"

    def measure(r):
        (old_s, old_beams, sampling_s), (new_s, new_beams, _) = beam_search.run_round(llm, work(r), r)
        # Random weights leave near-ties that batch shapes may flip: reported, not required.
        return {"old_s": old_s, "old_sampling_s": sampling_s, "new_s": new_s, "beams_equal": old_beams == new_beams}

    timed_rounds(run, row, measure, _summarize_beam)


def _summarize_beam(row: dict) -> None:
    for key in ("old_s", "old_sampling_s", "new_s"):
        row[key] = median(row["rounds"], key)
    row["beams_equal"] = all(r["beams_equal"] for r in row["rounds"])
    row["ratio"] = row["old_s"] / row["new_s"]


def throughput_8b(run: Run, row: dict) -> None:
    model = run.model("llama3_8b", LLAMA3_8B)
    s = run.sizes
    vocab = model.config.vocab_size
    blocks = s.num_requests * -(-(s.prompt_len + s.output_len) // BLOCK_SIZE) + 64
    llm = _llm(run, model, max_num_seqs=s.num_requests, num_kv_blocks=blocks, max_num_batched_tokens=8192)
    try:
        def workload(seed):
            return [random_ids(s.prompt_len, vocab, seed * 100_000 + i) for i in range(s.num_requests)]

        kvpage_batch(llm, workload(0)[:8], 8)  # warm-up
        if not run.args.quick:  # (a smoke run skips it: ~20 s of HF's manager starting and stopping on a CPU)
            t0 = time.perf_counter()
            hf_generate_batch(model, workload(0), s.output_len)  # sizes and warms HF's manager, kept for the rounds
            row["hf_first_call_s"] = time.perf_counter() - t0
        row["target"] = ">= 2x HF generate_batch output tokens/s"

        def measure(r):
            prompts = workload(r + 1)
            pair = [("kvpage", lambda: kvpage_batch(llm, prompts, s.output_len)),
                    ("hf_generate_batch", lambda: hf_generate_batch(model, prompts, s.output_len))]
            return {name: fn() for name, fn in (pair if r % 2 == 0 else pair[::-1])}

        timed_rounds(run, row, measure, _summarize_throughput)
    finally:
        model.destroy_cached_continuous_batching_manager()


def _summarize_throughput(row: dict) -> None:
    for name in ("kvpage", "hf_generate_batch"):
        row[f"{name}_output_tok_s"] = statistics.median(r[name]["output_tok_s"] for r in row["rounds"])
    row["ratio"] = row["kvpage_output_tok_s"] / row["hf_generate_batch_output_tok_s"]


def prefix_ttft_8b(run: Run, row: dict) -> None:
    model = run.model("llama3_8b", LLAMA3_8B)
    s = run.sizes
    vocab = model.config.vocab_size
    blocks = s.prefix_requests * -(-(s.prefix_len + s.suffix_len + 1) // BLOCK_SIZE) + 64
    engines = {caching: _llm(run, model, max_num_seqs=s.prefix_requests, num_kv_blocks=blocks,
                             max_num_batched_tokens=8192, enable_prefix_caching=caching, enforce_eager=True)
               for caching in (True, False)}

    def requests(seed):
        prefix = random_ids(s.prefix_len, vocab, seed)
        return [prefix + random_ids(s.suffix_len, vocab, seed * 1000 + i + 1) for i in range(s.prefix_requests)]

    for llm in engines.values():
        kvpage_batch(llm, requests(0)[:4], 1)  # warm-up
    row["target"] = ">= 5x lower mean time to first token with prefix caching"

    def measure(r):
        order = (True, False) if r % 2 == 0 else (False, True)
        return {("caching" if c else "no_caching"): kvpage_batch(engines[c], requests(r + 1), 1) for c in order}

    timed_rounds(run, row, measure, _summarize_prefix_ttft)


def _summarize_prefix_ttft(row: dict) -> None:
    for name in ("caching", "no_caching"):
        row[f"{name}_ttft_mean_s"] = statistics.median(r[name]["ttft_mean_s"] for r in row["rounds"])
    row["ratio"] = row["no_caching_ttft_mean_s"] / row["caching_ttft_mean_s"]


ROWS = {"decode_8b": decode_8b, "prefix_ttft_8b": prefix_ttft_8b, "decode_smollm2": decode_smollm2,
        "beam_smollm2": beam_smollm2, "throughput_8b": throughput_8b}


def _alarm(signum, frame):
    raise RowTimeout()


def time_box(run: Run, name: str, later: list[str]) -> int:
    """A row's seconds: its cap, or what the budget leaves after the later rows' reserves (at least 10). A smoke
    run (--quick without --budget) gets 10x the caps: on a loaded CI machine slowness is not its failure."""
    cap = ROW_CAPS[name][0] * (10 if run.args.quick and run.args.budget is None else 1)
    if run.args.budget is not None:
        left = run.args.budget - (time.perf_counter() - run.start) - sum(ROW_CAPS[n][1] for n in later)
        cap = min(cap, int(left))
    return max(cap, 10)


def run_row(run: Run, name: str, later: list[str]) -> dict:
    seconds = time_box(run, name, later)
    row = {"row": name, "time_box_s": seconds}
    run.result["rows"].append(row)
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        ROWS[name](run, row)
    except RowTimeout:
        row["error"] = f"timed out after {seconds} s (the rounds done are kept)"
    except Exception as e:  # recorded; the next row still runs
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
        row["seconds"] = time.perf_counter() - start
        free_memory()
        run.save()
    return row


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        raise SystemExit("engine_cuda: needs CUDA (only --quick runs on a CPU)")
    args.rounds = args.rounds or (1 if args.quick else 2)
    device = torch.device("cuda" if cuda else "cpu")
    path = Path(args.out) if args.out else common.RESULTS_DIR / f"engine_cuda{'_quick' if args.quick else ''}.json"
    run = Run(args, device, torch.bfloat16 if cuda else torch.float32, QUICK_SIZES if args.quick else Sizes(), path)
    import transformers

    run.result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name() if cuda else "cpu",
                  "cpu": common.cpu_model(), "torch": torch.__version__, "transformers": transformers.__version__,
                  "dtype": str(run.dtype), "sizes": run.sizes.__dict__, "rounds": args.rounds, "rows": []}
    run.result["copy_bytes_per_s"] = copy_bandwidth(device, (2 << 30) if cuda and not args.quick else 64 << 20)
    run.save()
    names = args.rows.split(",")
    for i, name in enumerate(names):
        row = run_row(run, name, names[i + 1:])
        figure = f"ratio {row['ratio']:.2f} (target {row['target']})" if "ratio" in row else ""
        print(f"engine_cuda: {name}: {figure} {'ERROR ' + row['error'] if 'error' in row else ''}"
              f" [{row['seconds']:.0f} s]", flush=True)
    run.result["complete"] = not any("error" in r for r in run.result["rows"])
    run.save()
    print(f"wrote {path}", file=sys.stderr)
    if not run.result["complete"]:
        raise SystemExit("engine_cuda: some rows failed (see their 'error')")
    return run.result


if __name__ == "__main__":
    main()
