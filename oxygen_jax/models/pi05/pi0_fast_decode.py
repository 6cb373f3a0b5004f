"""openpi's π0-FAST decoding, as the reference: a right-aligned prefill into one cache, then a greedy loop.

Axes (`oxygen_jax.axes`): B batch, P input tokens (images + the text capacity), S decode steps (the cache's
room after the prefix), L layers, K KV heads, H head dim, V vocabulary.

openpi's `Pi0FAST.sample_actions`, rule for rule (the served per-robot streams are the decode pool's, on
`pi0_fast.prefix`; with every camera present both give the same tokens, tested):

* Right alignment: each row is rolled so that its last valid input sits at index P - 1 (the padding after it
  moves to the front). The cache has P + S slots; the prefill writes slots 0..P-1 with positions
  cumsum(mask) - 1, attending as `make_attn_mask` says (a fully masked query row, e.g. a padding or masked
  camera input, attends uniformly over all P + S slots, the empty ones included, as openpi's does).
* Step i feeds token i at RoPE position prefill_len + i + 1 (prefill_len = valid inputs; position prefill_len
  is never used), writes slot P + i and attends to the contiguous window [P - prefill_len, P + i]
  (`window="openpi"`). With a masked camera that window holds masked image slots and misses the earliest valid
  ones; `window="valid"` attends to the valid inputs instead (what the pool does).
* Token 0 is the argmax of the prefill's last logits; the loop stops after a step in which every row produced
  EOS in that same step (a row's earlier EOS does not count), or after `num_steps`; ids after the stop stay 0.

Example (P = 6, S = 3, row mask [1 1 1 0 0 0]): aligned mask [0 0 0 1 1 1], positions [-1 -1 -1 0 1 2],
prefill_len 3, window start 3; token 0 goes to slot 6 at position 4, token 1 to slot 7 at position 5.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.pi05 import pi0_fast
from oxygen_jax.models.pi05.config import EOS_ID
from oxygen_jax.models.pi05.params import Pi0FastParams
from oxygen_jax.nn.masks import last_valid_index, make_attn_mask

Window = Literal["openpi", "valid"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AlignedCache:
    """The right-aligned prefill of `prefill`: what the greedy loop reads and extends.

    Attributes:
      k, v: [L, B, P + S, K, H] (K after RoPE); slots 0..P-1 the aligned inputs, P.. the decoded tokens.
      mask: bool [B, P], the aligned input mask.
      positions: int32 [B, P], cumsum(mask) - 1 of the aligned inputs (-1 on the leading padding).
      prefill_len: int32 [B], valid inputs per row.
      last_logits: float32 [B, V], the logits of the last input (token 0's).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    positions: jax.Array
    prefill_len: jax.Array
    last_logits: jax.Array

    @property
    def length(self) -> int:
        """P: aligned input slots."""
        return self.mask.shape[1]

    @property
    def prefix_start(self) -> jax.Array:
        """int32 [B]: P - prefill_len, the first slot of openpi's decode window."""
        return self.length - self.prefill_len


def right_align(x: jax.Array, input_mask: jax.Array, attn_mask: jax.Array):
    """openpi's `left_to_right_align` per row: roll by -(last valid index + 1) along the sequence.

    Args:
      x: [B, P, D]; input_mask: bool [B, P]; attn_mask: bool [B, P, P] (rolled along both axes).
    Returns:
      (x, input_mask, attn_mask) rolled; each row's last valid entry at index P - 1.
    """
    p = input_mask.shape[1]
    shift = last_valid_index(input_mask) + 1  # openpi: max(mask * arange) + 1
    index = (jnp.arange(p)[None, :] + shift[:, None]) % p  # rolled[i] = original[(i + shift) % P]
    x = jnp.take_along_axis(x, index[:, :, None], axis=1)
    input_mask = jnp.take_along_axis(input_mask, index, axis=1)
    attn_mask = jnp.take_along_axis(jnp.take_along_axis(attn_mask, index[:, :, None], axis=1), index[:, None, :], axis=2)
    return x, input_mask, attn_mask


def aligned_inputs(params: Pi0FastParams, obs: Observation):
    """The prefill's inputs: (embeddings [B, P, D], mask bool [B, P], attention bool [B, P, P]), right-aligned."""
    x, input_mask, ar = pi0_fast.embed_inputs(params, obs)
    return right_align(x, input_mask, make_attn_mask(input_mask, ar))


@functools.partial(jax.jit, static_argnames=("max_decoding_steps",))
def prefill(params: Pi0FastParams, obs: Observation, max_decoding_steps: int = 256) -> AlignedCache:
    """openpi's prefill: the right-aligned inputs written into a cache of P + `max_decoding_steps` slots.

    Args:
      obs: the inference prompt (openpi's `tokenize(prompt, state)`: no postfix), images and masks.
      max_decoding_steps: S, the cache's room for decoded tokens (openpi's server: 256).
    """
    sp, dec = pi0_fast.spec(params.config), pi0_fast.decoder(params)
    x, input_mask, attn = aligned_inputs(params, obs)
    b, p = input_mask.shape
    positions = jnp.cumsum(input_mask.astype(jnp.int32), axis=1) - 1
    mask = jnp.pad(attn, ((0, 0), (0, 0), (0, max_decoding_steps)))
    shape = (sp.depth, b, p + max_decoding_steps, sp.num_kv_heads, sp.head_dim)
    k, v = jnp.zeros(shape, x.dtype), jnp.zeros(shape, x.dtype)
    write = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, (k, v) = backbone.forward_write(sp, dec.layers, x, positions, mask, k, v, write)
    last = backbone.lm_logits(sp, dec, backbone.final_norm(sp, dec, hidden[:, -1]))
    return AlignedCache(k=k, v=v, mask=input_mask, positions=positions,
                        prefill_len=jnp.sum(input_mask, axis=1, dtype=jnp.int32), last_logits=last)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decoded:
    """What `decode` returns.

    Attributes:
      tokens: int32 [B, S], the chosen (or fed) token of each step; 0 after the stop.
      num_steps: int32 [], steps run (openpi's stop rule, at most the requested count).
      positions: int32 [B, S], the RoPE position each step's token was fed at (0 after the stop).
      logits: float32 [B, Sk, V], the logits each of the first Sk steps chose from (step 0: the prefill's).
      cache: the cache with the decoded tokens' K/V written.
    """

    tokens: jax.Array
    num_steps: jax.Array
    positions: jax.Array
    logits: jax.Array
    cache: AlignedCache


@functools.partial(jax.jit, static_argnames=("keep_logits", "window"), donate_argnames=("cache",))
def decode(params: Pi0FastParams, cache: AlignedCache, num_steps: jax.Array | int, feed: jax.Array | None = None, *,
           keep_logits: int = 0, window: Window = "openpi") -> Decoded:
    """openpi's greedy loop (temperature 0) on `cache`: one token per row per step, all rows in lockstep.

    Donates `cache`.

    Args:
      num_steps: steps to run at most (traced: one program for any count up to S).
      feed: int [B, S] tokens to feed instead of the argmax (a teacher-forced decode: each step's logits
        given openpi's own earlier tokens), or None.
      keep_logits: Sk, how many leading steps' logits to return (0: none; [B, S, V] can be large).
      window: "openpi" (its contiguous window, module docstring) or "valid" (the valid inputs, as the pool).
    """
    if window not in ("openpi", "valid"):
        raise ValueError(f"window must be 'openpi' or 'valid', got {window!r}")
    sp, dec = pi0_fast.spec(params.config), pi0_fast.decoder(params)
    b, p = cache.mask.shape
    total = cache.k.shape[2]
    steps = total - p
    slots = jnp.arange(total, dtype=jnp.int32)
    start = cache.prefix_start

    def body(carry):
        step, logits, tokens, positions, kept, k, v, _ = carry
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32) if feed is None else feed[:, step].astype(jnp.int32)
        tokens = tokens.at[:, step].set(token)
        kept = kept.at[:, step].set(logits, mode="drop") if keep_logits else kept
        position = cache.prefill_len + step + 1
        positions = positions.at[:, step].set(position)
        decoded = (slots >= p) & (slots <= p + step)
        if window == "openpi":
            seen = (slots[None] >= start[:, None]) & (slots[None] <= p + step)
        else:
            seen = jnp.concatenate([cache.mask, jnp.broadcast_to(decoded[p:], (b, steps))], axis=1)
        x = backbone.embed_tokens(sp, dec, token[:, None]).astype(cache.k.dtype)
        write = jnp.full((b, 1), p + step, jnp.int32)
        hidden, (k, v) = backbone.forward_write(sp, dec.layers, x, position[:, None], seen[:, None], k, v, write)
        logits = backbone.lm_logits(sp, dec, backbone.final_norm(sp, dec, hidden[:, 0]))
        return step + 1, logits, tokens, positions, kept, k, v, jnp.all(token == EOS_ID)

    def cond(carry):
        step, all_eos = carry[0], carry[-1]
        return (~all_eos) & (step < jnp.minimum(num_steps, steps))

    zeros = jnp.zeros((b, steps), jnp.int32)
    kept = jnp.zeros((b, keep_logits, cache.last_logits.shape[-1]), jnp.float32)
    init = (jnp.int32(0), cache.last_logits, zeros, zeros, kept, cache.k, cache.v, jnp.bool_(False))
    step, _, tokens, positions, kept, k, v, _ = jax.lax.while_loop(cond, body, init)
    return Decoded(tokens=tokens, num_steps=step, positions=positions, logits=kept,
                   cache=dataclasses.replace(cache, k=k, v=v))


def sample_tokens(params: Pi0FastParams, obs: Observation, max_decoding_steps: int = 256,
                  window: Window = "openpi") -> jax.Array:
    """openpi's `sample_actions` at temperature 0: the decoded ids int32 [B, S] (0 after the stop).

    Turn a row into actions with `robots.fast_prompt.extract_actions`.
    """
    return decode(params, prefill(params, obs, max_decoding_steps), max_decoding_steps, window=window).tokens
