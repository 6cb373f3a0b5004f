"""Host-side engine for online use: a robot loop or a server steps it once per control frame.

    engine = Engine(params, EngineConfig(num_slots=8, max_new_tokens=30, tokens_per_frame=5))
    rid = engine.submit(prompt_tokens=[...], max_tokens=20)       # any time, from the host
    result = engine.step(observation)                            # one compiled frame
    result.actions          # [B, Ha, A] this frame's action chunk (never waits for text)
    result.finished         # list of FinishedRequest (tokens, text, latency in frames and ms)

Requests wait in a FIFO queue while every slot is busy; none is dropped, and memory is bounded by
the pool. One device→host transfer per frame brings back actions, new tokens and finish flags.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import numpy as np

from oxygen_jax import decode
from oxygen_jax.config import EOS_ID
from oxygen_jax.observation import Observation, validate_observation
from oxygen_jax.params import Params
from oxygen_jax.schedule import FrameOutput, frame_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    num_slots: int = 8  # S: concurrent language requests
    max_new_tokens: int = 32  # G: per-request token cap (budgets above it are rejected)
    prompt_capacity: int = 0  # Q: max request-prompt tokens written after the shared prefix
    admissions_per_frame: int = 4  # J: requests admitted per frame at most
    tokens_per_frame: int = 5  # k
    num_steps: int = 10  # denoising steps S
    action_horizon: int = 10  # Ha, for the noise the engine draws when step() gets none
    seed: int = 0  # noise seed (frame f uses fold_in(seed, f))

    def __post_init__(self):
        for f in ("num_slots", "max_new_tokens", "admissions_per_frame", "tokens_per_frame", "num_steps", "action_horizon"):
            if getattr(self, f) < 1:
                raise ValueError(f"EngineConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.prompt_capacity < 0:
            raise ValueError("EngineConfig.prompt_capacity must be >= 0")


@dataclasses.dataclass
class _Record:
    request_id: int
    arrival_frame: int
    arrival_time: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    admit_frame: int | None = None
    detok: object | None = None


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
    request_id: int
    tokens: list[int]
    text: str | None
    arrival_frame: int
    admit_frame: int
    finish_frame: int
    latency_frames: int  # finish frame - arrival frame + 1 (a request finished in its arrival frame took 1)
    latency_ms: float  # arrival (submit) to the end of the frame that emitted its last token


@dataclasses.dataclass(frozen=True)
class StepResult:
    actions: np.ndarray  # [B, Ha, A]
    finished: list[FinishedRequest]
    new_text: dict[int, str]  # request id -> text completed this frame (with a tokenizer)
    frame: int
    frame_ms: float
    batch: int  # active slots in this frame's decode burst
    queued: int  # requests still waiting for a slot after this frame


class Engine:
    """Continuous-batching engine over `schedule.frame_step` (one compiled program per frame)."""

    def __init__(self, params: Params, config: EngineConfig = EngineConfig(), tokenizer=None):
        self.params, self.config, self.tokenizer = params, config, tokenizer
        self._pool: decode.DecodePool | None = None
        self._queue: collections.deque[tuple[_Record, dict]] = collections.deque()
        self._live: dict[int, _Record] = {}
        self._next_id = 0
        self._frame = 0
        self._base_key = jax.random.key(config.seed)

    # -- requests -------------------------------------------------------------------------------

    def submit(
        self,
        prompt_tokens=None,
        *,
        prompt: str | None = None,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token: int | None = EOS_ID,
        seed: int | None = None,
        row: int = 0,
    ) -> int:
        """Queues a language request on the observation row `row`; returns its id.

        The request continues the prefix of the observation of the frame that admits it. Its own
        prompt (`prompt_tokens`, or `prompt` text with a tokenizer) is written after that prefix.
        `stop_token=None` decodes exactly `max_tokens` tokens.
        """
        cfg = self.config
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt_tokens or Engine(..., tokenizer=...)")
            prompt_tokens = self.tokenizer.encode(prompt)
        prompt_tokens = list(prompt_tokens or [])
        if len(prompt_tokens) > cfg.prompt_capacity:
            raise ValueError(
                f"request prompt has {len(prompt_tokens)} tokens but EngineConfig.prompt_capacity is {cfg.prompt_capacity}"
            )
        vocab = self.params.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_tokens):
            raise ValueError(f"request prompt token ids must lie in [0, {vocab})")
        if not 1 <= max_tokens <= cfg.max_new_tokens:
            raise ValueError(f"max_tokens must be in [1, {cfg.max_new_tokens}] (EngineConfig.max_new_tokens), got {max_tokens}")
        if not (temperature >= 0 and np.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        rid = self._next_id
        self._next_id += 1
        rec = _Record(rid, self._frame, time.perf_counter())
        if self.tokenizer is not None:
            from oxygen_jax.tokenizer import StreamDetokenizer

            rec.detok = StreamDetokenizer(self.tokenizer)
        fields = dict(
            rows=[row], prompts=[prompt_tokens], budgets=[max_tokens],
            stop_tokens=[-1 if stop_token is None else stop_token], temperatures=[temperature], top_ps=[top_p],
            seeds=[rid if seed is None else seed],
        )
        self._queue.append((rec, fields))
        return rid

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_active(self) -> int:
        return len(self._live)

    # -- frames ---------------------------------------------------------------------------------

    def _offer(self, free: int) -> tuple[decode.Requests, list[_Record]]:
        take = [self._queue[i] for i in range(min(free, self.config.admissions_per_frame, len(self._queue)))]
        merged = {k: [v for _, f in take for v in f[k]] for k in (take[0][1] if take else {})}
        reqs = decode.make_requests(
            self.config.admissions_per_frame, self.config.prompt_capacity, [r.request_id for r, _ in take],
            **(merged or {}),
        )
        return reqs, [r for r, _ in take]

    def step(self, observation: Observation, noise: jax.Array | None = None) -> StepResult:
        """Runs one control frame with this frame's observation; returns actions and finished texts."""
        validate_observation(observation, self.params.config)
        b = observation.batch_size
        for rec, fields in self._queue:
            if fields["rows"][0] >= b:
                raise ValueError(f"request {rec.request_id} targets observation row {fields['rows'][0]} but the batch has {b}")
        cfg = self.config
        if self._pool is None:
            prefix_len = observation.num_cameras * self.params.config.siglip.num_patches + observation.tokens.shape[1]
            self._pool = decode.init_pool(self.params, cfg.num_slots, prefix_len, cfg.max_new_tokens, cfg.prompt_capacity)
        prefix_len = observation.num_cameras * self.params.config.siglip.num_patches + observation.tokens.shape[1]
        if prefix_len != self._pool.prefix_len:
            raise ValueError(
                f"observation prefix length changed from {self._pool.prefix_len} to {prefix_len} tokens "
                "(cameras or prompt length); in-flight requests hold caches of the old length. Keep the camera "
                "set and the prompt length (or its bucket) fixed for an engine."
            )
        if noise is None:
            shape = (b, cfg.action_horizon, self.params.config.action_dim)
            noise = jax.random.normal(jax.random.fold_in(self._base_key, self._frame), shape)
        free = cfg.num_slots - len(self._live)
        requests, offered = self._offer(free)
        start = time.perf_counter()
        self._pool, out = frame_step(
            self.params, self._pool, observation, noise, requests, num_steps=cfg.num_steps,
            tokens_per_frame=cfg.tokens_per_frame,
        )
        out: FrameOutput = jax.device_get(out)  # the frame's single host sync
        end = time.perf_counter()
        return self._absorb(out, offered, start, end)

    def _absorb(self, out: FrameOutput, offered: list[_Record], start: float, end: float) -> StepResult:
        frame = self._frame
        for rec, ok in zip(offered, out.admitted[: len(offered)]):
            if ok:
                self._queue.popleft()
                rec.admit_frame = frame
                self._live[rec.request_id] = rec
        finished, new_text = [], {}
        for slot, rid in enumerate(out.request_id):
            if rid < 0:
                continue
            rec = self._live[int(rid)]
            toks = [int(t) for t in out.new_tokens[slot] if t >= 0]
            rec.tokens += toks
            if rec.detok is not None and toks:
                new_text[rec.request_id] = rec.detok.push(toks)
            if out.finished[slot]:
                del self._live[rec.request_id]
                text = None
                if rec.detok is not None:
                    tail = rec.detok.flush()
                    if tail:
                        new_text[rec.request_id] = new_text.get(rec.request_id, "") + tail
                    text = rec.detok.text
                finished.append(
                    FinishedRequest(
                        request_id=rec.request_id, tokens=rec.tokens, text=text, arrival_frame=rec.arrival_frame,
                        admit_frame=rec.admit_frame, finish_frame=frame, latency_frames=frame - rec.arrival_frame + 1,
                        latency_ms=(end - rec.arrival_time) * 1e3,
                    )
                )
        self._frame += 1
        return StepResult(
            actions=np.asarray(out.actions), finished=finished, new_text=new_text, frame=frame,
            frame_ms=(end - start) * 1e3, batch=int(out.batch), queued=len(self._queue),
        )
