"""Parameter leaves shared by every model (dense, norms), the layer maths every model reuses (LayerNorm,
RoPE, grouped-query attention), and the layer loop over stacked or unstacked layers.

Axes (`oxygen_jax.axes`): L layers, B batch, T query tokens, S key tokens, N query heads, K KV heads,
R = N / K, H head dim, D width, Dc adaptive-norm condition width, W LayerNorm width.

The projection helpers (`stacked_matmul`, `project_heads`, `merge_heads`, `take_rows`, `vocab_logits`) also take
`nn.quant.QArray` weights: the one place a quantized weight meets an activation (its matmul mode, `nn.quant`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from oxygen_jax.nn import quant
from oxygen_jax.nn.quant import QArray, dequantizing


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class Dense:
    kernel: jax.Array  # [..., in, out] (SigLIP attention: [L, W, Nv, Hv] / [L, Nv, Hv, W])
    bias: jax.Array  # [..., out]


@_pytree
class RMSNorm:
    scale: jax.Array  # [(L,) D]; applied as (1 + scale)


@_pytree
class AdaRMSNorm:
    """Adaptive RMSNorm: a Dense from the condition to (scale, shift, gate); no `scale` leaf."""

    modulation: Dense  # kernel [(L,) Dc, 3D], bias [(L,) 3D]


@_pytree
class LayerNorm:
    scale: jax.Array  # [(L,) W]
    bias: jax.Array  # [(L,) W]


@_pytree
class Unstacked:
    """Per-layer parameter trees: a tuple of L trees without the layer axis (see `unstack_layers`)."""

    layers: tuple


def param_count(tree) -> int:
    """Number of scalars in a (possibly abstract) parameter tree."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def unstack_layers(layers):
    """A stacked layer tree (leaves [L, ...]) as `Unstacked` per-layer buffers (a no-op on `Unstacked`).

    The fast form on XLA's CPU backend (see `scan_layers`); `stack_layers` inverts it.
    """
    if isinstance(layers, Unstacked):
        return layers
    depth = jax.tree.leaves(layers)[0].shape[0]
    return Unstacked(layers=tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(depth)))


def stack_layers(layers):
    """Inverse of `unstack_layers` (a no-op on stacked layers)."""
    if not isinstance(layers, Unstacked):
        return layers
    return jax.tree.map(lambda *a: jnp.stack(a), *layers.layers)


def scan_layers(body, carry, layers, extra=None):
    """Runs `body(carry, layer_params, extra_l, index) -> (carry, y)` over the layers.

    Stacked layers (leaves [L, ...]) run as one `lax.scan`: a small program, and on GPUs the
    per-layer weight slice feeds the matmul directly. `Unstacked` layers run as an unrolled loop
    over separate per-layer buffers: XLA's CPU backend copies every dynamic weight slice of a
    scan (3x the bytes of a memory-bound decode step), so on CPUs this is the fast form.
    `extra` (e.g. per-layer cache slices, leaves [L, ...]) is sliced alongside. Returns
    (carry, ys stacked on a leading L axis, or None). Quantized leaves (`nn.quant.QArray`) reach `body`
    dequantized, one layer at a time.
    """
    body = dequantizing(body)
    if isinstance(layers, Unstacked):
        ys = []
        for i, lp in enumerate(layers.layers):
            x_i = None if extra is None else jax.tree.map(lambda a: a[i], extra)
            carry, y = body(carry, lp, x_i, i)
            ys.append(y)
        stacked = None if ys[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys)
        return carry, stacked
    depth = jax.tree.leaves(layers)[0].shape[0]
    return jax.lax.scan(lambda c, xs: body(c, xs[0], xs[1], xs[2]), carry, (layers, extra, jnp.arange(depth)))


# --------------------------------------------------------------------------------------------------
# Layer maths


MASK_FILL = -2.3819763e38  # openpi's fill: finite, so a row with no valid key stays finite


def dense(d: Dense, x: jax.Array) -> jax.Array:
    """x @ kernel + bias, both cast to x's dtype: [..., in] -> [..., out]."""
    return x @ d.kernel.astype(x.dtype) + d.bias.astype(x.dtype)


def stacked_matmul(xb: jax.Array, w) -> jax.Array:
    """xb [G, Y, D] by w [G, D, H] -> [G, Y, H]: G products in one dot.

    The projections' one matmul (`project_heads`, an MLP's [gate; up] pair): a `QArray` weight goes through
    `nn.quant.dot_stacked` (its matmul mode: dequantized, or int8 / fp8 products on rows quantized here).
    """
    if isinstance(w, QArray):
        return quant.dot_stacked(xb, w)
    return jnp.einsum("GYD,GDH->GYH", xb, w)


def project_heads(x: jax.Array, w) -> jax.Array:
    """x [..., D] by per-head weights w [G..., D, H] -> [..., G..., H] (G...: e.g. N, or 2, K).

    One dot batched over the weight's flattened leading axes, the activation broadcast to each: every head's
    [D, H] slab is read where it lies. The plain einsum `...D,GDH->...GH` makes XLA:CPU copy the whole weight
    to [D, G, H] on every call (1.7-7x slower on few rows; eval.bench.roofline_cpu --layouts). `w` may be a
    `QArray` (`stacked_matmul`).
    """
    lead, d, h = x.shape[:-1], w.shape[-2], w.shape[-1]
    heads = w.shape[:-2]
    xb = x.reshape(1, -1, d)
    flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[-2:]), w)  # [G, D, H] (a QArray's scale [G, 1, H])
    y = stacked_matmul(jnp.broadcast_to(xb, (math.prod(heads),) + xb.shape[1:]), flat)
    return jnp.moveaxis(y, 0, 1).reshape(lead + heads + (h,))


def merge_heads(a: jax.Array, w) -> jax.Array:
    """a [..., N, H] by w [N, H, D] -> [..., D], summed over N and H as one [*, N H] x [N H, D] product.

    Both reshapes are free, so XLA:CPU multiplies the weight where it lies (the einsum `...NH,NHD->...D`
    copies it to [H, N, D] on every call). `w` may be a `QArray` (scale [1, 1, D]; `nn.quant.dot`).
    """
    n, h, d = w.shape
    flat = jax.tree.map(lambda x: x.reshape(-1, x.shape[-1]), w)  # [N H, D] (a QArray's scale [1, D])
    return (a.reshape(-1, n * h) @ flat).reshape(a.shape[:-2] + (d,))


def take_rows(table, ids: jax.Array) -> jax.Array:
    """table [V, D] rows at int ids [...] -> [..., D] (a token embedding lookup); a `QArray` table (one scale per
    row) dequantizes only the gathered rows, in its scale's dtype."""
    if isinstance(table, QArray):
        return quant.dequantize(QArray(values=table.values[ids], scale=table.scale[ids]))
    return table[ids]


def vocab_logits(hidden: jax.Array, table, vocab_major: bool = False) -> jax.Array:
    """float32 logits of hidden [..., D] against a table [V, D] (the LM head): [..., V], or [V, B] for hidden
    [B, D] when `vocab_major` (the fast contraction order for decode batches on XLA:CPU). A `QArray` table (scale
    [V, 1]) is dequantized first ("weight_only") or multiplied quantized (`nn.quant.dot_rows`)."""
    if isinstance(table, QArray) and table.matmul != "weight_only":
        y = quant.dot_rows(hidden.reshape(-1, hidden.shape[-1]), table, vocab_major)
        return y if vocab_major else y.reshape(hidden.shape[:-1] + (table.shape[0],))
    if isinstance(table, QArray):
        table = quant.dequantize(table)
    if vocab_major:
        return jnp.einsum("VD,BD->VB", table.astype(hidden.dtype), hidden, preferred_element_type=jnp.float32)
    return jnp.einsum("...D,VD->...V", hidden, table.astype(hidden.dtype), preferred_element_type=jnp.float32)


def layer_norm(x: jax.Array, ln: LayerNorm | None, eps: float) -> jax.Array:
    """LayerNorm over the last axis in float32, cast back to x's dtype; `ln` None: no affine weights."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    if ln is not None:
        y = y * ln.scale.astype(jnp.float32) + ln.bias.astype(jnp.float32)
    return y.astype(x.dtype)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Half-split rotation: x [B, T, N, H] with sin, cos [B, T, 1, H/2] (float32 maths)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention with float32 logits and softmax.

    Args:
      q: [B, T, N, H], already scaled by 1/sqrt(H).
      k, v: [B, S, K, H].
      mask: bool [B, T, S]; masked logits get a large finite negative value (`MASK_FILL`).
    Returns:
      [B, T, N, H].
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    if mask.shape != (b, t, k.shape[1]):
        raise ValueError(f"attention mask must be [B, T, S] = {(b, t, k.shape[1])}, got {mask.shape}")
    qg = q.reshape(b, t, kh, n // kh, h)
    logits = jnp.einsum("BTKRH,BSKH->BKRTS", qg, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[:, None, None, :, :], logits, MASK_FILL)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKRTS,BSKH->BTKRH", probs, v)
    return out.reshape(b, t, n, h)
