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

Models with several action heads on one backbone (`mot.ModelSpec`: e.g. XR0-, QwenPI_v3- and
GR00T-style heads and the language decoder on one Qwen3-VL prefix) have the same four settings:

* `isolated`   — every head its own program (its own prefix pass keeping only its reads, then its
                 prepare + denoise: `mot.sample_all` of the single-head model), then the text's own
                 prefix pass and its requests to completion (`mot_text_program`); sequential.
* `parallel`   — those programs dispatched concurrently, one host thread each (`run_mot_parallel`).
* `shared_kv`  — one prefix pass, every head, the frame's requests to completion (`mot_shared_kv_program`).
* `continuous` — `mot_frame_step`, the fan-out frame:

    inputs ──prefix pass (ViT + backbone, once; the union of the reads)──► PrefixOutputs ─┬─► head 1: prepare, denoise
                                                                                          ├─► head 2: prepare, denoise
                                                                                          ├─► ...
    decode pool ── admit this frame's requests from the same prefix ── k-token burst ─────┴─► release finished

A head's actions are bit-identical in all four (and to `mot.sample_all` of that head alone), with or
without other heads and language requests in the frame (tested).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.runtime import compile_cache
from oxygen_jax.runtime import decode
from oxygen_jax.models import mot
from oxygen_jax.runtime.decode import DecodePool, Requests
from oxygen_jax.models.lora import LoraBank
from oxygen_jax.models.pi05.model import denoise, prefill, sample_actions
from oxygen_jax.models.mot import ModelParams, ModelSpec, PrefixInputs
from oxygen_jax.models.pi05.observation import Observation
from oxygen_jax.models.pi05.params import Params

SETTINGS = ("isolated", "parallel", "shared_kv", "continuous")
"""The four execution settings, baselines first (the one list every module uses)."""

BENCH_SETTINGS = SETTINGS + ("actions_only",)
"""What `eval.bench` can measure: the four settings plus the opt-in actions-only reference frame."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrameOutput:
    """What one continuous-batching frame returns to the host (one transfer).

    Attributes:
      actions: float32 [B, Ha, Ad]; for a model with several heads (`mot_frame_step`) a dict head
        name -> float32 [B, Ha, Ad] of that head.
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


def _language(lm, pool, prefix, requests, tokens_per_frame, bank=None):
    """This frame's language work on the pool: admit from `prefix`, one k-token burst, release."""
    pool, admitted, first = decode.admit(lm, pool, prefix, requests, bank)
    served = pool.request_id
    batch = jnp.sum(pool.active, dtype=jnp.int32)
    pool, burst = decode.decode_burst(lm, pool, tokens_per_frame, bank)
    pool, released = decode.release_finished(pool)
    return pool, dict(admitted=admitted, request_id=served, new_tokens=jnp.concatenate([first[:, None], burst], axis=1),
                      finished=released.done, num_generated=released.num_generated, batch=batch)


def _frame(params, pool, observation, noise, requests, num_steps, tokens_per_frame, evict=None, bank=None):
    if evict is not None:
        pool = decode.evict(pool, evict)
    # prefill and denoise never see the bank: actions and the prefix cache cannot depend on adapters.
    cache = prefill(params, observation)
    actions = denoise(params, cache, noise, num_steps)
    pool, text = _language(params, pool, cache, requests, tokens_per_frame, bank)
    return pool, FrameOutput(actions=actions, **text)


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
    pool = decode.init_pool(params, requests.size, decode.prefix_length(cache), max_new_tokens, requests.prompt.shape[1])
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
        _PARALLEL_POOL = compile_cache.thread_pool(2, "oxygen-parallel")
    act = _PARALLEL_POOL.submit(
        lambda: jax.block_until_ready(action_program(params, observation, noise, num_steps=num_steps))
    )
    txt = _PARALLEL_POOL.submit(
        lambda: jax.block_until_ready(text_program(params, observation, requests, bank, max_new_tokens=max_new_tokens))
    )
    tokens, n = txt.result()
    return act.result(), tokens, n


# --- models with several action heads on one prefix (mot.ModelSpec) ------------------------------


@functools.partial(jax.jit, static_argnames=("tokens_per_frame",), donate_argnames=("pool",))
def mot_frame_step(
    params: ModelParams, spec: ModelSpec, pool: DecodePool, inputs: PrefixInputs, noises: dict[str, jax.Array],
    states: dict[str, jax.Array], requests: Requests, evict: jax.Array | None = None, *, tokens_per_frame: int,
) -> tuple[DecodePool, FrameOutput]:
    """The fan-out frame: one prefix pass, every head of `spec`, then language admission and a k-token burst.

    Args:
      spec: the model (static): its heads and `language=True` (the pool reads every layer's K/V).
      pool: a `decode.init_pool(mot.language_model(spec, params), ...)` pool; donated.
      inputs: this frame's prompts and images (`mot.make_inputs`).
      noises: head name -> noise [B, Ha, Ad] of that head; exactly the heads of `spec`.
      states: head name -> robot state [B, Ds] for the heads with a state token ({} if none).
      requests, evict: as in `frame_step`.
    Returns:
      (pool, `FrameOutput` with `actions` = head name -> float32 [B, Ha, Ad]). Compiles once per
      (spec, shapes, tokens_per_frame); occupancy, arrivals and finishing are array values.
    """
    if not spec.language:
        raise ValueError("mot_frame_step decodes language from the shared prefix: build the ModelSpec with language=True")
    if evict is not None:
        pool = decode.evict(pool, evict)
    prefix = mot.prefix_pass(spec, params, inputs)
    actions = mot.run_heads(spec, params, prefix, noises, states)
    pool, text = _language(mot.language_model(spec, params), pool, prefix, requests, tokens_per_frame)
    return pool, FrameOutput(actions=actions, **text)


def _text_spec(spec: ModelSpec) -> ModelSpec:
    """The language decoder alone on `spec`'s backbone: a prefix pass keeping K/V and the last hidden only."""
    return spec.only(language=True)


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def mot_text_program(params: ModelParams, spec: ModelSpec, inputs: PrefixInputs, requests: Requests, *,
                     max_new_tokens: int):
    """Isolated text task of a multi-head model: its own prefix pass (no heads), the requests to completion.

    Returns:
      (tokens int32 [J, M], num_generated int32 [J]); row j is request j.
    """
    text = _text_spec(spec)
    prefix = mot.prefix_pass(text, params, inputs)
    return _text_to_completion(mot.language_model(text, params), prefix, requests, max_new_tokens)


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def mot_shared_kv_program(params: ModelParams, spec: ModelSpec, inputs: PrefixInputs, noises: dict[str, jax.Array],
                          states: dict[str, jax.Array], requests: Requests, *, max_new_tokens: int):
    """Shared KV without batching for a multi-head model: one prefix pass, every head, the text to completion.

    Returns:
      (actions: head name -> [B, Ha, Ad], tokens [J, M], num_generated [J]).
    """
    if not spec.language:
        raise ValueError("mot_shared_kv_program decodes language from the shared prefix: build the ModelSpec with language=True")
    prefix = mot.prefix_pass(spec, params, inputs)
    actions = mot.run_heads(spec, params, prefix, noises, states)
    tokens, n = _text_to_completion(mot.language_model(spec, params), prefix, requests, max_new_tokens)
    return actions, tokens, n


def mot_head_program(params: ModelParams, spec: ModelSpec, name: str, inputs: PrefixInputs, noises: dict[str, jax.Array],
                     states: dict[str, jax.Array]) -> jax.Array:
    """Isolated action task of one head: `mot.sample_all` of the model holding only that head (its own
    prefix pass keeping only its reads). Returns actions [B, Ha, Ad]."""
    alone = {name: states[name]} if name in states else {}
    return mot.sample_all(params.only(name), spec.only(name), inputs, {name: noises[name]}, alone)[name]


def _mot_isolated_calls(params, spec, inputs, noises, states, requests, max_new_tokens):
    heads = [functools.partial(mot_head_program, params, spec, n, inputs, noises, states) for n in spec.names]
    text = None
    if spec.language and requests is not None:
        text = functools.partial(mot_text_program, params.only(), spec, inputs, requests, max_new_tokens=max_new_tokens)
    return heads, text


def run_mot_isolated(params: ModelParams, spec: ModelSpec, inputs: PrefixInputs, noises, states, requests=None, *,
                     max_new_tokens: int):
    """Every head's own program, then the text's own program, one after the other (each waited for).

    Returns:
      (actions: head name -> [B, Ha, Ad], tokens [J, M] or None, num_generated [J] or None).
    """
    heads, text = _mot_isolated_calls(params, spec, inputs, noises, states, requests, max_new_tokens)
    actions = {n: jax.block_until_ready(call()) for n, call in zip(spec.names, heads)}
    tokens, n = jax.block_until_ready(text()) if text is not None else (None, None)
    return actions, tokens, n


_MOT_THREADS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}  # by number of programs


def run_mot_parallel(params: ModelParams, spec: ModelSpec, inputs: PrefixInputs, noises, states, requests=None, *,
                     max_new_tokens: int):
    """The isolated programs dispatched concurrently, one host thread per program; waits for all.

    Returns:
      as `run_mot_isolated`.
    """
    heads, text = _mot_isolated_calls(params, spec, inputs, noises, states, requests, max_new_tokens)
    calls = heads + ([text] if text is not None else [])
    threads = _MOT_THREADS.get(len(calls))
    if threads is None:
        threads = _MOT_THREADS[len(calls)] = compile_cache.thread_pool(len(calls), "oxygen-mot")
    futures = [threads.submit(lambda c=c: jax.block_until_ready(c())) for c in calls]
    actions = {n: f.result() for n, f in zip(spec.names, futures)}
    tokens, n = futures[-1].result() if text is not None else (None, None)
    return actions, tokens, n
