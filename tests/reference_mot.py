"""A deliberately plain π0.5 mixture-of-transformers forward and plain readings of every action-head kind,
for tests only.

No cache, no scan, no einsum tricks: a Python loop over layers, both experts' tokens concatenated
along the sequence exactly as openpi's joint forward does, attention computed head by head with an
explicit key-head index (GQA), RoPE from its angle formula, masks from a double loop. The fast paths
(prefill + cached denoise, cached text decode) must agree with it.
"""

from __future__ import annotations

import jax
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


# --------------------------------------------------------------------------------------------------
# The action heads, one plain reading per kind (float64, one row and one attention head at a time)
#
# Each takes the head's weights (any float leaves), its spec and a prefix given as numpy arrays: K/V
# [L, B, P, K, H] of every backbone layer, hidden states [L + 1, B, P, D], mask [B, P], next_position
# [B] and the RoPE theta (1-D RoPE). Blocks are walked in their native order (block i of a DiT, layer l
# of a stack), not in the fast path's stacked layout.


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _silu(x):
    return x / (1 + np.exp(-x))


def _ln(x, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


def _plain_rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _dense(x, lin):
    """x [..., in] @ kernel [in, out...] (+ bias)."""
    y = np.tensordot(x, lin.kernel, axes=([x.ndim - 1], [0]))
    return y if lin.bias is None else y + lin.bias


def _sincos(t, dim, cos_first, shift):
    """Diffusers / XR0 features: frequencies 10000^(-i / (dim/2 - shift))."""
    freqs = np.exp(-np.log(10_000.0) * np.arange(dim // 2) / (dim // 2 - shift))
    a = np.asarray(t, np.float64)[..., None] * freqs
    return np.concatenate([np.cos(a), np.sin(a)] if cos_first else [np.sin(a), np.cos(a)], -1)


def _rot(x, pos, theta):
    """x [T, N, H] rotated by 1-D RoPE at positions pos [T] (pairs i, i + H/2)."""
    h = x.shape[-1]
    ang = pos[:, None] / theta ** (2 * np.arange(h // 2) / h)
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    return np.concatenate([x[..., :h // 2] * c - x[..., h // 2:] * s, x[..., h // 2:] * c + x[..., :h // 2] * s], -1)


def _heads_attention(q, k, v, mask):
    """q [T, N, H] (already scaled), k, v [S, K, H], mask [T, S]: query head n reads key head n // (N / K)."""
    n, kh = q.shape[1], k.shape[1]
    out = np.zeros(q.shape[:2] + v.shape[-1:])
    for head in range(n):
        g = head // (n // kh)
        logits = np.where(mask, q[:, head] @ k[:, g].T, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
    return out


def joint_kv_velocity(params, spec, k_cache, v_cache, mask, next_position, theta, x_t, state, step):
    """XR0's DiT (`JointKvSpec`) at Euler step `step`: float64 [B, Ha, Ad]."""
    p = _f64(params)
    t_in = step / spec.num_steps * spec.time_scale if spec.t_direction == "0_to_1" else (1 - step / spec.num_steps) * spec.time_scale
    temb = _silu(_sincos(t_in, spec.time_embed_dim, True, 0) @ p.time_mlp.fc1.kernel) @ p.time_mlp.fc2.kernel
    mod = np.einsum("d,dse->se", temb, p.time_proj.kernel) + p.time_proj.bias  # [6, Da]
    out = []
    for b in range(x_t.shape[0]):
        tokens = []
        if spec.sink:
            tokens.append(p.sink)
        if spec.state_dim:
            tokens.append((_gelu(np.asarray(state[b], np.float64) @ p.state_in.fc1.kernel) @ p.state_in.fc2.kernel)[None])
        x = np.asarray(x_t[b], np.float64) * (1.0 if spec.action_mask is None else np.asarray(spec.action_mask))
        tokens.append(_gelu(x @ p.action_in.fc1.kernel) @ p.action_in.fc2.kernel)
        h = np.concatenate(tokens, 0)
        t = len(h)
        pos = next_position[b] + np.arange(t)
        valid = np.asarray(mask[b], bool)
        m = np.concatenate([np.broadcast_to(valid, (t, len(valid))), np.tril(np.ones((t, t), bool))], -1)
        for l, layer in enumerate(spec.kv_layers):
            lp = jax.tree.map(lambda a, l=l: a[l], p.layers)
            sh1, sc1, g1, sh2, sc2, g2 = lp.adaln + mod
            y = _plain_rms(h, lp.norms[0]) * (1 + sc1) + sh1
            q = np.einsum("td,dnh->tnh", y, lp.q.kernel) + lp.q.bias
            k = np.einsum("td,dnh->tnh", y, lp.kv.kernel[0]) + lp.kv.bias[0]
            v = np.einsum("td,dnh->tnh", y, lp.kv.kernel[1]) + lp.kv.bias[1]
            q = _rot(_plain_rms(q, lp.q_norm), pos, theta) / np.sqrt(spec.head_dim)
            k = _rot(_plain_rms(k, lp.k_norm), pos, theta)
            rep = spec.num_heads // spec.num_kv_heads  # the cache's K heads repeated to N: head n reads n // rep
            ck = np.repeat(np.asarray(k_cache[layer, b], np.float64), rep, axis=1)
            cv = np.repeat(np.asarray(v_cache[layer, b], np.float64), rep, axis=1)
            a = _heads_attention(q, np.concatenate([ck, k]), np.concatenate([cv, v]), m)
            h = _plain_rms(h + g1 * np.einsum("tnh,nhd->td", a, lp.out), lp.norms[1])
            y = _plain_rms(h, lp.norms[2]) * (1 + sc2) + sh2
            h = _plain_rms(h + g2 * ((_silu(y @ lp.gating[0]) * (y @ lp.gating[1])) @ lp.linear), lp.norms[3])
        out.append(_gelu(h[-spec.horizon:] @ p.action_out.fc1.kernel) @ p.action_out.fc2.kernel)
    return np.stack(out)


def _cross_block(blk, x, temb, ctx, mask, head_dim):
    """diffusers BasicTransformerBlock (ada_norm, no affine norms); ctx None: self-attention, no mask."""
    scale, shift = np.einsum("d,dse->se", _silu(temb), blk.ada.kernel) + blk.ada.bias
    y = _ln(x, 1e-5) * (1 + scale) + shift
    src = y if ctx is None else ctx
    q = (np.einsum("td,dnh->tnh", y, blk.q.kernel) + blk.q.bias) / np.sqrt(head_dim)
    k = np.einsum("sx,xnh->snh", src, blk.kv.kernel[0]) + blk.kv.bias[0]
    v = np.einsum("sx,xnh->snh", src, blk.kv.kernel[1]) + blk.kv.bias[1]
    m = np.ones((len(x), len(src)), bool) if ctx is None else np.broadcast_to(mask, (len(x), len(src)))
    x = x + np.einsum("tnh,nhd->td", _heads_attention(q, k, v, m), blk.out.kernel) + blk.out.bias
    return x + _dense(_gelu(_dense(_ln(x, 1e-5), blk.ff_in)), blk.ff_out)


def cross_actions(params, spec, hidden, mask, noise, state):
    """StarVLA's DiT head (`CrossHiddenSpec` / `CrossLastSpec`): `predict_action`'s whole Euler loop, float64 [B, Ha, Ad].

    Block i self-attends when the pattern interleaves and i is odd (any depth), else it cross-attends to
    the hidden state of its cross index (QwenPI_v3: after LayerNorm + Linear of that index).
    """
    p = _f64(params)
    blocks = p.blocks
    cross_stack, self_stack = (blocks.cross, blocks.self_) if hasattr(blocks, "self_") else (blocks, None)
    at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
    out = []
    for b in range(noise.shape[0]):
        ctxs = []
        for c, layer in enumerate(spec.hidden_layers):
            ctx = np.asarray(hidden[layer, b], np.float64)
            if p.hidden_proj is not None:
                ctx = (_ln(ctx, 1e-5) * p.hidden_proj.norm.scale[c] + p.hidden_proj.norm.bias[c]) @ p.hidden_proj.proj.kernel[c] \
                    + p.hidden_proj.proj.bias[c]
            ctxs.append(ctx)
        valid = np.asarray(mask[b], bool)
        x = np.asarray(noise[b], np.float64)
        for step in range(spec.num_steps):
            bucket = float(int(step / spec.num_steps * spec.time_scale))
            temb = _dense(_silu(_dense(_sincos(bucket, spec.time_embed_dim, True, 1), p.time_mlp.fc1)), p.time_mlp.fc2)
            tau = _sincos(np.full(spec.horizon, bucket), spec.width, False, 0)
            enc = p.action_in
            z = _dense(_silu(_dense(np.concatenate([_dense(x, enc.w1), tau], -1), enc.w2)), enc.w3)
            tokens = []
            if spec.state_dim:
                tokens.append(_dense(np.maximum(_dense(np.asarray(state[b], np.float64), p.state_in.fc1), 0), p.state_in.fc2)[None])
            if spec.num_future_tokens:
                tokens.append(p.future)
            h = np.concatenate(tokens + [z + p.positions[:spec.horizon]], 0)
            n_cross = n_self = 0
            for i in range(spec.depth):
                if spec.block_pattern == "cross_self" and i % 2 == 1:
                    h = _cross_block(at(self_stack, n_self), h, temb, None, None, spec.head_dim)
                    n_self += 1
                else:
                    h = _cross_block(at(cross_stack, n_cross), h, temb, ctxs[n_cross], valid, spec.head_dim)
                    n_cross += 1
            h = h[-spec.horizon:]
            if p.out_proj is not None:  # GR00T's output block: (shift, scale)
                shift, scale = np.einsum("d,dse->se", _silu(temb), p.out_mod.kernel) + p.out_mod.bias
                h = _dense(_ln(h, 1e-6) * (1 + scale) + shift, p.out_proj)
            x = x + _dense(np.maximum(_dense(h, p.action_out.fc1), 0), p.action_out.fc2) / spec.num_steps
        out.append(x)
    return np.stack(out)


def _posemb(t, dim, min_period=4e-3, max_period=4.0):
    frac = np.linspace(0.0, 1.0, dim // 2)
    arg = t * 2 * np.pi / (min_period * (max_period / min_period) ** frac)
    return np.concatenate([np.sin(arg), np.cos(arg)], -1)


def adarms_velocity(params, spec, k_cache, v_cache, mask, next_position, theta, x_t, t):
    """π0.5's action expert as a head (`AdaRmsSpec`) at flow time t (a float): float64 [B, Ha, Ad].

    Layer l attends to [prefix K/V of backbone layer l ‖ its own], bidirectionally inside the chunk.
    """
    p = _f64(params)
    d = spec.width
    cond = _silu(_dense(_silu(_dense(_posemb(t, d), p.time_mlp_in)), p.time_mlp_out))

    def ada(norm, l, x):
        kern, bias = (norm.modulation.kernel, norm.modulation.bias) if l is None else (norm.modulation.kernel[l], norm.modulation.bias[l])
        scale, shift, gate = np.split(cond @ kern + bias, 3)
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + scale) + shift, gate

    lp = p.layers
    out = []
    for b in range(x_t.shape[0]):
        x = _dense(np.asarray(x_t[b], np.float64), p.action_in)
        ha = len(x)
        pos = next_position[b] + np.arange(ha)
        valid = np.asarray(mask[b], bool)
        m = np.concatenate([np.broadcast_to(valid, (ha, len(valid))), np.ones((ha, ha), bool)], -1)
        for l in range(spec.depth):
            h, gate = ada(lp.attn_norm, l, x)
            q = _rot(np.einsum("td,ndh->tnh", h, lp.q[l]), pos, theta) / np.sqrt(spec.head_dim)
            k = _rot(np.einsum("td,kdh->tkh", h, lp.kv[l, 0]), pos, theta)
            v = np.einsum("td,kdh->tkh", h, lp.kv[l, 1])
            keys = np.concatenate([np.asarray(k_cache[l, b], np.float64), k])
            values = np.concatenate([np.asarray(v_cache[l, b], np.float64), v])
            x = x + gate * np.einsum("tnh,nhd->td", _heads_attention(q, keys, values, m), lp.out[l])
            h, gate = ada(lp.ffw_norm, l, x)
            x = x + gate * ((_gelu(h @ lp.gating[l, 0]) * (h @ lp.gating[l, 1])) @ lp.linear[l])
        out.append(_dense(ada(p.final_norm, None, x)[0], p.action_out))
    return np.stack(out)
