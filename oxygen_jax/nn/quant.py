"""Quantized weights: `QArray` leaves (int8 or float8 e4m3 values, per-output-channel scales) in any parameter
tree, quantized by path rules, and multiplied either in the compute dtype (weight-only: dequantized one layer at
a time) or as int8 x int8 / fp8 x fp8 products on activations quantized per row at the matmul (dynamic range).

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

Matmul modes (`MatmulMode`, a static field of each `QArray`, set at start-up by `with_matmul` from
`choose_matmul`): "weight_only" (the default) dequantizes as above; "int8" / "fp8" keep the leaves whose
rule is `dynamic` (their readers multiply them only through `dot`: `nn.layers.project_heads`,
`merge_heads`, `stacked_matmul`, `x @ w`, the token embedding's `take_rows` / `vocab_logits`) quantized into
the matmul: each row of the activation x [Y, K] is quantized to the weights' dtype with its own scale
absmax / QMAX, the product of the stored values accumulates in int32 (int8) or float32 (fp8), and both scales
multiply the result: y[Y, N] = (xq . wq)[Y, N] * sx[Y] * sw[N].
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Literal, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

WeightDType = Literal["int8", "fp8"]
Kind = Literal["attn", "mlp", "adanorm", "embed"]
MatmulMode = Literal["weight_only", "fp8", "int8"]
MATMUL_MODES: tuple[MatmulMode, ...] = ("weight_only", "fp8", "int8")

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
    # Static: how matmuls read it ("weight_only": dequantized first; "int8" / "fp8": the values' dtype, `dot`).
    matmul: MatmulMode = dataclasses.field(default="weight_only", metadata=dict(static=True))

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

    def astype(self, dtype) -> "QArray":
        """The same weight with its scale (and so its products) in `dtype`: what a matmul site's
        `w.astype(x.dtype)` gets when a dynamic leaf reaches it quantized."""
        return dataclasses.replace(self, scale=self.scale.astype(dtype))

    def __rmatmul__(self, x) -> jax.Array:
        """`x @ w` at a matmul site (e.g. an MLP's down projection [F, D]) goes through `dot`."""
        return dot(x, self)


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


def dequantize_tree(tree, dynamic: bool = True):
    """`tree` with every `QArray` replaced by `dequantize` of it (other leaves unchanged); `dynamic` False
    keeps the leaves whose matmuls read them quantized (`matmul` "int8" / "fp8")."""
    pick = (lambda x: _is_q(x)) if dynamic else (lambda x: _is_q(x) and x.matmul == "weight_only")
    return jax.tree.map(lambda x: dequantize(x) if pick(x) else x, tree, is_leaf=_is_q)


def dequantizing(body: Callable) -> Callable:
    """Wraps a layer-loop body `body(carry, layer, extra, index)` so that it sees `layer` dequantized (but for
    the leaves whose matmuls read them quantized, `with_matmul`).

    A layer without `QArray` leaves passes through untouched (the same program as before). With them, an
    optimisation barrier ties the layer's weights to the carry first: in an unrolled loop (XLA's CPU form)
    nothing then lets the compiler dequantize every layer up front, which would hold all weights in the
    compute dtype at once.
    """

    def run(carry, layer, extra, index):
        if not has_quantized(layer):
            return body(carry, layer, extra, index)
        carry, layer = jax.lax.optimization_barrier((carry, layer))
        return body(carry, dequantize_tree(layer, dynamic=False), extra, index)

    return run


# --------------------------------------------------------------------------------------------------
# Dynamic-range matmuls: activations quantized per row at the matmul


def quantize_rows(x: jax.Array, weights: WeightDType) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (values [..., K] int8 / float8_e4m3fn, scale float32 [..., 1]): each row's absmax onto QMAX
    (an all-zero row gets scale 1 / QMAX), int8 rounded to nearest, fp8 cast to nearest."""
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    qmax = QMAX[weights]
    scale = jnp.where(absmax > 0, absmax, 1.0) / qmax
    scaled = jnp.clip(xf / scale, -qmax, qmax)
    values = jnp.round(scaled).astype(jnp.int8) if weights == "int8" else scaled.astype(jnp.float8_e4m3fn)
    return values, scale


def _accumulator(w: QArray):
    """int32 for int8 products, float32 for fp8 ones; ValueError for a mode that is not the values' dtype."""
    if w.weights != w.matmul:
        raise ValueError(f"a {w.matmul} matmul reads {w.weights} weights: with_matmul pairs each mode with its own dtype")
    return jnp.int32 if w.matmul == "int8" else jnp.float32


def dot(x: jax.Array, w: QArray) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype; w's scale [1, N] (K reduced).

    "weight_only": x @ dequantize(w). "int8" / "fp8": rows of x quantized (`quantize_rows`), the stored values
    multiplied with int32 / float32 accumulation, then both scales applied.
    """
    if w.matmul == "weight_only":
        return x @ dequantize(w).astype(x.dtype)
    return dot_stacked(x.reshape(1, -1, x.shape[-1]), jax.tree.map(lambda a: a[None], w))[0].reshape(
        x.shape[:-1] + (w.shape[-1],))


def dot_stacked(xb: jax.Array, w: QArray) -> jax.Array:
    """xb [G, Y, K] by w [G, K, N] (scale [G, 1, N]) -> [G, Y, N] in xb's dtype: G products in one dot."""
    if w.matmul == "weight_only":
        return jnp.einsum("GYK,GKN->GYN", xb, dequantize(w).astype(xb.dtype))
    acc = _accumulator(w)
    xq, sx = quantize_rows(xb, w.matmul)
    y = jnp.einsum("GYK,GKN->GYN", xq, w.values, preferred_element_type=acc)
    return (y.astype(jnp.float32) * sx * w.scale.astype(jnp.float32)).astype(xb.dtype)


def error_bound(q: QArray, w) -> np.ndarray:
    """The largest |w - dequantize(q)| the format allows per element of the weight `w` q was made from
    (float32 [w.shape]): int8 scale / 2; fp8 2^-4 |w| + scale * 2^-10 (the subnormal step / 2).
    """
    scale = np.asarray(q.scale, np.float32)
    if q.weights == "int8":
        return np.broadcast_to(scale / 2, q.shape).astype(np.float32)
    return (np.abs(np.asarray(w, np.float32)) * 2.0 ** -4 + scale * 2.0 ** -10).astype(np.float32)


def dot_rows(x: jax.Array, w: QArray, vocab_major: bool = False) -> jax.Array:
    """x [Y, K] against the rows of w [N, K] (scale [N, 1]: one per row, e.g. an LM head's vocabulary rows), a
    dynamic mode's products -> float32 [Y, N], or [N, Y] when `vocab_major`. The values are read where they lie."""
    acc = _accumulator(w)
    xq, sx = quantize_rows(x, w.matmul)
    sw = w.scale.astype(jnp.float32)
    if vocab_major:
        return jnp.einsum("NK,YK->NY", w.values, xq, preferred_element_type=acc).astype(jnp.float32) * sw * sx.T
    return jnp.einsum("YK,NK->YN", xq, w.values, preferred_element_type=acc).astype(jnp.float32) * sx * sw.T


# --------------------------------------------------------------------------------------------------
# Which leaves: rules over the leaf's path


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """Leaves whose "/"-joined attribute path matches `pattern` are of `kind` and reduce over `axes`."""

    kind: Kind  # what the `--layers` choice selects: attention projections, MLP, adaptive norms' projections, embedding
    pattern: str  # regular expression, `re.search`ed on the path (e.g. "vlm/layers/q")
    axes: tuple[int, ...]  # the input axes, counted from the end; a leading layer axis must precede them
    # Every reader multiplies it through `dot` (the `nn.layers` projection helpers), so a dynamic matmul mode
    # may keep it quantized into the matmul; other leaves are always dequantized first.
    dynamic: bool = False


RULES: tuple[Rule, ...] = (
    # Gemma / Qwen3 decoder layers (π0.5's experts, `backbone.DecoderLayers`, the XR0 DiT's `out`), read by
    # `project_heads`, `merge_heads`, `stacked_matmul` and `@`: dynamic.
    Rule(kind="attn", pattern=r"(^|/)layers/q$", axes=(-2,), dynamic=True),  # [L, N, D, H]
    Rule(kind="attn", pattern=r"(^|/)layers/kv$", axes=(-2,), dynamic=True),  # [L, 2, K, D, H]
    Rule(kind="attn", pattern=r"(^|/)layers/out$", axes=(-3, -2), dynamic=True),  # [L, N, H, D]
    Rule(kind="mlp", pattern=r"(^|/)layers/gating$", axes=(-2,), dynamic=True),  # [L, 2, D, F]
    Rule(kind="mlp", pattern=r"(^|/)layers/linear$", axes=(-2,), dynamic=True),  # [L, F, D]
    # The token embedding [V, D] (the tied LM head of PaliGemma / Gemma) and a separate LM head [V, D]: one
    # scale per vocabulary row, read by `take_rows` (only the gathered rows dequantized) and `vocab_logits`.
    Rule(kind="embed", pattern=r"(^|/)(embedding|lm_head)$", axes=(-1,), dynamic=True),
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
"""The default `--layers`: the layer stacks' weights."""
ALL_KINDS: tuple[Kind, ...] = KINDS + ("embed",)
"""Every kind a `--layers` may name ("embed": the token embedding / LM head, float unless named)."""


def path_str(path) -> str:
    """A jax key path as the "/"-joined attribute path the rules match (e.g. "vlm/layers/q")."""
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
    bad = set(kinds) - set(ALL_KINDS)
    if bad or not kinds:
        raise ValueError(f"layer kinds must be a non-empty subset of {list(ALL_KINDS)}, got {list(kinds)}")
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_q)[0]:
        name = path_str(path)
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
    paths, leaves = [path_str(p) for p, _ in flat], [x for _, x in flat]
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


# --------------------------------------------------------------------------------------------------
# The matmul mode, chosen at start-up


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """What `choose_matmul` reads of a device (`device_info(jax.devices()[0])`)."""

    platform: str  # "cpu", "gpu" (CUDA), "rocm", "tpu", ...
    kind: str  # e.g. "cpu", "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] | None = None  # CUDA compute capability, e.g. (9, 0); None elsewhere


def device_info(device) -> DeviceInfo:
    """A jax device's `DeviceInfo`: CUDA's compute capability from `device.compute_capability` (e.g. "8.9"); a ROCm
    GPU (jax's platform "gpu" too, its capability a gfx name) as platform "rocm"."""
    cc = str(getattr(device, "compute_capability", None) or "")
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    platform = "rocm" if device.platform == "gpu" and ("rocm" in version or cc.startswith("gfx")) else device.platform
    capability = tuple(int(p) for p in cc.split(".")[:2]) if re.fullmatch(r"\d+\.\d+", cc) else None
    return DeviceInfo(platform=platform, kind=device.device_kind, capability=capability)


def native_dots(dev: DeviceInfo) -> dict[str, str]:
    """{"int8" / "fp8": how the device runs that product} for the low-precision dots it has.

    CUDA: int8 (IMMA) everywhere jax runs; fp8 from compute capability 8.9 (Ada, Hopper, Blackwell). XLA:CPU
    runs s8 x s8 -> s32 dots natively (measured on x86-64, docs/quantization.md) and fp8 dots only by
    converting both operands to float32 first, so auto never picks fp8 there. TPUs: int8.
    """
    if dev.platform in ("gpu", "cuda") and dev.capability is not None:
        return {"int8": "native", **({"fp8": "native"} if dev.capability >= (8, 9) else {})}
    if dev.platform == "cpu":
        return {"int8": "native", "fp8": "emulated (XLA:CPU converts both operands to float32)"}
    if dev.platform == "tpu":
        return {"int8": "native"}
    return {}


def choose_matmul(requested: str, weights: WeightDType | None, dev: DeviceInfo) -> MatmulMode:
    """The matmul mode for a model whose quantized weights are `weights` (None: none quantized) on `dev`.

    "auto": the weights' own dtype where the device runs that product natively, else "weight_only". A forced
    mode is taken where the device has the product (natively or, fp8 on a CPU, emulated) and the weights are of
    its dtype; otherwise ValueError in one line naming the device or the weights and the fix.
    """
    if requested not in ("auto",) + MATMUL_MODES:
        raise ValueError(f"--quant-matmul must be auto or one of {list(MATMUL_MODES)}, got {requested!r}")
    dots = native_dots(dev)
    if requested == "auto":
        return weights if weights is not None and dots.get(weights) == "native" else "weight_only"
    if requested == "weight_only":
        return "weight_only"
    if weights is None:
        raise ValueError(f"--quant-matmul {requested} multiplies quantized weights and this model has none: quantize "
                         "it (python -m oxygen_jax.quantize) or drop --quant-matmul")
    if weights != requested:
        raise ValueError(f"--quant-matmul {requested} needs {requested} weights and this model's are {weights}: use "
                         f"--quant-matmul {weights} or weight_only")
    if requested not in dots:
        cc = f" (compute capability {'.'.join(map(str, dev.capability))})" if dev.capability else ""
        need = "; fp8 needs compute capability 8.9+ (Ada, Hopper, Blackwell)" if requested == "fp8" else ""
        raise ValueError(f"--quant-matmul {requested}: the device {dev.kind!r} on {dev.platform}{cc} has no "
                         f"{requested} x {requested} matmuls{need}: use --quant-matmul auto or weight_only")
    return requested  # type: ignore[return-value]


_UNSTACKED_PART = re.compile(r"/layers/\d+(?=/)")  # Unstacked's own "layers/<i>" under the stack's name


def quantized_weights(tree) -> WeightDType | None:
    """The dtype of `tree`'s quantized leaves ("int8" / "fp8"), None without any; ValueError if they mix."""
    kinds = {x.weights for x in jax.tree.leaves(tree, is_leaf=_is_q) if _is_q(x)}
    if len(kinds) > 1:
        raise ValueError(f"a model holds one kind of quantized weights, these mix {sorted(kinds)}")
    return kinds.pop() if kinds else None


def with_matmul(tree, mode: MatmulMode, rules: tuple[Rule, ...] = RULES):
    """`tree` with each quantized leaf of a `dynamic` rule read by `mode` matmuls (its values' dtype: the other
    leaves, and every leaf for "weight_only", are dequantized first). Stacked or `Unstacked` layers alike."""
    if mode not in MATMUL_MODES:
        raise ValueError(f"matmul mode must be one of {list(MATMUL_MODES)}, got {mode!r}")

    def one(path, x):
        if not _is_q(x):
            return x
        full = path_str(path)
        name = _UNSTACKED_PART.sub("", full)  # vlm/layers/layers/3/q (one layer of an Unstacked stack) -> vlm/layers/q
        r = rule_for(name, x.ndim + (name != full), ALL_KINDS, rules)
        dynamic = mode != "weight_only" and r is not None and r.dynamic and x.weights == mode
        return dataclasses.replace(x, matmul=mode if dynamic else "weight_only")

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_q)


def matmul_summary(tree) -> dict[str, int]:
    """{matmul mode: number of quantized leaves (per-layer buffers counted apiece) read by it}."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree, is_leaf=_is_q):
        if _is_q(x):
            out[x.matmul] = out.get(x.matmul, 0) + 1
    return out


def start_matmul(tree, requested: str, device) -> tuple[Any, str]:
    """(`tree` read by the matmul mode `choose_matmul` picks on `device`, the start-up line's words for it:
    e.g. "int8 weights, int8 matmuls (auto on cpu)"; "" for a model without quantized weights)."""
    weights = quantized_weights(tree)
    dev = device_info(device)
    mode = choose_matmul(requested, weights, dev)
    if weights is None:
        return tree, ""
    how = "auto" if requested == "auto" else "forced"
    cc = f", compute capability {'.'.join(map(str, dev.capability))}" if dev.capability else ""
    return with_matmul(tree, mode), f"{weights} weights, {mode} matmuls ({how} on {dev.kind}{cc})"


def weights_info(tree) -> dict:
    """What a server's metadata says of its weights: {"quantized": None} for a float model, else the weights'
    dtype and how many quantized leaves each matmul mode reads, e.g. {"quantized": "int8", "matmul": {"int8": 10,
    "weight_only": 8}}."""
    weights = quantized_weights(tree)
    return {"quantized": weights} | ({"matmul": matmul_summary(tree)} if weights else {})
