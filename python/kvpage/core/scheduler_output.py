"""One step's decision, as data: everything the runner needs and nothing it must work out again."""
from __future__ import annotations

from dataclasses import dataclass, field

BlockPairs = list[tuple[int, int]]


@dataclass
class ScheduledSequence:
    """One sequence's share of the step: compute tokens at positions [start, start + num_scheduled_tokens).

    The K/V of positions < start are already in the cache (computed earlier or prefix-cache hits);
    the new tokens' K/V go to slot_mapping; attention covers context_len positions of block_table.
    A hybrid KV cache (kv_cache_groups) has one table and slot mapping per group, in layout order, in
    block_tables / slot_mappings (group 0's are block_table / slot_mapping); a window group's table
    holds NULL_BLOCK (-1) before its window, entries no query of the step reads.
    """

    request_id: str
    seq_id: int
    start: int
    num_scheduled_tokens: int
    token_ids: list[int]  # the tokens at those positions
    block_table: list[int]  # a copy: later steps may grow the live one
    slot_mapping: list[int]  # -1: this position's K/V is already cached (the last token of a full hit)
    is_prefill: bool  # prompt (or recompute) tokens rather than one decode token
    do_sample: bool  # the last scheduled token is the sequence's last: keep its logits and sample
    num_samples: int  # tokens to sample from those logits: n where the prompt's completion forks n samples
    # Prompt positions (within this step's) whose logits the runner returns as well, for prompt_logprobs:
    # position p's logits give the log-probability of prompt token p + 1.
    prompt_logit_positions: range = range(0)
    block_tables: list[list[int]] = field(default_factory=list)  # [] when built by hand: [block_table]
    slot_mappings: list[list[int]] = field(default_factory=list)  # [] when built by hand: [slot_mapping]
    # [spec decode] the proposed tokens at the end of token_ids (a decode of 1 + k query tokens in lookahead
    # slots): the runner returns a logits row for the real token and each of them (logits_rows).
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.block_tables:
            self.block_tables = [self.block_table]
        if not self.slot_mappings:
            self.slot_mappings = [self.slot_mapping]

    @property
    def context_len(self) -> int:
        """seq_lens for the attention ops: cached context plus this step's tokens."""
        return self.start + self.num_scheduled_tokens

    @property
    def positions(self) -> range:
        return range(self.start, self.context_len)


def logits_rows(scheduled) -> list[int]:
    """Rows of a step's flat batch (its sequences' tokens back to back) whose logits the runner
    returns, in this order: the last token of each sequence with do_sample (and, before it, the real
    token and drafts of a speculating one: 1 + k rows), in batch order, then
    each sequence's prompt_logit_positions, in batch order. A step that wants no prompt logits gets
    just the sampled rows, [sequences with do_sample, vocab]."""
    sampled, prompt, start = [], [], 0
    for s in scheduled:
        n = len(s.token_ids)
        if s.do_sample:
            k = len(getattr(s, "spec_token_ids", ()))  # [spec decode] k + 1 rows: the drafts' verification
            sampled.extend(range(start + n - 1 - k, start + n))
        positions = getattr(s, "prompt_logit_positions", None)  # a step object without it wants none
        if positions:
            if positions.start < s.start or positions.stop > s.start + n:
                raise ValueError(f"prompt_logit_positions {positions} must lie within the step's positions"
                                 f" [{s.start}, {s.start + n})")
            prompt += range(start + positions.start - s.start, start + positions.stop - s.start)
        start += n
    return sampled + prompt


@dataclass(frozen=True)
class BeamStep:
    """A beam request's selection after a step in which all its beams sampled (the engine's, see
    kvpage.engine.beam_search): the next running beams as (parent seq_id, token), or, with
    finish_reason set, the end of the search (every beam is freed)."""

    children: tuple[tuple[int, int], ...] = ()
    finish_reason: str | None = None  # a FinishReason value: "stop" or "length"


@dataclass
class SchedulerOutput:
    """Runner order: swap_blocks(out), swap_blocks(in), copy_blocks, then the forward pass.

    Out before in: a device block freed by a swap-out may be handed out again in the same step.
    Swap-ins never share a step with a preemption, so no block is both swapped out and in.
    """

    step: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_out: BlockPairs = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: BlockPairs = field(default_factory=list)  # (host, device)
    blocks_to_copy: BlockPairs = field(default_factory=list)  # (src, dst) copy-on-write, device
    preempted: list[str] = field(default_factory=list)  # request ids, in preemption order
    finished_request_ids: list[str] = field(default_factory=list)  # since the last step: drop their state
    # [kv tier] a KV connector's loads and stores for this step (kvpage.kv_offload.KVConnectorMeta), run before
    # everything above; None without a connector or with nothing to move.
    kv_connector_meta: object | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Tokens per request this step."""
        counts: dict[str, int] = {}
        for s in self.scheduled:
            counts[s.request_id] = counts.get(s.request_id, 0) + s.num_scheduled_tokens
        return counts

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy
                    or self.kv_connector_meta is not None)
