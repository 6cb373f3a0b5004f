"""Qwen3.5: a hybrid stack of Gated DeltaNet (linear attention) layers and gated full-attention layers.

Axes: B batch, T tokens, S key tokens, D width, F MLP, N query heads, K KV heads, H head dim, L layers,
V vocabulary, Mr M-RoPE axes (`oxygen_jax.axes`); Hk, Hv, Dk, Dv, Cc, Kc as in `models/qwen35/gated_deltanet.py`;
of this module: G layer groups, Pl / Pf linear / full layers per group, Lg = G Pl linear layers, Lf = G Pf
full layers.

`layer_types` repeats one group (the released checkpoints: 3 linear + 1 full), so the weights are stacked
[G, Pl, ...] and [G, Pf, ...] and the stack is one `lax.scan` over groups: a full-size model compiles one
group, not L layers. The layers are `models/qwen35/layers.py`'s: the full-attention layer is the
transformer layer of `models.backbone` with Qwen3.5's spec fields ((1 + w) norms, q/k-norm,
partial rotary (`rotary_dim` = H / 4), interleaved M-RoPE, the output gate `FullLayers.q_gate`); the
linear layers share the norms and the MLP and replace attention by `gated_deltanet.mixer`. Both round
in transformers' float32 order (`nn.torch_order`), the parity references' arithmetic.

What a prefix pass leaves (`prefill`), per row, as of its last valid token:

    k, v      [Lf, B, T, K, H]     full layers only; K after k-norm and partial RoPE
    window    [Lg, B, Cc, Kc]      linear layers: the last Kc conv inputs (activation dtype)
    state     [Lg, B, Hv, Dk, Dv]  linear layers: the delta-rule state, float32

Language adapters (`HybridBank`, served per row by `forward_step(..., lora=RowAdapters(bank, ids))`): E
adapters on both layer kinds, stacked like the weights with E after the group axes, so the layer scan
slices them with the weights and a full-size model still compiles one group:

    full     lora.ExpertLora   [G, Pf, E, ...]  q [N, D, r] / [N, r, H], kv, out, gating, linear: exactly
                                               the attention-only bank's targets (`lora.TARGETS`)
    linear   lora.DeltaNetLora [G, Pl, E, ...]  qkv [D, r] / [r, Cc], z [D, r] / [r, Hv, Dv],
                                               out [Hv, Dv, r] / [r, D], gating, linear (`lora.DELTANET_TARGETS`)

The full layers' output gate (`q_gate`) and the linear layers' b / a / conv are not targets. Id 0 = base
weights (not stored); id n = index n - 1 on the E axis.

Padding: a recurrent state cannot mask a token after the fact, so the valid tokens of a row must be
contiguous. Left padding (what StarVLA batches) and right padding are both exact here: pads are identity
steps, and the window ends at the last valid token (HF's own right-padded state is pad-contaminated).
Prefixes with invalid tokens between valid ones (π0.5-style masked cameras, kept in place and masked)
must be compacted first: `compact_left` moves every row's valid tokens to its right end in order, with
their positions; the result is what the same tokens without the masked camera would give.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models import backbone
from oxygen_jax.models.qwen35 import layers as layers_lib
from oxygen_jax.models.backbone import BackboneSpec, Decoder, Draw, Qwen3VisionSpec, RopeSpec
from oxygen_jax.models import lora as lora_lib
from oxygen_jax.models.qwen35.gated_deltanet import GatedDeltaNetLayers, GatedDeltaNetSpec, compute_dtype
from oxygen_jax.models.lora import DeltaNetLora, ExpertLora, LayerRows, LoraPair, RowAdapters
from oxygen_jax.models.prefix import Prefix, next_positions
from oxygen_jax.nn import kv_quant, quant
from oxygen_jax.nn.layers import RMSNorm
from oxygen_jax.nn.masks import last_valid_index, make_attn_mask

LINEAR, FULL = "linear_attention", "full_attention"


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# --------------------------------------------------------------------------------------------------
# Spec and presets


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen35Spec:
    """A Qwen3.5 language model (and vision tower). Hashable and static.

    Attributes:
      backbone: family 'qwen3_5': every dim the two layer kinds share and the full-attention maths
        (depth = all L layers; `vision` is the Qwen3-VL ViT without DeepStack, or None).
      gdn: the Gated DeltaNet dims.
      layer_types: per layer, 'linear_attention' or 'full_attention'; one group repeated G times.
      step_sums: how the recurrent form (decode and verification steps) sums each projection: 'in_order'
        (the prefill's one multiply-add chain per output; torch's CPU decode where MKL runs its sgemm for a
        few rows, as on AVX-512) or 'four_lanes' (`qwen35_steps`: torch's CPU decode with MKL held to AVX2,
        as the public parity fixture was made; a scan per projection, slower on CPU). The prefill and the
        chunked form always sum in order.
    """

    backbone: BackboneSpec
    gdn: GatedDeltaNetSpec
    layer_types: tuple[str, ...]
    step_sums: str = "in_order"

    def __post_init__(self):
        b = self.backbone
        _require(b.family == "qwen3_5", f"Qwen35Spec.backbone.family must be 'qwen3_5', got {b.family!r}")
        _require(b.norm_plus_one and b.qk_norm and b.mlp == "swiglu" and not b.embed_scale,
                 "Qwen35Spec.backbone needs norm_plus_one=True, qk_norm=True, mlp='swiglu', embed_scale=False (HF Qwen3.5)")
        _require(len(self.layer_types) == b.depth,
                 f"Qwen35Spec.layer_types has {len(self.layer_types)} entries but backbone.depth is {b.depth}")
        _require(set(self.layer_types) <= {LINEAR, FULL},
                 f"Qwen35Spec.layer_types entries must be {LINEAR!r} or {FULL!r}, got {sorted(set(self.layer_types))}")
        _require(self.group.count(LINEAR) > 0 and self.group.count(FULL) > 0,
                 f"Qwen35Spec.layer_types must repeat one group holding both kinds, got {self.layer_types}")
        _require(self.step_sums in ("in_order", "four_lanes"),
                 f"Qwen35Spec.step_sums must be 'in_order' or 'four_lanes', got {self.step_sums!r}")
        if isinstance(b.vision, Qwen3VisionSpec):
            _require(not b.vision.deepstack_layers, "Qwen3.5's vision tower has no DeepStack: set deepstack_layers=()")

    @property
    def group(self) -> tuple[str, ...]:
        """The shortest prefix of `layer_types` that repeats to all of it (3 linear + 1 full when released)."""
        types, n = self.layer_types, len(self.layer_types)
        return next(types[:p] for p in range(1, n + 1) if n % p == 0 and types[:p] * (n // p) == types)

    @property
    def num_groups(self) -> int:
        return len(self.layer_types) // len(self.group)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Decoder-layer index of each entry on the Lg axis (HF's `linear_layer_indices`)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Decoder-layer index of each entry on the Lf axis."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def state_bytes(self, kv_itemsize: int = 2, conv_itemsize: int = 2) -> dict[str, int]:
        """One sequence's cache: the fixed GDN state and window (all linear layers) and the full layers' K/V
        per token (`kv_itemsize`, `conv_itemsize`: bytes of the activation dtype, 2 for bfloat16)."""
        g, b = self.gdn, self.backbone
        lg = len(self.linear_layers)
        return dict(state=lg * 4 * g.num_value_heads * g.key_dim * g.value_dim,
                    window=lg * conv_itemsize * g.conv_channels * g.conv_kernel,
                    kv_per_token=len(self.full_layers) * 2 * b.num_kv_heads * b.head_dim * kv_itemsize)


def _qwen35(width, depth, heads, kv_heads, mlp_dim, vocab, tie, gdn_heads, *, head_dim=256, gdn_dim=128, rotary_dim=64,
            section=(11, 11, 10), theta=1e7, interval=4, vision=None) -> Qwen35Spec:
    hv, hk = gdn_heads
    types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(depth))
    return Qwen35Spec(
        backbone=BackboneSpec(
            family="qwen3_5", width=width, depth=depth, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            mlp_dim=mlp_dim, vocab_size=vocab, mlp="swiglu", norm_plus_one=True, qk_norm=True,
            rope=RopeSpec(theta=theta, kind="mrope_interleaved", mrope_section=section), embed_scale=False,
            tie_embeddings=tie, rotary_dim=rotary_dim, vision=vision),
        gdn=GatedDeltaNetSpec(num_key_heads=hk, num_value_heads=hv, key_dim=gdn_dim, value_dim=gdn_dim),
        layer_types=types)


def _vit(depth, width, heads, mlp, out) -> Qwen3VisionSpec:
    return Qwen3VisionSpec(depth=depth, width=width, num_heads=heads, mlp_dim=mlp, out_width=out, num_position_embeddings=2304)


_V = 248_320
_PRESETS: dict[str, Callable[[], Qwen35Spec]] = {
    # ../shared/fixtures/qwen35_tiny's dims (its config.json): GDN Hk 2 / Hv 4, Dk 16 != Dv 8.
    "qwen35_tiny": lambda: dataclasses.replace(
        _qwen35(64, 8, 4, 2, 128, 512, True, (4, 2), head_dim=32, gdn_dim=16, rotary_dim=8, section=(2, 1, 1),
                vision=Qwen3VisionSpec(depth=2, width=32, num_heads=2, mlp_dim=64, out_width=64, num_position_embeddings=64)),
        gdn=GatedDeltaNetSpec(num_key_heads=2, num_value_heads=4, key_dim=16, value_dim=8)),
    # CPU benchmarks: Qwen3.5-0.8B's layer dims (width, heads, GDN, MLP, vocabulary) at 8 of its 24 layers
    # (2 groups), with the Qwen3-VL bench ViT's size (384 x 6) and no DeepStack.
    "qwen35_bench": lambda: _qwen35(1024, 8, 8, 2, 3584, _V, True, (16, 16), vision=_vit(6, 384, 6, 1536, 1024)),
    # Released sizes: the table of ../shared/docs/qwen35.md §4 (model cards and config copies it cites).
    "qwen3_5_0.8b": lambda: _qwen35(1024, 24, 8, 2, 3584, _V, True, (16, 16), vision=_vit(12, 768, 12, 3072, 1024)),
    "qwen3_5_2b": lambda: _qwen35(2048, 24, 8, 2, 6144, _V, True, (16, 16), vision=_vit(24, 1024, 16, 4096, 2048)),
    "qwen3_5_4b": lambda: _qwen35(2560, 32, 16, 4, 9216, _V, True, (32, 16), vision=_vit(24, 1024, 16, 4096, 2560)),
    "qwen3_5_9b": lambda: _qwen35(4096, 32, 16, 4, 12288, _V, False, (32, 16), vision=_vit(27, 1152, 16, 4304, 4096)),
}


def preset(name: str) -> Qwen35Spec:
    """A named spec: 'qwen35_tiny' (the test fixture's dims), 'qwen35_bench' (CPU benchmarks) or a released
    size 'qwen3_5_{0.8b,2b,4b,9b}'."""
    if name not in _PRESETS:
        raise ValueError(f"unknown Qwen3.5 preset {name!r}; choose one of {sorted(_PRESETS)}")
    return _PRESETS[name]()


# --------------------------------------------------------------------------------------------------
# Parameters


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class FullLayers:
    """Gated full-attention layers: `backbone.DecoderLayers`' fields plus the output gate (read by name by
    `qwen35_layers.full_layer`). Leading stacking axes `...` first."""

    q: jax.Array  # [..., N, D, H] (HF q_proj rows 0..H-1 of each head)
    kv: jax.Array  # [..., 2, K, D, H]
    out: jax.Array  # [..., N, H, D]
    attn_norm: RMSNorm  # [..., D]
    ffw_norm: RMSNorm  # [..., D]
    gating: jax.Array  # [..., 2, D, F]
    linear: jax.Array  # [..., F, D]
    q_norm: RMSNorm  # [..., H]
    k_norm: RMSNorm  # [..., H]
    q_gate: jax.Array  # [..., N, D, H] (HF q_proj rows H..2H-1 of each head): a * sigmoid(x W)


@_pytree
class HybridLayers:
    """The layer stack: linear layers [G, Pl, ...] and full layers [G, Pf, ...], in group order."""

    linear: GatedDeltaNetLayers
    full: FullLayers


def decoder_tree(spec: Qwen35Spec, draw: Draw) -> Decoder:
    """The `backbone.Decoder` (layers = `HybridLayers`) of `spec` with every leaf from `draw`: fan-in scaled
    normals, (1 + w) norm scales around 0 and the gated norm around 1; A_log, dt_bias as HF's init ranges
    roughly (log 1..16, 1). The one description of its shapes."""
    b, g = spec.backbone, spec.gdn
    d, n, k, h, f, v = b.width, b.num_heads, b.num_kv_heads, b.head_dim, b.mlp_dim, b.vocab_size
    hv, dk, dv, cc = g.num_value_heads, g.key_dim, g.value_dim, g.conv_channels
    grp, pl, pf = spec.num_groups, spec.group.count(LINEAR), spec.group.count(FULL)

    def normal(shape, fan_in):
        return draw(shape, 1.0 / math.sqrt(fan_in), 0.0)

    def norm(shape, mean=0.0):
        return RMSNorm(scale=draw(shape, 0.1, mean))

    lin = (grp, pl)
    linear = GatedDeltaNetLayers(
        qkv=normal(lin + (d, cc), d), z=normal(lin + (d, hv, dv), d), b=normal(lin + (d, hv), d), a=normal(lin + (d, hv), d),
        conv=normal(lin + (cc, g.conv_kernel), g.conv_kernel), dt_bias=draw(lin + (hv,), 0.5, 1.0),
        a_log=draw(lin + (hv,), 0.5, 0.0), norm=draw(lin + (dv,), 0.1, 1.0), out=normal(lin + (hv, dv, d), hv * dv),
        attn_norm=norm(lin + (d,)), ffw_norm=norm(lin + (d,)), gating=normal(lin + (2, d, f), d), linear=normal(lin + (f, d), f))
    fl = (grp, pf)
    full = FullLayers(
        q=normal(fl + (n, d, h), d), kv=normal(fl + (2, k, d, h), d), out=normal(fl + (n, h, d), n * h),
        attn_norm=norm(fl + (d,)), ffw_norm=norm(fl + (d,)), gating=normal(fl + (2, d, f), d), linear=normal(fl + (f, d), f),
        q_norm=norm(fl + (h,)), k_norm=norm(fl + (h,)), q_gate=normal(fl + (n, d, h), d))
    return Decoder(embedding=normal((v, d), d), layers=HybridLayers(linear=linear, full=full), final_norm=norm((d,)),
                   lm_head=None if b.tie_embeddings else normal((v, d), d))


def init_decoder(spec: Qwen35Spec, seed: int = 0, dtype: str = "float32") -> Decoder:
    """Random weights for `spec` (tests and benchmarks; not a training initialisation)."""
    return decoder_tree(spec, backbone.numpy_draws(seed, dtype))


def abstract_decoder(spec: Qwen35Spec, dtype: str = "float32") -> Decoder:
    """`jax.ShapeDtypeStruct` leaves via `jax.eval_shape`: nothing is allocated."""
    return jax.eval_shape(lambda: decoder_tree(spec, backbone.zeros_draws(dtype)))


# --------------------------------------------------------------------------------------------------
# Language adapters


@_pytree
class HybridBank:
    """E LoRA adapters of a Qwen3.5 stack for per-row serving (the layout: module docstring).

    Attributes:
      full: `lora.ExpertLora` of the full-attention layers, leaves [G, Pf, E, ...] (targets without LoRA None).
      linear: `lora.DeltaNetLora` of the linear layers, leaves [G, Pl, E, ...].
    """

    full: ExpertLora
    linear: DeltaNetLora

    @property
    def num_adapters(self) -> int:
        """E: the bank serves ids 0 (base weights) .. E."""
        return int(jax.tree.leaves(self)[0].shape[2])

    def adapter(self, adapter_id: int) -> "HybridBank":
        """The stored adapter `adapter_id` (1..E) with leaves [G, P, ...] (what `merge_adapter` folds in)."""
        if not 1 <= adapter_id <= self.num_adapters:
            raise ValueError(f"adapter id {adapter_id} is not stored in this bank (ids 1..{self.num_adapters}; 0 = base)")
        return jax.tree.map(lambda x: x[:, :, adapter_id - 1], self)


def _deltanet_dims(spec: Qwen35Spec) -> lora_lib.DeltaNetDims:
    g, b = spec.gdn, spec.backbone
    return lora_lib.DeltaNetDims(width=b.width, mlp_dim=b.mlp_dim, conv_channels=g.conv_channels,
                                 num_value_heads=g.num_value_heads, value_dim=g.value_dim)


def _full_dims(spec: Qwen35Spec) -> lora_lib.LayerDims:
    b = spec.backbone
    return lora_lib.LayerDims(width=b.width, depth=len(spec.full_layers), mlp_dim=b.mlp_dim, num_heads=b.num_heads,
                              num_kv_heads=b.num_kv_heads, head_dim=b.head_dim)


def _fan_in(spec: Qwen35Spec, kind: str, target: str, a_shape) -> int:
    """The size A contracts (the heads and head dim for the two output projections)."""
    if target == "out":
        b, g = spec.backbone, spec.gdn
        return b.num_heads * b.head_dim if kind == FULL else g.num_value_heads * g.value_dim
    return a_shape[-2]


def bank_tree(spec: Qwen35Spec, num_adapters: int, rank: int, draw: Draw, *, alpha: float | None = None,
              rslora: bool = False, full_targets=lora_lib.TARGETS, linear_targets=lora_lib.DELTANET_TARGETS,
              b_std: float = 0.0) -> HybridBank:
    """The `HybridBank` of `spec` with every factor from `draw`: A ~ N(0, 1 / fan_in), B ~ N(0, b_std²)
    (b_std = 0: B = 0, every adapter the base model until trained). The one description of its shapes."""
    bad = sorted(set(full_targets) - set(lora_lib.TARGETS)) + sorted(set(linear_targets) - set(lora_lib.DELTANET_TARGETS))
    _require(not bad and num_adapters >= 1 and rank >= 1,
             f"qwen35 bank: need num_adapters >= 1, rank >= 1, full targets from {lora_lib.TARGETS} and linear targets "
             f"from {lora_lib.DELTANET_TARGETS}; got {num_adapters}, {rank}, {bad or 'targets ok'}")
    grp = spec.num_groups
    kinds = ((FULL, full_targets, lora_lib.TARGETS, lambda t: lora_lib.target_shapes(_full_dims(spec), t, rank)),
             (LINEAR, linear_targets, lora_lib.DELTANET_TARGETS,
              lambda t: lora_lib.deltanet_target_shapes(_deltanet_dims(spec), t, rank)))
    out = {}
    for kind, targets, every, shapes in kinds:
        lead = (grp, spec.group.count(kind), num_adapters)
        pairs = {}
        for t in every:
            if t not in targets:
                pairs[t] = None
                continue
            a, b = shapes(t)
            pairs[t] = LoraPair(a=draw(lead + a, 1.0 / math.sqrt(_fan_in(spec, kind, t, a)), 0.0), b=draw(lead + b, b_std, 0.0))
        out[kind] = pairs
    alpha = float(rank if alpha is None else alpha)
    return HybridBank(full=ExpertLora(**out[FULL], alpha=alpha, rslora=rslora),
                      linear=DeltaNetLora(**out[LINEAR], alpha=alpha, rslora=rslora))


def init_bank(spec: Qwen35Spec, num_adapters: int, rank: int, alpha: float | None = None, seed: int = 0, *,
              rslora: bool = False, full_targets=lora_lib.TARGETS, linear_targets=lora_lib.DELTANET_TARGETS,
              b_std: float = 0.0, dtype: str = "float32") -> HybridBank:
    """A bank of `num_adapters` adapters (`bank_tree`, numpy draws from `seed`): b_std = 0 gives the training
    init (B = 0, exactly the base weights), b_std > 0 random adapters (tests).

    Args:
      rank: r of every target; alpha: the scaling numerator (default rank: scaling 1).
      full_targets / linear_targets: subsets of `lora.TARGETS` / `lora.DELTANET_TARGETS` that get LoRA.
    """
    return bank_tree(spec, num_adapters, rank, backbone.numpy_draws(seed, dtype), alpha=alpha, rslora=rslora,
                     full_targets=full_targets, linear_targets=linear_targets, b_std=b_std)


def abstract_bank(spec: Qwen35Spec, num_adapters: int, rank: int, dtype: str = "float32", **kw) -> HybridBank:
    """`jax.ShapeDtypeStruct` leaves via `jax.eval_shape` (full-size specs too: nothing is allocated)."""
    return jax.eval_shape(lambda: bank_tree(spec, num_adapters, rank, backbone.zeros_draws(dtype), **kw))


def check_bank(spec: Qwen35Spec, bank) -> None:
    """Raises a one-line ValueError naming what does not fit: not a `HybridBank`, or leaves whose shapes are
    not `spec`'s (ranks read off the bank itself)."""
    _require(isinstance(bank, HybridBank),
             f"a Qwen3.5 language model serves a qwen35.HybridBank (qwen35.init_bank), got {type(bank).__name__}")
    e = bank.num_adapters
    lines = [f"full.{x}" for x in lora_lib.fit_problems(bank.full, _full_dims(spec), (spec.num_groups, spec.group.count(FULL), e))]
    lines += [f"linear.{x}" for x in lora_lib.fit_problems(bank.linear, _deltanet_dims(spec),
                                                          (spec.num_groups, spec.group.count(LINEAR), e))]
    _require(not lines, "HybridBank does not fit this Qwen3.5 spec (built for another one?): " + "; ".join(lines))


def merge_adapter(spec: Qwen35Spec, decoder: Decoder, bank: HybridBank, adapter_id: int) -> Decoder:
    """`decoder` with adapter `adapter_id` folded into the weights (W + ΔW, `lora.merge_layers`): the
    reference a row on that adapter must match."""
    check_bank(spec, bank)
    one = bank.adapter(adapter_id)
    layers = HybridLayers(linear=lora_lib.merge_layers(decoder.layers.linear, one.linear),
                          full=lora_lib.merge_layers(decoder.layers.full, one.full))
    return dataclasses.replace(decoder, layers=layers)


# --------------------------------------------------------------------------------------------------
# The stack


def _flat(x):
    """[G, P, ...] -> [G P, ...] (layer order: the groups are consecutive)."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _grouped(x, spec: Qwen35Spec, kind: str):
    """[Lg or Lf, ...] -> [G, Pl or Pf, ...]."""
    return x.reshape((spec.num_groups, spec.group.count(kind)) + x.shape[1:])


def _run_groups(spec: Qwen35Spec, layers: HybridLayers, x, rope, mask, valid, form, cache, window, state, kv_fn_for,
                collect_hidden=False, collect_taps=False, lora: RowAdapters | None = None):
    """The scan over groups shared by `forward_prefill` and `forward_step`.

    `window`, `state`: [Lg, B, ...] states the linear layers continue; `cache`: a carried pytree the full
    layers' `kv_fn_for(cache, layer) -> (kv_fn, get_cache)` reads and updates (layer = full-layer index);
    `lora`: a `HybridBank` and row ids, scanned with the weights (each layer gets its [E, ...] slice).
    Returns (x, cache, window [Lg, ...], state [Lg, ...], per-group outputs dict of [L or Lg, ...]).
    """
    pl, pf = spec.group.count(LINEAR), spec.group.count(FULL)
    lanes = form == "recurrent" and spec.step_sums == "four_lanes"

    def rows(bank, kind, i):  # layer i of this group's [P, E, ...] bank slice, or None without adapters
        return None if bank is None else LayerRows(jax.tree.map(lambda a: a[i], getattr(bank, kind)), lora.ids)

    def group(carry, layers_g, extra, g):  # `quant.dequantizing`'s body form: (carry, layer, extra, index)
        x, cache = carry
        lin, full = layers_g
        win, st, bank = extra
        wins, sts, hids, taps = [], [], [], []
        il = jf = 0
        for kind in spec.group:
            if kind == LINEAR:
                lp = jax.tree.map(lambda a, i=il: a[i], lin)
                tap = {} if collect_taps else None
                x, w_i, s_i = layers_lib.linear_layer(spec, lp, x, win[il], st[il], valid, form, tap,
                                                      rows(bank, "linear", il), lanes)
                wins.append(w_i), sts.append(s_i), taps.append(tap)
                il += 1
            else:
                fp = jax.tree.map(lambda a, j=jf: a[j], full)
                kv_fn, get_cache = kv_fn_for(cache, g * pf + jf)
                x = layers_lib.full_layer(spec.backbone, fp, x, rope, mask, kv_fn, rows(bank, "full", jf), lanes)
                cache = get_cache()
                jf += 1
            hids.append(x if collect_hidden else None)
        ys = dict(window=jnp.stack(wins), state=jnp.stack(sts))
        if collect_hidden:
            ys["hidden"] = jnp.stack(hids)
        if collect_taps:
            ys["taps"] = jax.tree.map(lambda *a: jnp.stack(a), *taps)
        return (x, cache), ys

    # Quantized leaves (`nn.quant.QArray`) reach `group` dequantized, one group at a time; float layers pass
    # through untouched (the same program).
    body = quant.dequantizing(group)
    xs = ((layers.linear, layers.full), (_grouped(window, spec, LINEAR), _grouped(state, spec, LINEAR),
                                         None if lora is None else lora.bank), jnp.arange(spec.num_groups))
    (x, cache), ys = jax.lax.scan(lambda c, a: body(c, *a), (x, cache), xs)
    ys = jax.tree.map(_flat, ys)
    return x, cache, ys.pop("window"), ys.pop("state"), ys


def empty_state(spec: Qwen35Spec, batch: int, dtype) -> tuple[jax.Array, jax.Array]:
    """(window [Lg, B, Cc, Kc] in `dtype`, state float32 [Lg, B, Hv, Dk, Dv] (float64 for float64 `dtype`)),
    all zeros: a fresh sequence."""
    g, lg = spec.gdn, len(spec.linear_layers)
    return (jnp.zeros((lg, batch, g.conv_channels, g.conv_kernel), dtype),
            jnp.zeros((lg, batch, g.num_value_heads, g.key_dim, g.value_dim), compute_dtype(dtype)))


def forward_prefill(spec: Qwen35Spec, layers: HybridLayers, x, positions, input_mask, mask=None, *, return_hidden=False,
                    return_taps=False):
    """All layers over `x` from an empty cache (linear layers in the chunked form).

    Args:
      x: [B, T, D]; positions: int [B, T] or [Mr, B, T]; input_mask: bool [B, T] (valid tokens contiguous
        per row, see the module docstring); mask: bool [B, T, T], default causal over valid tokens.
      return_hidden: also each layer's output [L, B, T, D]; return_taps: the mixers' intermediates.
    Returns:
      dict: hidden [B, T, D] before the final norm, k, v [Lf, B, T, K, H], window [Lg, B, Cc, Kc],
      state [Lg, B, Hv, Dk, Dv] (+ layer_outputs, taps).
    """
    mask = make_attn_mask(input_mask, jnp.ones(input_mask.shape[-1:], bool)) if mask is None else mask
    rope = layers_lib.rope_tables(spec.backbone, positions, x.dtype)
    b, t = x.shape[:2]
    bs = spec.backbone
    kv0 = jnp.zeros((len(spec.full_layers), b, t, bs.num_kv_heads, bs.head_dim), x.dtype)

    def kv_fn_for(cache, layer):
        out = {}

        def kv_fn(k, v):
            out["cache"] = (cache[0].at[layer].set(k), cache[1].at[layer].set(v))
            return k, v
        return kv_fn, lambda: out["cache"]

    window, state = empty_state(spec, b, x.dtype)
    x, (k, v), window, state, ys = _run_groups(spec, layers, x, rope, mask, input_mask, "chunked", (kv0, kv0), window, state,
                                               kv_fn_for, return_hidden, return_taps)
    out = dict(hidden=x, k=k, v=v, window=window, state=state)
    if return_hidden:
        out["layer_outputs"] = ys["hidden"]
    if return_taps:
        out["taps"] = ys["taps"]
    return out


def prefill(spec: Qwen35Spec, decoder: Decoder, x, positions, input_mask, *, return_hidden=False, return_taps=False):
    """The prefix pass: `forward_prefill`, the final norm, and HF-convention hidden states.

    Returns:
      `forward_prefill`'s dict plus `normed` [B, T, D]; with `return_hidden`, `hidden_states` [L + 1, B, T, D]
      as HF reports them (input embeddings, outputs of layers 0..L-2, final-normed output).
    """
    out = forward_prefill(spec, decoder.layers, x, positions, input_mask, return_hidden=return_hidden, return_taps=return_taps)
    out["normed"] = layers_lib.norm(spec.backbone, out["hidden"], decoder.final_norm)
    if return_hidden:
        out["hidden_states"] = jnp.concatenate([x[None], out.pop("layer_outputs")[:-1], out["normed"][None]], axis=0)
    return out


def prefix_pass(spec: Qwen35Spec, decoder: Decoder, x, positions, input_mask, next_position=None, *,
                hidden_layers: tuple[int, ...] = (), language: bool = True) -> Prefix:
    """`prefill` as the runtime's `Prefix`: what heads (HF hidden states `hidden_layers`) and the decode
    pool (with `language`: the full layers' K/V, the linear layers' window and state, the last valid
    token's final-normed output) read.

    Args:
      x: [B, P, D] embeddings (after any image scatter); positions: int [B, P] or [Mr, B, P];
      input_mask: bool [B, P], valid tokens contiguous per row (`compact_left` otherwise);
      next_position: int [B] where text continues (default: max valid position + 1).
    """
    hidden_layers = tuple(sorted(set(hidden_layers)))
    bad = [i for i in hidden_layers if not 0 <= i <= spec.backbone.depth]
    _require(not bad, f"hidden_layers {bad} are not HF hidden-state indices in [0, {spec.backbone.depth}]")
    out = prefill(spec, decoder, x, positions, input_mask, return_hidden=bool(hidden_layers))
    hidden = out["hidden_states"][jnp.asarray(hidden_layers, jnp.int32)] if hidden_layers else None
    nxt = next_positions(input_mask, positions) if next_position is None else jnp.asarray(next_position, jnp.int32)
    kept = dict(k=None, v=None, window=None, state=None, last_hidden=None, kv_layers=())
    if language:
        last = jnp.take_along_axis(out["normed"], last_valid_index(input_mask)[:, None, None], axis=1)[:, 0]
        kept = dict(k=out["k"], v=out["v"], window=out["window"], state=out["state"], last_hidden=last,
                    kv_layers=spec.full_layers)
    return Prefix(hidden=hidden, mask=input_mask, positions=positions, next_position=nxt, hidden_layers=hidden_layers,
                  rope=spec.backbone.rope, **kept)


def forward_step(spec: Qwen35Spec, layers: HybridLayers, x, positions, valid, mask, cache_k, cache_v, write_index,
                 window, state, form: str = "recurrent", lora: RowAdapters | None = None):
    """Continues cached sequences by T tokens: full layers write their K/V into the cache and attend to it;
    linear layers advance (window, state) (decode steps, request prompts).

    Args:
      x: [B, T, D]; positions: int [B, T] or [Mr, B, T]; valid: bool [B, T] tokens that advance the state
        (right padding and inactive rows: False, identity steps); mask: bool [B, T, S] over cache slots.
      cache_k, cache_v: [Lf, B, S, K, H] (float or `nn.kv_quant.QuantKV`); write_index: int [B, T] (>= S drops the write).
      window: [Lg, B, Cc, Kc]; state: float32 [Lg, B, Hv, Dk, Dv].
      lora: `RowAdapters(HybridBank, ids int32 [B])`: row b runs with adapter ids[b] on both layer kinds
        (0 = base weights; rows on 0 get exactly the adapter-free result); None: the adapter-free program.
    Returns:
      (hidden [B, T, D] before the final norm, (cache_k, cache_v), (window, state)).
    """
    if lora is not None:
        check_bank(spec, lora.bank)
        _require(lora.ids.shape == (x.shape[0],), f"RowAdapters.ids must be [B] = ({x.shape[0]},), got {lora.ids.shape}")
    rope = layers_lib.rope_tables(spec.backbone, positions, x.dtype)
    rows = jnp.arange(x.shape[0])[:, None]

    def kv_fn_for(cache, layer):
        out = {}

        def kv_fn(k, v):
            ck, keys = kv_quant.write_layer(cache[0], layer, rows, write_index, k)
            cv, values = kv_quant.write_layer(cache[1], layer, rows, write_index, v)
            out["cache"] = (ck, cv)
            return keys, values
        return kv_fn, lambda: out["cache"]

    x, (cache_k, cache_v), window, state, _ = _run_groups(spec, layers, x, rope, mask, valid, form, (cache_k, cache_v),
                                                          window, state, kv_fn_for, lora=lora)
    return x, (cache_k, cache_v), (window, state)


# --------------------------------------------------------------------------------------------------
# Padding


def compact_left(input_mask: np.ndarray, positions: np.ndarray | None = None):
    """Gather indices that move each row's valid tokens, in order, to its right end (left padding).

    Host numpy (prefix layouts are known on the host). Example, mask [1 1 0 0 1 1]: order [2 3 0 1 4 5],
    new mask [0 0 1 1 1 1]; `x[b, order[b]]` is the compacted row, and positions move with their tokens
    (cumsum(mask) - 1 over valid tokens is unchanged by the move).

    Returns:
      (order int32 [B, T], new mask bool [B, T], positions gathered the same way ([B, T] or [Mr, B, T]), or None).
    """
    m = np.asarray(input_mask).astype(bool)
    order = np.argsort(m, axis=-1, kind="stable").astype(np.int32)  # invalid (False) first, each group in order
    new_mask = np.take_along_axis(m, order, axis=-1)
    if positions is None:
        return order, new_mask, None
    p = np.asarray(positions)
    gathered = np.take_along_axis(p, np.broadcast_to(order, p.shape), axis=-1)
    return order, new_mask, np.where(new_mask, gathered, 0).astype(np.int32)
