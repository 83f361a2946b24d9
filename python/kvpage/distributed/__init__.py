"""Tensor parallelism: a single-writer driver (rank 0: scheduler, block tables, sampler) and workers that
only execute its broadcast decisions on their shard of the model (kvpage.model.tensor_parallel).

Two ways to start it, the same code:
- `kvpage.LLM(..., tensor_parallel_size=N)` in any script, notebook or `python -c`: starts N-1 local worker
  processes (`python -m kvpage.distributed`, no re-import of the caller's __main__). On CPU each rank, the
  driver included, runs cores // N torch threads (restored when the LLM shuts down): N ranks of all-core
  OpenMP on one machine would oversubscribe it.
- `torchrun --nproc-per-node N script.py` (and --nnodes for several machines), the script calling
  kvpage.LLM(..., tensor_parallel_size=N) on every rank: rank 0 gets the LLM; the other ranks serve inside the
  constructor and exit the process (SystemExit(0)) when rank 0 shuts down, so code after it runs on rank 0 only.
  torchrun sets OMP_NUM_THREADS=1 per rank unless told otherwise.
Devices: gloo on CPU; a model on CUDA gives NCCL for the model's collectives (rank r on cuda:LOCAL_RANK), the
step broadcast stays on gloo (it is host data either way).

Per step the driver sends one header (12 int64) and one int32 payload (protocol.py); every rank then runs
the same forward pass over its shard, with two all-reduces per layer, one for the embedding, and a gather of
the sampled rows' logits to rank 0.

Failure: a worker that dies is an error at the driver's next collective (its sockets close); one that hangs,
after KVPAGE_TP_TIMEOUT_S seconds (default 60); the driver then kills its workers and raises RuntimeError
naming the rank. Workers exit when the driver dies. LLM.shutdown() (also run on garbage collection and at
exit) stops the workers. KVPAGE_TP_STARTUP_TIMEOUT_S (default 600) bounds model loading in the workers.

    group.py     process groups (private, not torch.distributed's default group), timeouts, torchrun
    protocol.py  one step as a fixed header + one int32 payload
    launcher.py  local worker processes: spawn, liveness, stop
    worker.py    the worker loop (and the start-up handshake both sides run)
    executor.py  the driver: what kvpage.LLM(tensor_parallel_size=N) runs its steps through
"""
from .executor import StepRecord, TensorParallelExecutor, launch

__all__ = ["StepRecord", "TensorParallelExecutor", "launch"]
