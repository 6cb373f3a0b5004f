"""Per-frame programs and the four execution settings, one family for every model (`models.vla.MultiHead`).

Axes (`oxygen_jax.axes`): Fr frames, B observation rows (robots), Ha action horizon, Ad action dim,
Ns decode slots, Rq requests in a rollout table, J admissions per frame, M max new tokens;
k = tokens_per_frame.

One control frame of the `continuous` setting (one compiled program, the pool donated):

    inputs ──prefix (once)──► prefix ─┬─► head 1 (π0.5: "actions"): denoise, read-only ──► actions
                                      ├─► head 2 ... (several heads: XR0, StarVLA, GR00T on one Qwen3-VL prefix)
                                      └─► admit this frame's requests (copy prefix rows into free slots,
                                          run request prompts, sample token 0)
    decode pool ──────────────────────────k batched decode steps over all active slots──► release finished

Settings (same model, inputs, noise, requests and sampling policy):

* `isolated`   — every head its own program (its own prefix pass keeping only its reads), then a text
                 program with its own prefix pass that decodes the frame's requests to completion; sequential.
* `parallel`   — those programs dispatched concurrently, one host thread each.
* `shared_kv`  — one program: one prefix pass, every head, and the frame's requests to completion.
* `continuous` — `frame_step` above: requests persist across frames, k tokens per frame.

A head's actions are bit-identical in all four (and to that head run alone), with or without other
heads and language requests in the frame (tested).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models.lora import LoraBank
from oxygen_jax.runtime import compile_cache, decode, rtc as rtc_mod, speculative
from oxygen_jax.runtime.decode import DecodePool, Requests
from oxygen_jax.models.vla import MultiHead as Vla

SETTINGS = ("isolated", "parallel", "shared_kv", "continuous")
"""The four execution settings, baselines first (the one list every module uses)."""

BENCH_SETTINGS = SETTINGS + ("actions_only",)
"""What `eval.bench` can measure: the four settings plus the opt-in actions-only reference frame."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrameOutput:
    """What one continuous-batching frame returns to the host (one transfer).

    Attributes:
      actions: head name -> float32 [B, Ha, Ad] of that head (π0.5: the one head "actions").
      admitted: bool [J] which of this frame's offered requests got a slot.
      request_id: int32 [Ns] the request each slot served this frame (-1 = none).
      new_tokens: int32 [Ns, 1 + k] tokens emitted this frame: column 0 is token 0 of a request
        admitted this frame, columns 1.. the burst; -1 = nothing. A speculative pool: [Ns, 1 + k (γ + 1)],
        verify step s in columns 1 + s (γ + 1) ..., in order; `speculative.REJECTED` (-2) at drafts not emitted
        (`speculative.STOPPED` (-3) at the first of them where a stop id inside the accepted draft ended the block).
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


def _language(lm, pool, prefix, requests, tokens_per_frame, bank=None):
    """This frame's language work on the pool: admit from `prefix`, one k-token burst, release."""
    pool, admitted, first = decode.admit(lm, pool, prefix, requests, bank)
    served = pool.request_id
    batch = jnp.sum(pool.active, dtype=jnp.int32)
    if pool.draft_len:  # a speculative pool: k verify steps of γ + 1 tokens each (`runtime.speculative`)
        pool, burst = speculative.verify_burst(lm, pool, tokens_per_frame, bank)
    else:
        pool, burst = decode.decode_burst(lm, pool, tokens_per_frame, bank)
    pool, released = decode.release_finished(pool)
    return pool, dict(admitted=admitted, request_id=served, new_tokens=jnp.concatenate([first[:, None], burst], axis=1),
                      finished=released.done, num_generated=released.num_generated, batch=batch)


def _frame(vla: Vla, pool, inputs, noises, states, requests, tokens_per_frame, evict=None, bank=None, rtc=None):
    if evict is not None:
        pool = decode.evict(pool, evict)
    # The prefix and the heads never see the bank: actions and the prefix cannot depend on adapters.
    prefix = vla.prefix(inputs)
    if rtc is None:
        actions = vla.actions(prefix, noises, states)
    else:  # real-time chunking on the named heads; language reads the same prefix, untouched
        actions = rtc_mod.vla_actions(vla, prefix, noises, states, rtc)
    pool, text = _language(vla.language(), pool, prefix, requests, tokens_per_frame, bank)
    return pool, FrameOutput(actions=actions, **text)


@functools.partial(jax.jit, static_argnames=("tokens_per_frame",), donate_argnames=("pool",))
def frame_step(
    vla: Vla, pool: DecodePool, inputs, noises: dict[str, jax.Array], requests: Requests,
    evict: jax.Array | None = None, bank: LoraBank | None = None, states: dict[str, jax.Array] | None = None,
    rtc: dict | None = None, *, tokens_per_frame: int,
) -> tuple[DecodePool, FrameOutput]:
    """One control frame of continuous batching: one prefix pass, every head, admissions, a k-token burst.

    Args:
      vla: the model, a `models.vla.MultiHead` (π0.5: `pi05.model.as_vla(params, num_steps)`).
      pool: a `decode.init_pool(vla.language(), ...)` pool; donated.
      inputs: this frame's observation (`Observation` for π0.5, `mot.PrefixInputs` for a `ModelSpec`).
      noises: head name -> noise [B, Ha, Ad]; exactly the model's heads.
      evict: optional bool [Ns]: slots to free before admitting (cancelled requests); pass an array
        every frame (all False when nothing is cancelled) so the program never changes.
      bank: optional language adapters (`lora.LoraBank` of the language decoder) for the requests' and
        slots' adapter ids; only admission and decoding read it.
      states: head name -> robot state [B, Ds] for heads with a state token (None: no such head).
      rtc: optional head name -> `runtime.rtc.RtcInputs` (per-row real-time chunking: previous chunk, d, s,
        schedule, β, mode; all arrays, so changing them never recompiles). None: plain denoise.
    Donates `pool`. Occupancy, arrivals, cancellations and finishing are array values: this compiles
    once per (model spec, shapes, tokens_per_frame).
    """
    return _frame(vla, pool, inputs, noises, states, requests, tokens_per_frame, evict, bank, rtc)


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

    `fields` are forwarded to `decode.make_requests` (rows, prompts, stop_ids, temperatures, ...).
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


@functools.partial(jax.jit, static_argnames=("tokens_per_frame", "admissions_per_frame"), donate_argnames=("pool",))
def rollout(
    vla: Vla, pool: DecodePool, inputs, noises: dict[str, jax.Array], table: RequestTable,
    bank: LoraBank | None = None, states: dict[str, jax.Array] | None = None, rtc: dict | None = None, *,
    tokens_per_frame: int, admissions_per_frame: int,
) -> tuple[DecodePool, RolloutOutput]:
    """`frame_step` scanned over Fr frames: one compile for the whole rollout.

    Args:
      inputs: the frames' observations with a leading frame axis [Fr, B, ...].
      noises: head name -> [Fr, B, Ha, Ad]; states: head name -> [Fr, B, Ds] (or None).
      rtc: optional head name -> `runtime.rtc.RtcInputs` with a leading frame axis (prev_chunk [Fr, B, Ha, Ad],
        the rest [Fr, B]), one set per frame (as `frame_step`).
      table: requests sorted by arrival; waiting requests queue (FIFO) until a slot is free and are
        then admitted with the observation of the frame that admits them.
    Returns:
      (pool, RolloutOutput with [Fr, ...] leaves).
    """

    def body(carry, xs):
        pool, next_req = carry
        f, obs, nz, st, rt = xs
        offered = _window(table, next_req, admissions_per_frame, f)
        pool, out = _frame(vla, pool, obs, nz, st, offered, tokens_per_frame, bank=bank, rtc=rt)
        return (pool, next_req + jnp.sum(out.admitted, dtype=jnp.int32)), (out, next_req)

    frames = jax.tree.leaves(noises)[0].shape[0]
    (pool, _), (outs, starts) = jax.lax.scan(
        body, (pool, jnp.int32(0)), (jnp.arange(frames, dtype=jnp.int32), inputs, noises, states, rtc)
    )
    return pool, RolloutOutput(frames=outs, admitted_from=starts)


# --- settings that decode each frame's requests to completion ------------------------------------


def _text_to_completion(lm, prefix, requests: Requests, max_new_tokens: int, bank=None):
    pool = decode.init_pool(lm, requests.size, decode.prefix_length(prefix), max_new_tokens, requests.prompt.shape[1])
    pool, _, _ = decode.admit(lm, pool, prefix, requests, bank)
    pool = decode.decode_to_completion(lm, pool, bank)
    # Slots are filled in request order, so slot j holds request j.
    return pool.tokens, pool.num_generated


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def text_program(vla: Vla, inputs, requests: Requests, bank: LoraBank | None = None, *, max_new_tokens: int):
    """Isolated text task: its own prefix pass (keeping only what language reads), the requests to completion.

    Returns:
      (tokens int32 [J, M], num_generated int32 [J]); row j is request j.
    """
    text = vla.without_heads()
    return _text_to_completion(text.language(), text.prefix(inputs), requests, max_new_tokens, bank)


@functools.partial(jax.jit, static_argnames=("name",))
def head_program(vla: Vla, name: str, inputs, noises: dict[str, jax.Array],
                 states: dict[str, jax.Array] | None = None) -> jax.Array:
    """Isolated action task of one head: the model holding only that head, its own prefix pass keeping only
    its reads, then the head. Returns actions float32 [B, Ha, Ad]."""
    alone = vla.only(name)
    st = {name: states[name]} if states and name in states else None
    return alone.actions(alone.prefix(inputs), {name: noises[name]}, st)[name]


@jax.jit
def actions_program(vla: Vla, inputs, noises: dict[str, jax.Array],
                    states: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """Every head from one prefix pass keeping only the heads' reads, no language (actions-only frames).

    Returns head name -> actions float32 [B, Ha, Ad]."""
    heads = vla.only(*vla.heads)
    return heads.actions(heads.prefix(inputs), noises, states)


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def shared_kv_program(vla: Vla, inputs, noises: dict[str, jax.Array], requests: Requests,
                      bank: LoraBank | None = None, states: dict[str, jax.Array] | None = None, *,
                      max_new_tokens: int):
    """Shared KV without batching: one prefix pass serves every head and the text (to completion).

    Returns:
      (actions: head name -> [B, Ha, Ad], tokens [J, M], num_generated [J]).
    """
    prefix = vla.prefix(inputs)
    actions = vla.actions(prefix, noises, states)
    tokens, n = _text_to_completion(vla.language(), prefix, requests, max_new_tokens, bank)
    return actions, tokens, n


def _isolated_calls(vla: Vla, inputs, noises, requests, bank, states, max_new_tokens):
    heads = [functools.partial(head_program, vla, n, inputs, noises, states) for n in vla.heads]
    text = None
    if vla.has_language and requests is not None:
        text = functools.partial(text_program, vla, inputs, requests, bank, max_new_tokens=max_new_tokens)
    return heads, text


def run_isolated(vla: Vla, inputs, noises, requests=None, bank=None, states=None, *, max_new_tokens: int):
    """Every head's own program, then the text's own program, one after the other (each waited for).

    Returns:
      (actions: head name -> [B, Ha, Ad], tokens [J, M] or None, num_generated [J] or None).
    """
    heads, text = _isolated_calls(vla, inputs, noises, requests, bank, states, max_new_tokens)
    actions = {n: jax.block_until_ready(call()) for n, call in zip(vla.heads, heads)}
    tokens, n = jax.block_until_ready(text()) if text is not None else (None, None)
    return actions, tokens, n


_THREADS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}  # by number of programs


def run_parallel(vla: Vla, inputs, noises, requests=None, bank=None, states=None, *, max_new_tokens: int):
    """The isolated programs dispatched concurrently, one host thread per program; waits for all.

    Returns:
      as `run_isolated`.
    """
    heads, text = _isolated_calls(vla, inputs, noises, requests, bank, states, max_new_tokens)
    calls = heads + ([text] if text is not None else [])
    threads = _THREADS.get(len(calls))
    if threads is None:
        threads = _THREADS[len(calls)] = compile_cache.thread_pool(len(calls), "oxygen-settings")
    futures = [threads.submit(lambda c=c: jax.block_until_ready(c())) for c in calls]
    actions = {n: f.result() for n, f in zip(vla.heads, futures)}
    tokens, n = futures[-1].result() if text is not None else (None, None)
    return actions, tokens, n
