"""The prefix KV cache: what one observation's prefill leaves for the action expert and the decoder.

Axes (`oxygen_jax.axes`): L layers, B batch, P prefix tokens, K KV heads, H head dim, D VLM width.

    k, v         [L, B, P, K, H]  compute dtype; K after RoPE
    mask         bool [B, P]      True where a prefix token is valid (padding and masked cameras False)
    positions    int32 [B, P]     RoPE positions cumsum(mask) - 1
    last_hidden  [B, D]           final-normed VLM output at the last valid prefix token: the
                                  logits of the first decoded token come from it

Consumers never write this cache: `denoise` reads it for all `num_steps` steps; the decode pool copies it
into its own slots at admission.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixCache:
    k: jax.Array
    v: jax.Array
    mask: jax.Array
    positions: jax.Array
    last_hidden: jax.Array

    @property
    def num_valid(self) -> jax.Array:
        """int32 [B]: valid prefix tokens; the first continuation token has this RoPE position."""
        return jnp.sum(self.mask, axis=-1, dtype=jnp.int32)

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def row(self, index: jax.Array | int) -> "PrefixCache":
        """The cache of one batch row, keeping a batch axis of 1 (index may be traced)."""
        take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, index, 1, axis)  # noqa: E731
        return PrefixCache(
            k=take(self.k, 1), v=take(self.v, 1), mask=take(self.mask, 0),
            positions=take(self.positions, 0), last_hidden=take(self.last_hidden, 0),
        )
