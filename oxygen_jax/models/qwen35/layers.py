"""Qwen3.5's two decoder-layer kinds (`models/qwen35/model.py` stacks them), in transformers' float32 order.

Axes: B batch, T tokens, S key slots, D width, F MLP, N query heads, K KV heads, R = N / K, H head dim,
Y = B T flattened tokens, Mr M-RoPE axes (`oxygen_jax.axes`); the linear layer's as `models/qwen35/gated_deltanet.py`.

    full_layer     (1 + w) RMSNorm, q / gate / k / v projections, (1 + w) q- and k-norms, partial
                   interleaved M-RoPE, softmax(q kᵀ · H^-1/2) v, times sigmoid(gate), o-projection,
                   residual; norm, SwiGLU MLP, residual
    linear_layer   the same with `gated_deltanet.mixer` in place of attention

The maths is that of the backbone's transformer layer (`models.backbone`) with Qwen3.5's spec fields; the arithmetic differs on purpose.
Parity references come from transformers on CPU, and a random-weight model multiplies a one-ulp
difference of its first layers 10-100x, past the tolerances, so every step here rounds as transformers'
does (`nn.torch_order`): projections summed in order, norms with torch's reduction order, true division
and 1 / sqrt, RoPE from a float32 inverse frequency (θ^(-2i/R) as 1 / θ^(2i/R)) times the position,
rotated halves rounded before they are added, scores scaled after q kᵀ, SiLU and sigmoid in torch's form.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models import backbone
from oxygen_jax.models.qwen35 import gated_deltanet as gdn
from oxygen_jax.models.qwen35 import steps as qwen35_steps
from oxygen_jax.models.backbone import BackboneSpec
from oxygen_jax.models.lora import LayerRows
from oxygen_jax.nn import torch_order as to
from oxygen_jax.nn.layers import MASK_FILL, RMSNorm


def norm(spec: BackboneSpec, x: jax.Array, n: RMSNorm) -> jax.Array:
    """Qwen3.5's RMSNorm: x / rms(x) · (1 + w), in float32 (float64 for float64 x), cast back to x.dtype."""
    return to.rms_norm(x, n.scale, spec.norm_eps, plus_one=True)


def mlp(x: jax.Array, gating: jax.Array, linear: jax.Array, lora: LayerRows | None = None, lanes: bool = False) -> jax.Array:
    """SwiGLU `(silu(x W0) * (x W1)) W2`, gating = [W0; W1] [2, D, F], linear [F, D] (the two input
    projections as one batched matmul, XLA's fast form on CPU). `lora` adds per-row adapter terms; `lanes`:
    projections summed in four lanes (`qwen35_steps`)."""
    lead, d = x.shape[:-1], x.shape[-1]
    xf = x.reshape(-1, d)
    if lanes:
        gate_up = qwen35_steps.pair(xf, gating)
    else:
        gate_up = to.matmul(jnp.broadcast_to(xf, (2,) + xf.shape), gating.astype(x.dtype))  # [2, Y, F]
    if lora is not None:
        gate_up = lora.add("gating", gate_up, xf)
    h = to.silu(gate_up[0]) * gate_up[1]
    out = (qwen35_steps.dense if lanes else to.dense)(h, linear)
    if lora is not None:
        out = lora.add("linear", out, h)
    return out.reshape(lead + (linear.shape[-1],))


def rope_tables(spec: BackboneSpec, positions: jax.Array, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) [B, T, 1, R/2] of positions int [B, T] or [Mr, B, T] (R = rotary dims), in the compute
    dtype of activations of `dtype` (`gated_deltanet.compute_dtype`: float32, or float64).

    Angle i = position_i · inv_freq_i with inv_freq_i = 1 / θ^(2i/R) rounded to float32 (HF's table; in
    float64 the exact value) and position_i the M-RoPE axis frequency i belongs to (`backbone.rope_angles`
    with θ = 1 reads it off; integers, exact in float32).
    """
    r = spec.rotary_dim or spec.head_dim
    ct = np.dtype(gdn.compute_dtype(dtype))
    exponent = np.arange(0, r, 2, dtype=ct) / ct.type(r)
    inv_freq = ct.type(1.0) / (spec.rope.theta ** exponent.astype(np.float64)).astype(ct)
    per_freq = backbone.rope_angles(dataclasses.replace(spec.rope, theta=1.0), positions, r).astype(ct)  # [B, T, R/2]
    angles = (per_freq * jnp.asarray(inv_freq))[..., None, :]
    return jnp.sin(angles), jnp.cos(angles)


def _rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """x·cos + rotate_half(x)·sin on the leading R dims of H (the rest pass through), each product rounded."""
    r = 2 * sin.shape[-1]
    xr = x[..., :r].astype(sin.dtype)
    x1, x2 = xr[..., :r // 2], xr[..., r // 2:]
    rotated = to.separate(xr * jnp.concatenate([cos, cos], -1)) + to.separate(jnp.concatenate([-x2, x1], -1) * jnp.concatenate([sin, sin], -1))
    return jnp.concatenate([rotated.astype(x.dtype), x[..., r:]], axis=-1)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax(q kᵀ · H^-1/2, masked) v for q [B, T, N, H], k, v [B, S, K, H], mask bool [B, T, S]."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    if mask.shape != (b, t, k.shape[1]):
        raise ValueError(f"attention mask must be [B, T, S] = {(b, t, k.shape[1])}, got {mask.shape}")
    qg = jnp.transpose(q.reshape(b, t, kh, n // kh, h), (0, 2, 3, 1, 4)).reshape(b, kh, -1, h)  # [B, K, R T, H]
    ct = gdn.compute_dtype(q.dtype)
    scores = to.matmul(qg, jnp.transpose(k, (0, 2, 3, 1)), ct) * (h ** -0.5)  # [B, K, R T, S], float32 (or float64)
    scores = jnp.where(mask[:, None, None], scores.reshape(b, kh, n // kh, t, -1), MASK_FILL)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kh, -1, k.shape[1])
    out = to.matmul(probs, jnp.transpose(v, (0, 2, 1, 3)))  # [B, K, R T, H]
    return jnp.transpose(out.reshape(b, kh, n // kh, t, h), (0, 3, 1, 2, 4)).reshape(b, t, n, h)


def _heads_in(w: jax.Array) -> jax.Array:
    """[heads, D, H] -> [D, heads H]."""
    return jnp.moveaxis(w, 0, 1).reshape(w.shape[1], -1)


def full_layer(spec: BackboneSpec, lp, x: jax.Array, rope: tuple[jax.Array, jax.Array], mask: jax.Array,
               kv_fn: backbone.KVFn, lora: LayerRows | None = None, lanes: bool = False) -> jax.Array:
    """One gated full-attention layer (`qwen35.FullLayers` slice) over x [B, T, D].

    `rope` = `rope_tables(spec, positions)`; `kv_fn(k, v) -> (keys, values)` [B, S, K, H] chooses what the
    queries attend to (the layer's new k / v, or a cache they were written into); mask bool [B, T, S].
    `lora` adds per-row adapter terms to q, kv, out and the MLP (None: the adapter-free program); `lanes`:
    projections summed in four lanes (`qwen35_steps`, `Qwen35Spec.step_sums`).
    """
    sin, cos = rope
    b, t, d = x.shape
    n, kh, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    dense = qwen35_steps.dense if lanes else to.dense
    h = norm(spec, x, lp.attn_norm)
    q = dense(h, _heads_in(lp.q)).reshape(b, t, n, hd)
    gate = dense(h, _heads_in(lp.q_gate))
    kv = jnp.moveaxis(dense(h, _heads_in(lp.kv.reshape((-1,) + lp.kv.shape[2:]))).reshape(b, t, 2, kh, hd), 2, 0)
    if lora is not None:
        q, kv = lora.add("q", q, h), lora.add("kv", kv, h)
    k, v = kv
    q = _rope(norm(spec, q, lp.q_norm), sin, cos)
    k = _rope(norm(spec, k, lp.k_norm), sin, cos)
    keys, values = kv_fn(k, v)
    a = _attention(q, keys, values, mask)
    a = (a.reshape(b, t, n * hd) * to.sigmoid(gate.astype(gdn.compute_dtype(a.dtype))).astype(a.dtype)).reshape(b, t, n, hd)
    o = dense(a.reshape(b, t, n * hd), lp.out.reshape(n * hd, d))
    if lora is not None:
        o = lora.add("out", o, a)
    x = x + o
    return x + mlp(norm(spec, x, lp.ffw_norm), lp.gating, lp.linear, lora, lanes)


def linear_layer(spec, lp: gdn.GatedDeltaNetLayers, x: jax.Array, window: jax.Array, state: jax.Array,
                 valid: jax.Array | None, form: str, taps: dict | None = None, lora: LayerRows | None = None,
                 lanes: bool = False):
    """One Gated DeltaNet decoder layer of `spec` (a `qwen35.Qwen35Spec`): norm, mixer, residual, norm,
    SwiGLU, residual. Returns (x, window, state) as `gated_deltanet.mixer` (`lora`: this layer's
    `DeltaNetLora` slice and the row ids; `lanes`: projections summed in four lanes, `qwen35_steps`)."""
    bspec = spec.backbone
    o, window, state = gdn.mixer(spec.gdn, lp, norm(bspec, x, lp.attn_norm), window, state, valid, form, taps, lora, lanes)
    x = x + o
    return x + mlp(norm(bspec, x, lp.ffw_norm), lp.gating, lp.linear, lora, lanes), window, state
