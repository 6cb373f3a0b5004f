"""Action chunks decoded as token streams in the shared slot pool, each robot stopping on its own (π0-FAST).

A model whose `action_stream` is set (`models.decoded_actions`) has no action head: its decoder writes each
robot's chunk. One control frame of such a model (what `Engine.step` runs for it):

    inputs ──prefix (once)──► prefix ─┬─► admit one action stream per robot row (first, into the kept slots)
                                      └─► admit this frame's language requests (the slots language may hold)
    pool ──burst of k steps, every active slot──► [action streams still running?] ──another burst── ...
         ──► evict streams past the deadline, release finished slots ──► chunks read on the host

* Each stream stops at its own stop id (EOS, "|"), not when every row has (openpi's lockstep rule): a row that
  ends early frees its slot at the frame's end and costs nothing more; bursts go on only while some robot's
  chunk is unfinished. Language requests decode in the same bursts, beside the streams (their steps are free:
  the burst's shape is fixed), and persist across frames as usual.
* A deadline bounds a frame: `StreamConfig.deadline_steps` decode steps (whole bursts of k) and/or
  `deadline_ms` of wall time checked between bursts. A stream still running then, one that reached
  `max_tokens` without a stop, or whose tokens are no chunk (`decoded_actions.ChunkError`) fails THAT row:
  `StepResult.row_errors` names it and the other rows are served. openpi's zero chunk only with
  `on_failure="zeros"` (the reason then in `StepResult.fallbacks`).
* Slots: language requests hold at most Ns - `slots` slots (`Scheduler(reserved=...)`), so every frame finds
  `slots` free ones for its streams (all released at the frame's end). A row beyond them fails alone.

Compiled programs: `stream_frame` (per observation shape), `decode.decode_burst` (k) and `close_frame`; all
compiled by `warmup`, none per frame afterwards.

Axes: B rows, Ns slots, J admissions, k tokens per burst, Ha horizon, Ad action dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models.decoded_actions import ActionStream, ChunkError
from oxygen_jax.runtime import decode
from oxygen_jax.runtime.decode import DecodePool, Requests
from oxygen_jax.runtime.frame import FrameOutput

STREAM_ID_BASE = 2**30
"""Pool request id of the action stream of batch row i: STREAM_ID_BASE + i (language request ids stay below)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """How an engine decodes action streams (models with `action_stream`)."""

    slots: int | None = None  # decode slots kept for streams (language holds the rest); None: half the pool, >= 1
    max_tokens: int = 0  # tokens per chunk at most (0: the model's ActionStream.max_tokens, capped by the pool's M)
    deadline_steps: int = 0  # decode steps a frame may run for its chunks (0: max_tokens); whole bursts of k
    deadline_ms: float = 0.0  # wall time a frame's chunks may take, checked between bursts (0: no wall deadline)
    on_failure: Literal["error", "zeros"] = "error"  # "zeros": openpi's silent zero chunk (reason in `fallbacks`)

    def __post_init__(self):
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"StreamConfig.slots must be >= 1 (slots kept for robots' chunks) or None, got {self.slots}")
        if self.max_tokens < 0 or self.deadline_steps < 0:
            raise ValueError("StreamConfig.max_tokens and deadline_steps must be >= 0 (0: the default)")
        if not 0 <= self.deadline_ms < float("inf"):
            raise ValueError(f"StreamConfig.deadline_ms must be a finite number >= 0 (0: none), got {self.deadline_ms}")
        if self.on_failure not in ("error", "zeros"):
            raise ValueError(f"StreamConfig.on_failure must be 'error' or 'zeros', got {self.on_failure!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamBurst:
    """The first burst of a stream frame: admitted bool [J] (language), request_id int32 [Ns] served,
    new_tokens int32 [Ns, 1 + k] (token 0 of this frame's admissions, then the burst), active bool [Ns] after
    it, batch int32 [] active slots in it."""

    admitted: jax.Array
    request_id: jax.Array
    new_tokens: jax.Array
    active: jax.Array
    batch: jax.Array


@functools.partial(jax.jit, static_argnames=("tokens_per_frame",), donate_argnames=("pool",))
def stream_frame(vla, pool: DecodePool, inputs, streams: Requests, requests: Requests, evict: jax.Array,
                 bank=None, *, tokens_per_frame: int) -> tuple[DecodePool, StreamBurst]:
    """One prefix pass, the action streams admitted first (base weights), then the language requests, one burst.

    Args:
      vla: a model with `action_stream` (`decoded_actions.DecodedActions`).
      streams: one `Requests` entry per real robot row (request id STREAM_ID_BASE + row), valid ones first.
      requests, evict, bank: as `frame.frame_step`.
    Donates `pool`.
    """
    pool = decode.evict(pool, evict)
    prefix = vla.prefix(inputs)
    lm = vla.language()
    pool, _, first_streams = decode.admit(lm, pool, prefix, streams)
    pool, admitted, first = decode.admit(lm, pool, prefix, requests, bank)
    served = pool.request_id
    batch = jnp.sum(pool.active, dtype=jnp.int32)
    pool, burst = decode.decode_burst(lm, pool, tokens_per_frame, bank)
    first = jnp.maximum(first, first_streams)  # disjoint slots, -1 elsewhere
    return pool, StreamBurst(admitted=admitted, request_id=served, active=pool.active, batch=batch,
                             new_tokens=jnp.concatenate([first[:, None], burst], axis=1))


@functools.partial(jax.jit, donate_argnames=("pool",))
def close_frame(pool: DecodePool, unfinished: jax.Array) -> tuple[DecodePool, decode.Released]:
    """Evicts the streams past the deadline (bool [Ns]) and releases every finished slot. Donates `pool`."""
    return decode.release_finished(decode.evict(pool, unfinished))


@dataclasses.dataclass(frozen=True)
class Chunks:
    """One frame's chunks: actions float32 [B, Ha, Ad] (zeros on failed and padding rows), errors batch row -> why
    (on_failure "error"), fallbacks batch row -> why (a zero chunk under on_failure "zeros"), tokens batch row ->
    the stream's ids, and the decode steps the frame ran."""

    actions: np.ndarray
    errors: dict[int, str]
    fallbacks: dict[int, str]
    tokens: dict[int, list[int]]
    steps: int


class Streams:
    """An engine's action streams: the stream, its limits and the host side of a stream frame."""

    def __init__(self, stream: ActionStream, config: StreamConfig, *, num_slots: int, max_new_tokens: int,
                 prompt_capacity: int, tokens_per_frame: int):
        self.stream, self.config, self.k = stream, config, tokens_per_frame
        self.slots = config.slots if config.slots is not None else max(1, num_slots // 2)
        if self.slots > num_slots:
            raise ValueError(f"StreamConfig.slots = {self.slots} exceeds the pool's {num_slots} slots (EngineConfig.num_slots)")
        self.max_tokens = config.max_tokens or min(stream.max_tokens, max_new_tokens)
        if self.max_tokens > max_new_tokens:
            raise ValueError(f"chunks of up to {self.max_tokens} tokens do not fit slots of EngineConfig.max_new_tokens = "
                             f"{max_new_tokens}: raise max_new_tokens or lower StreamConfig.max_tokens")
        if len(stream.prompt_ids) > prompt_capacity:
            raise ValueError(f"the action stream's prompt has {len(stream.prompt_ids)} tokens but "
                             f"EngineConfig.prompt_capacity is {prompt_capacity}")
        self.deadline_steps = config.deadline_steps or self.max_tokens
        self.prompt_capacity = prompt_capacity

    def requests(self, rows: Sequence[int]) -> Requests:
        """One stream per real batch row (rows[i] >= 0), padded to len(rows) entries."""
        real = [i for i, r in enumerate(rows) if r >= 0]
        s = self.stream
        return decode.make_requests(len(rows), self.prompt_capacity, [STREAM_ID_BASE + i for i in real], rows=real,
                                    prompts=[list(s.prompt_ids)] * len(real), budgets=[self.max_tokens] * len(real),
                                    stop_ids=[s.stop_ids] * len(real))

    def run(self, vla, pool: DecodePool, inputs, rows: Sequence[int], requests: Requests, evict, bank=None,
            streams: Requests | None = None):
        """One stream frame (module docstring): (pool, host `FrameOutput` for the scheduler, `Chunks`).

        `streams`: the rows' stream entries (default `requests(rows)`; `eval.bench.fast` gives rows their own
        budgets to stand in for a trained model's chunk lengths)."""
        start = time.perf_counter()
        streams = self.requests(rows) if streams is None else streams
        pool, first = stream_frame(vla, pool, inputs, streams, requests, evict, bank, tokens_per_frame=self.k)
        first = jax.device_get(first)
        served, active = np.asarray(first.request_id), np.asarray(first.active)
        columns, steps = [np.asarray(first.new_tokens)], self.k
        streaming = served >= STREAM_ID_BASE
        lm = vla.language()
        bursts = math.ceil(self.deadline_steps / self.k)
        wall = self.config.deadline_ms / 1e3
        for _ in range(bursts - 1):
            if not (active & streaming).any() or (wall and time.perf_counter() - start > wall):
                break
            pool, toks = decode.decode_burst(lm, pool, self.k, bank)
            toks, active = jax.device_get((toks, pool.active))
            columns.append(np.asarray(toks))
            active, steps = np.asarray(active), steps + self.k
        late = active & streaming
        pool, released = close_frame(pool, late)
        released = jax.device_get(released)
        new_tokens = np.concatenate(columns, axis=1)
        out = FrameOutput(actions={}, admitted=np.asarray(first.admitted), request_id=served, new_tokens=new_tokens,
                          finished=np.asarray(released.done) & ~streaming, num_generated=np.asarray(released.num_generated),
                          batch=np.asarray(first.batch))
        return pool, out, self._chunks(rows, served, new_tokens, late, steps, time.perf_counter() - start)

    def _chunks(self, rows, served, new_tokens, late, steps: int, seconds: float) -> Chunks:
        b = len(rows)
        actions = np.zeros((b, *self.stream.shape), np.float32)
        errors, fallbacks, tokens = {}, {}, {}
        slot_of = {int(r) - STREAM_ID_BASE: s for s, r in enumerate(served) if r >= STREAM_ID_BASE}
        for i in (i for i, r in enumerate(rows) if r >= 0):
            slot = slot_of.get(i)
            if slot is None:
                why = (f"no free decode slot for its action chunk (StreamConfig.slots = {self.slots} kept for "
                       f"chunks; {sum(r >= 0 for r in rows)} robots this frame)")
            else:
                toks = [int(t) for t in new_tokens[slot] if t >= 0]
                tokens[i] = toks
                why = self._why_failed(toks, bool(late[slot]), steps, seconds)
            if why is None:
                try:
                    actions[i] = self.stream.chunk(toks)
                    continue
                except ChunkError as e:
                    why = f"its action chunk failed to decode: {e}"
            (fallbacks if self.config.on_failure == "zeros" else errors)[i] = why
        return Chunks(actions=actions, errors=errors, fallbacks=fallbacks, tokens=tokens, steps=steps)

    def _why_failed(self, toks: list[int], late: bool, steps: int, seconds: float) -> str | None:
        if late:
            limit = f"{steps} decode steps" + (f" / {self.config.deadline_ms:g} ms" if self.config.deadline_ms else "")
            return (f"its action chunk did not finish within the frame's deadline ({limit}; {len(toks)} tokens "
                    f"decoded in {seconds * 1e3:.0f} ms)")
        if not toks or toks[-1] not in self.stream.stop_ids:
            return f"its action chunk reached {self.max_tokens} tokens without a stop id {self.stream.stop_ids}"
        return None

    def warmup(self, vla, pool: DecodePool, inputs, requests: Requests, bank=None) -> None:
        """Compiles the three programs for this observation shape on a scratch `pool` (consumed)."""
        b = vla.batch_size(inputs)
        pool, first = stream_frame(vla, pool, inputs, self.requests(list(range(b))), requests,
                                   np.zeros((pool.num_slots,), bool), bank, tokens_per_frame=self.k)
        pool, _ = decode.decode_burst(vla.language(), pool, self.k, bank)
        jax.block_until_ready(close_frame(pool, np.zeros((pool.num_slots,), bool)))
