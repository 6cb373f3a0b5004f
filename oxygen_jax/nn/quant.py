"""Weight-only quantization: `QArray` leaves (int8 or float8 e4m3 values, per-output-channel scales) in any
parameter tree, quantized by path rules and turned back into the compute dtype one layer at a time.

A quantized weight w ≈ values * scale, elementwise with broadcasting:

    values: int8 (symmetric absmax, |values| <= 127) or float8_e4m3fn (|values| <= 448), w's shape;
    scale:  w's rank, 1 on the reduced (input) axes: absmax(w over those axes) / 127 or / 448, in the
            compute dtype (float32 on disk).

E.g. an MLP down-projection stack `linear` [L, F, D] reduces over F: scale [L, 1, D], one per layer and
output channel. Only leaves of layer stacks are quantized (`RULES`); `nn.layers.scan_layers` dequantizes
each layer's leaves at the top of its loop body (`dequantizing`; Qwen3.5's scan over layer groups wraps its
body the same way, one group at a time), so only one layer's (group's) weights ever exist
in the compute dtype and XLA may fuse the convert and the multiply into the matmul. Embeddings, norms,
biases and the small projections outside the stacks stay in the compute dtype.

Error of one element (`error_bound`): int8 at most scale / 2 (half a step); fp8 e4m3 at most 2^-4 |w|
(3 mantissa bits, round to nearest) or, below the smallest normal, scale * 2^-10.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Literal, Mapping

import jax
import ml_dtypes
import numpy as np

WeightDType = Literal["int8", "fp8"]
Kind = Literal["attn", "mlp", "adanorm"]

STORED_DTYPE: dict[str, np.dtype] = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
"""The dtype each `WeightDType` stores its values in."""

QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
"""The largest |value| of each `WeightDType`: the channel's absmax maps onto it."""

_BLOCK = 1 << 22  # elements quantized at once: a full-size leaf never needs float32 temporaries of its size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized weight: `values * scale` (see the module docstring). A pytree of its two arrays, so a stack
    [L, ...] slices, unstacks and scans like a plain array."""

    values: jax.Array  # [...] int8 or float8_e4m3fn
    scale: jax.Array  # [...] same rank, 1 on the reduced axes; the compute dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self):
        """The dtype `dequantize` gives (the compute dtype)."""
        return self.scale.dtype

    @property
    def weights(self) -> WeightDType:
        return weight_dtype_of(self.values.dtype)


def weight_dtype_of(dtype) -> WeightDType:
    """"int8" or "fp8" for a stored values dtype; ValueError for any other."""
    for name, d in STORED_DTYPE.items():
        if np.dtype(dtype) == d:
            return name  # type: ignore[return-value]
    raise ValueError(f"quantized values must be int8 or float8_e4m3fn, got {np.dtype(dtype).name}")


def scale_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    """The scale's shape for a weight of `shape` reduced over `axes`: those axes 1, the others kept."""
    reduced = {a % len(shape) for a in axes}
    return tuple(1 if i in reduced else n for i, n in enumerate(shape))


def quantize(w, weights: WeightDType, axes: tuple[int, ...]) -> QArray:
    """Quantizes `w` on the host (numpy), per channel: absmax over `axes` maps onto `QMAX[weights]`.

    Args:
      w: [...] a float weight (numpy or jax, any float dtype); read in float32 blocks along axis 0 when
        axis 0 is not reduced, so a multi-GiB stack never has float32 temporaries of its own size.
      weights: "int8" (round to nearest, |v| <= 127) or "fp8" (float8_e4m3fn, |v| <= 448).
      axes: the reduced (input) axes, e.g. (-2,) for [L, F, D]; negative or not.
    Returns:
      A `QArray` of numpy arrays: values [w.shape] in `STORED_DTYPE[weights]`, scale float32
      `scale_shape(w.shape, axes)`. An all-zero channel gets scale 1 / QMAX (values 0), never 0.
    """
    if weights not in STORED_DTYPE:
        raise ValueError(f"weights must be 'int8' or 'fp8', got {weights!r}")
    w = np.asarray(w)
    if not np.issubdtype(w.dtype, np.floating) and w.dtype != np.dtype(ml_dtypes.bfloat16):
        raise ValueError(f"only float weights are quantized, got {w.dtype.name}{list(w.shape)}")
    norm = tuple(sorted({a % w.ndim for a in axes})) if w.ndim else ()
    if not norm or len(norm) != len(axes) or any(not -w.ndim <= a < w.ndim for a in axes):
        raise ValueError(f"axes {axes} are not distinct axes of a weight of shape {list(w.shape)}")
    values = np.empty(w.shape, STORED_DTYPE[weights])
    scale = np.empty(scale_shape(w.shape, norm), np.float32)
    qmax = np.float32(QMAX[weights])
    # Blocks along axis 0 (each holds whole channels unless axis 0 is reduced, then it is one block).
    rows = w.shape[0] if 0 not in norm else 1
    per_row = max(1, w.size // max(rows, 1))
    step = max(1, _BLOCK // per_row) if rows > 1 else 1
    for start in range(0, rows, step):
        sl = slice(start, start + step) if rows > 1 else slice(None)
        block = np.asarray(w[sl], np.float32)
        if not np.isfinite(block).all():
            raise ValueError(f"cannot quantize a weight of shape {list(w.shape)} holding NaN or inf")
        absmax = np.max(np.abs(block), axis=norm, keepdims=True)
        s = np.where(absmax > 0, absmax, np.float32(1.0)) / qmax
        scaled = block / s
        values[sl] = np.clip(np.rint(scaled), -qmax, qmax) if weights == "int8" else np.clip(scaled, -qmax, qmax)
        scale[sl] = s
    return QArray(values=values, scale=scale)


def dequantize(q: QArray) -> jax.Array:
    """values * scale in the scale's dtype (the compute dtype): [...] -> [...]."""
    return q.values.astype(q.scale.dtype) * q.scale


def _is_q(x) -> bool:
    return isinstance(x, QArray)


def has_quantized(tree) -> bool:
    """Whether `tree` holds any `QArray`."""
    return any(_is_q(x) for x in jax.tree.leaves(tree, is_leaf=_is_q))


def dequantize_tree(tree):
    """`tree` with every `QArray` replaced by `dequantize` of it (other leaves unchanged)."""
    return jax.tree.map(lambda x: dequantize(x) if _is_q(x) else x, tree, is_leaf=_is_q)


def dequantizing(body: Callable) -> Callable:
    """Wraps a layer-loop body `body(carry, layer, extra, index)` so that it sees `layer` dequantized.

    A layer without `QArray` leaves passes through untouched (the same program as before). With them, an
    optimisation barrier ties the layer's weights to the carry first: in an unrolled loop (XLA's CPU form)
    nothing then lets the compiler dequantize every layer up front, which would hold all weights in the
    compute dtype at once.
    """

    def run(carry, layer, extra, index):
        if not has_quantized(layer):
            return body(carry, layer, extra, index)
        carry, layer = jax.lax.optimization_barrier((carry, layer))
        return body(carry, dequantize_tree(layer), extra, index)

    return run


def error_bound(q: QArray, w) -> np.ndarray:
    """The largest |w - dequantize(q)| the format allows per element of the weight `w` q was made from
    (float32 [w.shape]): int8 scale / 2; fp8 2^-4 |w| + scale * 2^-10 (the subnormal step / 2).
    """
    scale = np.asarray(q.scale, np.float32)
    if q.weights == "int8":
        return np.broadcast_to(scale / 2, q.shape).astype(np.float32)
    return (np.abs(np.asarray(w, np.float32)) * 2.0 ** -4 + scale * 2.0 ** -10).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# Which leaves: rules over the leaf's path


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """Leaves whose "/"-joined attribute path matches `pattern` are of `kind` and reduce over `axes`."""

    kind: Kind  # what the `--layers` choice selects: attention projections, the MLP or adaptive norms' projections
    pattern: str  # regular expression, `re.search`ed on the path (e.g. "vlm/layers/q")
    axes: tuple[int, ...]  # the input axes, counted from the end; a leading layer axis must precede them


RULES: tuple[Rule, ...] = (
    # Gemma / Qwen3 decoder layers (π0.5's experts, `backbone.DecoderLayers`, the XR0 DiT's `out`):
    Rule(kind="attn", pattern=r"(^|/)layers/q$", axes=(-2,)),  # [L, N, D, H]
    Rule(kind="attn", pattern=r"(^|/)layers/kv$", axes=(-2,)),  # [L, 2, K, D, H]
    Rule(kind="attn", pattern=r"(^|/)layers/out$", axes=(-3, -2)),  # [L, N, H, D]
    Rule(kind="mlp", pattern=r"(^|/)layers/gating$", axes=(-2,)),  # [L, 2, D, F]
    Rule(kind="mlp", pattern=r"(^|/)layers/linear$", axes=(-2,)),  # [L, F, D]
    # Kernels with split head axes (SigLIP's attention, the XR0 DiT's q / kv): [L, (2,) W, N, H] / [L, N, H, W]
    Rule(kind="attn", pattern=r"(^|/)layers/(q|kv|query|key|value)/kernel$", axes=(-3,)),
    Rule(kind="attn", pattern=r"(^|/)layers/out/kernel$", axes=(-3, -2)),
    Rule(kind="mlp", pattern=r"(^|/)layers/mlp_(in|out)/kernel$", axes=(-2,)),  # SigLIP [L, W, Fv], [L, Fv, W]
    # Adaptive RMSNorms' modulation projections (π0.5's action expert, from the time embedding): [L, Dc, 3 D]
    Rule(kind="adanorm", pattern=r"(^|/)layers/(attn_norm|ffw_norm)/modulation/kernel$", axes=(-2,)),
    # Qwen3.5's hybrid stack (`models.qwen35.HybridLayers`, leading [G, P]; dequantized per group in its own
    # scan). Full-attention layers: the decoder layer's leaves plus the output gate q_gate [G, Pf, N, D, H].
    Rule(kind="attn", pattern=r"(^|/)layers/full/(q|q_gate)$", axes=(-2,)),  # [G, Pf, N, D, H]
    Rule(kind="attn", pattern=r"(^|/)layers/full/kv$", axes=(-2,)),  # [G, Pf, 2, K, D, H]
    Rule(kind="attn", pattern=r"(^|/)layers/full/out$", axes=(-3, -2)),  # [G, Pf, N, H, D]
    # Gated DeltaNet layers: in_proj_qkv [G, Pl, D, Cc], in_proj_z [G, Pl, D, Hv, Dv], out_proj [G, Pl, Hv, Dv, D].
    # Kept float: in_proj_b / in_proj_a [D, Hv] (Hv outputs, a few per mille of the bytes, and they set β and
    # the state's decay exponent, whose error the recurrence compounds), the depthwise conv, A_log, dt_bias, norms.
    Rule(kind="attn", pattern=r"(^|/)layers/linear/qkv$", axes=(-2,)),
    Rule(kind="attn", pattern=r"(^|/)layers/linear/z$", axes=(-3,)),
    Rule(kind="attn", pattern=r"(^|/)layers/linear/out$", axes=(-3, -2)),
    Rule(kind="mlp", pattern=r"(^|/)layers/(full|linear)/gating$", axes=(-2,)),  # [G, P, 2, D, F]
    Rule(kind="mlp", pattern=r"(^|/)layers/(full|linear)/linear$", axes=(-2,)),  # [G, P, F, D]
)
"""The layer-stack leaves that are quantized, by kind. Only stacks whose loop bodies are wrapped in
`dequantizing` may be listed (`nn.layers.scan_layers`, Qwen3.5's scan over layer groups)."""

KINDS: tuple[Kind, ...] = ("attn", "mlp", "adanorm")


def _path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):  # GetAttrKey, DictKey, SequenceKey
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


def rule_for(path: str, ndim: int, kinds=KINDS, rules: tuple[Rule, ...] = RULES) -> Rule | None:
    """The first rule of a selected kind matching `path` whose axes fit a stacked leaf of rank `ndim`."""
    for r in rules:
        if r.kind in kinds and re.search(r.pattern, path) and ndim >= 1 - min(r.axes):
            return r
    return None


_UNSTACKED = re.compile(r"(^|/)layers/\d+(/|$)")  # a leaf of `nn.layers.Unstacked`: layers/<i>/...


def plan(tree, kinds=KINDS, rules: tuple[Rule, ...] = RULES) -> dict[str, Rule]:
    """{leaf path: its rule} for the leaves `quantize_tree` would quantize (layer stacks must be stacked)."""
    bad = set(kinds) - set(KINDS)
    if bad or not kinds:
        raise ValueError(f"layer kinds must be a non-empty subset of {list(KINDS)}, got {list(kinds)}")
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_q)[0]:
        name = _path_str(path)
        if _is_q(x):
            raise ValueError(f"{name} is already quantized")
        if _UNSTACKED.search(name):
            raise ValueError(f"quantize stacked layers (stack_layers first): {name} is in an Unstacked stack")
        r = rule_for(name, len(getattr(x, "shape", ())), kinds, rules)
        if r is not None:
            out[name] = r
    return out


def quantize_tree(tree, weights: WeightDType, kinds=KINDS, rules: tuple[Rule, ...] = RULES, *, dtype=None):
    """`tree` with the leaves `plan` selects replaced by `QArray`s (host-quantized, then put on the device).

    Args:
      tree: any parameter pytree with stacked layer stacks (e.g. π0.5 `Params` before `for_backend`).
        Each float leaf is dropped once quantized: when the caller holds no other reference to `tree`
        (e.g. `quantize_tree(load(...).params, ...)`), a full-size model is never held twice.
      weights: "int8" or "fp8".
      kinds: which leaves ("attn", "mlp"); every other leaf is kept as it is.
      dtype: the scales' (compute) dtype; default each leaf's own dtype.
    Returns:
      The same structure, selected leaves `QArray`(values, scale) of `jax.Array`s.
    """
    chosen = plan(tree, kinds, rules)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    del tree
    paths, leaves = [_path_str(p) for p, _ in flat], [x for _, x in flat]
    del flat
    for i, path in enumerate(paths):
        r = chosen.get(path)
        if r is not None:
            x, leaves[i] = leaves[i], None
            q = quantize(x, weights, r.axes)
            scale_dtype = dtype or x.dtype
            del x
            leaves[i] = jax.device_put(QArray(values=q.values, scale=q.scale.astype(scale_dtype)))
    return treedef.unflatten(leaves)


def float_bytes(tree, itemsize: int = 4) -> int:
    """Bytes of `tree` with every element (quantized ones included) held in `itemsize` bytes (4: float32)."""
    return sum(int(np.prod(x.shape)) * itemsize for x in jax.tree.leaves(tree, is_leaf=_is_q))


def weight_bytes(tree) -> int:
    """Bytes of every array in `tree` (quantized values and scales included)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
