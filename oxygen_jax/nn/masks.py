"""The one attention-mask builder, and positions derived from masks.

Every attention pattern in π0.5 (bidirectional prefix, causal prompt, block-causal action suffix,
decoded text) is `make_attn_mask(input_mask, ar)`; RoPE positions are `cumsum(input_mask) - 1`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def make_attn_mask(input_mask: jax.Array, ar: jax.Array) -> jax.Array:
    """Prefix-LM / block-causal attention mask.

    Token q may attend to token k iff both are valid and `cumsum(ar)[k] <= cumsum(ar)[q]`:
    an `ar=True` token opens a new causal block; `ar=False` tokens join the current block and
    see each other bidirectionally.

    Examples (rows = queries, columns = keys, all tokens valid):
      ar = [0 0 0 1 1 1]  -> a 3-token bidirectional prefix, then causal tokens (prefix-LM)
           q0..q2 see k0..k2; q3 sees k0..k3; q5 sees k0..k5.
      ar = [1 1 1 1]      -> plain causal attention.
      ar = [1 0 0 1 0 0]  -> two bidirectional blocks of 3; the second also sees the first.
    An invalid token (input_mask False) is never attended to; its own row is all False.

    Args:
      input_mask: bool [B, T], True on real tokens.
      ar: bool [T] or [B, T].
    Returns:
      bool [B, T, T].
    """
    ar = jnp.broadcast_to(ar, input_mask.shape)
    blocks = jnp.cumsum(ar.astype(jnp.int32), axis=1)
    causal = blocks[:, None, :] <= blocks[:, :, None]
    valid = input_mask[:, None, :] & input_mask[:, :, None]
    return causal & valid


def positions_from_mask(input_mask: jax.Array) -> jax.Array:
    """RoPE positions `cumsum(mask) - 1` (int32): invalid tokens do not advance the count.

    Example: mask [1 1 0 0 1] -> positions [0 1 1 1 2].
    """
    return jnp.cumsum(input_mask.astype(jnp.int32), axis=-1) - 1


def last_valid_index(input_mask: jax.Array) -> jax.Array:
    """Index of the last True along the last axis (0 if there is none), int32.

    With a masked camera the valid prefix is not contiguous: for mask [1 1 0 0 1 1 0] this returns
    5, while `sum(mask) - 1` would wrongly give 3.
    """
    t = input_mask.shape[-1]
    return (t - 1 - jnp.argmax(jnp.flip(input_mask, axis=-1), axis=-1)).astype(jnp.int32)
