"""Projections of Qwen3.5's one-token steps summed as transformers' CPU decode steps sum them when MKL is
held to AVX2 (`Qwen35Spec.step_sums = 'four_lanes'`; the recurrent form: decode and verification steps).

Why: torch's float32 CPU matmul over many rows (a prefill) sums each output over the contraction axis in order
with fused multiply-adds (`nn.torch_order.dense`, bit for bit). A cached decode step has one token per row,
and for so few rows MKL picks a kernel by the machine: with AVX-512 its sgemm, the same in-order sum (the
references in tests/data/qwen35_refs: their first linear layer's window after decoding equals
`torch_order.dense` bit for bit); held to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2, as the public qwen35_tiny
parity fixture was made) a dot product in 4 interleaved partial sums, each a chain of separately rounded
products and adds, combined as (s0 + s2) + (s1 + s3): that fixture's first window after 9 decode steps
equals this order bit for bit and differs from the in-order sum in 86 % of its values. 4 chains of K / 4
terms are about twice as close to the exact sum as one chain of K, so a decode that kept the in-order sum
against that reference drifted 1.3-1.6x further from the float64 result than transformers' own float32
decode did (rms, every linear layer's state after decoding; eval/results/qwen35_f64).

    dense(x, w)     x [..., K] @ w [K, N] in that order (K zero-padded to a multiple of 4: + 0 is exact)
    pair(x, w)      the SwiGLU's two input projections, w [2, K, N] -> [2, ..., N]

Per output the order is the same whatever the number of rows, so a row's result does not depend on the
batch (a decode step and a verification step of the same tokens agree bit for bit). The products must be
rounded on their own, which a dot cannot do, so this is one `lax.scan` over K / 4 per projection: slower
than XLA's dot on CPU (eval/results/qwen35_f64/step_cost). Other platforms (whose dots round their own way)
and other dtypes (bfloat16 rounds far above this; float64 is the exact reference) use `nn.torch_order`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oxygen_jax.nn import torch_order as to

LANES = 4


def _lanes(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] as 4 interleaved partial sums of separately rounded products (module docstring)."""
    m, k = x.shape
    pad = -k % LANES
    if pad:
        x, w = jnp.pad(x, [(0, 0), (0, pad)]), jnp.pad(w, [(0, pad), (0, 0)])
    j = x.shape[1] // LANES
    xs = jnp.swapaxes(x.reshape(m, j, LANES), 0, 1)  # [J, M, 4]: step j holds k = 4 j .. 4 j + 3
    ws = w.reshape(j, LANES, w.shape[1])  # [J, 4, N]

    def step(acc, xw):
        xj, wj = xw
        return acc + to.separate(xj[:, :, None] * wj[None]), None

    acc, _ = jax.lax.scan(step, jnp.zeros((m, LANES, w.shape[1]), x.dtype), (xs, ws))
    return (acc[:, 0] + acc[:, 2]) + (acc[:, 1] + acc[:, 3])


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in four lanes (float32 on CPU; otherwise `torch_order.dense`)."""
    w = w.astype(x.dtype)
    if x.dtype != jnp.float32:
        return to.dense(x, w)
    flat = jax.lax.platform_dependent(x.reshape(-1, x.shape[-1]), w, cpu=_lanes, default=to.dense)
    return flat.reshape(x.shape[:-1] + (w.shape[-1],))


def pair(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [Y, K] with w [2, K, N] -> [2, Y, N]: `dense` of both (the SwiGLU gate and up projections)."""
    return jnp.stack([dense(x, w[0]), dense(x, w[1])])
