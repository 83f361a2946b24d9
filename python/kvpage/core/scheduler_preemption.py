"""Making room in a step (the Scheduler's Preemption): victims chosen by the victim policy, preempted by swap
(blocks to the host pool) or by recompute (blocks dropped, the request waiting at the front of the queue),
as the preemption mode or, per victim, the swap-versus-recompute cost model decides."""
from __future__ import annotations

from .block_moves import num_unique_blocks
from .request import Request, RequestStatus
from .scheduler_output import SchedulerOutput
from .sequence import Sequence


class Preemption:
    """Scheduler mixin. Reads `bm`, `policy`, `preemption_mode`, `config.cost_model` and the step's
    `_scheduled`; moves victims from `running` to `swapped` or `waiting` and counts them."""

    def _make_room(self, request: Request, plan: list[tuple[Sequence, int]], out: SchedulerOutput,
                   preempt_self: bool, may_preempt: bool = True) -> bool:
        """Preempt victims until `plan` fits; False (after preempting `request` if allowed) if it cannot."""
        while self.bm.num_blocks_to_append(plan) > self.bm.num_free_blocks:
            if not may_preempt:
                return False
            candidates = [r for r in self.running if r is not request and r.request_id not in self._scheduled]
            if not candidates:
                if preempt_self and request.request_id not in self._scheduled:
                    self._preempt(request, out)
                return False
            self._preempt(self.policy.select(candidates), out)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._open.touch(request)
        seqs = request.live_seqs()
        self.running.remove(request)
        request.num_preemptions += 1
        out.preempted.append(request.request_id)
        if self._preemption_mode(seqs) == "swap" and self.bm.can_swap_out(seqs):
            out.blocks_to_swap_out.extend(self.bm.swap_out(seqs))
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            self.num_swap_preemptions += 1
        else:  # recompute, or swap with the host pool full
            for seq in seqs:
                self.bm.free(seq)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            self.num_recompute_preemptions += 1

    def _preemption_mode(self, seqs: list[Sequence]) -> str:
        if self.preemption_mode is not None:
            return self.preemption_mode
        if self.bm.num_host_blocks == 0:
            return "recompute"
        num_blocks = num_unique_blocks(seqs)
        num_tokens = sum(s.num_computed_tokens for s in seqs)
        return self.config.cost_model.choose(num_blocks, self.bm.block_size, num_tokens)
