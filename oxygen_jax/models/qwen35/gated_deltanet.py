"""Gated DeltaNet, the linear-attention layer of Qwen3.5: causal depthwise conv, the gated delta rule
(chunked for prefill, recurrent for decode) and the gated output norm, all pure functions over explicit
state.

Axes: B batch, T tokens, D width (`oxygen_jax.axes`); of this module (and `models/qwen35/model.py`): Hk key heads,
Hv value heads (r = Hv / Hk value heads per key head), Dk key head dim, Dv value head dim, Cc = 2 Hk Dk + Hv Dv
conv channels, Kc conv kernel, Tc chunk length, Nt chunks. Einsum letters: A = Hv, X = Dk, Z = Dv, I and J
tokens inside one chunk (no other meaning in this module).

The state a sequence carries (per layer; neither size depends on how many tokens were seen):

    window  [B, Cc, Kc]       the last Kc conv inputs (in_proj_qkv outputs, before the conv), oldest first,
                              zero where fewer than Kc tokens were seen; activation dtype
    state   [B, Hv, Dk, Dv]   float32; S indexed [key dim, value dim], zero-initialised

The delta rule per value head, token t (q̂ = l2norm(q) / sqrt(Dk), k̂ = l2norm(k), α = exp(g), β in (0, 1)):

    S <- α S ;  S <- S + β k̂ (v - Sᵀ k̂)ᵀ ;  o = Sᵀ q̂

`delta_rule_recurrent` runs exactly that (a `lax.scan` over tokens: decode). `delta_rule_chunked` computes
the same numbers in chunks of Tc (a `lax.scan` over chunks, matmuls inside one: prefill): with γ the
cumulative log-decay inside the chunk, Γ_ij = exp(γ_i - γ_j) (j <= i), A = strict-lower((β k̂) k̂ᵀ ⊙ Γ),
U = (I + A)⁻¹ [β v | β e^γ k̂] (one unit-lower triangular solve), V' = U_v - U_k S,
o = (e^γ q̂) S + (lower(q̂ k̂ᵀ) ⊙ Γ) V', S <- e^{γ_last} S + (e^{γ_last - γ} k̂)ᵀ V'.

Float32 order: every step rounds as transformers' torch reference (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `F.conv1d`, `Qwen3_5RMSNormGated`) does on CPU, through
`nn.torch_order`: projections and chunk matmuls summed in order, the conv a multiply-add chain from its
oldest tap, γ a correctly rounded cumulative sum, l2 and RMS norms with torch's reduction order and
1 / sqrt, q scaled by Dk^-1/2 (chunked) or divided by sqrt(Dk) (recurrent), and the products HF rounds
on their own kept out of fused multiply-adds. The triangular solve is XLA's (LAPACK's order is not
reproducible here).

Invalid tokens (padding) are identity steps: g = 0 and β = 0 leave S bit for bit unchanged, and their conv
inputs are zeroed (a select, not a multiply, so a non-finite pad cannot leak). The window after a call ends
at the last valid token. This is exact when the valid tokens of a row are contiguous: left padding before
an empty window (prefill), right padding anywhere (request prompts and bursts in the decode pool). Valid
tokens with invalid ones between them (masked cameras) must be compacted first (`models/qwen35/model.py`).
Example, Kc = 4, a row [pad, pad, a, b, c, pad] from an empty window: the conv of `a` sees (0, 0, 0, a),
the state absorbs a, b, c only, and the window is (0, a, b, c).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from oxygen_jax.models.qwen35 import steps as qwen35_steps
from oxygen_jax.models.lora import LayerRows
from oxygen_jax.nn import torch_order as to
from oxygen_jax.nn.layers import RMSNorm


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaNetSpec:
    """The dims of one Gated DeltaNet layer (HF `linear_*` config fields). Hashable and static."""

    num_key_heads: int  # Hk (linear_num_key_heads)
    num_value_heads: int  # Hv (linear_num_value_heads), a multiple of Hk
    key_dim: int  # Dk (linear_key_head_dim)
    value_dim: int  # Dv (linear_value_head_dim)
    conv_kernel: int = 4  # Kc (linear_conv_kernel_dim)
    chunk_size: int = 64  # Tc of the chunked (prefill) form; any sequence length works
    norm_eps: float = 1e-6  # the gated output norm's epsilon (rms_norm_eps)

    def __post_init__(self):
        for f in ("num_key_heads", "num_value_heads", "key_dim", "value_dim", "conv_kernel", "chunk_size"):
            _require(getattr(self, f) > 0, f"GatedDeltaNetSpec.{f} must be positive, got {getattr(self, f)}")
        _require(self.num_value_heads % self.num_key_heads == 0,
                 f"GatedDeltaNetSpec.num_value_heads ({self.num_value_heads}) must be a multiple of num_key_heads "
                 f"({self.num_key_heads})")

    @property
    def conv_channels(self) -> int:
        """Cc = 2 Hk Dk + Hv Dv, laid out [q (Hk Dk) | k (Hk Dk) | v (Hv Dv)], head-major."""
        return 2 * self.num_key_heads * self.key_dim + self.num_value_heads * self.value_dim

    def state_bytes(self, conv_itemsize: int = 2) -> int:
        """Bytes of one sequence's state in one layer: float32 [Hv, Dk, Dv] plus the [Cc, Kc] window."""
        return 4 * self.num_value_heads * self.key_dim * self.value_dim + conv_itemsize * self.conv_channels * self.conv_kernel


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


def compute_dtype(dtype) -> jnp.dtype:
    """What the float32 parts (norms, conv, delta rule, RoPE, scores) compute in for activations of `dtype`:
    float32, or float64 in a float64 program (which then has no float32 step: an exact reference)."""
    return jnp.promote_types(dtype, jnp.float32)


@_pytree
class GatedDeltaNetLayers:
    """A Gated DeltaNet decoder layer's weights, any leading stacking axes (`...`) first.

    The mixer's leaves are HF's `linear_attn.*` with linears as [in, out]; the norms and the MLP are
    those of `backbone.DecoderLayers` (the (1 + w) input / post-attention norms, SwiGLU).
    """

    qkv: jax.Array  # [..., D, Cc] in_proj_qkv
    z: jax.Array  # [..., D, Hv, Dv] in_proj_z (output gate)
    b: jax.Array  # [..., D, Hv] in_proj_b (β logits)
    a: jax.Array  # [..., D, Hv] in_proj_a (decay input)
    conv: jax.Array  # [..., Cc, Kc] depthwise conv1d, no bias
    dt_bias: jax.Array  # [..., Hv]
    a_log: jax.Array  # [..., Hv] A_log: decay rate -exp(A_log)
    norm: jax.Array  # [..., Dv] gated RMSNorm scale, applied as plain w (not 1 + w)
    out: jax.Array  # [..., Hv, Dv, D] out_proj
    attn_norm: RMSNorm  # scale [..., D]
    ffw_norm: RMSNorm  # scale [..., D]
    gating: jax.Array  # [..., 2, D, F]; 0 = gate (silu), 1 = up
    linear: jax.Array  # [..., F, D]


# --------------------------------------------------------------------------------------------------
# The conv


def causal_conv(window: jax.Array, columns: jax.Array, weight: jax.Array, valid: jax.Array | None = None):
    """Depthwise causal conv + SiLU over `columns` continuing `window`.

    Args:
      window: [B, Cc, Kc] the previous Kc inputs (zeros for a fresh sequence).
      columns: [B, T, Cc] new conv inputs; weight: [Cc, Kc] (tap Kc - 1 multiplies the newest input).
      valid: bool [B, T] (None: all); invalid columns are zeroed and the returned window ends at the
        last valid column of each row (the old window for a row with none).
    Returns:
      (silu(conv) [B, T, Cc] in the columns' dtype, window [B, Cc, Kc]).
    """
    kc, t = weight.shape[-1], columns.shape[1]
    if valid is not None:
        columns = jnp.where(valid[..., None], columns, jnp.zeros((), columns.dtype))
    full = jnp.concatenate([jnp.swapaxes(window, 1, 2).astype(columns.dtype), columns], axis=1)  # [B, Kc + T, Cc]
    ct = compute_dtype(columns.dtype)
    w = weight.astype(ct)
    taps = [full[:, i + 1:i + 1 + t].astype(ct) * w[:, i] for i in range(kc)]
    acc = to.separate(taps[0])  # oldest tap first, then one multiply-add per tap (F.conv1d's order)
    for tap in taps[1:]:
        acc = acc + tap
    out = to.silu(acc).astype(columns.dtype)
    if valid is None:
        new = full[:, t:]
    else:  # the Kc inputs ending at the last valid column: full[last + 1 : last + 1 + Kc]
        idx = jnp.arange(t)
        last = jnp.max(jnp.where(valid, idx, -1), axis=1)  # [B], -1 for a row without valid columns
        new = jax.vmap(lambda f, s: jax.lax.dynamic_slice_in_dim(f, s, kc, axis=0))(full, last + 1)
    return out, jnp.swapaxes(new, 1, 2).astype(window.dtype)


# --------------------------------------------------------------------------------------------------
# The delta rule, two forms


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x²) + eps) over the last axis, in float32 (HF's `l2norm`: eps inside the rsqrt)."""
    return to.l2_normalize(x, eps)


def _identity_steps(k, v, g, beta, valid):
    """Zero k, v, g and β where a token is not valid: such a step leaves the state exactly unchanged."""
    if valid is None:
        return k, v, g, beta
    m = valid[..., None]
    return (jnp.where(m[..., None], k, 0.0), jnp.where(m[..., None], v, 0.0), jnp.where(m, g, 0.0), jnp.where(m, beta, 0.0))


def delta_rule_recurrent(q, k, v, g, beta, state, valid=None):
    """The gated delta rule token by token (decode, and the reference for the chunked form).

    Args:
      q, k: float32 [B, T, Hv, Dk], already l2-normalised (q also scaled by 1 / sqrt(Dk)) and repeated to Hv
        heads; v: float32 [B, T, Hv, Dv]; g: float32 [B, T, Hv] log decay (<= 0); beta: float32 [B, T, Hv].
      state: float32 [B, Hv, Dk, Dv]; valid: bool [B, T] or None (invalid tokens are identity steps).
    Returns:
      (o float32 [B, T, Hv, Dv], state float32 [B, Hv, Dk, Dv]).
    """
    k, v, g, beta = _identity_steps(k, v, g, beta, valid)

    def step(s, xs):
        qt, kt, vt, gt, bt = xs  # [B, Hv, ...]
        s = s * jnp.exp(gt)[..., None, None]
        delta = (vt - to.inner_sum(to.separate(s * kt[..., :, None]))) * bt[..., None]
        s = s + to.separate(kt[..., :, None] * delta[..., None, :])
        return s, to.inner_sum(to.separate(s * qt[..., :, None]))

    ct = compute_dtype(q.dtype)
    xs = tuple(jnp.swapaxes(a.astype(ct), 0, 1) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state.astype(ct), xs)
    return jnp.swapaxes(o, 0, 1), state


def delta_rule_chunked(q, k, v, g, beta, state, valid=None, chunk_size: int = 64):
    """The gated delta rule in chunks of `chunk_size` (prefill); the same arguments and results as
    `delta_rule_recurrent` (equal up to float32 rounding). T is zero-padded to a multiple of Tc with
    identity steps, so any T works and the program depends only on T and Tc.
    """
    k, v, g, beta = _identity_steps(k, v, g, beta, valid)
    b, t, a, dk = q.shape
    ct = compute_dtype(q.dtype)
    tc = chunk_size
    nt = -(-t // tc)
    pad = nt * tc - t

    def chunks(x):  # [B, T, Hv (, Dk | Dv)] -> [Nt, B, Hv, Tc (, Dk | Dv)]
        x = jnp.pad(x.astype(ct), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, nt, tc) + x.shape[2:])
        return jnp.transpose(x, (1, 0, 3, 2) + tuple(range(4, x.ndim)))

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))
    lower = jnp.tril(jnp.ones((tc, tc), bool))
    strict = jnp.tril(jnp.ones((tc, tc), bool), -1)
    eye = jnp.eye(tc, dtype=ct)
    dv = vc.shape[-1]

    def step(s, xs):
        qi, ki, vi, gi, bi = xs  # [B, Hv, Tc (, Dk | Dv)]
        gam = to.cumsum(gi)  # [B, Hv, Tc]
        decay = jnp.exp(jnp.where(lower, gam[..., :, None] - gam[..., None, :], -jnp.inf))  # Γ, zero above the diagonal
        kb = ki * bi[..., None]
        kt = jnp.swapaxes(ki, -1, -2)
        amat = to.matmul(kb, kt) * decay
        attn = to.matmul(qi, kt) * decay
        rhs = jnp.concatenate([vi * bi[..., None], kb * jnp.exp(gam)[..., None]], axis=-1)
        sol = jax.scipy.linalg.solve_triangular(eye + jnp.where(strict, amat, 0.0), rhs, lower=True, unit_diagonal=True)
        u, w = sol[..., :dv], sol[..., dv:]
        vp = u - to.matmul(w, s)
        o = to.matmul(qi * jnp.exp(gam)[..., None], s) + to.matmul(attn, vp)
        kd = ki * jnp.exp(gam[..., -1:] - gam)[..., None]
        s = to.separate(s * jnp.exp(gam[..., -1])[..., None, None]) + to.matmul(jnp.swapaxes(kd, -1, -2), vp)
        return s, o

    state, o = jax.lax.scan(step, state.astype(ct), (qc, kc, vc, gc, bc))  # o [Nt, B, Hv, Tc, Dv]
    o = jnp.moveaxis(o, 0, 1)  # [B, Nt, Hv, Tc, Dv]
    o = jnp.swapaxes(o, 2, 3).reshape(b, nt * tc, a, -1)[:, :t]
    return o, state


# --------------------------------------------------------------------------------------------------
# The mixer (what replaces attention in a linear layer)


def gated_rms_norm(x: jax.Array, gate: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """w ⊙ RMS(x) ⊙ silu(gate) over the last axis (Dv), plain w, HF's cast order (RMS in float32, cast,
    × w, × silu(gate in float32), cast)."""
    ct = compute_dtype(x.dtype)
    xf = x.astype(ct)
    normed = (xf * to.rsqrt(to.row_mean(to.separate(xf * xf))[..., None] + eps)).astype(x.dtype)
    return ((scale.astype(x.dtype) * normed).astype(ct) * to.silu(gate.astype(ct))).astype(x.dtype)


def mixer(gspec: GatedDeltaNetSpec, lp: GatedDeltaNetLayers, x: jax.Array, window: jax.Array, state: jax.Array,
          valid: jax.Array | None, form: str = "chunked", taps: dict | None = None, lora: LayerRows | None = None,
          lanes: bool = False):
    """The linear-attention mixer of one layer over normed inputs x [B, T, D].

    Args:
      lp: one layer of `GatedDeltaNetLayers` (no stacking axis).
      window: [B, Cc, Kc]; state: float32 [B, Hv, Dk, Dv] (what the sequence carried so far).
      valid: bool [B, T] or None; invalid tokens are identity steps (see the module docstring).
      form: "chunked" (prefill) or "recurrent" (decode); the same numbers up to rounding.
      taps: optional dict that receives the intermediates HF's hooks see (qkv, z, a, b, core) for parity.
      lora: this layer's slice of a `lora.DeltaNetLora` bank and the row ids: each row's adapter term is
        added to in_proj_qkv, in_proj_z and out_proj (rows on id 0 keep the base projections bit for
        bit); None: the adapter-free program.
      lanes: the projections summed in four lanes (`qwen35_steps`: transformers' CPU decode steps under
        MKL at AVX2), else in order (`nn.torch_order.dense`).
    Returns:
      (out [B, T, D], window [B, Cc, Kc], state float32 [B, Hv, Dk, Dv]).
    """
    _require(form in ("chunked", "recurrent"), f"mixer form must be 'chunked' or 'recurrent', got {form!r}")
    hk, hv, dk, dv = gspec.num_key_heads, gspec.num_value_heads, gspec.key_dim, gspec.value_dim
    b, t, _ = x.shape
    if valid is not None:  # HF zeroes pad inputs (x * mask); a select also stops non-finite pads
        x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
    dense = qwen35_steps.dense if lanes else to.dense
    columns = dense(x, lp.qkv)  # [B, T, Cc]
    z = dense(x, lp.z.reshape(lp.z.shape[0], hv * dv)).reshape(b, t, hv, dv)
    if lora is not None:  # before the conv: an adapter changes what the window stores
        columns, z = lora.add("qkv", columns, x), lora.add("z", z, x)
    b_logit = dense(x, lp.b)
    a_in = dense(x, lp.a)
    u, window = causal_conv(window, columns, lp.conv, valid)
    q, k, v = jnp.split(u, [hk * dk, 2 * hk * dk], axis=-1)
    r = hv // hk  # key head j serves the consecutive value heads j r .. j r + r - 1
    q = l2norm(q.reshape(b, t, hk, dk))
    # HF's chunked rule multiplies by Dk^-1/2, its recurrent rule divides by sqrt(Dk)
    q = jnp.repeat(q * (dk ** -0.5) if form == "chunked" else to.divide(q, dk ** 0.5), r, axis=2)
    k = jnp.repeat(l2norm(k.reshape(b, t, hk, dk)), r, axis=2)
    ct = compute_dtype(x.dtype)
    v = v.reshape(b, t, hv, dv).astype(ct)
    beta = to.sigmoid(b_logit.astype(ct))
    g = -jnp.exp(lp.a_log.astype(ct)) * to.softplus(a_in.astype(ct) + lp.dt_bias.astype(ct))
    if form == "chunked":
        core, state = delta_rule_chunked(q, k, v, g, beta, state, valid, gspec.chunk_size)
    else:
        core, state = delta_rule_recurrent(q, k, v, g, beta, state, valid)
    core = core.astype(x.dtype)
    if taps is not None:
        taps.update(qkv=columns, z=z, a=a_in, b=b_logit, core=core)
    y = gated_rms_norm(core, z, lp.norm, gspec.norm_eps)
    out = dense(y.reshape(b, t, hv * dv), lp.out.reshape(hv * dv, lp.out.shape[-1]))
    return (out if lora is None else lora.add("out", out, y)), window, state
