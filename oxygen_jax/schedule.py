"""Per-frame programs and the four execution settings, all built from the same pure functions.

Axes (`oxygen_jax.axes`): Fr frames, B observation rows (robots), Ha action horizon, Ad model
action dim (32), Ns decode slots, Rq requests in a rollout table, J admissions per frame, M max new
tokens; k = tokens_per_frame.

One control frame of the `continuous` setting (one compiled program, the pool donated):

    observation ──prefill──► prefix KV ──denoise (num_steps, read-only)──► actions
                                 │
                                 └──admit this frame's requests (copy prefix rows into free slots,
                                    run request prompts, sample token 0)
    decode pool ─────────────────┴──k batched decode steps over all active slots──► release finished

Settings (same params, observations, noise, requests and sampling policy):

* `isolated`   — actions program (prefill + denoise), then a text program with its own prefill that
                 decodes the frame's requests to completion; sequential.
* `shared_kv`  — one program: one prefill, denoise, and the frame's requests to completion.
* `continuous` — `frame_step` above: requests persist across frames, k tokens per frame.
* `parallel`   — the isolated programs dispatched concurrently from two host threads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax import decode
from oxygen_jax.decode import DecodePool, Requests
from oxygen_jax.lora import LoraBank
from oxygen_jax.model import denoise, prefill, sample_actions
from oxygen_jax.observation import Observation
from oxygen_jax.params import Params

SETTINGS = ("isolated", "parallel", "shared_kv", "continuous")
"""The four execution settings, baselines first (the one list every module uses)."""

BENCH_SETTINGS = SETTINGS + ("actions_only",)
"""What `eval.bench` can measure: the four settings plus the opt-in actions-only reference frame."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrameOutput:
    """What one continuous-batching frame returns to the host (one transfer).

    Attributes:
      actions: float32 [B, Ha, Ad].
      admitted: bool [J] which of this frame's offered requests got a slot.
      request_id: int32 [Ns] the request each slot served this frame (-1 = none).
      new_tokens: int32 [Ns, 1 + k] tokens emitted this frame: column 0 is token 0 of a request
        admitted this frame, columns 1.. the burst; -1 = nothing.
      finished: bool [Ns] the slot's request finished this frame (the slot is free again).
      num_generated: int32 [Ns] tokens of the slot's request so far.
      batch: int32 [] active slots in this frame's decode burst.
    """

    actions: jax.Array
    admitted: jax.Array
    request_id: jax.Array
    new_tokens: jax.Array
    finished: jax.Array
    num_generated: jax.Array
    batch: jax.Array


def _frame(params, pool, observation, noise, requests, num_steps, tokens_per_frame, evict=None, bank=None):
    if evict is not None:
        pool = decode.evict(pool, evict)
    # prefill and denoise never see the bank: actions and the prefix cache cannot depend on adapters.
    cache = prefill(params, observation)
    actions = denoise(params, cache, noise, num_steps)
    pool, admitted, first = decode.admit(params, pool, cache, requests, bank)
    served = pool.request_id
    batch = jnp.sum(pool.active, dtype=jnp.int32)
    pool, burst = decode.decode_burst(params, pool, tokens_per_frame, bank)
    pool, released = decode.release_finished(pool)
    out = FrameOutput(
        actions=actions, admitted=admitted, request_id=served,
        new_tokens=jnp.concatenate([first[:, None], burst], axis=1), finished=released.done,
        num_generated=released.num_generated, batch=batch,
    )
    return pool, out


@functools.partial(jax.jit, static_argnames=("num_steps", "tokens_per_frame"), donate_argnames=("pool",))
def frame_step(
    params: Params, pool: DecodePool, observation: Observation, noise: jax.Array, requests: Requests,
    evict: jax.Array | None = None, bank: LoraBank | None = None, *, num_steps: int, tokens_per_frame: int,
) -> tuple[DecodePool, FrameOutput]:
    """One control frame of continuous batching: prefill once, actions, admissions, k-token burst.

    Args:
      evict: optional bool [Ns]: slots to free before admitting (cancelled requests); pass an array
        every frame (all False when nothing is cancelled) so the program never changes.
      bank: optional language adapters (`lora.LoraBank` of the VLM expert) for the requests' and
        slots' adapter ids; only admission and decoding read it.
    Donates `pool`. Occupancy, arrivals, cancellations and finishing are array values: this compiles
    once per (shapes, num_steps, tokens_per_frame).
    """
    return _frame(params, pool, observation, noise, requests, num_steps, tokens_per_frame, evict, bank)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RequestTable:
    """All requests of a rollout, sorted by arrival frame (a FIFO queue on device).

    Attributes:
      requests: `Requests` of size Rq (valid = real entry).
      arrival_frame: int32 [Rq] non-decreasing.
    """

    requests: Requests
    arrival_frame: jax.Array


def make_request_table(arrival_frames, budgets, prompt_capacity: int = 0, **fields) -> RequestTable:
    """Host helper: a table with request ids 0..Rq-1 (seeds default to the ids).

    `fields` are forwarded to `decode.make_requests` (rows, prompts, stop_tokens, temperatures, ...).
    """
    arrival = np.asarray(arrival_frames, np.int32)
    if arrival.size and np.any(np.diff(arrival) < 0):
        raise ValueError("arrival_frames must be sorted (non-decreasing)")
    r = len(arrival)
    req = decode.make_requests(max(r, 1), prompt_capacity, list(range(r)), budgets=list(budgets), **fields)
    if r == 0:
        arrival = np.zeros((1,), np.int32)
    return RequestTable(requests=req, arrival_frame=arrival)


def _window(table: RequestTable, start, size: int, frame) -> Requests:
    """The next `size` table entries from `start` that have arrived by `frame` (valid ones first)."""
    r = table.arrival_frame.shape[0]
    idx = start + jnp.arange(size)
    inside = idx < r
    idx_c = jnp.minimum(idx, r - 1)
    req = jax.tree.map(lambda x: x[idx_c], table.requests)
    valid = inside & req.valid & (table.arrival_frame[idx_c] <= frame)
    valid = jnp.cumprod(valid.astype(jnp.int32)).astype(bool)  # keep the FIFO prefix only
    return dataclasses.replace(req, valid=valid)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutOutput:
    """Per-frame outputs of `rollout` ([Fr, ...] versions of `FrameOutput`) plus admission indices.

    `admitted_from` int32 [Fr]: table index of the first request offered in that frame.
    """

    frames: FrameOutput
    admitted_from: jax.Array


@functools.partial(
    jax.jit, static_argnames=("num_steps", "tokens_per_frame", "admissions_per_frame"), donate_argnames=("pool",)
)
def rollout(
    params: Params, pool: DecodePool, observations: Observation, noise: jax.Array, table: RequestTable,
    bank: LoraBank | None = None, *, num_steps: int, tokens_per_frame: int, admissions_per_frame: int,
) -> tuple[DecodePool, RolloutOutput]:
    """`frame_step` scanned over F frames: one compile for the whole rollout.

    Args:
      observations: `Observation` with a leading frame axis [Fr, B, ...].
      noise: [Fr, B, Ha, Ad].
      table: requests sorted by arrival; waiting requests queue (FIFO) until a slot is free and are
        then admitted with the observation of the frame that admits them.
    Returns:
      (pool, RolloutOutput with [Fr, ...] leaves).
    """

    def body(carry, inputs):
        pool, next_req = carry
        f, obs, nz = inputs
        offered = _window(table, next_req, admissions_per_frame, f)
        pool, out = _frame(params, pool, obs, nz, offered, num_steps, tokens_per_frame, bank=bank)
        return (pool, next_req + jnp.sum(out.admitted, dtype=jnp.int32)), (out, next_req)

    frames = noise.shape[0]
    (pool, _), (outs, starts) = jax.lax.scan(
        body, (pool, jnp.int32(0)), (jnp.arange(frames, dtype=jnp.int32), observations, noise)
    )
    return pool, RolloutOutput(frames=outs, admitted_from=starts)


# --- settings that decode each frame's requests to completion ------------------------------------


def _text_to_completion(params, cache, requests: Requests, max_new_tokens: int, bank=None):
    pool = decode.init_pool(params, requests.size, cache.length, max_new_tokens, requests.prompt.shape[1])
    pool, _, _ = decode.admit(params, pool, cache, requests, bank)
    pool = decode.decode_to_completion(params, pool, bank)
    # Slots are filled in request order, so slot j holds request j.
    return pool.tokens, pool.num_generated


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def text_program(params: Params, observation: Observation, requests: Requests, bank: LoraBank | None = None, *,
                 max_new_tokens: int):
    """Isolated text task: its own prefill, the requests decoded to completion.

    Returns:
      (tokens int32 [J, M], num_generated int32 [J]); row j is request j.
    """
    return _text_to_completion(params, prefill(params, observation), requests, max_new_tokens, bank)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def action_program(params: Params, observation: Observation, noise: jax.Array, *, num_steps: int) -> jax.Array:
    """Isolated action task: prefill + denoise."""
    return sample_actions(params, observation, noise, num_steps)


@functools.partial(jax.jit, static_argnames=("num_steps", "max_new_tokens"))
def shared_kv_program(
    params: Params, observation: Observation, noise: jax.Array, requests: Requests, bank: LoraBank | None = None, *,
    num_steps: int, max_new_tokens: int,
):
    """Shared KV without batching: one prefill serves the actions and the text (to completion).

    Returns:
      (actions [B, Ha, Ad], tokens [J, M], num_generated [J]).
    """
    cache = prefill(params, observation)
    actions = denoise(params, cache, noise, num_steps)
    tokens, n = _text_to_completion(params, cache, requests, max_new_tokens, bank)
    return actions, tokens, n


_PARALLEL_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def run_parallel(params, observation, noise, requests, bank=None, *, num_steps: int, max_new_tokens: int):
    """Action and text programs dispatched concurrently from two host threads; waits for both.

    Returns:
      (actions, tokens, num_generated), all on the host side as ready jax arrays.
    """
    global _PARALLEL_POOL
    if _PARALLEL_POOL is None:
        _PARALLEL_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="oxygen-parallel")
    act = _PARALLEL_POOL.submit(
        lambda: jax.block_until_ready(action_program(params, observation, noise, num_steps=num_steps))
    )
    txt = _PARALLEL_POOL.submit(
        lambda: jax.block_until_ready(text_program(params, observation, requests, bank, max_new_tokens=max_new_tokens))
    )
    tokens, n = txt.result()
    return act.result(), tokens, n
