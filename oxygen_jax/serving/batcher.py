"""Multi-robot frame batching for the policy server, and the one thread that runs the engine.

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
* Model specifics (rows, stacking, noise shapes, the output transform) are the `codec`'s: any model family
  an `Engine` runs is served by this code.
* No robot can fail another's step (`EngineWorker.step`): a frame whose row the codec or the Engine
  refuses, or whose actions come back non-finite (`StepResult.row_errors`), is answered with a BadRequest
  and its requests are withdrawn; the others get their actions. Only a failure no single row explains
  fails every frame of the step.
* The event loop never runs model code: only `EngineWorker` methods touch the Engine, on its thread.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from oxygen_jax.runtime import compile_cache
from oxygen_jax.runtime.engine import FailedRequest, FinishedRequest, RequestError
from oxygen_jax.serving.outbox import LanguageOutbox, LanguageRouter

log = logging.getLogger("oxygen_jax.serve")

_MAX_REASON = 300  # characters of an engine refusal quoted back to the client

BUCKETS = (1, 2, 4, 8)
"""Default batch sizes (robots per step), each compiled at start-up."""


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `n` rows. Example: buckets (1, 2, 4, 8): 3 -> 4, 4 -> 4, 5 -> 8."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest batch bucket {max(buckets)}")


# -------------------------------------------------------------------------------------------------
# Host records
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)  # identity: a Stream is the Engine `owner` of its requests
class Stream:
    """One connected robot for the lifetime of its connection.

    Attributes:
      id: stream id (the Engine row id of its frames and requests); never reused.
      deadline_s: the robot's round-trip budget per frame (declared, or the server default).
      frames: frames of this stream handed to the engine so far (the next frame's index).
      busy: a frame of this stream is queued or in a step.
      last_reply: perf_counter time of the last reply sent (robots that just got one are expected back).
      think_s: the robot's observed time from a reply to its next frame (moving average; None before
        its second frame).
      closed: the connection is gone; results for it are dropped.
      language: its live language requests and what its next response says of them (`outbox.LanguageOutbox`).
    """

    id: int
    deadline_s: float
    frames: int = 0
    busy: bool = False
    last_reply: float = -math.inf
    think_s: float | None = None
    closed: bool = False
    language: LanguageOutbox = dataclasses.field(default_factory=LanguageOutbox)

    @property
    def expect_s(self) -> float:
        """How long after a reply this robot is expected back: 2 x its observed period + 5 ms, at most its deadline."""
        if self.think_s is None:
            return self.deadline_s
        return min(self.deadline_s, 2.0 * self.think_s + 0.005)

    def observe_arrival(self, now: float) -> None:
        """Updates `think_s` with the gap between the last reply and a frame arriving at `now`."""
        if math.isfinite(self.last_reply):
            gap = max(now - self.last_reply, 0.0)
            self.think_s = gap if self.think_s is None else 0.7 * self.think_s + 0.3 * gap


@dataclasses.dataclass(frozen=True)
class LanguageRequest:
    """One language request carried by an observation (already type-checked; ranges are the Engine's)."""

    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    adapter: str | int = "base"
    stop_at_eos: bool = True  # stop at the model's stop ids (its checkpoint's `eos_token_id`s)
    stop_ids: tuple[int, ...] = ()  # more stop ids the client named ("stop")
    tag: str | int | None = None  # the client's id for it, echoed back
    tokens: tuple[int, ...] | None = None  # the prompt's ids, tokenized on a prep thread (None: the engine does)
    auto: bool = False  # opened by the server for this observation (`serving.auto_language`), not by the robot


@dataclasses.dataclass(eq=False)
class Frame:
    """One robot observation waiting for its step.

    Attributes:
      observation: the model row of this robot (`codec.prepare`: numpy, batch 1).
      state: the robot's native state [Ds] (robot_outputs needs it for ALOHA).
      arrival: perf_counter time the frame was queued.
      index: the stream's frame index, set when the frame is handed to the engine.
      replace: live automatic requests of this stream to cancel before its requests are submitted.
    """

    stream: Stream
    observation: Any
    state: np.ndarray
    language: list[LanguageRequest]
    arrival: float
    future: asyncio.Future
    index: int = -1
    replace: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class FrameResult:
    """What a frame's connection replies: actions [Ha, Da] (+ per-head extras) and accepted requests, or a
    BadRequest text."""

    actions: np.ndarray | None
    error: str | None
    accepted: list[dict]  # {"id": engine request id, "tag": the client's tag} (+ "auto": True for the server's)
    index: int
    rows: int  # robots in the step
    bucket: int  # padded batch size of the step
    step_ms: float
    queue_ms: float
    extras: dict = dataclasses.field(default_factory=dict)  # codec.outputs extras (e.g. "heads")
    replaced: list[int] = dataclasses.field(default_factory=list)  # Frame.replace ids that were still live


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """One engine step as the event loop sees it."""

    results: list[FrameResult]  # one per frame handed in, same order
    finished: list[FinishedRequest]
    failed: list[FailedRequest]
    emitted: dict[int, tuple[list[int], str]]  # request id -> (token ids, text) emitted this step
    rows: int
    bucket: int
    step_ms: float  # Engine.step wall time (0 when every frame was rejected)
    language_active: int
    language_queued: int


# -------------------------------------------------------------------------------------------------
# The engine thread
# -------------------------------------------------------------------------------------------------

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: collections.Counter = collections.Counter()  # thread ident -> XLA compiles run on that thread
_listener_lock = threading.Lock()
_listening = False


def _count_compile(event: str, *_args, **_kwargs) -> None:
    if event == _COMPILE_EVENT:
        _compiles[threading.get_ident()] += 1


def _listen_for_compiles() -> None:
    global _listening
    import jax

    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_count_compile)
            _listening = True


class EngineWorker:
    """Owns an `Engine` and the single thread that may call it (the Engine is not thread-safe).

    Every public method runs on that thread: call them through `run(loop, method, *args)`.
    With a `mesh` (several devices), each step's rows are sharded over the mesh axis "robots" when the
    bucket divides evenly, and replicated otherwise; params must already be on the mesh
    (`runtime.slot_mesh.place_model`), and the engine's slot pool is split over the same axis (`Engine(mesh=)`).
    """

    def __init__(self, engine, codec, *, seed: int = 0, mesh=None):
        self.engine, self.codec, self.seed, self.mesh = engine, codec, seed, mesh
        self._executor = compile_cache.thread_pool(1, "oxygen-engine")
        self._thread = self._executor.submit(threading.get_ident).result()
        _listen_for_compiles()

    def run(self, loop: asyncio.AbstractEventLoop, method: Callable, *args) -> asyncio.Future:
        """Schedules `method(*args)` on the engine thread (FIFO with every other call)."""
        return loop.run_in_executor(self._executor, method, *args)

    def call(self, method: Callable, *args):
        """Runs `method(*args)` on the engine thread and waits for it (for synchronous callers)."""
        return self._executor.submit(method, *args).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    @property
    def num_devices(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    @property
    def compiles(self) -> int:
        """XLA compilations that ran on the engine thread so far."""
        return _compiles[self._thread]

    def _place(self, tree, rows: int):
        if self.mesh is None:
            return tree
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        spec = PartitionSpec("robots") if rows % self.mesh.shape["robots"] == 0 else PartitionSpec()
        return jax.device_put(tree, NamedSharding(self.mesh, spec))

    def warmup(self, example, buckets: Sequence[int], cancel: threading.Event | None = None) -> dict[int, float]:
        """Compiles every bucket; returns the steady step time (ms) of each, measured after compiling.

        `cancel` is checked between batch sizes: once it is set, warm-up stops after the compile in
        progress and returns the times measured so far (a SIGTERM during warm-up is answered in the
        time of one compile, not of all of them).

        One device: `Engine.warmup` per bucket (a scratch pool, no request touched), run twice. Several
        devices: real steps whose rows are all padding (no request is admitted): every bucket, then the
        first bucket again (the first step ran on the fresh pool; every later one gets the pool committed
        to the mesh by the step before, a different program), then every bucket timed.
        """
        times = {}
        stop = cancel.is_set if cancel is not None else (lambda: False)
        progress = _Progress(buckets)
        if self.mesh is None:
            for b in buckets:
                if stop():
                    return times
                progress.compiling(b)
                inputs, states = self.codec.batch([example] * b, b)
                self.engine.warmup(inputs, states)
                if stop():
                    return times
                times[b] = self.engine.warmup(inputs, states) * 1e3
            return times

        # An engine with several programs per bucket (`rtc_session.RtcEngine`) steps each of them and
        # reports the slower one.
        several = getattr(self.engine, "padding_steps", None)

        def padding_step(b: int) -> float:
            inputs, states = self.codec.batch([example] * b, b)
            obs, noise, states = self._place((inputs, self.codec.noise(self.seed, [], [], b), states), b)
            if several is not None:
                return several(obs, noise, rows=[-1] * b, states=states) * 1e3
            start = time.perf_counter()
            self.engine.step(obs, noise, rows=[-1] * b, states=states)
            return (time.perf_counter() - start) * 1e3

        for b in [*buckets, buckets[0]]:
            if stop():
                return times
            progress.compiling(b)
            padding_step(b)
        for b in buckets:
            if stop():
                return times
            times[b] = padding_step(b)
        return times

    def _stops(self, req: LanguageRequest) -> tuple[int, ...]:
        return tuple(sorted(set(self.engine.vla.stop_ids if req.stop_at_eos else ()) | set(req.stop_ids)))

    def _submit(self, frame: Frame) -> list[int]:
        ids = []
        try:
            for req in frame.language:
                text = {"prompt": req.prompt} if req.tokens is None else {"prompt_tokens": list(req.tokens)}
                ids.append(self.engine.submit(
                    **text, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    seed=req.seed, adapter=req.adapter, stop_ids=self._stops(req),
                    row=frame.stream.id, owner=frame.stream))
        except RequestError as e:
            for rid in ids:
                self.engine.cancel(rid)
            reason = str(e) if len(str(e)) <= _MAX_REASON else f"{str(e)[:_MAX_REASON]}…"  # never echo a large value
            raise RequestError(f"language_requests[{len(ids)}]: {reason}") from None
        return ids

    def step(self, frames: Sequence[Frame], bucket: int) -> StepOutput:
        """Submits the frames' language requests, then runs one step of `bucket` rows.

        No frame can fail another: a frame whose language request the Engine refuses, whose row the
        Engine refuses (`_refused_rows`: the step is then run again without it), whose actions come back
        non-finite (`StepResult.row_errors`) or whose reply cannot be made gets a BadRequest result, and its
        requests are withdrawn; the remaining frames get their step's results.
        """
        accepted, errors = {}, {}
        replaced = {id(f): [rid for rid in f.replace if self.engine.cancel(rid)] for f in frames if f.replace}
        for f in frames:
            try:
                accepted[id(f)] = self._submit(f)
            except RequestError as e:
                errors[id(f)] = f"BadRequest: {e}"
        live = [f for f in frames if id(f) not in errors]
        res, step_ms = None, 0.0
        while live and res is None:
            try:
                res, step_ms = self._step_rows(live, max(bucket, len(live)))
            except Exception:  # noqa: BLE001 - one row's inputs are that row's error; anything else fails the step
                refused = self._refused_rows(live)
                if not refused:
                    raise
                errors.update(refused)
                live = [f for f in live if id(f) not in refused]
        actions, out_rows = {}, len(live)
        for i, f in enumerate(live):
            why = res.row_errors.get(i)
            if why is None:
                try:
                    actions[id(f)] = _finite_reply(*self.codec.outputs(res.head_actions, i, f.state))
                except ValueError as e:
                    why = str(e)
            if why is not None:
                errors[id(f)] = f"BadRequest: {_cut(why)}; check {self.codec.state_field} and the images"
        withdrawn = self._withdraw([rid for f in frames if id(f) in errors for rid in accepted.get(id(f), [])])
        now = time.perf_counter()
        results = [FrameResult(
            actions=actions[id(f)][0] if id(f) in actions else None, error=errors.get(id(f)), index=f.index,
            extras=actions[id(f)][1] if id(f) in actions else {},
            accepted=[] if id(f) in errors else [{"id": rid, "tag": req.tag, **({"auto": True} if req.auto else {})}
                                                 for rid, req in zip(accepted.get(id(f), []), f.language)],
            replaced=replaced.get(id(f), []),
            rows=out_rows, bucket=bucket if live else 0, step_ms=step_ms,
            queue_ms=(now - f.arrival) * 1e3 - step_ms,
        ) for f in frames]
        return StepOutput(
            results=results, finished=[d for d in res.finished if d.request_id not in withdrawn] if res else [],
            failed=[d for d in res.errors if d.request_id not in withdrawn] if res else [], rows=out_rows,
            emitted={rid: (toks, res.new_text.get(rid, "")) for rid, toks in getattr(res, "new_tokens", {}).items()
                     if rid not in withdrawn} if res else {},
            bucket=bucket if live else 0, step_ms=step_ms, language_active=self.engine.num_active,
            language_queued=self.engine.num_queued)

    def _step_rows(self, live: Sequence[Frame], bucket: int):
        """(StepResult, step ms) of one Engine step of the live frames' rows, padded to `bucket`."""
        inputs, states = self.codec.batch([f.observation for f in live], bucket)
        noise = self.codec.noise(self.seed, [f.stream.id for f in live], [f.index for f in live], bucket)
        obs, noise, states = self._place((inputs, noise, states), bucket)
        start = time.perf_counter()
        res = self.engine.step(obs, noise, rows=[f.stream.id for f in live] + [-1] * (bucket - len(live)),
                               states=states)
        return res, (time.perf_counter() - start) * 1e3

    def _refused_rows(self, live: Sequence[Frame]) -> dict[int, str]:
        """id(frame) -> BadRequest text, for each frame whose row alone the codec or the Engine refuses.

        Called when a step of all of them raised: each row is batched alone and checked
        (`Engine.validate`), so one robot's unusable row is its own error, not its neighbours'.
        """
        validate = getattr(self.engine, "validate", None)
        refused = {}
        for f in live:
            try:
                inputs, states = self.codec.batch([f.observation], 1)
                if validate is not None:
                    validate(inputs, states=states)
            except Exception as e:  # noqa: BLE001 - whatever this row alone raises is this row's refusal
                refused[id(f)] = f"BadRequest: {_cut(str(e) or type(e).__name__)}"
        return refused

    def _withdraw(self, request_ids: Sequence[int]) -> set[int]:
        """Cancels requests of frames that were refused (their robot never learns the ids); returns the ids."""
        for rid in request_ids:
            self.engine.cancel(rid)
        return set(request_ids)

    def cancel_owner(self, owner: object) -> int:
        """Cancels every queued and running request of `owner`; returns how many."""
        ids = self.engine.requests_of(owner)
        for rid in ids:
            self.engine.cancel(rid)
        return len(ids)


# -------------------------------------------------------------------------------------------------
# The batching policy
# -------------------------------------------------------------------------------------------------


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


def _cut(text: str) -> str:
    """An engine reason quoted back to a client: at most `_MAX_REASON` characters."""
    return text if len(text) <= _MAX_REASON else f"{text[:_MAX_REASON]}…"


def _finite_reply(actions: np.ndarray, extras: dict) -> tuple[np.ndarray, dict]:
    """A row's reply (`codec.outputs`), or ValueError when a value in it is not finite (e.g. a state added
    to a delta action beyond float32)."""
    arrays = [actions, *extras.get("heads", {}).values()]
    with np.errstate(over="ignore", invalid="ignore"):
        finite = all(np.isfinite(np.asarray(a, np.float32)).all() for a in arrays)
    if not finite:
        raise ValueError("the reply's actions are not finite (NaN/inf) once mapped to robot units")
    return actions, extras


class _Progress:
    """One log line per batch size as warm-up starts compiling it (a cold start compiles for minutes)."""

    def __init__(self, buckets: Sequence[int]):
        self.buckets, self.done, self.t0 = list(buckets), 0, time.perf_counter()

    def compiling(self, b: int) -> None:
        self.done += 1
        if self.done > len(self.buckets):  # the mesh path's second step of the first size (already compiled)
            return
        log.info("compiling batch size %d (%d of %d; %.0f s so far)", b, self.done, len(self.buckets),
                 time.perf_counter() - self.t0)


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
