"""The host records of the policy server: a connected robot, a frame waiting for its step, and what comes back.

Plain dataclasses shared by the request parser (`serving.requests`), the batching policy
(`serving.batcher`), the engine thread (`serving.engine_worker`) and the per-robot outbox
(`serving.outbox`); none of them runs model code.

    Stream ──has──► Frame (observation + LanguageRequest list) ──step──► FrameResult, in a StepOutput

Axes: Ha action horizon, Da the robot's action dim, Ds its state dim.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import numpy as np

from oxygen_jax.runtime.engine import FailedRequest, FinishedRequest
from oxygen_jax.runtime.request_limits import CheckedRequest
from oxygen_jax.serving.outbox import LanguageOutbox


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
    """One language request carried by an observation: its fields as the robot sent them (type-checked,
    `requests.parse_language_requests`), then `checked` against the engine's limits (`requests.check_requests`)."""

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
    checked: CheckedRequest | None = None  # the fields the engine queues (`Engine.enqueue`; row set per frame)


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
    drafts_proposed: int = 0  # speculative decoding: draft tokens the step's verify steps checked
    drafts_accepted: int = 0  # of which emitted (`StepResult.drafts_accepted`)
