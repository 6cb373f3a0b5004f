"""Real-time chunking per connection: each robot's last chunks, its reported progress, its RTC parameters.

A robot that executes chunks asynchronously sends its next observation while still executing the current
chunk, and keeps executing it while the server computes the next one. It tells the server, in the
observation's "rtc" map, which chunk it is executing and how far it got; the server denoises the new
chunk so that it continues that one (`runtime.rtc`). Everything is counted in actions the robot consumed,
never in wall-clock time. The protocol (docs/rtc.md has it with an example):

    observation "rtc": {"chunk": 12,          # the response rtc.chunk of the chunk being executed
                        "executed": 4,        # s: its actions executed when this observation was taken
                        "delay": 2,           # d: its actions the robot will execute before this reply
                        "mode": "guided", "schedule": "exp", "max_guidance": 5.0}   # kept per connection
    response    "rtc": {"chunk": 13, "new_from": 2, "previous": 12, "executed": 4, "delay": 2,
                        "mode": "guided", "fallback": null}

The new chunk's index 0 is the executed chunk's index s (the same control step); actions [0, new_from)
continue the committed ones (reproduced exactly in mode "trained", approximately when guided) and the
robot executes the new chunk from index `new_from` (or from the number of actions it actually consumed
while waiting, if more). A frame without "rtc" (an unmodified openpi client) is served exactly as
before: its row is off and its response has no "rtc" key. Fallbacks (the reply says which in "fallback";
the chunk is then a plain one, "new_from" 0): no "chunk" named (the first frame), a chunk id that is not
among the connection's last `KEEP_CHUNKS` chunks, or a chunk executed to its end. A delay longer than
what is left of the chunk (d > Ha - s) is cut to Ha - s: the robot runs out of the old chunk first and
holds its last action until the reply arrives (the client's documented fallback on a missed deadline).

Chunks are kept in the model's (normalised) action space of the primary head; robot formats whose output
depends on each frame's state (ALOHA's delta joints) would need them re-anchored, so RTC refuses them.

Threads: `on_frame`, `reply` and `forget` run on the event loop; `RtcEngine.step` (which calls `inputs` and
`record`) on the engine thread; one lock guards the sessions.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from oxygen_jax.runtime import rtc as rtc_mod
from oxygen_jax.serving.requests import BadRequest
from oxygen_jax.serving.wire import short

FIELDS = ("chunk", "executed", "delay", "mode", "schedule", "max_guidance")
KEEP_CHUNKS = 4  # chunks kept per connection (a client that dropped a late chunk may name an older one)
MAX_GUIDANCE = 100.0  # cap on β a client may set


@dataclasses.dataclass(frozen=True)
class RtcRequest:
    """One observation's "rtc" map, types and ranges checked (None: not sent)."""

    chunk: int | None = None
    executed: int | None = None
    delay: int | None = None
    mode: str | None = None
    schedule: str | None = None
    max_guidance: float | None = None


def _int(value, name: str, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= hi:
        raise BadRequest(f"rtc.{name} must be an integer in [0, {hi}], got {short(value)}")
    return int(value)


def parse(value, horizon: int, *, trained_ok: bool = True) -> RtcRequest | None:
    """The "rtc" field of one observation (None when absent). Raises BadRequest naming the bad key."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise BadRequest(f"rtc must be a map with keys {list(FIELDS)}, got {short(value)}")
    unknown = sorted(str(k) for k in value if k not in FIELDS)
    if unknown:
        raise BadRequest(f"rtc has unknown keys {short(unknown)}; known: {list(FIELDS)}")
    out = {}
    for name, hi in (("chunk", 2**62), ("executed", horizon), ("delay", horizon)):
        if value.get(name) is not None:
            out[name] = _int(value[name], name, hi)
    if ("chunk" in out) != ("executed" in out):
        raise BadRequest("rtc.chunk and rtc.executed go together: name the chunk being executed and how many of "
                         "its actions were executed when the observation was taken")
    for name, table in (("mode", rtc_mod.MODES), ("schedule", rtc_mod.SCHEDULES)):
        if value.get(name) is not None:
            if value[name] not in table:
                raise BadRequest(f"rtc.{name} must be one of {list(table)}, got {short(value[name])}")
            out[name] = value[name]
    if out.get("mode") == "trained" and not trained_ok:
        raise BadRequest("rtc.mode 'trained' needs per-token flow time, which this model's action head lacks; "
                         "use 'guided' or 'stop_gradient'")
    beta = value.get("max_guidance")
    if beta is not None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float, np.number)) or not 0 <= beta <= MAX_GUIDANCE:
            raise BadRequest(f"rtc.max_guidance must be a number in [0, {MAX_GUIDANCE:g}], got {short(beta)}")
        out["max_guidance"] = float(beta)
    return RtcRequest(**out)


@dataclasses.dataclass
class _Session:
    """One connection's RTC state: parameters kept across frames and its last chunks (model space [Ha, Ad])."""

    mode: str = "guided"
    schedule: str = "exp"
    max_guidance: float = 5.0
    delay: int = 0
    chunks: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    next_chunk: int = 0
    pending: RtcRequest | None = None
    reply: dict | None = None


class RtcSessions:
    """Every connection's RTC state, and the per-row inputs of one step built from it.

    Args:
      horizon, action_dim: the primary head's chunk shape [Ha, Ad] (model space).
      trained_ok: the primary head takes per-token flow time (π0.5, adarms_joint heads).
    """

    def __init__(self, horizon: int, action_dim: int, *, trained_ok: bool):
        self.horizon, self.action_dim, self.trained_ok = horizon, action_dim, trained_ok
        self._sessions: dict[int, _Session] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, engine, robot_name: str) -> "RtcSessions":
        if robot_name == "aloha":
            raise ValueError("ServeConfig.rtc: ALOHA's delta joint actions are relative to each frame's state, so a "
                             "kept chunk would need re-anchoring; RTC is served for libero and droid formats only")
        vla = engine.vla
        ha, ad = vla.action_shape(vla.primary, engine.config.action_horizon)
        trained = vla.spec.head(vla.primary).per_token_time
        return cls(ha, ad, trained_ok=trained)

    def parse(self, sample: Mapping) -> RtcRequest | None:
        return parse(sample.get("rtc"), self.horizon, trained_ok=self.trained_ok)

    def metadata(self) -> dict:
        return {"field": "rtc", "fields": list(FIELDS), "modes": list(rtc_mod.MODES),
                "schedules": list(rtc_mod.SCHEDULES), "keep_chunks": KEEP_CHUNKS, "max_guidance": MAX_GUIDANCE,
                "trained": self.trained_ok}

    # -- event loop -------------------------------------------------------------------------------

    def on_frame(self, stream: int, request: RtcRequest | None) -> None:
        """Files this frame's request for the step that takes the stream's row (frames are lock-step)."""
        with self._lock:
            if request is None:
                s = self._sessions.get(stream)
                if s is not None:
                    s.pending = None
                return
            s = self._sessions.setdefault(stream, _Session())
            s.pending, s.reply = request, None

    def reply(self, stream: int) -> dict:
        """{"rtc": {...}} for the response to the stream's last stepped frame that asked for RTC, else {}."""
        with self._lock:
            s = self._sessions.get(stream)
            if s is None or s.reply is None:
                return {}
            out, s.reply = s.reply, None
            return {"rtc": out}

    def forget(self, stream: int) -> None:
        with self._lock:
            self._sessions.pop(stream, None)

    # -- engine thread ----------------------------------------------------------------------------

    def _plan(self, s: _Session) -> dict:
        """What this frame's row does: RTC row inputs (or off) and the reply fields."""
        req = s.pending
        for name in ("mode", "schedule", "max_guidance", "delay"):
            if getattr(req, name) is not None:
                setattr(s, name, getattr(req, name))
        plan = dict(mode="off", previous=req.chunk, executed=req.executed, delay=0, new_from=0, fallback=None)
        if s.mode == "off":
            return plan
        if req.chunk is None:
            plan["fallback"] = "no chunk named (a first frame): a plain chunk; name it in rtc.chunk next time"
        elif req.chunk not in s.chunks:
            plan["fallback"] = (f"chunk {req.chunk} is not one of this connection's last {KEEP_CHUNKS} chunks "
                                f"{list(s.chunks)}: a plain chunk")
        elif req.executed >= self.horizon:
            plan["fallback"] = f"chunk {req.chunk} was executed to its end ({self.horizon} actions): a plain chunk"
        else:
            d = min(s.delay, self.horizon - req.executed)
            old = s.chunks[req.chunk]
            plan.update(mode=s.mode, delay=d, new_from=d, prev=np.concatenate(
                [old[req.executed:], np.zeros_like(old[:req.executed])], axis=0))
        return plan

    def inputs(self, rows: Sequence[int], batch: int) -> tuple[rtc_mod.RtcInputs | None, list[dict | None]]:
        """The step's RTC inputs for rows (stream ids, -1 padding), None when every row is off; and each row's plan.

        One lock section: a connection closing meanwhile (`forget`, on the event loop) either happens
        before (its row is planned as absent: off) or after (its plan stands; `record` skips it).
        """
        with self._lock:
            plans = []
            for r in rows:
                s = self._sessions.get(r) if r >= 0 else None
                plan = self._plan(s) if s is not None and s.pending is not None else None
                if plan is not None and plan["mode"] != "off":
                    plan.update(schedule=s.schedule, max_guidance=s.max_guidance)
                plans.append(plan)
        if all(p is None or p["mode"] == "off" for p in plans):
            return None, plans
        prev = np.zeros((batch, self.horizon, self.action_dim), np.float32)
        d, s, mode, sched = (np.zeros(batch, np.int32) for _ in range(4))
        beta = np.zeros(batch, np.float32)
        for i, p in enumerate(plans):
            if p is None or p["mode"] == "off":
                continue
            prev[i], d[i], s[i] = p["prev"], p["delay"], p["executed"]
            mode[i], sched[i] = rtc_mod.MODES.index(p["mode"]), rtc_mod.SCHEDULES.index(p["schedule"])
            beta[i] = p["max_guidance"]
        return rtc_mod.RtcInputs(prev_chunk=prev, delay=d, horizon=s, schedule=sched, max_guidance=beta,
                                 mode=mode), plans

    def record(self, rows: Sequence[int], chunks: np.ndarray, plans: Sequence[dict | None],
               refused: Sequence[int] = ()) -> None:
        """Keeps each RTC row's new chunk (model space) under a fresh id and files its reply.

        Rows in `refused` (batch rows whose frame was refused, e.g. non-finite actions) keep nothing: their
        chunk is never continued. A session closed since `inputs` is skipped.
        """
        with self._lock:
            for i, (r, p) in enumerate(zip(rows, plans)):
                s = self._sessions.get(r) if p is not None else None
                if s is None:
                    continue
                if i in refused:
                    s.pending = None
                    continue
                cid = s.next_chunk
                s.next_chunk += 1
                s.chunks[cid] = np.array(chunks[i], np.float32)
                while len(s.chunks) > KEEP_CHUNKS:
                    s.chunks.popitem(last=False)
                s.pending = None
                s.reply = {"chunk": cid, **{k: p[k] for k in ("new_from", "previous", "executed", "delay", "mode",
                                                               "fallback")}}


class RtcEngine:
    """The engine as `engine_worker.EngineWorker` calls it, with each stream's RTC inputs added to its row.

    Every attribute but `warmup` and `step` is the engine's. Steps where no row asks for RTC run the plain
    program (bit-identical to a server without RTC); the others run the RTC program, where off rows are
    bit-identical to plain denoise (`runtime.rtc`). `warmup` compiles both.
    """

    def __init__(self, engine, sessions: RtcSessions):
        self.engine, self.sessions = engine, sessions

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def warmup(self, observation, states=None) -> float:
        b = self.engine.vla.batch_size(observation)
        plain = self.engine.warmup(observation, states)
        guided = self.engine.warmup(observation, states, rtc=rtc_mod.off(b, self.sessions.horizon,
                                                                          self.sessions.action_dim))
        return max(plain, guided)  # the step-time prediction: the slower of the two programs

    def padding_steps(self, observation, noise, *, rows, states=None) -> float:
        """Warm-up on a device mesh (`EngineWorker.warmup`): a padding step of each program, plain then RTC
        with every row off, so neither compiles while serving. Returns the slower step's seconds (as
        `warmup` does: the step-time prediction)."""
        b = self.engine.vla.batch_size(observation)
        seconds = []
        for rtc in (None, rtc_mod.off(b, self.sessions.horizon, self.sessions.action_dim)):
            start = time.perf_counter()
            self.engine.step(observation, noise, rows=rows, states=states, **({} if rtc is None else {"rtc": rtc}))
            seconds.append(time.perf_counter() - start)
        return max(seconds)

    def step(self, observation, noise=None, *, rows=None, states=None):
        b = self.engine.vla.batch_size(observation)
        rows = list(range(b)) if rows is None else list(rows)
        inputs, plans = self.sessions.inputs(rows, b)
        res = self.engine.step(observation, noise, rows=rows, states=states, rtc=inputs)
        self.sessions.record(rows, res.head_actions[self.engine.vla.primary], plans, refused=res.row_errors)
        return res
