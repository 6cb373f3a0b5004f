"""The one thread that runs the engine for the policy server (`EngineWorker`).

The Engine is not thread-safe: every call to it goes through `EngineWorker.run` / `call`, on a single
thread. A step submits each frame's language requests (row = the frame's stream id, owner = its
`Stream`), pads the rows to the bucket, runs `Engine.step`, and makes one `FrameResult` per frame.

* No robot can fail another's step (`EngineWorker.step`): a frame whose row the codec or the Engine
  refuses, or whose actions come back non-finite (`StepResult.row_errors`), is answered with a BadRequest
  and its requests are withdrawn; the others get their actions. Only a failure no single row explains
  fails every frame of the step.
* Warm-up (`EngineWorker.warmup`) compiles every batch size before the server reports healthy, one log
  line per size; padding rows repeat row 0 and belong to no stream (row id -1).
* Model specifics (rows, stacking, noise shapes, the output transform) are the `codec`'s.

Axes: B rows of one step (a bucket size), Ha action horizon, Ad model action dim, Da the robot's action dim.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from oxygen_jax.runtime import compile_cache
from oxygen_jax.runtime.engine import RequestError
from oxygen_jax.serving.records import Frame, FrameResult, StepOutput

log = logging.getLogger("oxygen_jax.serve")

_MAX_REASON = 300  # characters of an engine refusal quoted back to the client

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
        self._zero_line_at, self._zero_chunks = -float("inf"), 0  # the zero-chunk log line, once a second at most
        _listen_for_compiles()

    def _log_zero_chunk(self, f: Frame, why: str) -> None:
        """One line a second at most (engine thread only): a model whose chunks keep failing would otherwise log
        every robot's every frame."""
        self._zero_chunks += 1
        now = time.monotonic()
        if now - self._zero_line_at >= 1.0:
            log.warning("stream %d frame %d: all-zero chunk (--chunk-on-failure zeros): %s (%d such chunks since the "
                        "last line)", f.stream.id, f.index, _cut(why), self._zero_chunks)
            self._zero_line_at, self._zero_chunks = now, 0

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

    def _submit(self, frame: Frame) -> list[int]:
        """Queues the frame's requests, checked on the prep thread (`requests.check_requests`), on its stream.

        `Engine.enqueue` checks nothing (the prep thread did): every request is looked at before any is queued,
        so a refused frame leaves nothing to withdraw.
        """
        unchecked = [i for i, req in enumerate(frame.language) if req.checked is None]
        if unchecked:  # a caller that built the Frame without `check_requests`: this frame's error, not the step's
            raise RequestError(f"language_requests[{unchecked[0]}]: the request was not checked against the engine's "
                               "limits (serving.requests.check_requests)")
        return [self.engine.enqueue(dataclasses.replace(req.checked, row=frame.stream.id), owner=frame.stream)
                for req in frame.language]

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
                errors[id(f)] = f"BadRequest: {_cut(why)}; {self.codec.failure_advice}"
            elif i in res.fallbacks:  # the robot asked for openpi's zeros: it gets them, the log says why
                self._log_zero_chunk(f, res.fallbacks[i])
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
            language_queued=self.engine.num_queued, drafts_proposed=res.drafts_proposed if res else 0,
            drafts_accepted=res.drafts_accepted if res else 0)

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
