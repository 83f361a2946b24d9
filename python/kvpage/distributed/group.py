"""Process groups for one tensor-parallel LLM: a rendezvous store, a gloo group for the driver's step
broadcasts (CPU tensors on either device) and the model's group (the same gloo group on CPU, NCCL on CUDA).

The groups are private backend objects, never torch.distributed's global default group: kvpage coexists with
a caller's own process group (under torchrun too), two tensor-parallel LLMs can live in one process, and
shutting one down leaves nothing global behind.

Timeouts are per rank. The driver's collectives give up after KVPAGE_TP_TIMEOUT_S (a hung worker becomes
an error in bounded time; a dead one fails at once, its sockets close). Workers wait for the next step with
no practical limit, since an idle driver sends nothing; they notice a dead driver through its closed
sockets, and spawned workers also watch their parent process (launcher.py).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Seconds the driver waits in one collective before declaring a worker hung. Ranks do equal work between
# collectives, so a healthy worker is never far behind; the limit only has to cover scheduling noise.
DEFAULT_TIMEOUT_S = 60.0
# Seconds the driver waits for spawned workers to load and shard the model.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
WORKER_TIMEOUT_S = 10 * 365 * 86400.0


def driver_timeout_s() -> float:
    return _env_seconds("KVPAGE_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)


def startup_timeout_s() -> float:
    return _env_seconds("KVPAGE_TP_STARTUP_TIMEOUT_S", DEFAULT_STARTUP_TIMEOUT_S)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {raw!r}")
    return value


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def torchrun_env() -> TorchrunEnv | None:
    """The launcher's layout when this process was started by torchrun (or any env:// launcher)."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    rank = int(env["RANK"])
    return TorchrunEnv(rank, int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", rank)), env["MASTER_ADDR"],
                       int(env["MASTER_PORT"]))


def torchrun_store(env: TorchrunEnv, timeout_s: float) -> dist.Store:
    """The job's store at MASTER_ADDR:MASTER_PORT, as torch's env:// rendezvous finds it: torchrun's agent
    hosts it; under other launchers rank 0 does (multi-tenant, so a caller's init_process_group can share it)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0, timeout=timeout,
                         multi_tenant=True, wait_for_workers=False)


def rendezvous_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """A TCP store for spawned workers (port 0 on the master: the OS picks a free port, see .port)."""
    return dist.TCPStore(host, port, world_size, is_master=is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class Collectives:
    """One process group's collectives, called on the backend object itself (see the module docstring)."""

    def __init__(self, backend, rank: int, world_size: int) -> None:
        self.backend, self.rank, self.world_size = backend, rank, world_size

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.backend.broadcast([t], opts).wait()

    def all_reduce(self, t: torch.Tensor) -> None:
        self.backend.allreduce([t]).wait()

    def gather(self, t: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's t on rank dst (None elsewhere)."""
        opts = dist.GatherOptions()
        opts.rootRank = dst
        outs = [[torch.empty_like(t) for _ in range(self.world_size)]] if self.rank == dst else []
        self.backend.gather(outs, [t], opts).wait()
        return outs[0] if outs else None

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        outs = [[torch.empty_like(t) for _ in range(self.world_size)]]
        self.backend.allgather(outs, [t]).wait()
        return outs[0]

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> None:
        """Equal slices of dim 0: slice j of t goes to rank j, and out's slice i comes from rank i."""
        self.backend.alltoall_base(out, t, [], [], dist.AllToAllOptions()).wait()

    def shutdown(self) -> None:
        """Release the backend's connections (peers blocked on us then fail instead of waiting)."""
        for name in ("shutdown", "abort"):
            fn = getattr(self.backend, name, None)
            if fn is not None:
                try:
                    fn()
                    break
                except Exception:  # already broken: dropping the reference below still closes it
                    continue
        self.backend = None


@dataclass
class TPGroup:
    """This process's place in one tensor-parallel LLM."""

    rank: int
    world_size: int
    device: torch.device
    control: Collectives  # gloo: step broadcasts and start-up handshakes
    model: Collectives  # the model's all-reduces and logits gather
    dcp: Collectives | None = None  # this rank's decode-context-parallel group (ranks sharing its KV heads)
    dcp_size: int = 1

    @property
    def dcp_rank(self) -> int:
        """This rank's index in its DCP group: groups are runs of dcp_size consecutive ranks."""
        return self.rank % self.dcp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def destroy(self) -> None:
        if self.dcp is not None and self.dcp.backend is not None:
            self.dcp.shutdown()
        if self.model is not self.control and self.model.backend is not None:
            self.model.shutdown()
        if self.control.backend is not None:
            self.control.shutdown()


def device_for(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_group(store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float,
               dcp_size: int = 1) -> TPGroup:
    """Create this LLM's groups on `store` (every rank calls it, with the same store namespace); with
    dcp_size > 1 also this rank's DCP group, ranks [g * dcp_size, (g + 1) * dcp_size)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    control = Collectives(dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout),
                          rank, world_size)
    model = control if device.type != "cuda" else _model_group(store, "nccl/", rank, world_size, device, timeout)
    dcp = None
    if dcp_size > 1:
        prefix = f"dcp{rank // dcp_size}/"
        dcp = (_model_group(store, prefix, rank % dcp_size, dcp_size, device, timeout) if device.type == "cuda" else
               Collectives(dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank % dcp_size, dcp_size, timeout),
                           rank % dcp_size, dcp_size))
    return TPGroup(rank, world_size, device, control, model, dcp, dcp_size)


def _model_group(store, prefix: str, rank: int, size: int, device: torch.device, timeout) -> Collectives:
    """NCCL collectives among `size` ranks on the store's `prefix` namespace."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return Collectives(dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, options), rank, size)
