"""A deliberately plain π0.5 mixture-of-transformers forward, for tests only.

No cache, no scan, no einsum tricks: a Python loop over layers, both experts' tokens concatenated
along the sequence exactly as openpi's joint forward does, attention computed head by head with an
explicit key-head index (GQA), RoPE from its angle formula, masks from a double loop. The fast paths
(prefill + cached denoise, cached text decode) must agree with it.
"""

from __future__ import annotations

import numpy as np

from oxygen_jax.nn.layers import AdaRMSNorm
from oxygen_jax.models.pi05.params import Params

_NEG = -2.3819763e38


def _rms(x, norm, cond, layer=None):
    var = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    normed = x / np.sqrt(var + 1e-6)
    if isinstance(norm, AdaRMSNorm):
        kern = np.asarray(norm.modulation.kernel, np.float64)
        bias = np.asarray(norm.modulation.bias, np.float64)
        if layer is not None:
            kern, bias = kern[layer], bias[layer]
        mod = cond @ kern + bias
        d = x.shape[-1]
        scale, shift, gate = mod[:, None, :d], mod[:, None, d:2 * d], mod[:, None, 2 * d:]
        return normed * (1 + scale) + shift, gate
    scale = np.asarray(norm.scale, np.float64)
    if layer is not None:
        scale = scale[layer]
    return normed * (1 + scale), None


def _rope(x, pos):
    """x [T, N, H], pos [T]: rotate pair (i, i + H/2) by pos / 10000^(2i/H)."""
    h = x.shape[-1]
    out = np.empty_like(x)
    for i in range(h // 2):
        ang = pos / 10000.0 ** (2 * i / h)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        out[..., i] = x[..., i] * c - x[..., i + h // 2] * s
        out[..., i + h // 2] = x[..., i + h // 2] * c + x[..., i] * s
    return out


def attn_mask(input_mask, ar):
    """Double-loop version of make_attn_mask for one row: [T] -> [T, T]."""
    t = len(input_mask)
    blocks = np.cumsum(ar)
    m = np.zeros((t, t), bool)
    for q in range(t):
        for k in range(t):
            m[q, k] = bool(input_mask[q] and input_mask[k] and blocks[k] <= blocks[q])
    return m


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def joint_forward(params: Params, xs, input_mask, ar, cond=None):
    """One row of the joint forward.

    Args:
      xs: list of per-expert token embeddings ([T_i, D_i] arrays, or None to skip an expert), in
        sequence order (expert 0 first).
      input_mask, ar: [sum T_i] for the concatenated sequence.
      cond: [Da] time condition for the adaptive expert.
    Returns:
      per-expert outputs after their final norms (None for skipped experts).
    """
    experts = [params.vlm, params.action_expert]
    xs = [None if x is None else np.asarray(x, np.float64) for x in xs]
    cond = None if cond is None else np.asarray(cond, np.float64)[None]
    pos = np.cumsum(input_mask) - 1
    mask = attn_mask(input_mask, ar)
    depth = params.vlm.layers.q.shape[0]
    for layer in range(depth):
        qs, ks, vs, gates, sizes = [], [], [], [], []
        for e, x in zip(experts, xs):
            if x is None:
                sizes.append(0)
                gates.append(None)
                continue
            lp = e.layers
            h, g = _rms(x[None], lp.attn_norm, cond, layer)
            h = h[0]
            gates.append(g)
            qs.append(np.einsum("td,ndh->tnh", h, np.asarray(lp.q[layer], np.float64)))
            kv = np.asarray(lp.kv[layer], np.float64)
            ks.append(np.einsum("td,kdh->tkh", h, kv[0]))
            vs.append(np.einsum("td,kdh->tkh", h, kv[1]))
            sizes.append(len(x))
        q, k, v = (np.concatenate(a, 0) for a in (qs, ks, vs))
        hd = q.shape[-1]
        q = _rope(q, pos) / np.sqrt(hd)
        k = _rope(k, pos)
        n, kh = q.shape[1], k.shape[1]
        out = np.zeros_like(q)
        for head in range(n):
            kv_head = head // (n // kh)
            logits = q[:, head] @ k[:, kv_head].T
            logits = np.where(mask, logits, _NEG)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[:, head] = p @ v[:, kv_head]
        start = 0
        for i, (e, x) in enumerate(zip(experts, xs)):
            if x is None:
                continue
            lp = e.layers
            a = np.einsum("tnh,nhd->td", out[start:start + sizes[i]], np.asarray(lp.out[layer], np.float64))
            start += sizes[i]
            x = x + (a if gates[i] is None else a * gates[i][0])
            h, g = _rms(x[None], lp.ffw_norm, cond, layer)
            w = np.asarray(lp.gating[layer], np.float64)
            m = (_gelu(h[0] @ w[0]) * (h[0] @ w[1])) @ np.asarray(lp.linear[layer], np.float64)
            xs[i] = x + (m if g is None else m * g[0])
    outs = []
    for e, x in zip(experts, xs):
        outs.append(None if x is None else _rms(x[None], e.final_norm, cond)[0][0])
    return outs
