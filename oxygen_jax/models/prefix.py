"""What one prefix pass leaves for the action heads and the language decoder: `Prefix`, the one type every
model's prefix pass returns (π0.5's `model.prefill`, a backbone-with-heads `mot.prefix_pass`).

Axes (`oxygen_jax.axes`): L layers (Lk kept K/V layers, Lh kept hidden states), B batch, P prefix tokens,
K KV heads, H head dim, D VLM width, Mr = 3 M-RoPE axes (t, h, w).

    k, v           [Lk, B, P, K, H]  compute dtype; K after q/k-norm and RoPE, of the layers `kv_layers`
                                     (π0.5 and any model with language: every layer); None when unread
    hidden         [Lh, B, P, D]     HF-convention hidden states `hidden_layers` (0 = embeddings, l = output
                                     of layer l - 1 before any DeepStack addition, L = final-normed output);
                                     None when unread (π0.5)
    mask           bool [B, P]       True where a prefix token is valid (padding and masked cameras False)
    positions      int32 [B, P]      RoPE positions cumsum(mask) - 1 (π0.5, text); an M-RoPE (Qwen3-VL)
                   or [Mr, B, P]     prefix has one row per axis, image tokens sharing positions
    next_position  int32 [B]         where a continuation's RoPE positions start: the largest valid
                                     position + 1 on any axis (`next_positions`). `num_valid` for 1-D
                                     positions cumsum(mask) - 1, less for an M-RoPE prefix with images
                                     (HF's `rope_deltas`)
    last_hidden    [B, D]            final-normed output at the last valid prefix token (the first decoded
                                     token's logits); None without a language decoder
    window         [Lg, B, Cc, Kc]   Qwen3.5's linear (Gated DeltaNet) layers, as of the last valid token:
    state          [Lg, B, Hv, Dk, Dv]  the conv window and the float32 recurrent state (`models/qwen35/model.py`;
                                     k, v then hold the full-attention layers `kv_layers`); None otherwise

Consumers never write a prefix: heads read it for all their denoising steps; the decode pool copies the
K/V into its own slots at admission.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from oxygen_jax.models.backbone import RopeSpec

_STATIC = dict(static=True)


def next_positions(mask: jax.Array, positions: jax.Array) -> jax.Array:
    """int32 [B]: max valid position + 1 per row, over every M-RoPE axis (0 for an empty row)."""
    valid_positions = jnp.where(mask, positions, -1)  # [B, P] or [Mr, B, P]
    axes = tuple(range(valid_positions.ndim - 2)) + (valid_positions.ndim - 1,)
    return jnp.max(valid_positions, axis=axes).astype(jnp.int32) + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """Everything heads and the language decoder read from one prefix pass (shapes in the module docstring).

    `kv_layers` / `hidden_layers` (static, sorted) say which backbone layers' K/V and which HF hidden
    states were kept; `rope` (static) is the backbone's rotary embedding (joint heads continue it).

    Example: a model with an XR0-style head reading layers 20..35 and a language decoder keeps
    kv_layers = (0, ..., 35); without the decoder it keeps (20, ..., 35) only.
    """

    k: jax.Array | None
    v: jax.Array | None
    hidden: jax.Array | None
    mask: jax.Array
    positions: jax.Array
    next_position: jax.Array
    last_hidden: jax.Array | None
    kv_layers: tuple[int, ...] = dataclasses.field(metadata=_STATIC)
    hidden_layers: tuple[int, ...] = dataclasses.field(default=(), metadata=_STATIC)
    rope: RopeSpec | None = dataclasses.field(default=None, metadata=_STATIC)
    window: jax.Array | None = None
    state: jax.Array | None = None

    @classmethod
    def every_layer(cls, k, v, mask, positions, last_hidden, rope: RopeSpec | None = None) -> Prefix:
        """A prefix holding every layer's K/V [L, B, P, K, H] (π0.5's prefill; language decoding)."""
        return cls(k=k, v=v, hidden=None, mask=mask, positions=positions, next_position=next_positions(mask, positions),
                   last_hidden=last_hidden, kv_layers=tuple(range(k.shape[0])), rope=rope)

    @property
    def num_valid(self) -> jax.Array:
        """int32 [B]: valid prefix tokens."""
        return jnp.sum(self.mask, axis=-1, dtype=jnp.int32)

    @property
    def length(self) -> int:
        """P: prefix positions."""
        return self.mask.shape[-1]

    def row(self, index: jax.Array | int) -> Prefix:
        """The prefix of one batch row, keeping a batch axis of 1 (index may be traced)."""
        take = lambda x, axis: None if x is None else jax.lax.dynamic_slice_in_dim(x, index, 1, axis)  # noqa: E731
        return dataclasses.replace(
            self, k=take(self.k, 1), v=take(self.v, 1), hidden=take(self.hidden, 1), mask=take(self.mask, 0),
            positions=take(self.positions, self.positions.ndim - 2), next_position=take(self.next_position, 0),
            last_hidden=take(self.last_hidden, 0), window=take(self.window, 1), state=take(self.state, 1))

    def layer_kv(self, layers: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
        """K, V [len(layers), B, P, K, H] of the given backbone layers (a slice when contiguous)."""
        missing = [l for l in layers if l not in self.kv_layers]
        if missing or self.k is None:
            raise ValueError(f"the prefix kept the K/V of layers {self.kv_layers}, not {tuple(missing) or layers}; "
                             "build it with a ModelSpec that contains this head")
        rows = tuple(self.kv_layers.index(l) for l in layers)
        return select_layers(self.k, rows), select_layers(self.v, rows)

    def hidden_states(self, layers: tuple[int, ...]) -> jax.Array:
        """[len(layers), B, P, D] hidden states of the given HF indices."""
        missing = [l for l in layers if l not in self.hidden_layers]
        if missing or self.hidden is None:
            raise ValueError(f"the prefix kept hidden states {self.hidden_layers}, not {tuple(missing) or layers}; "
                             "build it with a ModelSpec that contains this head")
        return select_layers(self.hidden, tuple(self.hidden_layers.index(l) for l in layers))


def select_layers(x: jax.Array, rows: tuple[int, ...]) -> jax.Array:
    """x[rows] along the leading (layer) axis: a slice when the rows are contiguous, else a gather."""
    if rows == tuple(range(rows[0], rows[0] + len(rows))):
        return jax.lax.slice_in_dim(x, rows[0], rows[0] + len(rows), axis=0)
    return jnp.take(x, jnp.asarray(rows, jnp.int32), axis=0)
