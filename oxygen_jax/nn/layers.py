"""Parameter leaves shared by every model (dense, norms) and the layer loop over stacked or unstacked layers.

Axes (`oxygen_jax.axes`): L layers, D width, Dc adaptive-norm condition width, W LayerNorm width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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


def scan_layers(body, carry, layers, extra=None):
    """Runs `body(carry, layer_params, extra_l, index) -> (carry, y)` over the layers.

    Stacked layers (leaves [L, ...]) run as one `lax.scan`: a small program, and on GPUs the
    per-layer weight slice feeds the matmul directly. `Unstacked` layers run as an unrolled loop
    over separate per-layer buffers: XLA's CPU backend copies every dynamic weight slice of a
    scan (3x the bytes of a memory-bound decode step), so on CPUs this is the fast form.
    `extra` (e.g. per-layer cache slices, leaves [L, ...]) is sliced alongside. Returns
    (carry, ys stacked on a leading L axis, or None).
    """
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
