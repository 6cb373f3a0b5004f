"""Quantized K/V for the decode slot pool: int8 or float8 e4m3 values, one float32 scale per (layer, slot,
position, KV head), written and read through one pair of functions.

Axes (`oxygen_jax.axes`): Lk layers with K/V, Ns slots (B rows in a forward pass), C slot length (S keys),
K KV heads, H head dim.

    values: [Lk, Ns, C, K, H] int8 (symmetric absmax, |v| <= 127) or float8_e4m3fn (|v| <= 448)
    scale:  float32 [Lk, Ns, C, K, 1]   absmax over H / 127 (int8) or / 448 (fp8); an all-zero head 1 / QMAX

The conventions (rounding, clipping, QMAX, the zero-head scale) are `nn.quant`'s weight quantization with the
head dimension as the one reduced axis, so `quant.error_bound` bounds one entry's error: int8 scale / 2, fp8
2^-4 |x| + scale * 2^-10. The difference: K/V are quantized inside jitted programs as each entry is written
(`quantize`), not on the host.

A cache argument is either a float array (the pool's default: today's program, bit for bit) or a `QuantKV`;
`write_layer` is the one place an entry is stored and `dequantize` the one place one is read back, so every
stack that routes its K/V writes through `write_layer` takes either storage (`models.backbone.forward_write`,
Qwen3.5's full-attention layers). Attention reads a layer dequantized to the activation dtype: the entry just
written included, so a quantized pool computes the float program on round-tripped entries.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from oxygen_jax.nn.quant import QMAX, STORED_DTYPE, quantize_rows, weight_dtype_of

KVCache = Literal["float", "int8", "fp8"]
KV_CACHES: tuple[KVCache, ...] = ("float", "int8", "fp8")
"""The K/V storages of a slot pool: float (the decoder's dtype), int8 or fp8 values with float32 scales."""


def check_kv_cache(kind) -> KVCache:
    """`kind` if it names a storage; one-line ValueError otherwise."""
    if kind not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kind!r}")
    return kind


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantKV:
    """Quantized K (or V) entries: `values * scale` (see the module docstring for the axes).

    A pytree of its two arrays with the same leading axes, so slicing, padding and scattering over layers,
    slots and positions apply to both with `jax.tree.map` (the scale's last axis is 1).
    """

    values: jax.Array  # [..., K, H] int8 or float8_e4m3fn
    scale: jax.Array  # float32 [..., K, 1]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def kind(self) -> KVCache:
        return weight_dtype_of(self.values.dtype)


def quantize(x: jax.Array, kind: KVCache) -> QuantKV:
    """x [..., K, H] (any float dtype, traced or not) -> `QuantKV`, absmax over H in float32 (`nn.quant.quantize_rows`,
    the rows the int8 / fp8 matmuls quantize).
    """
    if kind not in STORED_DTYPE:
        raise ValueError(f"quantized K/V are int8 or fp8, got {kind!r}")
    values, scale = quantize_rows(x, kind)
    return QuantKV(values=values, scale=scale)


def dequantize(cache, dtype) -> jax.Array:
    """The entries as attention reads them, in `dtype`: a float array unchanged, a `QuantKV` values * scale."""
    if not isinstance(cache, QuantKV):
        return cache
    return (cache.values.astype(jnp.float32) * cache.scale).astype(dtype)


def zeros(shape: tuple[int, ...], dtype, kind: KVCache):
    """An empty cache of `shape` [..., K, H]: float zeros in `dtype`, or a `QuantKV` of zeros (what `quantize`
    makes of zeros: scale 1 / QMAX)."""
    if check_kv_cache(kind) == "float":
        return jnp.zeros(shape, dtype)
    return QuantKV(values=jnp.zeros(shape, STORED_DTYPE[kind]),
                   scale=jnp.full(shape[:-1] + (1,), 1.0 / QMAX[kind], jnp.float32))


def like(x: jax.Array, cache):
    """Float entries x in `cache`'s storage: x itself for a float cache (a write casts it), quantized for a
    `QuantKV` (e.g. the prefix rows admission copies into a quantized slot)."""
    return quantize(x, cache.kind) if isinstance(cache, QuantKV) else x


def storage(cache) -> KVCache:
    """Which storage `cache` is."""
    return cache.kind if isinstance(cache, QuantKV) else "float"


def write_layer(cache, layer, rows, index, value: jax.Array):
    """Stores `value` at cache[layer, rows, index] and returns (cache, cache[layer] as attention reads it).

    Args:
      cache: [Lk, B, S, K, H] float or `QuantKV`.
      layer: int or traced int; rows int [B, 1]; index int [B, T] (>= S: that write is dropped).
      value: [B, T, K, H] the new entries in the activation dtype.
    Returns:
      (cache, [B, S, K, H] in value's dtype).
    """
    if not isinstance(cache, QuantKV):  # the float program, unchanged
        cache = cache.at[layer, rows, index].set(value.astype(cache.dtype), mode="drop")
        return cache, cache[layer]
    q = quantize(value, cache.kind)
    cache = jax.tree.map(lambda c, n: c.at[layer, rows, index].set(n, mode="drop"), cache, q)
    return cache, dequantize(jax.tree.map(lambda c: c[layer], cache), value.dtype)
