"""Tensor parallelism: what the driver's per-step broadcast costs next to the model, TP=1 vs TP=2.

Workload: kvpage.engine.workload (seed 0), 16 requests sharing a ~120-token system prompt, outputs of 16..48
tokens, greedy, ignore_eos; the default model (SmolLM2-135M-Instruct, fp32, 9 query / 3 KV heads: at TP=2 rank 0
holds 1 KV-head group, rank 1 two). Each TP size gets its own LLM, a warm-up pass over same-shaped prompts, then
the measured pass, recording every step on the driver:
  bytes       header + payload the step broadcasts (at TP=1: what pack_step would send; nothing is sent)
  pack        SchedulerOutput -> header + payload
  broadcast   the two gloo broadcasts (TP=2)
  model       rank 0's unpack + forward + logits (at TP=2 including the waits inside its collectives)
  comm        of model, the time inside the all-reduces and the logits gather (TP=2)
Steps are split into prefill steps (some sequence brings > 1 token) and decode steps. On CPU every rank gets
cores // N threads (both ranks share this machine's cores), TP=1 all cores.

--compare-torch-tp: rank 0's forward pass with kvpage's sharded modules (kvpage.model.tensor_parallel) against
torch.distributed.tensor.parallel (ColwiseParallel / RowwiseParallel on DTensor, the API transformers' tp_plan
uses), 2 processes, on a random SmolLM2-shaped model with 8 query / 2 KV heads (DTensor's equal row blocks
cannot split SmolLM2's 9 heads at head boundaries at all), for a decode and a prefill step.

    python bench/tp.py                      # CPU, TP=1 and TP=2 (a few minutes on 2 cores)
    python bench/tp.py --quick              # 4 short requests: a smoke run
    python bench/tp.py --compare-torch-tp   # also the DTensor comparison
    python bench/tp.py --device cuda        # GPUs, NCCL (needs 2 GPUs; not run in this repository)

Writes bench/results/tp.json (tp_quick.json) and tp.png, and prints tables.
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, add_model_argument, machine_info, print_table, write_json  # noqa: E402

import kvpage  # noqa: E402
from kvpage.distributed import protocol  # noqa: E402
from kvpage.engine.workload import make_workload  # noqa: E402
from kvpage.model.tensor_parallel import CommTimer  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _record_tp1(llm, device: str) -> list[dict]:
    """Wrap the TP=1 runner: model time per step, and what the step would broadcast at TP > 1."""
    records, real = [], llm.runner.execute

    def execute(batch):
        t0 = time.perf_counter()
        h, payload = protocol.pack_step(batch, 0, llm.runner.block_size)
        t1 = time.perf_counter()
        out = real(batch)
        _sync(device)
        t2 = time.perf_counter()
        records.append(dict(prefill=any(len(s.token_ids) > 1 for s in batch.scheduled),
                            tokens=sum(len(s.token_ids) for s in batch.scheduled),
                            bytes=protocol.message_bytes(h, payload), pack_s=t1 - t0, broadcast_s=0.0,
                            model_s=t2 - t1, comm_s=0.0))
        return out

    llm.runner.execute = execute
    return records


def _tp_records(log) -> list[dict]:
    return [dict(prefill=r.num_tokens > r.num_seqs, tokens=r.num_tokens, bytes=r.broadcast_bytes, pack_s=r.pack_s,
                 broadcast_s=r.broadcast_s, model_s=r.model_s, comm_s=r.comm_s) for r in log]


def _summary(records: list[dict], prefill: bool) -> dict:
    rows = [r for r in records if r["prefill"] == prefill]
    if not rows:
        return {"steps": 0}
    mean = lambda k: statistics.fmean(r[k] for r in rows)  # noqa: E731
    out = {"steps": len(rows), "tokens_per_step": mean("tokens"), "bytes_per_step": mean("bytes")}
    for k in ("pack_s", "broadcast_s", "model_s", "comm_s"):
        out[k.replace("_s", "_ms")] = 1e3 * mean(k)
    out["broadcast_over_model"] = out["broadcast_ms"] / out["model_ms"]
    return out


def run_size(size: int, workload, prompts, warmup, device: str, threads: int | None = None,
             model_path: str | None = None) -> dict:
    """threads: torch threads at TP=1 (None: as the process has them); TP > 1 sets its own per rank.
    model_path: --model's directory (None: the default model)."""
    from kvpage.engine.workload import Workload, run_kvpage

    threads_before = torch.get_num_threads()
    if size == 1 and threads:
        torch.set_num_threads(threads)

    model = model_path
    if device == "cuda":
        from kvpage.model import load_model
        model = load_model(model_path)[0].to("cuda")
    llm = kvpage.LLM(model=model, tensor_parallel_size=size, num_kv_blocks=2048)
    threads_per_rank = torch.get_num_threads()
    run_kvpage(llm, Workload(warmup, workload.output_lens))  # one-time costs, nothing cached to hit later
    if size == 1:
        records = _record_tp1(llm, device)
    else:
        llm.runner.step_log = []
        CommTimer.enabled, _ = True, CommTimer.reset()
    result = run_kvpage(llm, Workload(prompts, workload.output_lens))
    if size > 1:
        records = _tp_records(llm.runner.step_log)
        CommTimer.enabled = False
    stats = llm.stats()
    llm.shutdown()
    del llm
    gc.collect()
    torch.set_num_threads(threads_before)
    return {"tensor_parallel_size": size, "threads_per_rank": threads_per_rank,
            "output_tok_s": result["output_tok_s"], "seconds": result["seconds"],
            "kv_cache_bytes_per_rank": stats["kv_cache_bytes_per_rank"], "num_kv_blocks": stats["num_kv_blocks"],
            "prefill": _summary(records, True), "decode": _summary(records, False)}


# -- kvpage modules vs torch.distributed.tensor.parallel ---------------------------------------------


def _compare_config():
    from transformers import AutoConfig

    from kvpage.model.loader import default_model_dir

    config = AutoConfig.from_pretrained(str(default_model_dir()))
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 2, 64
    return config


def _compare_rank(rank: int, port: int, device: str, iters: int, out) -> None:
    """One rank of the comparison; rank 0 puts its timings on `out` (a multiprocessing queue)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    from kvpage.distributed.group import device_for, init_group
    from kvpage.model import ModelInput, ModelRunner, SequenceInput, set_kvpage_attention
    from kvpage.model.tensor_parallel import ShardPlan, set_process_group, shard_model

    torch.set_num_threads(max(1, torch.get_num_threads() // 2) if device == "cpu" else torch.get_num_threads())
    dev = device_for(device, rank)
    tcp = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo" if device == "cpu" else "nccl", store=dist.PrefixStore("pg/", tcp), rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    full = LlamaForCausalLM(_compare_config()).eval()
    set_kvpage_attention(full)
    plan = ShardPlan.build(full.config, 2)
    local_kv = plan.ranks[rank].num_kv_heads

    ours = shard_model(copy.deepcopy(full), plan, rank).to(dev)
    set_process_group(ours, init_group(dist.PrefixStore("kv/", tcp), rank, 2, dev, 120).model)

    theirs = copy.deepcopy(full).to(dev)
    mesh = init_device_mesh(device, (2,))
    layer_plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                  "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                  "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                  "mlp.down_proj": RowwiseParallel()}
    for layer in theirs.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    from torch.distributed.tensor import Replicate
    parallelize_module(theirs, mesh, {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                      "lm_head": ColwiseParallel(output_layouts=Replicate())})

    block = 16
    def batch(num_seqs, query_len, context):
        seqs = []
        width = (context + query_len) // block + 1
        for i in range(num_seqs):
            table = list(range(i * width, (i + 1) * width))
            slots = [table[p // block] * block + p % block for p in range(context, context + query_len)]
            seqs.append(SequenceInput([(7 * i + j) % 1000 + 3 for j in range(query_len)], context, table, slots))
        return ModelInput(seqs)

    steps = {"decode 16 seqs x 1 token, 128 context": batch(16, 1, 128),
             "prefill 4 seqs x 128 tokens": batch(4, 128, 0)}
    results = {}
    for name, model in (("kvpage modules", ours), ("torch DTensor TP", theirs)):
        runner = ModelRunner(model, 16 * 10, block, num_kv_heads=local_kv)
        for label, step in steps.items():
            if label.startswith("decode"):  # fill the context the decode step attends to
                runner.execute(batch(16, 128, 0))
            logits = runner.execute(step)
            times = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                runner.execute(step)
                _sync(device)
                times.append(time.perf_counter() - t0)
            results[(name, label)] = (statistics.median(times), logits.float().cpu())
        del runner
    if rank == 0:
        rows = []
        for label in steps:
            a, b = results[("kvpage modules", label)], results[("torch DTensor TP", label)]
            rows.append({"step": label, "kvpage_ms": round(1e3 * a[0], 2), "dtensor_ms": round(1e3 * b[0], 2),
                         "dtensor_over_kvpage": round(b[0] / a[0], 3),
                         "max_logit_diff": float((a[1] - b[1]).abs().max())})
        out.put(rows)
    dist.destroy_process_group()


def compare_torch_tp(device: str, iters: int) -> list[dict]:
    import torch.multiprocessing as mp

    from kvpage.distributed.group import rendezvous_store

    port = rendezvous_store("127.0.0.1", 0, 1, True, 5).port  # a free port (this store closes on return)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_compare_rank, args=(r, port, device, iters, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=1800)
    for p in procs:
        p.join()
    return rows


# -- report ------------------------------------------------------------------------------------------


def plot(results: list[dict], path) -> None:
    """Top: where a step's time goes on the driver. Bottom: the broadcast alone, on its own scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), gridspec_kw={"height_ratios": [3, 2]})
    labels = [f"TP={r['tensor_parallel_size']}\n{r['threads_per_rank']} thr/rank" for r in results]
    for col, phase in enumerate(("prefill", "decode")):
        get = lambda key: [r[phase].get(key, 0.0) for r in results]  # noqa: E731
        comm = get("comm_ms")
        compute = [m - c for m, c in zip(get("model_ms"), comm)]
        top, bottom = axes[0][col], axes[1][col]
        top.bar(labels, compute, label="model compute")
        top.bar(labels, comm, bottom=compute, label="inside model collectives")
        top.set_title(f"{phase} steps: mean ms per step on the driver", fontsize=10)
        bcast = [p + b for p, b in zip(get("pack_ms"), get("broadcast_ms"))]
        bottom.bar(labels, bcast, color="tab:green")
        for i, r in enumerate(results):
            ratio = bcast[i] / r[phase]["model_ms"] if r[phase].get("model_ms") else 0.0
            bottom.annotate(f"{r[phase].get('bytes_per_step', 0) / 1024:.1f} KiB, {100 * ratio:.2f}% of model",
                            (i, bcast[i]), ha="center", va="bottom", fontsize=8)
        bottom.set_title(f"{phase}: pack + broadcast ms per step (TP=1: pack only)", fontsize=10)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M fp32 on CPU: per-step broadcast vs model time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 short requests (smoke run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to run (default 1,2)")
    parser.add_argument("--tp1-threads", default="",
                        help="comma list: run TP=1 once per torch thread count (default: once, all threads)")
    parser.add_argument("--compare-torch-tp", action="store_true", help="also kvpage modules vs DTensor TP")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per step (--compare-torch-tp)")
    add_model_argument(parser)
    args = parser.parse_args(argv)
    workload = make_workload(4, 8, 16) if args.quick else make_workload(16, 16, 48)
    tokenizer = kvpage.model.load_model(args.model)[1]
    prompts = [tokenizer.encode(p) for p in workload.prompts]
    marker = tokenizer.encode("Note:", add_special_tokens=False)[0]
    warmup = [[marker] + p[1:] for p in prompts]
    results = []
    tp1_threads = [int(t) for t in args.tp1_threads.split(",") if t] or [None]
    for size in (int(s) for s in args.sizes.split(",")):
        for threads in (tp1_threads if size == 1 else [None]):
            res = run_size(size, workload, prompts, warmup, args.device, threads, args.model)
            results.append(res)
            print(f"TP={size} ({res['threads_per_rank']} threads per rank): {res['output_tok_s']:.1f} output tok/s"
                  f" ({res['seconds']:.1f} s)", flush=True)
    columns = ["tp", "threads", "phase", "steps", "tokens_per_step", "bytes_per_step", "pack_ms", "broadcast_ms", "model_ms",
               "comm_ms", "broadcast_over_model"]
    rows = []
    for r in results:
        for phase in ("prefill", "decode"):
            s = r[phase]
            rows.append({"tp": r["tensor_parallel_size"], "threads": r["threads_per_rank"], "phase": phase,
                         "steps": s["steps"],
                         **{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in s.items() if k != "steps"}})
    print_table(rows, columns)
    print_table([{"tp": r["tensor_parallel_size"], "threads": r["threads_per_rank"],
                  "output_tok_s": f"{r['output_tok_s']:.1f}",
                  "num_kv_blocks": r["num_kv_blocks"],
                  "kv_cache_MiB_per_rank": "/".join(f"{b / 2**20:.0f}" for b in r["kv_cache_bytes_per_rank"])}
                 for r in results], ["tp", "threads", "output_tok_s", "num_kv_blocks", "kv_cache_MiB_per_rank"])
    payload = {"machine": machine_info(), "device": args.device, "workload": {
        "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": workload.num_output_tokens},
        "results": results}
    if args.compare_torch_tp:
        payload["torch_tp_comparison"] = compare_torch_tp(args.device, args.iters)
        print_table(payload["torch_tp_comparison"],
                    ["step", "kvpage_ms", "dtensor_ms", "dtensor_over_kvpage", "max_logit_diff"])
    name = "tp_quick" if args.quick else "tp"
    print(f"wrote {write_json(name, payload)}")
    plot(results, RESULTS_DIR / f"{name}.png")
    return payload


if __name__ == "__main__":
    main()
