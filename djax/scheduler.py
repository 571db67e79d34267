"""Host-side continuous batching: waiting / running queues, chunked prefill mixed with decodes, preemption.

Never traced. Each step the scheduler fills the device's fixed slot batch (one row per running
sequence) and returns a `Plan` of host arrays; the engine runs one jitted step on it and hands the
sampled tokens back through `postprocess`. A step's width c (tokens per row) is the largest
bucket with rows x c within the token budget when any row is prefilling, else 1 (decode).

Preemption is by recompute: when pages run out, the youngest running sequence gives up its slot
and pages and goes back to the front of the queue with its prompt plus everything it generated
so far; resuming replays those tokens (from a prefix-cache hit where there is one), so the
outcome equals an uninterrupted run.

Asynchronous use: `schedule` may be called again before the previous plan's results are back. A
sequence's token still in flight is fed on device from the previous step's output (`from_prev`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from djax.paging import PageAllocator, SnapshotCache, block_hashes


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generated sequence: tokens = prompt + confirmed outputs; its device state covers num_computed positions."""

    seq_id: int
    tokens: list[int]
    num_prompt: int
    params: object  # djax.engine.SamplingParams
    seed: int
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    inflight: int = 0
    restore: int = -1  # snapshot slot to load at the next step
    num_registered: int = 0  # leading pages named in the prefix cache
    finish_reason: str | None = None
    num_fed: int = 0  # tokens fed to the model in all (work done, recomputation included)
    num_cached: int = 0  # prompt tokens served by the prefix cache at the last admission
    num_preempted: int = 0
    logprobs: list = field(default_factory=list)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt :]


@dataclass
class Plan:
    """Host arrays for one device step over all slots (row r = slot r); rows with valid 0 are idle."""

    tokens: np.ndarray  # int32[S, c]
    from_prev: np.ndarray  # bool[S]: column 0 is the previous step's sampled token of this slot
    lengths: np.ndarray  # int32[S]: positions already in the state
    valid: np.ndarray  # int32[S]
    sample: np.ndarray  # bool[S]: the row's last valid token yields a new token
    page_table: np.ndarray  # int32[S, P]
    restore: np.ndarray  # int32[S]: snapshot slot to load first (-1: none)
    save: np.ndarray  # int32[S]: snapshot slot to write after (-1: none)
    seqs: list  # Sequence | None per slot, as scheduled

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def idle(cls, slots: int, width: int, pages: int) -> Plan:
        """A step with every row idle: a no-op on the state (used to compile and to time a width)."""
        return cls(
            tokens=np.zeros((slots, width), np.int32),
            from_prev=np.zeros(slots, bool),
            lengths=np.zeros(slots, np.int32),
            valid=np.zeros(slots, np.int32),
            sample=np.zeros(slots, bool),
            page_table=np.zeros((slots, pages), np.int32),
            restore=np.full(slots, -1, np.int32),
            save=np.full(slots, -1, np.int32),
            seqs=[None] * slots,
        )


class Scheduler:
    """Queues and the page allocator for `num_slots` device rows of up to `pages_per_seq` pages each."""

    def __init__(
        self,
        num_slots: int,
        num_pages: int,
        pages_per_seq: int,
        block_size: int,
        max_num_batched_tokens: int,
        widths: tuple[int, ...],
        num_snapshots: int = 0,
        prefix_caching: bool = True,
    ):
        self.num_slots, self.pages_per_seq, self.block_size = num_slots, pages_per_seq, block_size
        self.budget = max_num_batched_tokens
        self.widths = tuple(sorted(widths))
        self.pages = PageAllocator(num_pages)
        self.snaps = SnapshotCache(num_snapshots if prefix_caching else 0)
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.free_slots = list(range(num_slots))[::-1]
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- admission and preemption ---------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        """Give seq a slot and its prefix-cache hit: shared pages and a snapshot of the state at the hit's end."""
        seq.slot, seq.status = self.free_slots.pop(), Status.RUNNING
        seq.num_computed, seq.restore, seq.num_cached, seq.num_registered = 0, -1, 0, 0
        # penalties count the prompt from fed tokens, so a penalized sequence computes its whole prefix
        if self.prefix_caching and not getattr(seq.params, "penalized", False):
            hashes = block_hashes(seq.tokens, self.block_size, upto=len(seq.tokens) - 1)
            found, best = [], -1
            for i, h in enumerate(hashes):
                page = self.pages.lookup(h)
                if page is None:
                    break
                found.append(page)
                if self.snaps.slot_of.get(h) is not None:
                    best = i
            if best >= 0:
                for page in found[: best + 1]:
                    self.pages.share(page)
                seq.pages = found[: best + 1]
                seq.restore = self.snaps.get(hashes[best])
                seq.num_computed = seq.num_cached = (best + 1) * self.block_size
                seq.num_registered = best + 1
        self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free seq's slot and pages and queue it first; it resumes by recomputing (cache hits permitting)."""
        self._register(seq)
        self.pages.release(seq.pages)
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        seq.pages, seq.slot, seq.num_computed, seq.restore = [], None, 0, -1
        seq.status = Status.WAITING
        seq.num_preempted += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.status == Status.RUNNING:
            self._register(seq)
            self.pages.release(seq.pages)
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            seq.pages, seq.slot = [], None
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def _register(self, seq: Sequence) -> None:
        """Name the computed full blocks of known tokens in the prefix cache."""
        if not self.prefix_caching:
            return
        n = min(seq.num_computed, len(seq.tokens)) // self.block_size
        if n > seq.num_registered:
            hashes = block_hashes(seq.tokens, self.block_size, upto=n * self.block_size)
            for i in range(seq.num_registered, n):
                self.pages.register(seq.pages[i], hashes[i])
            seq.num_registered = n

    def _grow(self, seq: Sequence, upto: int) -> bool:
        """Give seq pages for positions < upto, preempting younger sequences; False if seq itself was preempted."""
        need = -(-upto // self.block_size) - len(seq.pages)
        while need > 0:
            if self.pages.num_free:
                seq.pages.append(self.pages.allocate())
                need -= 1
                continue
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    # ---- one step --------------------------------------------------------------------------------
    def _done(self, seq: Sequence) -> bool:
        """Every token it may produce is produced or in flight."""
        return seq.num_output + seq.inflight >= seq.params.max_tokens

    def schedule(self) -> Plan | None:
        """The next step over all slots, or None when nothing can run."""
        # admit while slots are free and pages leave one spare per running sequence (limits thrashing)
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            first = min(len(seq.tokens), self.budget // self.num_slots or 1)
            if self.pages.num_free < -(-first // self.block_size) + len(self.running):
                break
            self.waiting.popleft()
            self._admit(seq)
        rows = []
        prefilling = False
        for seq in list(self.running):
            if seq.status != Status.RUNNING or self._done(seq):
                continue
            need = len(seq.tokens) + seq.inflight - seq.num_computed
            prefilling |= need > 1
            rows.append(seq)
        if not rows:
            return None
        S = self.num_slots
        if prefilling:
            fit = [w for w in self.widths if w * S <= self.budget] or [self.widths[0]]
            longest = max(len(s.tokens) + s.inflight - s.num_computed for s in rows)
            c = next((w for w in fit if w >= longest), fit[-1])
        else:
            c = 1
        plan = Plan(
            tokens=np.zeros((S, c), np.int32),
            from_prev=np.zeros(S, bool),
            lengths=np.zeros(S, np.int32),
            valid=np.zeros(S, np.int32),
            sample=np.zeros(S, bool),
            page_table=np.zeros((S, self.pages_per_seq), np.int32),
            restore=np.full(S, -1, np.int32),
            save=np.full(S, -1, np.int32),
            seqs=[None] * S,
        )
        protect = {s.restore for s in rows if s.restore >= 0}
        for seq in rows:
            if seq.status != Status.RUNNING:  # preempted while making room for an older one
                continue
            total = len(seq.tokens) + seq.inflight
            n = min(c, total - seq.num_computed)
            if not self._grow(seq, seq.num_computed + n):
                continue
            r, start = seq.slot, seq.num_computed
            plan.seqs[r] = seq
            plan.lengths[r], plan.valid[r] = start, n
            known = seq.tokens[start : start + n]
            plan.tokens[r, : len(known)] = known
            if len(known) < n:  # the last token is still on device
                assert seq.inflight and len(known) == n - 1 == 0, "only one token can be in flight"
                plan.from_prev[r] = True
            plan.sample[r] = start + n == total
            plan.restore[r] = seq.restore
            seq.restore = -1
            end = start + n
            if self.prefix_caching and end % self.block_size == 0 and end <= len(seq.tokens) and n > 1:
                h = block_hashes(seq.tokens, self.block_size, upto=end)[-1]
                slot = self.snaps.put(h, protect)
                if slot is not None:
                    plan.save[r] = slot
            seq.num_computed = end
            seq.num_fed += n
            if plan.sample[r]:
                seq.inflight += 1
        for seq in plan.seqs:
            if seq is not None:
                plan.page_table[seq.slot, : len(seq.pages)] = seq.pages
        return plan

    def postprocess(self, plan: Plan, tokens: np.ndarray, check_stop) -> list[Sequence]:
        """Append each sampling row's token to its sequence; `check_stop(seq)` -> finish reason or None.

        Returns the sequences that got a token. A sequence already finished (its stop was found
        after the next step had been dispatched) drops the extra token.
        """
        out = []
        for r, seq in enumerate(plan.seqs):
            if seq is None or not plan.sample[r]:
                continue
            seq.inflight -= 1
            if seq.status == Status.FINISHED:
                continue
            seq.tokens.append(int(tokens[r]))
            out.append(seq)
            reason = check_stop(seq)
            if reason is not None:
                self.finish(seq, reason)
            elif seq.status == Status.RUNNING:
                self._register(seq)
        return out
