"""Host-side scheduling of language requests over a decode pool: the one frame loop's bookkeeping.

`Engine` (robot loops and the policy server) and the benchmark's continuous-batching runner both
drive `runtime.frame.frame_step` through this class, so queueing, admission order, cancellation and the
reading of a frame's outputs exist once.

    sched = Scheduler(num_slots=8, admissions_per_frame=4, prompt_capacity=8)
    sched.enqueue(Ticket.make(rid, budget=20, ...))          # FIFO
    requests, evict = sched.offer(rows)                      # numpy inputs of this frame's program
    pool, out = frame_step(vla, pool, obs, noises, requests, evict, ...)
    events = sched.absorb(jax.device_get(out), frame)        # admitted, emitted tokens, finished

Rows: a request names the *stream* (robot) whose observation it continues. `offer(rows)` takes the
stream id of every batch row of this frame (`rows[i]` = stream at batch row i; -1 = padding row); a
queued request whose stream has no row this frame waits without blocking requests behind it.
Cancelling a queued request drops it; cancelling a live one frees its slot in the next frame
(`evict`), and its outputs are ignored from then on.

Speculative decoding (`speculate` = γ > 0, a pool from `decode.init_pool(..., speculate=γ)`): each offered
request carries its draft reference (`draft_book.DraftBook`: the robot's earlier answers), every finished
answer is recorded for the robot's next requests, and a frame's burst is read as k verify steps of γ + 1
columns each.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from oxygen_jax.runtime import decode, speculative
from oxygen_jax.runtime.draft_book import DraftBook


@dataclasses.dataclass(eq=False)  # identity: tickets sit in queues and are removed by identity
class Ticket:
    """One language request's host record (sampling fields already in their device form)."""

    request_id: int
    row: int  # stream id (robot) whose observation the request continues
    prompt: np.ndarray  # int32 [q]
    budget: int
    stop_ids: np.ndarray  # int32 [S] (`decode.stop_row`: -1 padding; all -1 = none)
    temperature: float
    top_p: float
    key: np.ndarray  # uint32 raw PRNG key data
    adapter: int = 0
    arrival_frame: int = 0
    arrival_time: float = 0.0
    admit_frame: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    owner: object = None  # free for the caller (e.g. a connection); never read here

    @classmethod
    def make(
        cls, request_id: int, *, budget: int, row: int = 0, prompt=(), stop_ids=(),
        temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, adapter: int = 0,
        arrival_frame: int = 0, owner: object = None,
    ) -> "Ticket":
        """A ticket with the PRNG key of `seed` (default: the request id). `stop_ids`: a sequence of ids (() =
        none: decode exactly `budget` tokens). Values are not validated here."""
        return cls(
            request_id=request_id, row=row, prompt=np.asarray(prompt, np.int32).reshape(-1), budget=budget,
            stop_ids=decode.stop_row(stop_ids), temperature=temperature, top_p=top_p,
            key=decode.key_data(request_id if seed is None else seed), adapter=adapter,
            arrival_frame=arrival_frame, arrival_time=time.perf_counter(), owner=owner,
        )


@dataclasses.dataclass(frozen=True)
class FrameEvents:
    """What one frame did to the requests (host side).

    Attributes:
      admitted: tickets that got a slot this frame.
      emitted: request id -> tokens emitted this frame (in order).
      finished: tickets whose last token came this frame (their slots are free again).
      batch: active slots in this frame's decode burst.
      steps: burst steps that ran (a step runs iff some slot was active): decode steps, or verify steps
        under speculation.
      burst_tokens: tokens the burst emitted (token 0 of a request comes from its admission, not counted).
      slot_steps: (slot, step) pairs that emitted: burst_tokens / slot_steps is the accepted tokens per step
        of a slot (1 without speculation, up to γ + 1 with it).
      drafts: (draft tokens proposed, accepted) this frame under speculation (`speculative.draft_counts`).
    """

    admitted: list[Ticket]
    emitted: dict[int, list[int]]
    finished: list[Ticket]
    batch: int
    steps: int
    burst_tokens: int = 0
    slot_steps: int = 0
    drafts: tuple[int, int] = (0, 0)


class Scheduler:
    """FIFO queue of `Ticket`s in front of a pool of `num_slots` decode slots."""

    def __init__(self, num_slots: int, admissions_per_frame: int, prompt_capacity: int, *, speculate: int = 0,
                 max_new_tokens: int = 0, reserved: int = 0):
        """`speculate` = γ (0: plain decoding); a speculative scheduler needs the pool's `max_new_tokens` (M) to
        size the draft references. `reserved`: slots its requests never hold (kept for a model's action streams,
        `runtime.action_streams`)."""
        self.num_slots, self.admissions, self.prompt_capacity = num_slots, admissions_per_frame, prompt_capacity
        self.reserved = reserved
        if speculate and max_new_tokens < 1:
            raise ValueError("a speculative Scheduler needs max_new_tokens (the pool's M) to size draft references")
        self.speculate = speculate
        self._book = DraftBook(decode.draft_capacity(max_new_tokens, prompt_capacity)) if speculate else None
        self._queue: collections.deque[Ticket] = collections.deque()
        self._live: dict[int, Ticket] = {}
        self._slot: dict[int, int] = {}  # live request id -> slot
        self._evict: set[int] = set()  # slots to free next frame
        self._offered: list[Ticket] = []
        self._empty = decode.make_requests(1, prompt_capacity)  # padding values, one entry

    # -- queue ----------------------------------------------------------------------------------

    def enqueue(self, ticket: Ticket) -> None:
        if len(ticket.prompt) > self.prompt_capacity:
            raise ValueError(
                f"request {ticket.request_id}: prompt of {len(ticket.prompt)} tokens exceeds the capacity "
                f"{self.prompt_capacity}")
        self._queue.append(ticket)

    def cancel(self, request_id: int) -> bool:
        """Drops a queued request or frees a live one's slot next frame; False if unknown or already done."""
        for t in self._queue:
            if t.request_id == request_id:
                self._queue.remove(t)
                return True
        if request_id in self._live:
            del self._live[request_id]
            slot = self._slot.pop(request_id, None)
            if slot is not None:
                self._evict.add(slot)
            return True
        return False

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def queued(self) -> list[Ticket]:
        return list(self._queue)

    def live(self) -> list[Ticket]:
        return list(self._live.values())

    def offered(self) -> list[Ticket]:
        """The tickets of the last `offer` not yet absorbed."""
        return list(self._offered)

    # -- one frame ------------------------------------------------------------------------------

    def offer(self, rows: Sequence[int] | int) -> tuple[decode.Requests, np.ndarray]:
        """This frame's admission batch and eviction mask (numpy, fixed shapes).

        Args:
          rows: the stream id of each batch row (-1 = padding row), or an int B meaning rows 0..B-1.
        Returns:
          (`Requests` of size J: the first queued tickets whose stream has a row, in FIFO order,
          with `row` rewritten to the batch row; evict bool [Ns]).
        """
        if isinstance(rows, (int, np.integer)):
            rows = range(int(rows))
        where = {int(s): i for i, s in enumerate(rows) if s >= 0}
        free = self.num_slots - self.reserved - len(self._live) + len(self._evict)
        take = []
        for t in self._queue:
            if len(take) == min(self.admissions, max(free, 0)):
                break
            if t.row in where:
                take.append(t)
        self._offered = take
        reqs = self._batch(take, where)
        evict = np.zeros((self.num_slots,), bool)
        evict[list(self._evict)] = True
        return reqs, evict

    def _batch(self, take: list[Ticket], where: dict[int, int]) -> decode.Requests:
        j, q = self.admissions, self.prompt_capacity
        pad = self._empty
        prompt = np.zeros((j, q), np.int32)
        prompt_len = np.zeros((j,), np.int32)
        for i, t in enumerate(take):
            prompt[i, : len(t.prompt)] = t.prompt
            prompt_len[i] = len(t.prompt)

        def col(values, fill):
            out = np.repeat(np.asarray(fill)[:1], j, axis=0)
            if take:
                out[: len(take)] = values
            return out

        sampling = decode.Sampling(
            budget=col([t.budget for t in take], pad.sampling.budget),
            stop_ids=col(np.stack([t.stop_ids for t in take]) if take else None, pad.sampling.stop_ids),
            temperature=col([t.temperature for t in take], pad.sampling.temperature),
            top_p=col([t.top_p for t in take], pad.sampling.top_p),
            key=col(np.stack([t.key for t in take]) if take else None, pad.sampling.key),
        )
        ref = None
        if self._book is not None:
            ref = np.full((j, self._book.width), -1, np.int32)
            for i, t in enumerate(take):
                ref[i] = self._book.reference(t.row, t.prompt, t.adapter)
        return decode.Requests(
            valid=np.arange(j) < len(take), row=col([where[t.row] for t in take], pad.row), prompt=prompt,
            prompt_len=prompt_len, sampling=sampling, request_id=col([t.request_id for t in take], pad.request_id),
            adapter=col([t.adapter for t in take], pad.adapter), draft_ref=ref,
        )

    def absorb(self, out, frame: int) -> FrameEvents:
        """Reads a frame's host-side `runtime.frame.FrameOutput` (after the `offer` that fed it)."""
        self._evict.clear()
        admitted = []
        for t, ok in zip(self._offered, np.asarray(out.admitted)[: len(self._offered)]):
            if ok:
                self._queue.remove(t)
                t.admit_frame = frame
                self._live[t.request_id] = t
                admitted.append(t)
        self._offered = []
        emitted, finished = {}, []
        new_tokens = np.asarray(out.new_tokens)
        for slot, rid in enumerate(np.asarray(out.request_id)):
            t = self._live.get(int(rid))
            if t is None:  # a free slot, or a request cancelled this frame
                continue
            self._slot[t.request_id] = slot
            toks = [int(x) for x in new_tokens[slot] if x >= 0]
            t.tokens += toks
            if toks:
                emitted[t.request_id] = toks
            if out.finished[slot]:
                del self._live[t.request_id]
                self._slot.pop(t.request_id, None)
                finished.append(t)
                if self._book is not None:
                    self._book.record(t.row, t.prompt, t.adapter, t.tokens)
        burst = new_tokens[:, 1:] >= 0
        per_step = burst.reshape(burst.shape[0], -1, self.speculate + 1).any(axis=2)  # [Ns, steps]
        return FrameEvents(admitted=admitted, emitted=emitted, finished=finished, batch=int(out.batch),
                           steps=int(per_step.any(axis=0).sum()), burst_tokens=int(burst.sum()),
                           slot_steps=int(per_step.sum()),
                           drafts=speculative.draft_counts(new_tokens[:, 1:], self.speculate) if self.speculate
                           else (0, 0))

    def reset_live(self) -> list[Ticket]:
        """Forgets every live request (after the pool was rebuilt); returns them."""
        lost = list(self._live.values())
        self._live.clear()
        self._slot.clear()
        self._evict.clear()
        return lost
