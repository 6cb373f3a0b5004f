"""Language decoding on a fixed pool of slots that continue prefix caches.

Axes (the package glossary, `oxygen_jax.axes`): Lk layers with K/V, Ns slots, P prefix tokens, Q request-prompt
capacity, M max new tokens, C = P + Q + M slot length, K KV heads, H head dim, D width, V vocabulary,
J requests per admission call, S = `decoder.MAX_STOP_IDS` stop ids per request.

A slot's sequence is a copy of one observation's prefix followed by its own suffix:

    [ prefix copy (P) | request prompt (q <= Q, causal) | forwarded generated tokens ]
      mask = the prefix's own     True for the suffix entries written so far
      validity mask (masked cameras and prompt padding stay invisible)

RoPE position of suffix entry j is `base_position + j`, with base_position = the prefix's
`next_position`, so text continues right after the last valid prefix token for any mask pattern (an
M-RoPE backbone gets the same position on all three axes, as HF Qwen3-VL decodes).

Token 0 of a request is sampled at admission from the last valid prefix row (or from the last
request-prompt token); each decode step feeds the last sampled token and samples the next. A
request stops at any of its stop ids (up to S; none = decode exactly `budget` tokens), or after `budget`
tokens; the last token is never fed back (no wasted forward). Finished slots are released at the end of
the frame that finished them.

Everything per request is an array: where it reads (row, prompt) in `Requests`, how it samples
(budget, stop ids, temperature, top-p, RNG key) in one `Sampling` pytree that requests and the pool
share. Occupancy, arrivals and finishing therefore never change a compiled shape. Sampling keys are
`fold_in(request key, token index)`: a request samples the same tokens in any batch.

Any decoder: every function takes a `models.decoder.LanguageDecoder` as its first argument (π0.5's VLM
expert: `pi05.model.language_model(params)`; any `ModelSpec` with language: `mot.language_model`; a
`MultiHead`'s `language()`). The pool asks it for the shape of a slot's K/V, its carry (per-slot state
beside the K/V, e.g. Qwen3.5's conv windows and recurrent states, leaves [layers, Ns, ...]), the request
prompt pass (`prompt_pass`, on `extend`) and the decode step (`step`), and keeps the slot bookkeeping here. Admission
copies a prefix row's K/V and carry into the slot, which is also the reset of a reused slot (K/V past the
written entries are masked); an inactive slot's step leaves its carry bit for bit. `slot_bytes` is a
slot's memory per part.

Quantized K/V (`init_pool(..., kv_cache="int8" | "fp8")`, `nn.kv_quant`): the slots' K/V (the prefix copy and
the suffix) are stored as int8 or float8 e4m3 values with one float32 scale per (layer, slot, position, KV head),
quantized as each entry is written (admission's prefix copy, the request prompt, every decode and verify step)
and dequantized where attention reads a layer; the decoder says which storages it takes (`kv_caches`). The
prefix cache itself, which the action heads read, stays float. "float" (the default) is the program without
the option, bit for bit.

Language adapters: a bank of the kind the decoder serves (`decoder.check_bank`: a `lora.LoraBank` for
attention decoders, a `qwen35.HybridBank` for Qwen3.5); each slot's id runs through its request prompt and
every step, and slots on id 0 compute exactly the bank-free program's numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models.decoder import MAX_STOP_IDS, LanguageDecoder, PrefixRows, row_adapters
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn import kv_quant
from oxygen_jax.nn.quant import weight_bytes
from oxygen_jax.nn.sampling import sample_tokens
from oxygen_jax.runtime import slot_mesh

_STATIC = dict(static=True)


def _decoder(lm) -> LanguageDecoder:
    if not isinstance(lm, LanguageDecoder):
        raise ValueError(f"the decode pool serves a models.decoder.LanguageDecoder (pi05.model.language_model(params), "
                         f"mot.language_model(spec, params), or a MultiHead's language()), got {type(lm).__name__}")
    return lm


def prefix_length(prefix: Prefix) -> int:
    """P of a `Prefix`: what `init_pool` takes as `prefix_len`."""
    return prefix.mask.shape[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each request samples, one entry per request or slot (leading axis J or Ns).

    Attributes:
      budget: int32 max new tokens (1 <= budget <= M once admitted).
      stop_ids: int32 [..., S] stop ids, -1 padding (all -1 = none: decode exactly `budget` tokens).
      temperature: float32, 0 = greedy.
      top_p: float32 in (0, 1], 1 = no nucleus filtering.
      key: uint32 [..., 2] raw PRNG key data of the request (token i uses fold_in(key, i)).
    """

    budget: jax.Array
    stop_ids: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    key: jax.Array


def _key_shape() -> tuple[int, ...]:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def _empty_sampling(n: int, xp=jnp) -> Sampling:
    """Placeholder values for n unused entries (free slots, padding requests)."""
    return Sampling(
        budget=xp.ones((n,), xp.int32), stop_ids=xp.full((n, MAX_STOP_IDS), -1, xp.int32),
        temperature=xp.zeros((n,), xp.float32), top_p=xp.ones((n,), xp.float32),
        key=xp.zeros((n,) + _key_shape(), xp.uint32),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePool:
    """Per-slot decode state. A slot is free when `request_id < 0`.

    Attributes:
      k, v: [L, Ns, C, K, H] slot caches in the decoder's dtype, or `kv_quant.QuantKV` (int8 / fp8 values,
        float32 scales [L, Ns, C, K, 1]).
      mask: bool [Ns, C] positions a decode query may attend to.
      base_position: int32 [Ns] RoPE position of suffix entry 0.
      length: int32 [Ns] suffix entries written (request prompt + fed-back tokens).
      last_token: int32 [Ns] the token the next decode step feeds.
      num_generated: int32 [Ns] tokens sampled so far.
      sampling: `Sampling` with [Ns] leaves: the request each slot serves.
      request_id: int32 [Ns], -1 = free.
      adapter: int32 [Ns] language adapter id (0 = base weights).
      active: bool [Ns] occupied and still generating.
      tokens: int32 [Ns, M] generated tokens, -1 beyond num_generated.
      prefix_len, prompt_len: static P and Q.
      carry: the decoder's per-slot state beside the K/V (`LanguageDecoder.init_carry`: named leaves
        [layers, Ns, ...], e.g. Qwen3.5's conv "window" [Lg, Ns, Cc, Kc] and float32 recurrent "state"
        [Lg, Ns, Hv, Dk, Dv]; k, v then hold its full-attention layers only), or None.
      draft_ref: int32 [Ns, R] tokens each slot drafts from under speculative decoding (`runtime.speculative`;
        -1 separates segments), set at admission from `Requests.draft_ref`; None without speculation.
      draft_len: static γ, the most draft tokens one verify step checks (0: no speculation).
      verify_cost: static, decode steps one verify step with drafts is charged against a frame's budget
        (`speculative.verify_burst`; 1: k verify steps per frame).
      mesh: static device mesh whose `robots` axis splits the slots (`runtime.slot_mesh`: each device holds
        Ns / Dr slots, admits into them and runs their bursts), or None (one device).

    Bytes per slot: `slot_bytes` (K/V grow with C; a carry is fixed, at Qwen3.5-0.8B / 2B in bfloat16 as
    much as the K/V of about 1,600 entries).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    base_position: jax.Array
    length: jax.Array
    last_token: jax.Array
    num_generated: jax.Array
    sampling: Sampling
    request_id: jax.Array
    adapter: jax.Array
    active: jax.Array
    tokens: jax.Array
    prefix_len: int = dataclasses.field(metadata=_STATIC)
    prompt_len: int = dataclasses.field(metadata=_STATIC)
    carry: dict[str, jax.Array] | None = None
    draft_ref: jax.Array | None = None
    draft_len: int = dataclasses.field(default=0, metadata=_STATIC)
    verify_cost: float = dataclasses.field(default=1.0, metadata=_STATIC)
    mesh: jax.sharding.Mesh | None = dataclasses.field(default=None, metadata=_STATIC)

    @property
    def num_slots(self) -> int:
        return self.request_id.shape[0]

    @property
    def max_new_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    @property
    def occupied(self) -> jax.Array:
        return self.request_id >= 0

    @property
    def kv_cache(self) -> kv_quant.KVCache:
        """The K/V storage: "float", "int8" or "fp8"."""
        return kv_quant.storage(self.k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Requests:
    """A fixed-size batch of J language requests to admit; valid entries come first.

    Attributes:
      valid: bool [J].
      row: int32 [J] prefix-cache batch row (which observation) the request continues.
      prompt: int32 [J, Q] request prompt written after the prefix; prompt_len int32 [J] (0 = none).
      sampling: `Sampling` with [J] leaves.
      request_id: int32 [J] >= 0; adapter int32 [J] (0 = base weights).
      draft_ref: optional int32 [J, R] what each request drafts from (speculative pools; None: nothing).
    """

    valid: jax.Array
    row: jax.Array
    prompt: jax.Array
    prompt_len: jax.Array
    sampling: Sampling
    request_id: jax.Array
    adapter: jax.Array
    draft_ref: jax.Array | None = None

    @property
    def size(self) -> int:
        return self.valid.shape[0]


def key_data(seed: int) -> np.ndarray:
    """uint32 raw key data of `jax.random.key(seed)` (what `Sampling.key` stores)."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def stop_row(stops) -> np.ndarray:
    """One request's stop ids as an int32 [S] row padded with -1: `stops` is a sequence of ids, one id, or
    None / -1 / () for none. One-line ValueError for more than S ids or a negative id."""
    if stops is None:
        stops = ()
    elif isinstance(stops, (int, np.integer)):
        stops = () if int(stops) == -1 else (int(stops),)
    ids = sorted({int(t) for t in stops})
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"a request takes at most {MAX_STOP_IDS} stop ids, got {len(ids)}")
    if ids and ids[0] < 0:
        raise ValueError(f"stop ids must be token ids >= 0, got {ids[0]}")
    return np.asarray(ids + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)


def make_requests(
    size: int,
    prompt_capacity: int,
    request_ids=(),
    *,
    rows=None,
    prompts=None,
    budgets=None,
    stop_ids: Sequence | None = None,
    temperatures=None,
    top_ps=None,
    seeds=None,
    adapters=None,
) -> Requests:
    """Host helper: pads per-request lists into a `Requests` batch of `size` entries (numpy leaves).

    `stop_ids[i]` is request i's stop set (a sequence of ids, one id, or None / -1 for none; `stop_row`).
    Defaults: row 0, no prompt, budget must be given, no stop ids, greedy, top-p 1, seed = request id,
    adapter 0.
    """
    n = len(request_ids)
    if n > size:
        raise ValueError(f"{n} requests do not fit an admission batch of {size}")

    def col(values, default, dtype):
        out = np.full((size,), default, dtype)
        if values is not None:
            if len(values) != n:
                raise ValueError(f"expected {n} values, got {len(values)}")
            out[:n] = values
        return out

    prompt = np.zeros((size, prompt_capacity), np.int32)
    prompt_len = np.zeros((size,), np.int32)
    for i, p in enumerate(prompts or []):
        if len(p) > prompt_capacity:
            raise ValueError(f"request {request_ids[i]}: prompt of {len(p)} tokens exceeds the pool's capacity {prompt_capacity}")
        prompt[i, : len(p)] = p
        prompt_len[i] = len(p)
    if budgets is None and n:
        raise ValueError("make_requests needs a token budget per request")
    key = np.zeros((size,) + _key_shape(), np.uint32)
    for i in range(n):
        key[i] = key_data(int(seeds[i]) if seeds is not None else int(request_ids[i]))
    stops = np.full((size, MAX_STOP_IDS), -1, np.int32)
    if stop_ids is not None:
        if len(stop_ids) != n:
            raise ValueError(f"expected {n} stop sets, got {len(stop_ids)}")
        for i, row in enumerate(stop_ids):
            stops[i] = stop_row(row)
    sampling = Sampling(
        budget=col(budgets, 1, np.int32), stop_ids=stops,
        temperature=col(temperatures, 0.0, np.float32), top_p=col(top_ps, 1.0, np.float32), key=key,
    )
    return Requests(
        valid=np.arange(size) < n, row=col(rows, 0, np.int32), prompt=prompt, prompt_len=prompt_len,
        sampling=sampling, request_id=col(request_ids, -1, np.int32), adapter=col(adapters, 0, np.int32),
    )


def draft_capacity(max_new_tokens: int, prompt_len: int) -> int:
    """R, the draft reference width of a speculative pool: room for a previous answer, two recent answers and
    the request prompt, each followed by a -1 separator."""
    return 3 * (max_new_tokens + 1) + prompt_len + 1


def init_pool(lm: LanguageDecoder, num_slots: int, prefix_len: int, max_new_tokens: int, prompt_len: int = 0,
              speculate: int = 0, verify_cost: float = 1.0, mesh: jax.sharding.Mesh | None = None,
              kv_cache: kv_quant.KVCache = "float") -> DecodePool:
    """An empty pool of `num_slots` slots for prefixes of `prefix_len` tokens.

    Take `prefix_len` from the prefix the pool will serve (`Prefix.length`, `prefix_length`, or
    `model.prefix_length(params, observation)` before any prefill). `speculate` = γ > 0 makes a pool for
    speculative decoding (`runtime.speculative`): it keeps each slot's draft reference. `mesh` (a
    `slot_mesh.serving_mesh`) splits the slots over its `robots` axis: `num_slots` must be a multiple of it.
    `kv_cache` stores the slots' K/V as float (the decoder's dtype), int8 or fp8 (`nn.kv_quant`); a decoder that
    cannot take it is refused in one line (`LanguageDecoder.init_kv`).
    """
    if speculate < 0:
        raise ValueError(f"speculate must be >= 0 (γ draft tokens per verify step), got {speculate}")
    if not 1 <= verify_cost < float("inf"):  # NaN fails this too
        raise ValueError(f"verify_cost must be a finite number >= 1 (decode steps one verify step costs), got {verify_cost}")
    slot_mesh.check_slots(num_slots, mesh)
    lm = _decoder(lm)
    cap = prefix_len + prompt_len + max_new_tokens
    k, v = lm.init_kv(num_slots, cap, kv_cache)
    # Every field gets its own buffer: donation rejects a pool whose fields alias one array.
    ints = lambda fill=0: jnp.full((num_slots,), fill, jnp.int32)  # noqa: E731
    pool = DecodePool(
        k=k, v=v,
        mask=jnp.zeros((num_slots, cap), bool), base_position=ints(), length=ints(), last_token=ints(),
        num_generated=ints(), sampling=_empty_sampling(num_slots), request_id=ints(-1),
        adapter=ints(), active=jnp.zeros((num_slots,), bool),
        tokens=jnp.full((num_slots, max_new_tokens), -1, jnp.int32), prefix_len=prefix_len, prompt_len=prompt_len,
        carry=lm.init_carry(num_slots), draft_len=speculate, verify_cost=float(verify_cost),
        draft_ref=jnp.full((num_slots, draft_capacity(max_new_tokens, prompt_len)), -1, jnp.int32) if speculate else None,
        mesh=mesh,
    )
    return pool if mesh is None else jax.device_put(pool, slot_mesh.shardings(mesh, slot_mesh.pool_specs(pool)))


def pool_slot_bytes(pool: DecodePool) -> dict[str, int]:
    """One slot's bytes in `pool` by part, from shapes alone (a donated or abstract pool answers too): `kv` (K and V
    of the attention layers, scales included), each carry part of the decoder (Qwen3.5: `window`, `state`; none for an attention
    decoder) and `total` (with the bookkeeping: mask, tokens, per-slot scalars)."""
    nbytes = weight_bytes  # shapes and dtypes only
    carry = {name: nbytes(leaf) for name, leaf in (pool.carry or {}).items()}
    parts = dict(kv=nbytes((pool.k, pool.v)), **carry, total=nbytes(pool))
    return {name: b // pool.num_slots for name, b in parts.items()}


def slot_bytes(lm: LanguageDecoder, prefix_len: int, max_new_tokens: int, prompt_len: int = 0,
               kv_cache: kv_quant.KVCache = "float") -> dict[str, int | float]:
    """One slot's device memory by part, before anything is allocated: `pool_slot_bytes` of the pool `init_pool`
    would build with this `kv_cache` (shapes only), plus `bookkeeping` (total - K/V - carry), `kv_per_token` (K/V bytes of one
    entry) and `state_tokens` (how many entries' K/V the fixed carry equals): at Qwen3.5-0.8B / 2B in bfloat16
    the fixed part equals the K/V of about 1,600 tokens.
    """
    pool = jax.eval_shape(lambda: init_pool(lm, 1, prefix_len, max_new_tokens, prompt_len, kv_cache=kv_cache))
    out = pool_slot_bytes(pool)
    carry = sum(b for name, b in out.items() if name not in ("kv", "total"))
    kv_per_token = out["kv"] // pool.capacity
    return dict(out, bookkeeping=out["total"] - out["kv"] - carry, kv_per_token=kv_per_token,
                state_tokens=carry / kv_per_token)


def _sample(logits: jax.Array, sampling: Sampling, index: jax.Array) -> jax.Array:
    """Token `index` of each request from vocabulary-major logits [V, n]: int32 [n]."""
    keys = jax.vmap(lambda k, i: jax.random.fold_in(jax.random.wrap_key_data(k), i))(sampling.key, index)
    return sample_tokens(logits, sampling.temperature, sampling.top_p, keys, vocab_axis=0)


def _stops(tokens: jax.Array, sampling: Sampling) -> jax.Array:
    """bool [n]: token i is one of request i's stop ids."""
    return jnp.any(tokens[:, None] == sampling.stop_ids, axis=-1)


def _check_adapter_ids(requests: Requests, bank) -> None:
    """One-line ValueError when a valid request names an adapter the bank does not store (host values only:
    inside a traced program, e.g. a frame step, the ids are not known and ids outside 0..E get the base
    weights)."""
    ids, valid = requests.adapter, requests.valid
    if isinstance(ids, jax.core.Tracer) or isinstance(valid, jax.core.Tracer):
        return
    ids, valid = np.asarray(ids), np.asarray(valid)
    stored = 0 if bank is None else bank.num_adapters
    bad = ids[valid & ((ids < 0) | (ids > stored))]
    if bad.size:
        held = "no bank: only id 0 (base weights)" if bank is None else f"ids 0..{stored} (0 = base weights)"
        raise ValueError(f"request adapter id {int(bad[0])} is out of range: the bank serves {held}")


def _extend_with_prompts(lm: LanguageDecoder, view: PrefixRows, req: Requests, q_cap: int, bank=None):
    """Runs the request prompts after their prefixes: slot caches [Lk, J, P+Q, K, H], seed hidden [J, D] (the
    final-normed state the first token is sampled from) and the rows' carry."""
    if q_cap == 0:
        return view.k, view.v, view.last_hidden, view.carry
    ck, cv, h, carry = lm.prompt_pass(view, req.prompt, req.prompt_len, bank, req.adapter)
    last = jnp.clip(req.prompt_len - 1, 0, q_cap - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)
    h_last = lm.final_norm(h_last)
    seed = jnp.where((req.prompt_len > 0)[:, None], h_last[:, 0], view.last_hidden)
    return ck, cv, seed, carry


def _admit(lm: LanguageDecoder, pool: DecodePool, prefix: Prefix, req: Requests, bank=None):
    s, p, q_cap = pool.num_slots, pool.prefix_len, pool.prompt_len
    if prefix_length(prefix) != p:
        raise ValueError(f"prefix cache has {prefix_length(prefix)} positions but the pool was built for {p}")
    if req.prompt.shape[1] != q_cap:
        raise ValueError(f"request prompts have capacity {req.prompt.shape[1]} but the pool has {q_cap}")
    free = ~pool.occupied
    free_slots = jnp.argsort(~free, stable=True).astype(jnp.int32)  # free slots first, in index order
    rank = jnp.arange(req.size)
    admitted = req.valid & (rank < jnp.sum(free))
    slot = jnp.where(admitted, free_slots[jnp.minimum(rank, s - 1)], s)  # s = out of range: dropped

    lm.check_bank(bank)
    if pool.mesh is not None and slot_mesh.manual(pool.mesh):  # each device fills its own slots
        new, first = slot_mesh.admit_per_device(_write, lm, pool, prefix, req, slot, bank)
    else:
        new, first = _write(pool, lm.rows(prefix, req.row), req, slot, lm, bank)
        new = new if pool.mesh is None else slot_mesh.pin(new)
    return new, admitted, first


def _write(pool: DecodePool, view: PrefixRows, req: Requests, slot, lm: LanguageDecoder, bank=None):
    """Fills slots `slot` (int32 [J], >= Ns: dropped) from the requests' prefix rows `view`: runs their prompts,
    samples token 0. Returns (pool, first_token int32 [Ns])."""
    s, g, p, q_cap = pool.num_slots, pool.max_new_tokens, pool.prefix_len, pool.prompt_len
    # The prefix rows in the slots' storage first, so the request prompt attends to what later steps read.
    view = view._replace(k=kv_quant.like(view.k, pool.k), v=kv_quant.like(view.v, pool.v))
    ck, cv, seed, carry = _extend_with_prompts(lm, view, req, q_cap, bank)
    logits = lm.logits_vocab_major(seed)
    sampling = dataclasses.replace(req.sampling, budget=jnp.clip(req.sampling.budget, 1, g))
    token0 = _sample(logits, sampling, jnp.zeros_like(req.row))
    active = ~_stops(token0, sampling) & (sampling.budget > 1)

    cap = pool.capacity
    suffix_valid = jnp.arange(cap - p)[None, :] < req.prompt_len[:, None]
    row_mask = jnp.concatenate([view.mask, suffix_valid], axis=1)
    tokens = jnp.full((req.size, g), -1, jnp.int32).at[:, 0].set(token0)

    def put(field, value):
        return field.at[slot].set(value.astype(field.dtype), mode="drop")

    def put_layered(field, value):  # [layers, Ns, ...] leaves: the slot axis is 1
        return field.at[:, slot, : value.shape[2]].set(value.astype(field.dtype), mode="drop")

    new = dataclasses.replace(
        pool,
        k=jax.tree.map(put_layered, pool.k, ck),
        v=jax.tree.map(put_layered, pool.v, cv),
        mask=put(pool.mask, row_mask),
        base_position=put(pool.base_position, view.next_position),
        length=put(pool.length, req.prompt_len),
        last_token=put(pool.last_token, token0),
        num_generated=put(pool.num_generated, jnp.ones_like(token0)),
        sampling=jax.tree.map(put, pool.sampling, sampling),
        request_id=put(pool.request_id, req.request_id),
        adapter=put(pool.adapter, req.adapter),
        active=put(pool.active, active),
        tokens=put(pool.tokens, tokens),
        # The slot's whole carry is overwritten: the reset of a reused slot.
        carry=None if pool.carry is None else jax.tree.map(lambda f, c: f.at[:, slot].set(c.astype(f.dtype), mode="drop"),
                                                           pool.carry, carry),
        draft_ref=None if pool.draft_ref is None else put(pool.draft_ref, _draft_rows(pool, req)),
    )
    first = jnp.full((s,), -1, jnp.int32).at[slot].set(token0, mode="drop")
    return new, first


def _draft_rows(pool: DecodePool, req: Requests) -> jax.Array:
    """[J, R] draft references of the requests (all -1 where they bring none)."""
    if req.draft_ref is None:
        return jnp.full((req.size, pool.draft_ref.shape[1]), -1, jnp.int32)
    if req.draft_ref.shape[1] != pool.draft_ref.shape[1]:
        raise ValueError(f"requests carry draft references of {req.draft_ref.shape[1]} tokens but the pool keeps "
                         f"{pool.draft_ref.shape[1]}: build both with decode.draft_capacity")
    return req.draft_ref


def admit(lm: LanguageDecoder, pool: DecodePool, prefix: Prefix, requests: Requests, bank=None):
    """Admits valid requests into free slots (lowest index first), in order, while slots last.

    Each admitted request copies its prefix row into the slot, runs its own prompt (if any) after
    it with its adapter (`requests.adapter`, 0 = base weights; a bank of the decoder's kind is needed for
    other ids: `LanguageDecoder.check_bank`), and samples its first token. Donates `pool` (one jitted
    program; host-held adapter ids outside the bank's 0..E are refused before it runs).

    Returns:
      (pool, admitted bool [J], first_token int32 [Ns]: the token sampled in each slot, -1 elsewhere).
    """
    lm = _decoder(lm)
    _check_adapter_ids(requests, bank)
    return _admit_program(lm, pool, prefix, requests, bank)


@functools.partial(jax.jit, donate_argnames=("pool",))
def _admit_program(lm: LanguageDecoder, pool: DecodePool, prefix: Prefix, requests: Requests, bank=None):
    return jax.lax.cond(
        jnp.any(requests.valid),
        lambda: _admit(lm, pool, prefix, requests, bank),
        lambda: (pool, jnp.zeros_like(requests.valid), jnp.full((pool.num_slots,), -1, jnp.int32)),
    )


def step_logits(lm: LanguageDecoder, pool: DecodePool, bank=None) -> tuple[DecodePool, jax.Array]:
    """Feeds every active slot's last token: writes its K/V and returns logits float32 [V, Ns].

    Each slot runs with its own adapter (`pool.adapter`) from `bank`; slots on adapter 0 compute
    exactly the adapter-free step. The position of the fed token is `base_position + length` (all
    three axes of an M-RoPE backbone).

    The pool's mask and length are not advanced here (see `_decode_step`); inactive slots write
    nothing and their carry comes back unchanged, bit for bit.
    """
    lm = _decoder(lm)
    cap = pool.capacity
    write = pool.prefix_len + pool.length
    x = lm.embed(pool.last_token[:, None])
    positions = (pool.base_position + pool.length)[:, None]
    attend = pool.mask | (jnp.arange(cap)[None, :] == write[:, None])
    write_index = jnp.where(pool.active, write, cap)[:, None]
    lm.check_bank(bank)
    h, (k, v), carry = lm.step(x, positions, pool.active[:, None], attend[:, None, :], pool.k, pool.v, write_index,
                               pool.carry, row_adapters(bank, pool.adapter))
    pool = dataclasses.replace(pool, k=k, v=v, carry=carry)
    h = lm.final_norm(h)
    return pool, lm.logits_vocab_major(h[:, 0])


def _decode_step(lm: LanguageDecoder, pool: DecodePool, bank=None) -> tuple[DecodePool, jax.Array, jax.Array]:
    """One token for every active slot: (pool, token int32 [Ns] (-1 for inactive slots), logits [Ns, V])."""
    pool, logits = step_logits(lm, pool, bank)
    tok = _sample(logits, pool.sampling, pool.num_generated)
    act = pool.active
    rows = jnp.arange(pool.num_slots)
    write = jnp.where(act, pool.prefix_len + pool.length, pool.capacity)
    n = pool.num_generated + act
    pool = dataclasses.replace(
        pool,
        mask=pool.mask.at[rows, write].set(True, mode="drop"),
        length=pool.length + act,
        tokens=pool.tokens.at[rows, jnp.where(act, pool.num_generated, pool.max_new_tokens)].set(tok, mode="drop"),
        num_generated=n,
        last_token=jnp.where(act, tok, pool.last_token),
        active=act & ~_stops(tok, pool.sampling) & (n < pool.sampling.budget),
    )
    return pool, jnp.where(act, tok, -1), logits.T


decode_step = functools.partial(jax.jit, donate_argnames=("pool",))(_decode_step)
"""Jitted single step: (pool, token [Ns], logits float32 [Ns, V]). Donates `pool`. (A meshed pool runs it under
the SPMD partitioner's layout, not per device: `decode_burst` is the per-device program.)"""


def _maybe_step(lm: LanguageDecoder, pool: DecodePool, bank=None):
    return jax.lax.cond(
        jnp.any(pool.active),
        lambda p: _decode_step(lm, p, bank)[:2],
        lambda p: (p, jnp.full((p.num_slots,), -1, jnp.int32)),
        pool,
    )


@functools.partial(jax.jit, static_argnames=("num_tokens",), donate_argnames=("pool",))
def decode_burst(lm: LanguageDecoder, pool: DecodePool, num_tokens: int, bank=None) -> tuple[DecodePool, jax.Array]:
    """Advances every active slot by up to `num_tokens` tokens in one batched scan. Donates `pool`.

    Returns:
      (pool, tokens int32 [Ns, num_tokens]: what each slot emitted per step, -1 when it did not).
    """
    def burst(pool, lm, bank):
        pool, toks = jax.lax.scan(lambda p, _: _maybe_step(lm, p, bank), pool, None, length=num_tokens)
        return pool, toks.T

    return slot_mesh.on_slot_devices(burst, pool, lm, bank)


@functools.partial(jax.jit, donate_argnames=("pool",))
def decode_to_completion(lm: LanguageDecoder, pool: DecodePool, bank=None) -> DecodePool:
    """Steps until no slot is active (at most max_new_tokens - 1 steps; on a mesh, each device until its own
    slots are done). Donates `pool`."""
    def run(pool, lm, bank):
        pool = jax.lax.while_loop(lambda p: jnp.any(p.active), lambda p: _decode_step(lm, p, bank)[0], pool)
        return pool, pool.num_generated

    return slot_mesh.on_slot_devices(run, pool, lm, bank)[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Released:
    """Slots released at the end of a frame: done bool [Ns], request_id int32 [Ns], tokens int32 [Ns, M],
    num_generated int32 [Ns]."""

    done: jax.Array
    request_id: jax.Array
    tokens: jax.Array
    num_generated: jax.Array


def evict(pool: DecodePool, slots: jax.Array) -> DecodePool:
    """Frees the slots where `slots` (bool [Ns]) is True without reporting them (cancelled requests)."""
    return dataclasses.replace(
        pool, request_id=jnp.where(slots, -1, pool.request_id), active=pool.active & ~slots,
    )


@functools.partial(jax.jit, donate_argnames=("pool",))
def release_finished(pool: DecodePool) -> tuple[DecodePool, Released]:
    """Frees occupied slots that stopped generating and reports them. Donates `pool`."""
    done = pool.occupied & ~pool.active
    out = Released(done=done, request_id=jnp.where(done, pool.request_id, -1), tokens=pool.tokens,
                   num_generated=pool.num_generated)
    pool = dataclasses.replace(pool, request_id=jnp.where(done, -1, pool.request_id))
    return pool, out

