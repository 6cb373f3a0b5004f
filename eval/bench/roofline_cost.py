"""An analytic cost model: FLOPs and bytes moved by each component of a frame, for any model spec and dtype.

Axes (`oxygen_jax.axes`): B batch rows, P prefix tokens, Ha horizon, Ns slots, C slot length, J admissions,
plus the heads' own (`models.heads`) and Qwen3.5's (`models.qwen35.model`). γ: draft tokens per verify step.

What is counted, per component (`Cost`):

    flops     matrix products only (every dot_general and triangular solve of the program), 2 per
              multiply-add, over the shapes the program computes: attention is dense over every key slot
              (masked ones too), a decode step computes every slot of the pool. Element-wise work (norms,
              activations, softmax, RoPE, gates, the conv taps and Qwen3.5's recurrent delta rule at decode)
              is left out: XLA's cost analysis of single layers shows how much that is (tests/test_roofline.py).
    weights   bytes of the weights the component reads, once each, from the model's abstract parameter tree
              (exact for any preset or checkpoint); an embedding table counts only the rows gathered, except
              where it is also the LM head.
    kv_read   K/V of the prefix or the slots the attention reads (Qwen3.5 also its recurrent state and conv
    kv_write  windows), and what the component writes there (prefix K/V and kept hidden states, slot entries).
    acts      every product's input and output once, at the activation dtype (an unfused estimate; attention
              scores are left out, as a fused attention kernel never stores them).

The time limit of a component on a device is max(flops / peak FLOP/s, bytes / bandwidth) (`Cost.limit_s`).

Precision (`Precision`): activations and K/V entries in the compute dtype; weights at the dtypes stored in the
model's tree (a quantized checkpoint's int8 / fp8 values and their scales, `nn.quant`), or all at `weight_bytes`
each to ask what quantized weights would give.

Head kinds: each has a prepare cost (once per frame) and a step cost (per Euler step) in `HEAD_COSTS`; a new
kind (π0's head) adds its pair there. Vision encoders likewise in `VISION_COSTS`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np

from oxygen_jax.models import mot
from oxygen_jax.models.backbone import BackboneSpec, Qwen3VisionSpec
from oxygen_jax.models.heads import HeadSpec
from oxygen_jax.models.mot import ModelParams, ModelSpec
from oxygen_jax.models.pi05 import model as pi05_model
from oxygen_jax.models.pi05.config import ModelConfig
from oxygen_jax.models.vision.siglip import SiglipConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --------------------------------------------------------------------------------------------------
# Precision and cost


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per element of what a component moves."""

    act_bytes: int  # one activation (the compute dtype)
    kv_bytes: int  # one cached K/V entry (the compute dtype); recurrent states are float32 regardless
    weight_bytes: float | None = None  # one stored weight; None: each leaf's own dtype in the model's tree (a
    #   quantized checkpoint's int8 / fp8 values and their scales included); a number: every weight at it (what
    #   if the weights were quantized: 1 for int8, 0.5 for int4)

    def __post_init__(self):
        for f in ("act_bytes", "kv_bytes"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Precision.{f} must be positive, got {getattr(self, f)}")
        if self.weight_bytes is not None and not 0 < self.weight_bytes < math.inf:
            raise ValueError(f"Precision.weight_bytes must be None or a positive number, got {self.weight_bytes}")

    @classmethod
    def of(cls, dtype: str, weight_bytes: float | None = None) -> Precision:
        """The precision of a model run in `dtype` ('float32', 'bfloat16'); weights stored as the tree says
        unless `weight_bytes` is given."""
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
        b = _DTYPE_BYTES[dtype]
        return cls(act_bytes=b, kv_bytes=b, weight_bytes=weight_bytes)


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of one component (module docstring). Adds and scales."""

    flops: float = 0.0
    weights: float = 0.0
    kv_read: float = 0.0
    kv_write: float = 0.0
    acts: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def times(self, n: float) -> Cost:
        return Cost(*(n * a for a in dataclasses.astuple(self)))

    @property
    def bytes(self) -> float:
        return self.weights + self.kv_read + self.kv_write + self.acts

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else math.inf

    def limit_s(self, peak_flops: float, bandwidth: float) -> float:
        """The roofline time: max(FLOPs / peak FLOP/s, bytes / bandwidth in bytes/s)."""
        return max(self.flops / peak_flops, self.bytes / bandwidth)

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        """'compute' or 'memory': which term of `limit_s` is larger."""
        return "compute" if self.flops / peak_flops >= self.bytes / bandwidth else "memory"

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "bytes": self.bytes}


def total(costs) -> Cost:
    return sum(costs, Cost())


def _mm(rows: float, din: float, dout: float, prec: Precision) -> Cost:
    """One product [rows, din] @ [din, dout] (weights counted apart, from the tree)."""
    return Cost(flops=2.0 * rows * din * dout, acts=rows * (din + dout) * prec.act_bytes)


def _attn(queries: float, keys: float, heads: int, head_dim: int) -> Cost:
    """Scores and weighted values of `queries` rows over `keys` each (dense): 2 products of 2 FLOPs per MAC."""
    return Cost(flops=4.0 * queries * keys * heads * head_dim)


# --------------------------------------------------------------------------------------------------
# The model: a spec and its abstract parameter tree


@dataclasses.dataclass(frozen=True)
class Model:
    """What the cost functions read: the spec (dims, heads) and a parameter tree in the stacked layout whose
    leaves have shapes and dtypes (abstract or real): weights are counted on it."""

    spec: ModelSpec
    tree: ModelParams
    name: str

    @property
    def backbone(self) -> BackboneSpec:
        return self.spec.backbone


def multihead(spec: ModelSpec, dtype: str = "float32", name: str = "") -> Model:
    """Any model as its `mot.ModelSpec` (π0.5 and π0: `pi05.model.model_spec`, or a `MultiHead`'s spec), its
    weights stored in `dtype`; nothing is allocated."""
    return Model(spec, mot.abstract_model(spec, dtype), name or spec.backbone.family)


def pi05(config: ModelConfig, num_steps: int = 10, name: str = "pi05", dtype: str = "float32") -> Model:
    """π0.5 (or π0, by `config.variant`) of `config`."""
    return multihead(pi05_model.model_spec(config, num_steps), dtype, name)


def from_params(spec: ModelSpec, params: ModelParams, name: str) -> Model:
    """A loaded model (`MultiHead.params`, any layer layout, quantized leaves included): its stored dtypes."""
    return Model(spec, jax.eval_shape(lambda p: mot.for_backend(spec, p, "gpu"), params), name)


def count(tree) -> int:
    """Elements in a (sub)tree, None leaves skipped (a quantized leaf: its values and scales)."""
    return int(sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree)))


def stored_bytes(tree) -> int:
    """Bytes of a (sub)tree's leaves in their own dtypes."""
    return int(sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))


def _w(tree, prec: Precision) -> Cost:
    if prec.weight_bytes is None:
        return Cost(weights=stored_bytes(tree))
    return Cost(weights=count(tree) * prec.weight_bytes)


def _rows_read(rows: float, table, prec: Precision) -> Cost:
    """A gather of `rows` rows of a [V, D] table."""
    per = np.dtype(table.dtype).itemsize if prec.weight_bytes is None else prec.weight_bytes
    return Cost(weights=rows * table.shape[-1] * per)


# --------------------------------------------------------------------------------------------------
# Transformer layers


def attention_layer(b: BackboneSpec, rows: float, keys: float, prec: Precision, *, q_gate: bool = False) -> Cost:
    """One transformer layer's products over `rows` query tokens, each attending to `keys` (weights apart).

    q [D -> N H], k/v [D -> 2 K H], scores and values, out [N H -> D], the gated MLP [D -> 2 F], [F -> D];
    Qwen3.5's full layers add the output gate [D -> N H].
    """
    d, n, k, h, f = b.width, b.num_heads, b.num_kv_heads, b.head_dim, b.mlp_dim
    parts = [_mm(rows, d, n * h, prec), _mm(rows, d, 2 * k * h, prec), _attn(rows, keys, n, h),
             _mm(rows, n * h, d, prec), _mm(rows, d, 2 * f, prec), _mm(rows, f, d, prec)]
    if q_gate:
        parts.append(_mm(rows, d, n * h, prec))
    return total(parts)


def _gdn_projections(m: Model, rows: float, prec: Precision) -> Cost:
    b, g = m.backbone, m.spec.hybrid.gdn
    d, f, hv, dv = b.width, b.mlp_dim, g.num_value_heads, g.value_dim
    return total([_mm(rows, d, g.conv_channels, prec), _mm(rows, d, hv * dv, prec), _mm(rows, d, hv, prec),
                  _mm(rows, d, hv, prec), _mm(rows, hv * dv, d, prec), _mm(rows, d, 2 * f, prec), _mm(rows, f, d, prec)])


def gdn_layer(m: Model, batch: int, tokens: int, prec: Precision, *, chunked: bool) -> Cost:
    """One Gated DeltaNet layer over `tokens` per row: its projections, and in the chunked (prefill) form the
    chunk products of `gated_deltanet.delta_rule_chunked` per value head and chunk of Tc (tokens padded to a
    multiple of Tc): q k^T and (β k) k^T [Tc, Dk, Tc], the unit-lower solve [Tc, Tc] x [Tc, Dv + Dk], w S and
    q S [Tc, Dk, Dv], scores V' [Tc, Tc, Dv], k^T V' [Dk, Tc, Dv]. The recurrent (decode) rule is element-wise."""
    g = m.spec.hybrid.gdn
    cost = _gdn_projections(m, batch * tokens, prec)
    if chunked:
        tc, dk, dv = g.chunk_size, g.key_dim, g.value_dim
        chunks = batch * g.num_value_heads * -(-tokens // tc)
        per_chunk = 4 * tc * tc * dk + tc * tc * (dv + dk) + 6 * tc * dk * dv + 2 * tc * tc * dv
        cost += Cost(flops=float(chunks * per_chunk))
    return cost


def _hybrid_state_bytes(m: Model, slots: int, prec: Precision) -> float:
    """Recurrent state (float32) and conv windows of every linear layer, for `slots` rows."""
    g = m.spec.hybrid.gdn
    lg = len(m.spec.hybrid.linear_layers)
    return slots * lg * (4 * g.num_value_heads * g.key_dim * g.value_dim + prec.act_bytes * g.conv_channels * g.conv_kernel)


def _stack(m: Model, batch: int, tokens: int, keys: float, prec: Precision, *, chunked: bool) -> Cost:
    """The backbone's layers over `tokens` per row (attention layers read `keys` each), weights included."""
    b, layers = m.backbone, m.tree.decoder.layers
    if m.spec.hybrid is None:
        return attention_layer(b, batch * tokens, keys, prec).times(b.depth) + _w(layers, prec)
    h = m.spec.hybrid
    full = attention_layer(b, batch * tokens, keys, prec, q_gate=True).times(len(h.full_layers))
    linear = gdn_layer(m, batch, tokens, prec, chunked=chunked).times(len(h.linear_layers))
    return full + linear + _w(layers, prec)


def _kv_bytes(m: Model, layers: int, rows: float, prec: Precision) -> float:
    b = m.backbone
    return 2.0 * layers * rows * b.num_kv_heads * b.head_dim * prec.kv_bytes


def _lm_head(m: Model, rows: float, prec: Precision) -> Cost:
    """The LM head over `rows` final-normed rows: [D -> V] and its table (tied: the embedding)."""
    b, dec = m.backbone, m.tree.decoder
    table = dec.embedding if b.tie_embeddings else dec.lm_head
    return _mm(rows, b.width, b.vocab_size, prec) + _w(table, prec)


# --------------------------------------------------------------------------------------------------
# Vision encoders


def _siglip(m: Model, images: int, image_size: int, prec: Precision) -> Cost:
    """SigLIP on `images` images: stem [p p 3 -> W], per layer q/k/v/out [W -> W], attention per image over
    its Np patches, MLP [W -> Fv -> W]; the head [W -> D]."""
    c: SiglipConfig = m.backbone.vision
    if image_size != c.image_size:
        raise ValueError(f"SigLIP of this model takes {c.image_size} px images, got image_size={image_size}")
    np_, w = c.num_patches, c.width
    rows = images * np_
    layer = total([_mm(rows, w, w, prec).times(4), _attn(rows, np_, c.num_heads, c.head_dim),
                   _mm(rows, w, c.mlp_dim, prec), _mm(rows, c.mlp_dim, w, prec)])
    return (_mm(rows, c.patch_size ** 2 * 3, w, prec) + layer.times(c.depth)
            + _mm(rows, w, m.backbone.width, prec) + _w(m.tree.vision, prec))


def _siglip_tokens(m: Model, image_size: int) -> int:
    c: SiglipConfig = m.backbone.vision
    return (image_size // c.patch_size) ** 2


def _qwen_vit(m: Model, images: int, image_size: int, prec: Precision) -> Cost:
    """The Qwen3-VL ViT on `images` square images: patch embed [Pd -> W], per block qkv [W -> 3 W], attention
    dense over every patch of every image (one masked program), out [W -> W], MLP [W -> Fv -> W]; the merger
    and each DeepStack merger [Mw W -> Mw W -> D] per merged token."""
    v: Qwen3VisionSpec = m.backbone.vision
    side = image_size // v.patch_size
    rows = images * side * side
    w, mw = v.width, v.merge_width
    block = total([_mm(rows, w, 3 * w, prec), _attn(rows, rows, v.num_heads, v.head_dim), _mm(rows, w, w, prec),
                   _mm(rows, w, v.mlp_dim, prec), _mm(rows, v.mlp_dim, w, prec)])
    merged = rows // v.spatial_merge_size ** 2
    merger = _mm(merged, mw, mw, prec) + _mm(merged, mw, v.out_width, prec)
    return (_mm(rows, v.patch_dim, w, prec) + block.times(v.depth) + merger.times(1 + len(v.deepstack_layers))
            + _w(m.tree.vision, prec))


def _qwen_vit_tokens(m: Model, image_size: int) -> int:
    """LLM tokens of one image in a prompt: its merged tokens between <vision_start> and <vision_end>."""
    v: Qwen3VisionSpec = m.backbone.vision
    side = image_size // (v.patch_size * v.spatial_merge_size)
    return side * side + 2


VISION_COSTS: dict[type, tuple[Callable, Callable]] = {
    SiglipConfig: (_siglip, _siglip_tokens),
    Qwen3VisionSpec: (_qwen_vit, _qwen_vit_tokens),
}
"""Vision spec type -> (cost(model, images, image_size, prec), prompt tokens per image(model, image_size))."""


def _vision_fns(m: Model) -> tuple[Callable, Callable]:
    vision = m.backbone.vision
    if type(vision) not in VISION_COSTS:
        raise ValueError(f"no cost model for a {type(vision).__name__} vision encoder: add one to VISION_COSTS")
    return VISION_COSTS[type(vision)]


def default_image_size(m: Model) -> int:
    """SigLIP's configured size; 224 px for a Qwen ViT (the bench's default)."""
    vision = m.backbone.vision
    return vision.image_size if isinstance(vision, SiglipConfig) else 224


def vision(m: Model, images: int, prec: Precision, image_size: int | None = None) -> Cost:
    """The vision encoder on `images` images (0, or no encoder: nothing)."""
    if not images or m.backbone.vision is None:
        return Cost()
    return _vision_fns(m)[0](m, images, image_size or default_image_size(m), prec)


def prefix_length(m: Model, cameras: int, prompt_tokens: int, image_size: int | None = None) -> int:
    """P of a prompt with `cameras` images and `prompt_tokens` text tokens (for predictions; measured runs read
    P off the prefix they built)."""
    if not cameras or m.backbone.vision is None:
        return prompt_tokens
    return cameras * _vision_fns(m)[1](m, image_size or default_image_size(m)) + prompt_tokens


# --------------------------------------------------------------------------------------------------
# The prefix pass and the language decoder


def prefill(m: Model, prefix_len: int, prec: Precision, batch: int = 1) -> Cost:
    """The backbone over the prefix (vision apart): embedding rows, every layer (attention dense over P keys),
    and what it keeps (`ModelSpec.reads`): K/V of the kept layers, hidden states, the last row's final norm."""
    b, reads = m.backbone, m.spec.reads()
    rows = batch * prefix_len
    cost = _rows_read(rows, m.tree.decoder.embedding, prec) + _stack(m, batch, prefix_len, prefix_len, prec, chunked=True)
    kept = Cost(kv_write=_kv_bytes(m, len(reads.kv_layers), rows, prec)
                + len(reads.hidden_layers) * rows * b.width * prec.act_bytes)
    if m.spec.hybrid is not None:
        kept += Cost(kv_write=_hybrid_state_bytes(m, batch, prec))
    return cost + kept + _w(m.tree.decoder.final_norm, prec)


def prefix_pass(m: Model, prefix_len: int, images: int, prec: Precision, batch: int = 1,
                image_size: int | None = None) -> Cost:
    """Vision (`images` in all) and `prefill`: the bench's `prefill` component."""
    return vision(m, images, prec, image_size) + prefill(m, prefix_len, prec, batch)


def language_step(m: Model, slots: int, capacity: int, prec: Precision, block: int = 1) -> Cost:
    """One pass of the language decoder over `block` tokens of every slot (all `slots` rows are computed,
    busy or not): a decode step (block 1) or a verify step of γ drafts (block γ + 1).

    Attention layers read the whole slot (C keys) and write `block` entries; Qwen3.5's linear layers read and
    write their recurrent state and window; the LM head scores every row.
    """
    rows = slots * block
    b = m.backbone
    lk = len(m.spec.hybrid.full_layers) if m.spec.hybrid else b.depth
    cost = _rows_read(rows, m.tree.decoder.embedding, prec) + _stack(m, slots, block, capacity, prec, chunked=False)
    cost += Cost(kv_read=_kv_bytes(m, lk, slots * capacity, prec), kv_write=_kv_bytes(m, lk, rows, prec))
    if m.spec.hybrid is not None:
        state = _hybrid_state_bytes(m, slots, prec)
        cost += Cost(kv_read=state, kv_write=state)
    return cost + _w(m.tree.decoder.final_norm, prec) + _lm_head(m, rows, prec)


def decode_step(m: Model, slots: int, capacity: int, prec: Precision) -> Cost:
    """One decode step of an Ns-slot pool of slot length C."""
    return language_step(m, slots, capacity, prec, 1)


def verify_block(m: Model, slots: int, capacity: int, gamma: int, prec: Precision) -> Cost:
    """One verify step: the [Ns, γ + 1] block of every slot (`runtime.speculative`)."""
    return language_step(m, slots, capacity, prec, gamma + 1)


def speculative_burst(m: Model, slots: int, capacity: int, gamma: int, steps: int, prec: Precision) -> Cost:
    """A frame's speculative language work at verify cost 1: `steps` verify steps (draft lookup left out)."""
    return verify_block(m, slots, capacity, gamma, prec).times(steps)


def admission(m: Model, prefix_len: int, requests: int, prec: Precision) -> Cost:
    """Admitting J requests: each copies the prefix's K/V (and Qwen3.5's state) into its slot and samples token 0
    through the LM head from the last prefix row (no request prompt)."""
    lk = len(m.spec.hybrid.full_layers) if m.spec.hybrid else m.backbone.depth
    kv = _kv_bytes(m, lk, requests * prefix_len, prec)
    if m.spec.hybrid is not None:
        kv += _hybrid_state_bytes(m, requests, prec)
    return Cost(kv_read=kv, kv_write=kv) + _lm_head(m, requests, prec)


# --------------------------------------------------------------------------------------------------
# Heads: a prepare cost (once per frame) and a step cost (one Euler step), per kind


def _adarms_prepare(m: Model, h: HeadSpec, prefix_len: int, batch: int, horizon: int, prec: Precision) -> Cost:
    return Cost()  # the prefix's K/V are read as they are


def _adarms_step(m: Model, h: HeadSpec, prefix_len: int, batch: int, horizon: int, prec: Precision) -> Cost:
    """π0.5's action expert: the sincos time features (an outer product), the time MLP and every adaRMS
    modulation on B rows, action_in, the Gemma layers over B Ha tokens reading P + Ha keys each and action_out
    on B Ha rows; the prefix K/V of every layer."""
    da, rows = h.width, batch * horizon
    layer = total([_mm(rows, da, h.num_heads * h.head_dim, prec), _mm(rows, da, 2 * h.num_kv_heads * h.head_dim, prec),
                   _attn(rows, prefix_len + horizon, h.num_heads, h.head_dim), _mm(rows, h.num_heads * h.head_dim, da, prec),
                   _mm(rows, da, 2 * h.mlp_dim, prec), _mm(rows, h.mlp_dim, da, prec), _mm(batch, da, 3 * da, prec).times(2)])
    cost = (_mm(batch, 1, da // 2, prec) + _mm(rows, h.action_dim, da, prec) + _mm(batch, da, da, prec).times(2)
            + layer.times(h.depth) + _mm(batch, da, 3 * da, prec) + _mm(rows, da, h.action_dim, prec))
    kv = 2.0 * h.depth * batch * prefix_len * h.num_kv_heads * h.head_dim * prec.kv_bytes
    return cost + Cost(kv_read=kv) + _w(m.tree.heads[h.name], prec)


def _time_mlp_prepare(m: Model, h: HeadSpec, prefix_len: int, batch: int, horizon: int, prec: Precision) -> Cost:
    """π0: the state token [Ad -> Da] (the prefix K/V are read as they are)."""
    p = m.tree.heads[h.name]
    return _mm(batch, h.action_dim, h.width, prec) + _w(p.state_in, prec)


def _time_mlp_step(m: Model, h: HeadSpec, prefix_len: int, batch: int, horizon: int, prec: Precision) -> Cost:
    """π0's action expert: action_in, the sincos features (an outer product), the time MLP [2 Da -> Da -> Da] per
    action token, the Gemma layers over B (1 + Ha) tokens reading P + 1 + Ha keys each, action_out; the prefix
    K/V of every layer."""
    da, t = h.width, 1 + horizon
    rows, act_rows, nh = batch * t, batch * horizon, h.num_heads * h.head_dim
    layer = total([_mm(rows, da, nh, prec), _mm(rows, da, 2 * h.num_kv_heads * h.head_dim, prec),
                   _attn(rows, prefix_len + t, h.num_heads, h.head_dim), _mm(rows, nh, da, prec),
                   _mm(rows, da, 2 * h.mlp_dim, prec), _mm(rows, h.mlp_dim, da, prec)])
    cost = (_mm(act_rows, h.action_dim, da, prec) + _mm(batch, 1, da // 2, prec) + _mm(act_rows, 2 * da, da, prec)
            + _mm(act_rows, da, da, prec) + layer.times(h.depth) + _mm(act_rows, da, h.action_dim, prec))
    kv = 2.0 * h.depth * batch * prefix_len * h.num_kv_heads * h.head_dim * prec.kv_bytes
    return cost + Cost(kv_read=kv) + _w(dataclasses.replace(m.tree.heads[h.name], state_in=None), prec)


def _joint_prepare(m: Model, h: HeadSpec, prefix_len: int, batch: int, horizon: int, prec: Precision) -> Cost:
    """XR0: its layers' prefix K/V gathered and repeated to N heads in the compute dtype; the state MLP."""
    b, p = m.backbone, m.tree.heads[h.name]
    read = 2.0 * h.depth * batch * prefix_len * b.num_kv_heads * b.head_dim * prec.kv_bytes
    write = 2.0 * h.depth * batch * prefix_len * h.num_heads * h.head_dim * prec.act_bytes
    cost = Cost(kv_read=read, kv_write=write) + _w(p.sink, prec)
    if h.state_dim:
        cost += _mm(batch, h.state_dim, h.width, prec) + _mm(batch, h.width, h.width, prec) + _w(p.state_in, prec)
    return cost


def _joint_step(m: Model, h: HeadSpec, prefix_len: int, batch: int, horizon: int, prec: Precision) -> Cost:
    """XR0: the time MLP and adaLN projection on B rows, the action MLP on B Ha rows, the layers over B T tokens
    (T = extra + Ha) reading P + T keys each (own K/V with N heads), the output MLP; the repeated prefix K/V."""
    da, nh, t = h.width, h.num_heads * h.head_dim, h.num_extra + horizon
    rows, act_rows = batch * t, batch * horizon
    layer = total([_mm(rows, da, nh, prec), _mm(rows, da, 2 * nh, prec), _attn(rows, prefix_len + t, h.num_heads, h.head_dim),
                   _mm(rows, nh, da, prec), _mm(rows, da, 2 * h.mlp_dim, prec), _mm(rows, h.mlp_dim, da, prec)])
    cost = (_mm(batch, h.time_embed_dim, da, prec) + _mm(batch, da, da, prec) + _mm(batch, da, 6 * da, prec)
            + _mm(act_rows, h.action_dim, da, prec) + _mm(act_rows, da, da, prec) + layer.times(h.depth)
            + _mm(act_rows, da, h.action_dim, prec) + _mm(act_rows, h.action_dim, h.action_dim, prec))
    kv = 2.0 * h.depth * batch * prefix_len * nh * prec.act_bytes
    p = m.tree.heads[h.name]
    return cost + Cost(kv_read=kv) + _w(dataclasses.replace(p, sink=None, state_in=None), prec)


def _cross_blocks(p):
    """(cross blocks, self blocks or None) of a cross head's weights."""
    blocks = p.blocks
    return (blocks.cross, blocks.self_) if hasattr(blocks, "self_") else (blocks, None)


def _cross_prepare(m: Model, h: HeadSpec, prefix_len: int, batch: int, horizon: int, prec: Precision) -> Cost:
    """StarVLA: each cross block's K/V of its context, once per frame (QwenPI_v3 first LayerNorm + Linear
    [D -> Dx] per block); the state MLP."""
    p, rows = m.tree.heads[h.name], batch * prefix_len
    cross, _ = _cross_blocks(p)
    lc, dx, nh = h.num_cross_blocks, h.context_width, h.num_heads * h.head_dim
    cost = _mm(rows, dx, 2 * nh, prec).times(lc) + _w(cross.kv, prec) + _w(p.future, prec)
    if h.hidden_proj:
        cost += _mm(rows, h.vlm_width, dx, prec).times(lc) + _w(p.hidden_proj, prec)
    cost += Cost(kv_read=len(h.context_layers) * rows * h.vlm_width * prec.act_bytes,
                 kv_write=2.0 * lc * rows * nh * prec.act_bytes)
    if h.state_dim:
        cost += _mm(batch, h.state_dim, h.io_hidden, prec) + _mm(batch, h.io_hidden, h.width, prec) + _w(p.state_in, prec)
    return cost


def _cross_step(m: Model, h: HeadSpec, prefix_len: int, batch: int, horizon: int, prec: Precision) -> Cost:
    """StarVLA: the time MLP and every block's adaLN on B rows, the action encoder on B Ha rows, per block q,
    out and the MLP over B T tokens, cross blocks reading P keys, self blocks their own K/V over T keys; GR00T's
    output block; the action decoder. Reads the per-block context K/V."""
    p = m.tree.heads[h.name]
    da, nh, t, f = h.width, h.num_heads * h.head_dim, h.num_extra + horizon, h.mlp_dim
    rows, act_rows = batch * t, batch * horizon
    block = total([_mm(batch, da, 2 * da, prec), _mm(rows, da, nh, prec), _mm(rows, nh, da, prec),
                   _mm(rows, da, f, prec), _mm(rows, f, da, prec)])
    cross_attn = _attn(rows, prefix_len, h.num_heads, h.head_dim)
    self_attn = _mm(rows, da, 2 * nh, prec) + _attn(rows, t, h.num_heads, h.head_dim)
    cost = (_mm(batch, h.time_embed_dim, da, prec) + _mm(batch, da, da, prec) + _mm(act_rows, h.action_dim, da, prec)
            + _mm(act_rows, 2 * da, da, prec) + _mm(act_rows, da, da, prec) + block.times(h.depth)
            + cross_attn.times(h.num_cross_blocks) + self_attn.times(h.num_self_blocks))
    out = da
    if h.dit_output_dim:
        cost += _mm(batch, da, 2 * da, prec) + _mm(act_rows, da, h.dit_output_dim, prec)
        out = h.dit_output_dim
    cost += _mm(act_rows, out, h.io_hidden, prec) + _mm(act_rows, h.io_hidden, h.action_dim, prec)
    cross, self_ = _cross_blocks(p)
    step_weights = [p.time_mlp, p.action_in, dataclasses.replace(cross, kv=None), self_, p.out_mod, p.out_proj,
                    p.action_out]
    cost += _w(step_weights, prec) + _rows_read(horizon, p.positions, prec)  # position rows of the actions
    return cost + Cost(kv_read=2.0 * h.num_cross_blocks * batch * prefix_len * nh * prec.act_bytes)


HEAD_COSTS: dict[str, tuple[Callable, Callable]] = {
    "adarms_joint": (_adarms_prepare, _adarms_step),
    "time_mlp_joint": (_time_mlp_prepare, _time_mlp_step),
    "joint_kv": (_joint_prepare, _joint_step),
    "cross_hidden": (_cross_prepare, _cross_step),
    "cross_last": (_cross_prepare, _cross_step),
}
"""Head kind -> (prepare cost, step cost), each (model, head spec, P, B, Ha, precision) -> `Cost`."""


def _head_fns(h: HeadSpec) -> tuple[Callable, Callable]:
    if h.kind not in HEAD_COSTS:
        raise ValueError(f"no cost model for head kind {h.kind!r} (head {h.name!r}): add one to HEAD_COSTS")
    return HEAD_COSTS[h.kind]


def _horizon(h: HeadSpec, horizon: int | None) -> int:
    ha = h.horizon or horizon
    if not ha:
        raise ValueError(f"head {h.name!r} takes the caller's chunk length: pass horizon=Ha")
    return ha


def head_prepare(m: Model, name: str, prefix_len: int, prec: Precision, batch: int = 1, horizon: int | None = None) -> Cost:
    """The head's per-frame precompute."""
    h = m.spec.head(name)
    return _head_fns(h)[0](m, h, prefix_len, batch, _horizon(h, horizon), prec)


def head_step(m: Model, name: str, prefix_len: int, prec: Precision, batch: int = 1, horizon: int | None = None) -> Cost:
    """One Euler step of the head (one velocity evaluation and the update)."""
    h = m.spec.head(name)
    return _head_fns(h)[1](m, h, prefix_len, batch, _horizon(h, horizon), prec)


def denoise(m: Model, name: str, prefix_len: int, prec: Precision, steps: int | None = None, batch: int = 1,
            horizon: int | None = None) -> Cost:
    """prepare + `steps` Euler steps (default the head's own)."""
    s = m.spec.head(name).num_steps if steps is None else steps
    return (head_prepare(m, name, prefix_len, prec, batch, horizon)
            + head_step(m, name, prefix_len, prec, batch, horizon).times(s))


# --------------------------------------------------------------------------------------------------
# A frame


@dataclasses.dataclass(frozen=True, kw_only=True)
class FramePlan:
    """One continuous-batching frame: the prefix, every head's steps, J admissions and k decode steps."""

    prefix_len: int  # P
    images: int  # camera images encoded
    horizon: int  # Ha of heads that take the caller's (π0.5)
    steps: int | None = None  # Euler steps of every head (None: each head's own)
    slots: int  # Ns of the pool
    capacity: int  # C = P + Q + M
    tokens_per_frame: int  # k
    admissions: int = 1  # J
    image_size: int | None = None


def frame_parts(m: Model, plan: FramePlan, prec: Precision) -> dict[str, Cost]:
    """The parts of one continuous frame, in program order."""
    parts = {"prefix": prefix_pass(m, plan.prefix_len, plan.images, prec, image_size=plan.image_size)}
    for h in m.spec.heads:
        parts[f"denoise:{h.name}"] = denoise(m, h.name, plan.prefix_len, prec, plan.steps, horizon=plan.horizon)
    if m.spec.language and plan.tokens_per_frame:
        parts["admission"] = admission(m, plan.prefix_len, plan.admissions, prec)
        parts["decode"] = decode_step(m, plan.slots, plan.capacity, prec).times(plan.tokens_per_frame)
    return parts


def continuous_frame(m: Model, plan: FramePlan, prec: Precision) -> Cost:
    return total(frame_parts(m, plan, prec).values())
