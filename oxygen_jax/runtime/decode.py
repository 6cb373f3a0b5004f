"""Language decoding on a fixed pool of slots that continue prefix caches.

Axes (the package glossary, `oxygen_jax.axes`): L layers, Ns slots, P prefix tokens, Q request-prompt
capacity, M max new tokens, C = P + Q + M slot length, K KV heads, H head dim, D VLM width, V vocabulary,
J requests per admission call.

A slot's sequence is a copy of one observation's prefix followed by its own suffix:

    [ prefix copy (P) | request prompt (q <= Q, causal) | forwarded generated tokens ]
      mask = the prefix's own     True for the suffix entries written so far
      validity mask (masked cameras and prompt padding stay invisible)

RoPE position of suffix entry j is `base_position + j`, with base_position = the prefix's
`next_position` (the number of valid prefix tokens for π0.5), so text continues right after the
last valid prefix token for any mask pattern.

Token 0 of a request is sampled at admission from the last valid prefix row (or from the last
request-prompt token); each decode step feeds the last sampled token and samples the next. A
request stops at its stop token (default EOS = 1; -1 disables it), or after `budget` tokens; the
last token is never fed back (no wasted forward). Finished slots are released at the end of the
frame that finished them.

Everything per request is an array: where it reads (row, prompt) in `Requests`, how it samples
(budget, stop token, temperature, top-p, RNG key) in one `Sampling` pytree that requests and the pool
share. Occupancy, arrivals and finishing therefore never change a compiled shape. Sampling keys are
`fold_in(request key, token index)`: a request samples the same tokens in any batch.

Any backbone: every function takes the language model as its first argument, either π0.5 `Params`
(the VLM expert with its embedder and tied head; unchanged programs) or a `LanguageModel`, a
`backbone.Decoder` with its static `BackboneSpec` (Qwen3 / Qwen3-VL, e.g. `mot.language_model`). The
prefix is a `prefix.Prefix` that kept every layer's K/V and the last hidden state (π0.5's `model.prefill`,
or `mot.prefix_pass` of a model with `language=True`). Positions
are 1-D; for an M-RoPE backbone a [B, T] position means all three axes equal, which is what text after
the prefix uses (HF Qwen3-VL's decode positions: the row's next_position + j on every axis).

Qwen3.5 (a `LanguageModel` whose spec is a `models.qwen35.Qwen35Spec`; prefix from `qwen35.prefix_pass`):
k, v hold the full-attention layers only ([Lf, ...]) and every slot also carries its linear layers'
conv window [Lg, Ns, Cc, Kc] and float32 recurrent state [Lg, Ns, Hv, Dk, Dv], whose size does not
depend on the sequence length. Admission copies the prefix row's window and state into the slot, and
that copy is the reset of a reused slot: no leaf keeps anything of its previous request (K/V past the
written entries are masked). The request prompt runs in the chunked form with entries >= its length as
identity steps (state untouched, window ending at the last real entry); a decode step runs the
recurrent form with the slot's activity as validity, so an inactive slot's step is an identity step too
(its window and state come back unchanged, bit for bit). `slot_bytes` is a slot's memory per part.
Language adapters on Qwen3.5: a `qwen35.HybridBank` (both layer kinds, grouped like the layer scan); each
slot's id runs through its request prompt and every recurrent step, and slots on id 0 compute exactly the
bank-free program's numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models import backbone, qwen35
from oxygen_jax.models.backbone import BackboneSpec, Decoder, LanguageModel
from oxygen_jax.models.pi05.config import EOS_ID
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.models.lora import LoraBank, RowAdapters
from oxygen_jax.models.pi05.model import vlm_decoder
from oxygen_jax.models.pi05.params import Params
from oxygen_jax.models.pi05.spec import pi05_spec
from oxygen_jax.models.qwen35 import Qwen35Spec
from oxygen_jax.nn.sampling import sample_tokens

_STATIC = dict(static=True)


# --------------------------------------------------------------------------------------------------
# Which language model and which prefix


LM = Params | LanguageModel


class _Text(NamedTuple):
    """What the pool needs of a language model, for π0.5 `Params` and `LanguageModel` alike."""

    spec: BackboneSpec
    decoder: Decoder
    dtype: jnp.dtype
    hybrid: Qwen35Spec | None = None  # Qwen3.5: linear layers with (window, state), K/V for the full ones

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return self.hybrid.full_layers if self.hybrid else tuple(range(self.spec.depth))


def _text(lm: LM) -> _Text:
    if isinstance(lm, Params):  # π0.5: the VLM expert with the embedder and the tied head (the same arrays)
        return _Text(pi05_spec(lm.config), vlm_decoder(lm), lm.config.jnp_dtype)
    if isinstance(lm, LanguageModel) and isinstance(lm.spec, Qwen35Spec):
        return _Text(lm.spec.backbone, lm.decoder, lm.decoder.embedding.dtype, lm.spec)
    if isinstance(lm, LanguageModel):
        return _Text(lm.spec, lm.decoder, lm.decoder.embedding.dtype)
    raise ValueError(f"the decode pool serves π0.5 Params or a decode.LanguageModel, got {type(lm).__name__}")


class _PrefixView(NamedTuple):
    k: jax.Array  # [L, B, P, K, H] (Qwen3.5: [Lf, ...])
    v: jax.Array
    mask: jax.Array  # bool [B, P]
    next_position: jax.Array  # int32 [B]
    last_hidden: jax.Array  # [B, D]
    window: jax.Array | None  # Qwen3.5: [Lg, B, Cc, Kc]
    state: jax.Array | None  # Qwen3.5: float32 [Lg, B, Hv, Dk, Dv]


def _prefix(prefix: Prefix, text: _Text) -> _PrefixView:
    """The fields admission reads, from a `Prefix` holding the decoder's K/V (every layer; Qwen3.5: the
    full-attention layers, with the linear layers' window and state) and the last hidden state."""
    layers = text.kv_layers
    if prefix.kv_layers != layers or prefix.last_hidden is None:
        raise ValueError(f"language decoding needs the K/V of layers {layers} and the last hidden state, but the "
                         f"prefix kept K/V of layers {prefix.kv_layers}: build it with a ModelSpec that has language=True")
    if text.hybrid is not None and (prefix.window is None or prefix.state is None):
        raise ValueError("a Qwen3.5 language model decodes from a prefix with its linear layers' window and state: "
                         "build it with models.qwen35.prefix_pass(..., language=True)")
    return _PrefixView(prefix.k, prefix.v, prefix.mask, prefix.next_position, prefix.last_hidden, prefix.window, prefix.state)


def prefix_length(prefix: Prefix) -> int:
    """P of a `Prefix`: what `init_pool` takes as `prefix_len`."""
    return prefix.mask.shape[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each request samples, one entry per request or slot (leading axis J or Ns).

    Attributes:
      budget: int32 max new tokens (1 <= budget <= M once admitted).
      stop_token: int32 stop id, -1 = none (decode exactly `budget` tokens).
      temperature: float32, 0 = greedy.
      top_p: float32 in (0, 1], 1 = no nucleus filtering.
      key: uint32 [..., 2] raw PRNG key data of the request (token i uses fold_in(key, i)).
    """

    budget: jax.Array
    stop_token: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    key: jax.Array


def _key_shape() -> tuple[int, ...]:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def _empty_sampling(n: int, xp=jnp) -> Sampling:
    """Placeholder values for n unused entries (free slots, padding requests)."""
    return Sampling(
        budget=xp.ones((n,), xp.int32), stop_token=xp.full((n,), -1, xp.int32),
        temperature=xp.zeros((n,), xp.float32), top_p=xp.ones((n,), xp.float32),
        key=xp.zeros((n,) + _key_shape(), xp.uint32),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePool:
    """Per-slot decode state. A slot is free when `request_id < 0`.

    Attributes:
      k, v: [L, Ns, C, K, H] slot caches.
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
      window, state: Qwen3.5 only (None otherwise): [Lg, Ns, Cc, Kc] conv windows (activation dtype) and
        float32 [Lg, Ns, Hv, Dk, Dv] recurrent states of the linear layers; k, v are then [Lf, Ns, C, K, H].

    Bytes per slot: `slot_bytes` (K/V grow with C; Qwen3.5's window + state are fixed, at 0.8B / 2B in
    bfloat16 as much as the K/V of about 1,600 entries).
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
    window: jax.Array | None = None
    state: jax.Array | None = None

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
    """

    valid: jax.Array
    row: jax.Array
    prompt: jax.Array
    prompt_len: jax.Array
    sampling: Sampling
    request_id: jax.Array
    adapter: jax.Array

    @property
    def size(self) -> int:
        return self.valid.shape[0]


def key_data(seed: int) -> np.ndarray:
    """uint32 raw key data of `jax.random.key(seed)` (what `Sampling.key` stores)."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def make_requests(
    size: int,
    prompt_capacity: int,
    request_ids=(),
    *,
    rows=None,
    prompts=None,
    budgets=None,
    stop_tokens=None,
    temperatures=None,
    top_ps=None,
    seeds=None,
    adapters=None,
) -> Requests:
    """Host helper: pads per-request lists into a `Requests` batch of `size` entries (numpy leaves).

    Defaults: row 0, no prompt, budget must be given, EOS stop, greedy, top-p 1, seed = request id,
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
    sampling = Sampling(
        budget=col(budgets, 1, np.int32), stop_token=col(stop_tokens, EOS_ID, np.int32),
        temperature=col(temperatures, 0.0, np.float32), top_p=col(top_ps, 1.0, np.float32), key=key,
    )
    return Requests(
        valid=np.arange(size) < n, row=col(rows, 0, np.int32), prompt=prompt, prompt_len=prompt_len,
        sampling=sampling, request_id=col(request_ids, -1, np.int32), adapter=col(adapters, 0, np.int32),
    )


def init_pool(params: LM, num_slots: int, prefix_len: int, max_new_tokens: int, prompt_len: int = 0) -> DecodePool:
    """An empty pool of `num_slots` slots for prefixes of `prefix_len` tokens.

    Take `prefix_len` from the prefix the pool will serve (`Prefix.length`, `prefix_length`, or
    `model.prefix_length(params, observation)` before any prefill).
    """
    text = _text(params)
    cap = prefix_len + prompt_len + max_new_tokens
    kv_shape = (len(text.kv_layers), num_slots, cap, text.spec.num_kv_heads, text.spec.head_dim)
    window, state = qwen35.empty_state(text.hybrid, num_slots, text.dtype) if text.hybrid else (None, None)
    # Every field gets its own buffer: donation rejects a pool whose fields alias one array.
    ints = lambda fill=0: jnp.full((num_slots,), fill, jnp.int32)  # noqa: E731
    return DecodePool(
        k=jnp.zeros(kv_shape, text.dtype), v=jnp.zeros(kv_shape, text.dtype),
        mask=jnp.zeros((num_slots, cap), bool), base_position=ints(), length=ints(), last_token=ints(),
        num_generated=ints(), sampling=_empty_sampling(num_slots), request_id=ints(-1),
        adapter=ints(), active=jnp.zeros((num_slots,), bool),
        tokens=jnp.full((num_slots, max_new_tokens), -1, jnp.int32), prefix_len=prefix_len, prompt_len=prompt_len,
        window=window, state=state,
    )


def slot_bytes(params: LM, prefix_len: int, max_new_tokens: int, prompt_len: int = 0) -> dict[str, int | float]:
    """One slot's device memory by part, from the spec alone (what `init_pool` allocates per slot).

    kv: K and V of the attention layers over C = P + Q + M entries; window, state: Qwen3.5's linear layers
    (Lg Cc Kc activation-dtype elements, Lg Hv Dk Dv float32), 0 for other models; bookkeeping: mask,
    tokens and the per-slot scalars. `kv_per_token` (K/V bytes of one entry) and `state_tokens` (how many
    entries' K/V the fixed window + state equal) compare the two kinds: at Qwen3.5-0.8B / 2B in
    bfloat16 the fixed part equals the K/V of about 1,600 tokens.
    """
    text = _text(params)
    s, item = text.spec, jnp.dtype(text.dtype).itemsize
    cap = prefix_len + prompt_len + max_new_tokens
    kv_per_token = 2 * len(text.kv_layers) * s.num_kv_heads * s.head_dim * item
    fixed = text.hybrid.state_bytes(kv_itemsize=item, conv_itemsize=item) if text.hybrid else dict(window=0, state=0)
    window, state = fixed["window"], fixed["state"]
    scalars = 4 * 8 + 4 + 4 + 4 * int(np.prod(_key_shape())) + 1  # 8 int32 + temperature, top_p, key, active
    out = dict(kv=cap * kv_per_token, window=window, state=state, bookkeeping=cap + 4 * max_new_tokens + scalars)
    return dict(out, total=sum(out.values()), kv_per_token=kv_per_token, state_tokens=(window + state) / kv_per_token)


def _sample(logits: jax.Array, sampling: Sampling, index: jax.Array) -> jax.Array:
    """Token `index` of each request from vocabulary-major logits [V, n]: int32 [n]."""
    keys = jax.vmap(lambda k, i: jax.random.fold_in(jax.random.wrap_key_data(k), i))(sampling.key, index)
    return sample_tokens(logits, sampling.temperature, sampling.top_p, keys, vocab_axis=0)


def _row_adapters(bank, ids):
    """`backbone.forward_write`'s (or `qwen35.forward_step`'s) per-row LoRA argument, or None (the adapter-free
    program) without a bank."""
    return None if bank is None else RowAdapters(bank, ids)


def _check_bank(text: _Text, bank) -> None:
    """One-line ValueError when `bank` is not the kind of bank this language model serves (shapes are checked
    where it is applied: `qwen35.check_bank`, `lora.check_bank_fits`)."""
    if bank is None:
        return
    if text.hybrid is not None:
        qwen35.check_bank(text.hybrid, bank)
    elif isinstance(bank, qwen35.HybridBank):
        raise ValueError("a qwen35.HybridBank serves Qwen3.5 language models only; this decoder takes a lora.LoraBank")


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


def suffix_forward(params: LM, prefix: Prefix, rows: jax.Array, tokens: jax.Array,
                   bank: LoraBank | None = None, adapter: jax.Array | None = None):
    """Runs suffix tokens causally after prefix rows through the language model: the request-prompt pass.

    This is the one forward of a request's own tokens: admission runs it on request prompts, and
    the memory-LoRA training runs it teacher-forced on [prompt | answer], so a trained adapter sees
    exactly the computation it is served with.

    Args:
      params: π0.5 `Params` (the VLM expert) or a `LanguageModel`.
      prefix: a `Prefix` with every layer's K/V.
      rows: int32 [J] prefix row each sequence continues.
      tokens: int32 [J, Q] suffix tokens (entries beyond a sequence's length are padding: they are
        computed but nothing before them attends to them).
      bank, adapter: optional LoRA bank and int32 [J] adapter ids (0 = base weights).
    Returns:
      (k, v [L, J, P + Q, K, H]: the prefix rows followed by the suffix, hidden [J, Q, D] before the
      final norm).
    """
    text = _text(params)
    if text.hybrid is not None:
        raise ValueError("suffix_forward serves attention-only decoders; a Qwen3.5 prompt also advances recurrent "
                         "states (admission runs it with its length)")
    ck, cv, x, positions, mask, write = _suffix_inputs(text, _prefix(prefix, text), rows, tokens)
    lora = _row_adapters(bank, jnp.zeros((rows.shape[0],), jnp.int32) if adapter is None else adapter)
    h, (ck, cv) = backbone.forward_write(text.spec, text.decoder.layers, x, positions, mask, ck, cv, write, lora=lora)
    return ck, cv, h


def _suffix_inputs(text: _Text, view: _PrefixView, rows, tokens):
    """Slot caches [L, J, P + Q, K, H] (prefix rows, then room for Q entries), embedded tokens [J, Q, D],
    positions [J, Q], mask [J, Q, P + Q] (prefix validity, causal suffix) and write index [J, Q]."""
    j, q_cap, p = rows.shape[0], tokens.shape[1], view.mask.shape[-1]
    pad = [(0, 0), (0, 0), (0, q_cap), (0, 0), (0, 0)]
    ck, cv = jnp.pad(view.k[:, rows], pad), jnp.pad(view.v[:, rows], pad)
    steps = jnp.arange(q_cap, dtype=jnp.int32)
    causal = steps[None, :] <= steps[:, None]  # [Q, Q]
    mask = jnp.concatenate(
        [jnp.broadcast_to(view.mask[rows][:, None, :], (j, q_cap, p)), jnp.broadcast_to(causal, (j, q_cap, q_cap))], -1
    )
    positions = view.next_position[rows][:, None] + steps[None]  # equal on all M-RoPE axes
    x = backbone.embed_tokens(text.spec, text.decoder, tokens).astype(text.dtype)
    return ck, cv, x, positions, mask, jnp.broadcast_to(p + steps, (j, q_cap))


def _hybrid_prompts(text: _Text, view: _PrefixView, req: Requests, bank=None):
    """Qwen3.5 request prompts after their prefix rows: entries >= prompt_len are identity steps of the
    linear layers (chunked form), so the window and state are those at the last real entry. Each request
    runs with its adapter (`req.adapter`) from `bank`.

    Returns (k, v [Lf, J, P + Q, K, H], hidden [J, Q, D] before the final norm, (window, state) [Lg, J, ...]).
    """
    ck, cv, x, positions, mask, write = _suffix_inputs(text, view, req.row, req.prompt)
    real = jnp.arange(req.prompt.shape[1])[None, :] < req.prompt_len[:, None]
    h, (ck, cv), carried = qwen35.forward_step(text.hybrid, text.decoder.layers, x, positions, real, mask, ck, cv, write,
                                               view.window[:, req.row], view.state[:, req.row], form="chunked",
                                               lora=_row_adapters(bank, req.adapter))
    return ck, cv, h, carried


def _extend_with_prompts(params: LM, prefix: Prefix, req: Requests, q_cap: int, bank=None):
    """Runs the request prompts after their prefixes: returns slot caches [L, J, P+Q, K, H] and seed hidden [J, D]."""
    text = _text(params)
    view = _prefix(prefix, text)
    seed_prefix = view.last_hidden[req.row]
    carried = None if text.hybrid is None else (view.window[:, req.row], view.state[:, req.row])
    if q_cap == 0:
        return view.k[:, req.row], view.v[:, req.row], seed_prefix, carried
    if text.hybrid is not None:
        ck, cv, h, carried = _hybrid_prompts(text, view, req, bank)
    else:
        ck, cv, h = suffix_forward(params, prefix, req.row, req.prompt, bank, req.adapter)
    last = jnp.clip(req.prompt_len - 1, 0, q_cap - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)
    h_last = backbone.final_norm(text.spec, text.decoder, h_last)
    seed = jnp.where((req.prompt_len > 0)[:, None], h_last[:, 0], seed_prefix)
    return ck, cv, seed, carried


def _admit(params: LM, pool: DecodePool, prefix: Prefix, req: Requests, bank=None):
    s, g = pool.num_slots, pool.max_new_tokens
    p, q_cap = pool.prefix_len, pool.prompt_len
    text = _text(params)
    if prefix_length(prefix) != p:
        raise ValueError(f"prefix cache has {prefix_length(prefix)} positions but the pool was built for {p}")
    if req.prompt.shape[1] != q_cap:
        raise ValueError(f"request prompts have capacity {req.prompt.shape[1]} but the pool has {q_cap}")
    free = ~pool.occupied
    free_slots = jnp.argsort(~free, stable=True).astype(jnp.int32)  # free slots first, in index order
    rank = jnp.arange(req.size)
    admitted = req.valid & (rank < jnp.sum(free))
    slot = jnp.where(admitted, free_slots[jnp.minimum(rank, s - 1)], s)  # s = out of range: dropped

    _check_bank(text, bank)
    ck, cv, seed, carried = _extend_with_prompts(params, prefix, req, q_cap, bank)
    view = _prefix(prefix, text)
    logits = backbone.lm_logits_vocab_major(text.spec, text.decoder, seed)
    sampling = dataclasses.replace(req.sampling, budget=jnp.clip(req.sampling.budget, 1, g))
    token0 = _sample(logits, sampling, jnp.zeros_like(req.row))
    active = (token0 != sampling.stop_token) & (sampling.budget > 1)

    cap = pool.capacity
    suffix_valid = jnp.arange(cap - p)[None, :] < req.prompt_len[:, None]
    row_mask = jnp.concatenate([view.mask[req.row], suffix_valid], axis=1)
    tokens = jnp.full((req.size, g), -1, jnp.int32).at[:, 0].set(token0)

    def put(field, value):
        return field.at[slot].set(value.astype(field.dtype), mode="drop")

    new = dataclasses.replace(
        pool,
        k=pool.k.at[:, slot, : ck.shape[2]].set(ck.astype(pool.k.dtype), mode="drop"),
        v=pool.v.at[:, slot, : cv.shape[2]].set(cv.astype(pool.v.dtype), mode="drop"),
        mask=put(pool.mask, row_mask),
        base_position=put(pool.base_position, view.next_position[req.row]),
        length=put(pool.length, req.prompt_len),
        last_token=put(pool.last_token, token0),
        num_generated=put(pool.num_generated, jnp.ones_like(token0)),
        sampling=jax.tree.map(put, pool.sampling, sampling),
        request_id=put(pool.request_id, req.request_id),
        adapter=put(pool.adapter, req.adapter),
        active=put(pool.active, active),
        tokens=put(pool.tokens, tokens),
    )
    if carried is not None:  # the slot's whole window and state are overwritten: the reset of a reused slot
        new = dataclasses.replace(new, window=pool.window.at[:, slot].set(carried[0].astype(pool.window.dtype), mode="drop"),
                                  state=pool.state.at[:, slot].set(carried[1], mode="drop"))
    first = jnp.full((s,), -1, jnp.int32).at[slot].set(token0, mode="drop")
    return new, admitted, first


def admit(params: LM, pool: DecodePool, prefix: Prefix, requests: Requests,
          bank: LoraBank | qwen35.HybridBank | None = None):
    """Admits valid requests into free slots (lowest index first), in order, while slots last.

    Each admitted request copies its prefix row into the slot, runs its own prompt (if any) after
    it with its adapter (`requests.adapter`, 0 = base weights; a bank is needed for other ids: a
    `lora.LoraBank`, or on Qwen3.5 a `qwen35.HybridBank`), and samples its first token. Donates `pool`
    (one jitted program; host-held adapter ids outside the bank's 0..E are refused before it runs).

    Returns:
      (pool, admitted bool [J], first_token int32 [Ns]: the token sampled in each slot, -1 elsewhere).
    """
    _check_adapter_ids(requests, bank)
    return _admit_program(params, pool, prefix, requests, bank)


@functools.partial(jax.jit, donate_argnames=("pool",))
def _admit_program(params: LM, pool: DecodePool, prefix: Prefix, requests: Requests, bank=None):
    return jax.lax.cond(
        jnp.any(requests.valid),
        lambda: _admit(params, pool, prefix, requests, bank),
        lambda: (pool, jnp.zeros_like(requests.valid), jnp.full((pool.num_slots,), -1, jnp.int32)),
    )


def step_logits(params: LM, pool: DecodePool, bank: LoraBank | None = None) -> tuple[DecodePool, jax.Array]:
    """Feeds every active slot's last token: writes its K/V and returns logits float32 [V, Ns].

    Each slot runs with its own adapter (`pool.adapter`) from `bank`; slots on adapter 0 compute
    exactly the adapter-free step. The position of the fed token is `base_position + length` (all
    three axes of an M-RoPE backbone). On Qwen3.5 the bank is a `qwen35.HybridBank`.

    The pool's mask and length are not advanced here (see `_decode_step`); inactive slots write
    nothing. On Qwen3.5 the linear layers advance each active slot's window and state by one
    recurrent step; inactive slots run identity steps, which keep theirs bit for bit.
    """
    text = _text(params)
    cap = pool.capacity
    write = pool.prefix_len + pool.length
    x = backbone.embed_tokens(text.spec, text.decoder, pool.last_token[:, None]).astype(text.dtype)
    positions = (pool.base_position + pool.length)[:, None]
    attend = pool.mask | (jnp.arange(cap)[None, :] == write[:, None])
    write_index = jnp.where(pool.active, write, cap)[:, None]
    _check_bank(text, bank)
    if text.hybrid is None:
        h, (k, v) = backbone.forward_write(text.spec, text.decoder.layers, x, positions, attend[:, None, :],
                                           pool.k, pool.v, write_index, lora=_row_adapters(bank, pool.adapter))
        pool = dataclasses.replace(pool, k=k, v=v)
    else:
        h, (k, v), (window, state) = qwen35.forward_step(
            text.hybrid, text.decoder.layers, x, positions, pool.active[:, None], attend[:, None, :], pool.k, pool.v,
            write_index, pool.window, pool.state, form="recurrent", lora=_row_adapters(bank, pool.adapter))
        pool = dataclasses.replace(pool, k=k, v=v, window=window, state=state)
    h = backbone.final_norm(text.spec, text.decoder, h)
    return pool, backbone.lm_logits_vocab_major(text.spec, text.decoder, h[:, 0])


def _decode_step(params: LM, pool: DecodePool, bank=None) -> tuple[DecodePool, jax.Array, jax.Array]:
    """One token for every active slot: (pool, token int32 [Ns] (-1 for inactive slots), logits [Ns, V])."""
    pool, logits = step_logits(params, pool, bank)
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
        active=act & (tok != pool.sampling.stop_token) & (n < pool.sampling.budget),
    )
    return pool, jnp.where(act, tok, -1), logits.T


decode_step = functools.partial(jax.jit, donate_argnames=("pool",))(_decode_step)
"""Jitted single step: (pool, token [Ns], logits float32 [Ns, V]). Donates `pool`."""


def _maybe_step(params: LM, pool: DecodePool, bank=None):
    return jax.lax.cond(
        jnp.any(pool.active),
        lambda p: _decode_step(params, p, bank)[:2],
        lambda p: (p, jnp.full((p.num_slots,), -1, jnp.int32)),
        pool,
    )


@functools.partial(jax.jit, static_argnames=("num_tokens",), donate_argnames=("pool",))
def decode_burst(params: LM, pool: DecodePool, num_tokens: int, bank: LoraBank | None = None
                 ) -> tuple[DecodePool, jax.Array]:
    """Advances every active slot by up to `num_tokens` tokens in one batched scan. Donates `pool`.

    Returns:
      (pool, tokens int32 [Ns, num_tokens]: what each slot emitted per step, -1 when it did not).
    """
    pool, toks = jax.lax.scan(lambda p, _: _maybe_step(params, p, bank), pool, None, length=num_tokens)
    return pool, toks.T


@functools.partial(jax.jit, donate_argnames=("pool",))
def decode_to_completion(params: LM, pool: DecodePool, bank: LoraBank | None = None) -> DecodePool:
    """Steps until no slot is active (at most max_new_tokens - 1 steps). Donates `pool`."""
    return jax.lax.while_loop(lambda p: jnp.any(p.active), lambda p: _decode_step(params, p, bank)[0], pool)


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

