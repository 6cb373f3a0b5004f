"""Float32 arithmetic in the order PyTorch's CPU kernels round it: the primitives of the Qwen3.5 path
(`models/qwen35/model.py`, `models/qwen35/gated_deltanet.py`), whose parity references come from transformers on CPU.

Why: a random-weight reference model amplifies a one-ulp difference in its first layer 10-100x by its
last, so two correct float32 programs that round differently can be further apart than a parity
tolerance, and further than either is from the exact result. These functions compute the same values
as torch's float32 CPU kernels (bit for bit where noted, on the same inputs):

    dense, matmul  each output a sequential fused multiply-add over the contraction axis, first term
                   first (MKL's sgemm for two or more rows and contractions up to 384). XLA's CPU backend
                   does the same when the output axis is a multiple of 64 and gives other widths to a
                   kernel that splits the sum, so the output axis is zero-padded to a multiple of 64 and
                   sliced back (a few idle columns; none at released sizes).
    row_sum        torch's last-axis float sum: 8-lane vectors into 4 accumulators (its cascade for long
                   rows), the leftover scalars, then the 8 lanes in order; rows under 8 use 4 scalar
                   accumulators. Bit for bit for every length (checked 1..20000). row_mean divides;
                   inner_sum reduces the second-to-last axis in 4 interleaved accumulators.
    divide         a true division by a Python number (XLA turns x / c into x * (1 / c)).
    rsqrt          1 / sqrt(x): two correctly rounded steps, as torch; XLA's own rsqrt differs.
    cumsum         every prefix sum rounded once from its exact value: torch accumulates a float32 cumsum
                   in float64; here a compensated (two-float) running sum.
    silu, sigmoid, x / (1 + exp(-x)), 1 / (1 + exp(-x)), log1p(exp(x)) (x itself above 20): torch's
    softplus       formulas (exp itself is XLA's, within an ulp of torch's).
    separate       rounds a product on its own where torch does, so that XLA does not fuse it with the
                   following add into one multiply-add (XLA contracts a * b + c by default).

Inputs of other dtypes go through the same code (the orderings are then merely a valid choice).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_WIDE = 64  # output widths XLA's CPU dot sums sequentially (see the module docstring)


def separate(x: jax.Array) -> jax.Array:
    """x, rounded on its own: a product passed through here is not fused with a following add into one
    multiply-add. (A second use of x that no compiler can drop does it: LLVM contracts a product with one
    use only; an optimisation barrier does not, XLA removes it before code generation.)"""
    return jnp.where(x == x, x, jnp.nan)


def _opaque(x: jax.Array) -> jax.Array:
    """x, hidden from XLA's algebraic rewrites (x / c -> x * (1 / c), 1 / sqrt(x) -> rsqrt(x))."""
    return jax.lax.optimization_barrier(x)


def _pad_last(w: jax.Array) -> tuple[jax.Array, int]:
    n = w.shape[-1]
    pad = -n % _WIDE
    return (jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)]) if pad else w), n


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N], each output summed over K in order (module docstring)."""
    wp, n = _pad_last(w.astype(x.dtype))
    y = x.reshape(-1, x.shape[-1]) @ wp
    return y[:, :n].reshape(x.shape[:-1] + (n,))


def matmul(a: jax.Array, b: jax.Array, preferred_element_type=None) -> jax.Array:
    """a [..., I, K] @ b [..., K, J] -> [..., I, J] (leading axes broadcast), summed over K in order."""
    bp, n = _pad_last(b)
    return jnp.matmul(a, bp, preferred_element_type=preferred_element_type)[..., :n]


def _add(a, b):
    return b if a is None else (a if b is None else a + b)


def _cascade(groups: list) -> jax.Array | None:
    """torch's `multi_row_sum`: sequential sums of blocks of 2^p groups, carried up 4 levels."""
    size, levels = len(groups), 4
    power = max(4, (math.ceil(math.log2(size)) if size > 1 else 0) // levels)
    step, acc, i = 1 << power, [None] * levels, 0
    while i + step <= size:
        for _ in range(step):
            acc[0], i = _add(acc[0], groups[i]), i + 1
        for j in range(1, levels):
            acc[j], acc[j - 1] = _add(acc[j], acc[j - 1]), None
            if i & ((step - 1) << (j * power)):
                break
    while i < size:
        acc[0], i = _add(acc[0], groups[i]), i + 1
    for j in range(1, levels):
        acc[0] = _add(acc[0], acc[j])
    return acc[0]


def _four_accumulators(rows: jax.Array) -> jax.Array | None:
    """rows [..., M, W] summed over M into 4 interleaved accumulators, then acc0 + acc1 + acc2 + acc3."""
    m = rows.shape[-2]
    groups = [rows[..., 4 * i:4 * i + 4, :] for i in range(m // 4)]
    total = _cascade(groups) if groups else None
    acc = [None] * 4 if total is None else [total[..., k, :] for k in range(4)]
    for i in range(m - m % 4, m):
        acc[0] = _add(acc[0], rows[..., i, :])
    out = acc[0]
    for k in range(1, 4):
        out = _add(out, acc[k])
    return out


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in torch's CPU order: [..., n] -> [...]."""
    n = x.shape[-1]
    if n < 8:
        return _four_accumulators(x[..., None])[..., 0]
    nv = n // 8
    lanes = _four_accumulators(x[..., :nv * 8].reshape(x.shape[:-1] + (nv, 8)))
    out = None
    for k in range(nv * 8, n):
        out = _add(out, x[..., k])
    for lane in range(8):
        out = _add(out, lanes[..., lane])
    return out


def inner_sum(x: jax.Array) -> jax.Array:
    """Sum over the second-to-last axis, [..., m, n] -> [..., n], in 4 interleaved accumulators (torch's
    order for a strided axis of a small tensor, e.g. the recurrent delta rule's sums over Dk)."""
    return _four_accumulators(x)


def divide(x: jax.Array, c: float) -> jax.Array:
    """x / c, correctly rounded (not x times a rounded 1 / c)."""
    return x / _opaque(jnp.full(x.shape, c, x.dtype))


def row_mean(x: jax.Array) -> jax.Array:
    """Mean over the last axis: `row_sum` / n, as torch's CPU mean."""
    return divide(row_sum(x), x.shape[-1])


def rsqrt(x: jax.Array) -> jax.Array:
    """1 / sqrt(x) in two rounded steps."""
    return 1.0 / _opaque(jnp.sqrt(x))


def sigmoid(x: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-x))


def silu(x: jax.Array) -> jax.Array:
    return x / (1.0 + jnp.exp(-x))


def softplus(x: jax.Array) -> jax.Array:
    """log(1 + e^x), x itself above 20 (torch's threshold)."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def cumsum(x: jax.Array) -> jax.Array:
    """Prefix sums over the last axis, each the rounding of the exact prefix sum (but for ties)."""

    def step(carry, v):
        hi, lo = carry
        s = hi + v  # two-sum: s + e == hi + v exactly
        b = s - hi
        e = (hi - (s - b)) + (v - b) + lo
        hi = s + e
        return (hi, e - (hi - s)), hi

    xs = jnp.moveaxis(x, -1, 0)
    zero = jnp.zeros_like(xs[0])
    return jnp.moveaxis(jax.lax.scan(step, (zero, zero), xs)[1], 0, -1)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, plus_one: bool) -> jax.Array:
    """x * rsqrt(mean(x²) + eps) in float32, times (1 + scale) or scale, cast back to x.dtype (HF
    Qwen3.5's RMSNorm, computed and scaled in float32)."""
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # float64 stays float64
    normed = xf * rsqrt(row_mean(separate(xf * xf))[..., None] + eps)
    s = scale.astype(xf.dtype)
    return (normed * ((1.0 + s) if plus_one else s)).astype(x.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x²) + eps) over the last axis, float32 (eps inside the root)."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x * rsqrt(row_sum(separate(x * x))[..., None] + eps)
