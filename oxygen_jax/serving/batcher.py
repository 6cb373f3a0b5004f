"""Multi-robot frame batching for the policy server: when to step, and how many rows.

Axes: B rows of one step (a bucket size, e.g. 1/2/4/8), Ha action horizon, Ad model action dim (32),
Da the robot's action dim.

    connection handlers ──Frame──► Batcher (event loop)             EngineWorker (one thread, owns the Engine)
      (one Stream each)             waits for robots about to send,  submit each frame's language requests
            ▲                       never past the tightest          (row = stream id, owner = Stream), pad the
            │                       deadline; picks a bucket ──────► rows to the bucket, Engine.step(rows)
            └── frame.future ◄───── routes finished / failed language to the owning Stream's outbox

* Every connection is a `Stream` with a fixed id for its lifetime. The Engine admits a stream's
  language requests only in steps where that stream has a row, so a request always continues its own
  robot's observation, and all robots share one decode pool.
* Batch sizes come from a fixed bucket set, each compiled before the server reports healthy
  (`EngineWorker.warmup`); padding rows repeat row 0 and belong to no stream (row id -1).
* When to fire (`fire_delay`): at once when no other robot is expected soon, or when every expected
  robot is in; otherwise wait until the tightest pending deadline minus the predicted step time. A
  robot is expected for its observed period (`Stream.expect_s`: twice its usual time between a reply
  and its next frame), never longer than its deadline (itself capped by the server), so a robot that
  declares a long deadline and goes quiet stops being waited for.
* Noise is deterministic: row noise of frame f of stream s is `codec.frame_noise(seed, s, f)` (one per
  head), so a client (or a test) can reproduce a served action chunk with `Engine.step(observation, noise)`.
* The event loop never runs model code: only `EngineWorker` methods (`serving.engine_worker`) touch the
  Engine, on its thread; the records it passes are `serving.records`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

from oxygen_jax.serving.engine_worker import EngineWorker
from oxygen_jax.serving.outbox import LanguageRouter
from oxygen_jax.serving.records import Frame, StepOutput, Stream

log = logging.getLogger("oxygen_jax.serve")

BUCKETS = (1, 2, 4, 8)
"""Default batch sizes (robots per step), each compiled at start-up."""


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `n` rows. Example: buckets (1, 2, 4, 8): 3 -> 4, 4 -> 4, 5 -> 8."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest batch bucket {max(buckets)}")


def expected_streams(streams: Sequence[Stream], now: float) -> list[Stream]:
    """Robots likely to send a frame soon: idle, and answered less than `Stream.expect_s` ago.

    Example: a robot that declared a 1-hour deadline (capped by the server at, say, 1 s) and sent
    frames 10 ms after each reply is expected for 25 ms after its last reply, not for an hour.
    """
    return [s for s in streams if not s.busy and not s.closed and now - s.last_reply < s.expect_s]


def fire_delay(pending: Sequence[Frame], expected: Sequence[Stream], now: float, predicted_s: float,
               max_rows: int) -> float | None:
    """Seconds to wait before stepping the pending frames: 0 = now, None = nothing to do.

    Fire at once when the pending frames fill the largest bucket or no other robot is expected;
    otherwise wait for the expected robots, but only while the tightest pending deadline still holds
    after a step of `predicted_s` (a deadline that cannot be met anyway does not delay anyone), and
    no longer than the first expected robot stays expected (then the caller decides again).

    Example: a frame that arrived at t=0 with a 100 ms deadline, a step predicted at 30 ms, another
    robot expected (answered at t=0 with a 100 ms deadline): at t=0.002 the delay is 0.068 s (fire at
    t=0.070 unless that robot arrives first).
    """
    if not pending:
        return None
    if len(pending) >= max_rows or not expected:
        return 0.0
    fire_at = min(f.arrival + f.stream.deadline_s for f in pending) - predicted_s
    still_expected = min(s.last_reply + s.deadline_s for s in expected)
    return max(0.0, min(fire_at, still_expected) - now)


class Busy(Exception):
    """The frame queue is full; the client should retry."""



def _fail_frames(frames, exc: BaseException) -> None:
    """Answers every frame with `exc` (skipping handlers that stopped waiting) and frees its stream."""
    for f in frames:
        f.stream.busy = False
        if not f.future.done():
            f.future.set_exception(exc)


class Batcher:
    """Collects frames from all connections and feeds the engine thread one bucketed step at a time.

    Event-loop side only (not thread-safe); `EngineWorker` does the engine work.
    """

    def __init__(self, worker: EngineWorker, *, buckets: Sequence[int] = BUCKETS, max_pending: int = 16,
                 on_step: Callable[[StepOutput], None] | None = None):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive batch sizes, got {list(buckets)}")
        self.worker, self.buckets, self.max_pending = worker, tuple(buckets), max_pending
        self._on_step = on_step or (lambda _out: None)
        self._streams: dict[int, Stream] = {}
        self._pending: list[Frame] = []
        self._inflight: list[Frame] = []
        self._predicted_s: dict[int, float] = {b: 0.0 for b in self.buckets}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._cancel_warmup = threading.Event()
        self.ready = False
        self.warmup_ms: dict[int, float] = {}
        self.steps = 0
        self.rows_total = 0
        self._router = LanguageRouter()

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def outstanding(self) -> int:
        """Frames queued or in a step."""
        return len(self._pending) + len(self._inflight)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, example) -> None:
        """Compiles every bucket on the engine thread, then starts stepping frames."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        t0 = time.perf_counter()
        self.warmup_ms = await self.worker.run(loop, self.worker.warmup, example, self.buckets, self._cancel_warmup)
        if self._cancel_warmup.is_set():
            raise asyncio.CancelledError("warm-up cancelled: the server is shutting down")
        self._predicted_s = {b: ms / 1e3 for b, ms in self.warmup_ms.items()}
        log.info("warm-up compiled batch sizes %s in %.1f s; steady step ms %s", list(self.buckets),
                 time.perf_counter() - t0, {b: round(ms, 1) for b, ms in self.warmup_ms.items()})
        self.ready = True
        self._task = asyncio.create_task(self._run(), name="oxygen-batcher")
        self._wake.set()

    def cancel_warmup(self) -> None:
        """Stops warm-up after the compile in progress (thread-safe; shutdown calls it)."""
        self._cancel_warmup.set()

    async def drain(self) -> None:
        """Steps every frame already queued (without waiting for other robots), then stops the loop.

        Before warm-up has finished nothing can be stepped: queued frames fail with `Busy` ("unavailable").
        """
        self._closing = True
        if self._task is None:
            _fail_frames(self._pending, Busy("unavailable: the server is shutting down before it was ready"))
            self._pending = []
            return
        self._wake.set()
        await self._task

    # -- streams and frames ---------------------------------------------------------------------

    def add_stream(self, stream: Stream) -> None:
        self._streams[stream.id] = stream

    def remove_stream(self, stream: Stream) -> asyncio.Future:
        """Forgets a closed connection: drops its queued frame and cancels its language requests.

        Wakes the loop: others may have been waiting for this robot's next frame.
        """
        stream.closed = True
        self._streams.pop(stream.id, None)
        self._router.forget(stream)
        for f in [f for f in self._pending if f.stream is stream]:
            self._pending.remove(f)
            f.future.cancel()
        if self._wake is not None:
            self._wake.set()
        return self.worker.run(asyncio.get_running_loop(), self.worker.cancel_owner, stream)

    def submit(self, frame: Frame) -> None:
        """Queues a frame. Raises Busy when `max_pending` frames already wait or the loop has stopped."""
        if self._closing and (self._task is None or self._task.done()):
            raise Busy("unavailable: the server is shutting down; reconnect to another server")
        if len(self._pending) >= self.max_pending:
            raise Busy(f"busy: {len(self._pending)} frames are queued (limit {self.max_pending}); retry shortly")
        frame.stream.busy = True
        self._pending.append(frame)
        if self._wake is not None:
            self._wake.set()

    # -- the loop -------------------------------------------------------------------------------

    def _delay(self, now: float) -> float | None:
        if not self.ready:
            return None
        if self._closing:
            return 0.0 if self._pending else None
        expected = expected_streams(list(self._streams.values()), now)
        rows = min(len(self._pending) + len(expected), self.max_rows)
        predicted = self._predicted_s[bucket_for(max(rows, 1), self.buckets)]
        return fire_delay(self._pending, expected, now, predicted, self.max_rows)

    async def _run(self) -> None:
        while True:
            delay = self._delay(time.perf_counter())
            if delay is None and self._closing:
                return
            if delay == 0.0:
                await self._fire()
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            except TimeoutError:
                pass

    async def _fire(self) -> None:
        frames, self._pending = self._pending[: self.max_rows], self._pending[self.max_rows:]
        for f in frames:
            f.index = f.stream.frames
            f.stream.frames += 1
        self._inflight = frames
        bucket = bucket_for(len(frames), self.buckets)
        try:
            out = await self.worker.run(asyncio.get_running_loop(), self.worker.step, frames, bucket)
        except Exception as e:  # noqa: BLE001 - an engine failure fails every row of the step, not the server
            log.exception("engine step failed for %d frames", len(frames))
            _fail_frames(frames, e)
            return
        finally:
            self._inflight = []
        if out.rows:
            self.steps += 1
            self.rows_total += out.rows
            self._predicted_s[out.bucket] = 0.8 * self._predicted_s[out.bucket] + 0.2 * out.step_ms / 1e3
        self._router.route(frames, out)
        self._on_step(out)
        for f, res in zip(frames, out.results):
            f.stream.busy = False
            if not f.future.done():
                f.future.set_result(res)
