"""A deterministic stand-in for the model runner, and a driver loop that checks every step.

The fake KV cache holds one token id per slot. The runner executes a SchedulerOutput the way the
real one would (swap out, swap in, copy-on-write copies, then write this step's tokens through the
slot mapping), then reads every sequence's whole context back through its block table and samples
from a hash of what it read. So a wrong block table, slot mapping, copy or swap changes the output
tokens, and the expected output of any request is a pure function of its prompt (`expected_outputs`).

A hybrid layout (sliding_windows with a window per KV-cache group) writes through every group's slot
mapping and reads, in each window group, exactly the positions the step's queries can see: a block
freed too early (NULL_BLOCK, or reused by another sequence) fails the check against the scheduler's
tokens. The sample comes from a full group's read (the whole context).
"""
from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass, field

from kvpage.core import NULL_BLOCK, BlockManager, Scheduler, SchedulerOutput, check_block_manager, kv_cache_layout

VOCAB = 64
EOS = 0
# KV-cache layouts the scheduler tests run on: one full group (None: the default), hybrid ones with a
# full group and one or two windows, and one with windows only (the sample then comes from the tokens).
LAYOUTS = (None, kv_cache_layout([None, 4, 4, None]), kv_cache_layout([None, 3, 7]), kv_cache_layout([5, 5]))


def sample(context: list[int], index: int = 0) -> int:
    """The fake model: a token id from a hash of the whole context (and the sample index, for n > 1)."""
    return zlib.crc32(array("q", context).tobytes() + bytes([index])) % VOCAB


def expected_outputs(prompt: list[int], max_tokens: int, n: int = 1, eos: int | None = EOS,
                     stop_token_ids=(), max_model_len: int | None = None) -> list[list[int]]:
    """What any correct schedule produces: the n samples' output token ids, in fork order."""
    stops = set(stop_token_ids) | ({eos} if eos is not None else set())
    outputs = []
    for j in range(n):
        out = [sample(prompt, j)]
        while out[-1] not in stops and len(out) < max_tokens and (
                max_model_len is None or len(prompt) + len(out) < max_model_len):
            out.append(sample(prompt + out))
        outputs.append(out)
    return outputs


class FakeRunner:
    def __init__(self, block_size: int, sliding_windows: tuple = (None,)) -> None:
        self.block_size = block_size
        self.sliding_windows = tuple(sliding_windows)
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def _block(self, kv: dict, block_id: int) -> list:
        return kv.setdefault(block_id, [None] * self.block_size)

    def execute(self, out: SchedulerOutput, expected_tokens=None) -> dict[int, list[int]]:
        """Run one step; `expected_tokens(seq_id)` (optional) gives the scheduler's view to check against."""
        for dev, host in out.blocks_to_swap_out:
            self.host[host] = list(self._block(self.device, dev))
        for host, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self.host[host])
        srcs = [list(self._block(self.device, src)) for src, _ in out.blocks_to_copy]
        for (_, dst), contents in zip(out.blocks_to_copy, srcs):  # one kernel: all reads before writes
            self.device[dst] = contents
        bs = self.block_size
        for s in out.scheduled:  # writes first: the real forward pass writes K/V, then attends
            assert len(s.block_tables) == len(s.slot_mappings) == len(self.sliding_windows)
            assert s.block_tables[0] == s.block_table and s.slot_mappings[0] == s.slot_mapping
            for slots in s.slot_mappings:
                assert len(slots) == len(s.token_ids) == s.num_scheduled_tokens
                for slot, token in zip(slots, s.token_ids):
                    if slot >= 0:
                        self._block(self.device, slot // bs)[slot % bs] = token
        sampled = {}
        for s in out.scheduled:
            context = None
            for table, window in zip(s.block_tables, self.sliding_windows):
                first = 0 if window is None else max(0, s.start - window + 1)  # the step's first query's window
                assert NULL_BLOCK not in table[first // bs:], f"seq {s.seq_id}: a block its window reads is NULL"
                read = [self.device[table[p // bs]][p % bs] for p in range(first, s.context_len)]
                if expected_tokens is not None:
                    assert read == expected_tokens(s.seq_id)[first:s.context_len], f"seq {s.seq_id}: cache disagrees"
                if window is None:
                    context = read
            if context is None:  # every group has a window: the whole context is in no cache
                context = list(expected_tokens(s.seq_id)[:s.context_len])
            if s.do_sample:
                samples = [sample(context, j) for j in range(s.num_samples)]
                sampled[s.seq_id] = samples[0] if s.num_samples == 1 else samples
        return sampled


@dataclass
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    n: int = 1
    abort_at: int | None = None  # the step at which to abort it, if any
    prompt_logits: bool = False  # prompt_logprobs: the prompt's logits come back, each position once


@dataclass
class RunResult:
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    statuses: dict = field(default_factory=dict)
    latency: dict[str, int] = field(default_factory=dict)  # steps from arrival to finish
    wait: dict[str, int] = field(default_factory=dict)  # steps from arrival to first scheduled token
    num_steps: int = 0
    total_scheduled_tokens: int = 0
    rejected: list[str] = field(default_factory=list)
    num_failed_steps: int = 0
    # Per prompt_logits request, the prompt positions whose logits taken steps returned, in order.
    prompt_logit_positions: dict[str, list[int]] = field(default_factory=dict)


def check_output(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Budgets hold and each scheduled sequence's data agrees with the scheduler's state."""
    cfg = scheduler.config
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert out.num_seqs <= cfg.max_num_seqs
    assert len({s.seq_id for s in out.scheduled}) == out.num_seqs, "a sequence scheduled twice"
    for s in out.scheduled:
        assert s.num_scheduled_tokens >= 1
        seq = scheduler._seqs[s.seq_id]
        assert s.start == seq.num_computed_tokens and s.context_len <= seq.num_tokens
        assert s.do_sample == (s.context_len == seq.num_tokens)
        request = scheduler.requests[s.request_id]
        if request.prompt_logits_pending:  # no prefix hit, no chunk, may skip a position still owed
            assert s.start <= request.num_prompt_logits_done
            assert s.prompt_logit_positions.start == max(s.start, request.num_prompt_logits_done)
        assert s.prompt_logit_positions == request.prompt_logit_positions(s.start, s.context_len)
    assert not (out.blocks_to_swap_in and out.preempted), "swap-in in a step that preempted"
    # Sources may repeat (two victims sharing a prefix-cache block each take a host copy); targets may not.
    for pairs in (out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy):
        targets = [dst for _, dst in pairs]
        assert len(set(targets)) == len(targets), "a block is written twice in one step"


def all_seqs(scheduler: Scheduler):
    return [seq for r in scheduler.requests.values() for seq in r.live_seqs()]


class StepFailed(Exception):
    """A runner's failure, injected by a test."""


def drive(scheduler: Scheduler, arrivals: list[Arrival], max_steps: int = 100_000,
          check_every_step: bool = True, eos: int | None = EOS,
          allow_rejects: bool = False, runner: FakeRunner | None = None) -> RunResult:
    """Feed arrivals at their steps, run until everyone finishes, checking invariants throughout.
    A step whose runner raises StepFailed is discarded (Scheduler.discard_step) and the run goes on."""
    runner = runner or FakeRunner(scheduler.bm.block_size, scheduler.bm.sliding_windows)
    pending = sorted(arrivals, key=lambda a: a.step)
    aborts = {a.abort_at: [] for a in arrivals if a.abort_at is not None}
    for a in arrivals:
        if a.abort_at is not None:
            aborts[a.abort_at].append(a.request_id)
    result, requests = RunResult(), {}
    step = 0
    while pending or scheduler.has_unfinished_requests():
        assert step < max_steps, "the workload did not finish"
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            try:
                requests[a.request_id] = scheduler.add_request(a.request_id, a.prompt, max_tokens=a.max_tokens,
                                                               n=a.n, eos_token_id=eos,
                                                               prompt_logits=a.prompt_logits)
                if a.prompt_logits:
                    result.prompt_logit_positions[a.request_id] = []
            except ValueError:
                if not allow_rejects:
                    raise
                result.rejected.append(a.request_id)
        for request_id in aborts.get(step, []):
            scheduler.abort_request(request_id)
        out = scheduler.schedule()
        check_output(scheduler, out)
        try:
            sampled = runner.execute(out, lambda seq_id: scheduler._seqs[seq_id].token_ids)
        except StepFailed:
            assert scheduler.discard_step(out)
            result.num_failed_steps += 1
        else:
            result.total_scheduled_tokens += out.num_batched_tokens
            scheduler.update_from_output(out, sampled)
            for s in out.scheduled:
                if s.prompt_logit_positions and s.request_id in result.prompt_logit_positions:
                    result.prompt_logit_positions[s.request_id] += s.prompt_logit_positions
        if check_every_step:
            check_block_manager(scheduler.bm, all_seqs(scheduler))
        step += 1
    result.num_steps = step
    for rid, r in requests.items():
        result.outputs[rid] = [seq.output_token_ids for seq in r.seqs]
        result.statuses[rid] = r.status
        result.latency[rid] = r.finished_step - r.arrival_step
        if r.first_scheduled_step >= 0:
            result.wait[rid] = r.first_scheduled_step - r.arrival_step
    return result


def assert_pool_whole(bm: BlockManager) -> None:
    check_block_manager(bm, [])
    stats = bm.stats()
    assert stats.num_used_blocks == 0 and stats.num_host_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
