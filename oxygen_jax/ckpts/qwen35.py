"""Hugging Face Qwen3.5 checkpoints (`model_type` 'qwen3_5' / 'qwen3_5_text'): config.json -> `Qwen35Spec`,
safetensors -> our `backbone.Decoder` (layers = `qwen35.HybridLayers`) and the Qwen3-VL vision tree.

HF names (prefix `model.language_model.`; a text-only checkpoint uses `model.`), torch Linear = [out, in]:

    layers.{i}.linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj}.weight, conv1d.weight
        [Cc, 1, Kc], dt_bias, A_log, norm.weight           (layer_types[i] == 'linear_attention')
    layers.{i}.self_attn.{q_proj [N 2H, D] = per head [query H | gate H], k_proj, v_proj, o_proj}.weight,
        q_norm.weight, k_norm.weight                        (layer_types[i] == 'full_attention')
    layers.{i}.{input_layernorm, post_attention_layernorm}.weight, layers.{i}.mlp.{gate,up,down}_proj.weight
    embed_tokens.weight, norm.weight; lm_head.weight (untied sizes only); model.visual.* (hf.py's ViT table)

`mtp.*` (the multi-token-prediction block) is ignored, as transformers does. Layer i goes to group
i // len(group), slot (its rank among the group's layers of its kind). A checkpoint that does not fit
fails with one line naming every missing, unexpected and mis-shaped tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.ckpts import hf, limits
from oxygen_jax.ckpts.safetensors import read_checkpoint_tensors
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.models.backbone import BackboneSpec, Decoder, Qwen3VisionSpec, RopeSpec
from oxygen_jax.models.qwen35.gated_deltanet import GatedDeltaNetSpec
from oxygen_jax.models.qwen35.model import FULL, LINEAR, Qwen35Spec
from oxygen_jax.nn.layers import RMSNorm

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


def _unsupported(cond: bool, what: str) -> None:
    if cond:
        raise ValueError(f"unsupported Qwen3.5 checkpoint: {what}")


def check_config(config: Mapping, shapes: Mapping[str, Any], where: str, *, fields: str = "") -> None:
    """`hf.check_config` (every size within its cap, layer / block counts and widths as the weights' header
    says) plus Qwen3.5's `layer_types`: one entry per layer. One-line ValueError naming `where` and the field."""
    hf.check_config(config, shapes, where, fields=fields)
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    types = text.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != int(text["num_hidden_layers"])):
        raise ValueError(f"{where}: layer_types must list one kind per layer ({int(text['num_hidden_layers'])}), "
                         f"got {len(types) if isinstance(types, list) else type(types).__name__}")
    if text.get("full_attention_interval") is not None:
        limits.int_field(text["full_attention_interval"], "full_attention_interval", where, cap=limits.MAX_LAYERS)


def spec_from_config(config: Mapping, names=()) -> Qwen35Spec:
    """A `Qwen35Spec` from an HF Qwen3.5 config.json dict; `names` settle a missing tie flag."""
    _unsupported(config.get("model_type") not in MODEL_TYPES, f"model_type {config.get('model_type')!r} (expected {MODEL_TYPES})")
    text = config.get("text_config") or config
    _unsupported(text.get("hidden_act", "silu") != "silu", f"hidden_act {text.get('hidden_act')!r}")
    _unsupported(bool(text.get("attention_bias", False)), "attention_bias=true")
    rope = hf._rope_params(text)  # noqa: SLF001 (the one reader of rope_parameters / rope_theta)
    _unsupported(rope.get("rope_type", "default") != "default", f"rope_type {rope.get('rope_type')!r}")
    heads, depth = int(text["num_attention_heads"]), int(text["num_hidden_layers"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    rotary = int(head_dim * float(rope.get("partial_rotary_factor", 0.25)))
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    _unsupported(bool(section) and not rope.get("mrope_interleaved", True), "non-interleaved M-RoPE")
    layer_types = tuple(text.get("layer_types") or (
        FULL if (i + 1) % int(text.get("full_attention_interval", 4)) == 0 else LINEAR for i in range(depth)))
    ties = [c["tie_word_embeddings"] for c in (config, text) if "tie_word_embeddings" in c]
    _unsupported(len(set(ties)) > 1, f"config.json disagrees with itself on tie_word_embeddings: {ties}")
    tie = bool(ties[0]) if ties else ("lm_head.weight" not in set(names))
    vision = None
    if config.get("vision_config"):
        v = config["vision_config"]
        _unsupported(v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh", f"vision hidden_act {v.get('hidden_act')!r}")
        _unsupported(bool(v.get("deepstack_visual_indexes")), "deepstack_visual_indexes (Qwen3.5 has no DeepStack)")
        vision = Qwen3VisionSpec(
            depth=int(v["depth"]), width=int(v["hidden_size"]), num_heads=int(v["num_heads"]), mlp_dim=int(v["intermediate_size"]),
            out_width=int(v["out_hidden_size"]), num_position_embeddings=int(v["num_position_embeddings"]),
            patch_size=int(v.get("patch_size", 16)), temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)), in_channels=int(v.get("in_channels", 3)),
            rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10_000.0)))
    eps = float(text.get("rms_norm_eps", 1e-6))
    bspec = BackboneSpec(
        family="qwen3_5", width=int(text["hidden_size"]), depth=depth, num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads", heads)), head_dim=head_dim, mlp_dim=int(text["intermediate_size"]),
        vocab_size=int(text["vocab_size"]), mlp="swiglu", norm_plus_one=True, qk_norm=True,
        rope=(RopeSpec(theta=float(rope.get("rope_theta", 1e7)), kind="mrope_interleaved", mrope_section=section) if section
              else RopeSpec(theta=float(rope.get("rope_theta", 1e7)))),
        embed_scale=False, tie_embeddings=tie, norm_eps=eps, vision=vision, rotary_dim=0 if rotary == head_dim else rotary)
    gspec = GatedDeltaNetSpec(
        num_key_heads=int(text["linear_num_key_heads"]), num_value_heads=int(text["linear_num_value_heads"]),
        key_dim=int(text["linear_key_head_dim"]), value_dim=int(text["linear_value_head_dim"]),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)), norm_eps=eps)
    return Qwen35Spec(backbone=bspec, gdn=gspec, layer_types=layer_types)


# --------------------------------------------------------------------------------------------------
# The name table: (HF name under layers.{i}., kind, our leaf path, layout (hf array, spec) -> our slice)


def _t(w, s):
    return w.T


def _same(w, s):
    return w


_LAYER_COMMON = [
    ("input_layernorm.weight", ("attn_norm", "scale"), _same), ("post_attention_layernorm.weight", ("ffw_norm", "scale"), _same),
    ("mlp.gate_proj.weight", ("gating", 0), _t), ("mlp.up_proj.weight", ("gating", 1), _t), ("mlp.down_proj.weight", ("linear",), _t),
]
_LINEAR_ROWS = _LAYER_COMMON + [
    ("linear_attn.in_proj_qkv.weight", ("qkv",), _t),
    ("linear_attn.in_proj_z.weight", ("z",), lambda w, s: w.T.reshape(w.shape[1], s.gdn.num_value_heads, s.gdn.value_dim)),
    ("linear_attn.in_proj_b.weight", ("b",), _t), ("linear_attn.in_proj_a.weight", ("a",), _t),
    ("linear_attn.conv1d.weight", ("conv",), lambda w, s: w[:, 0, :]),
    ("linear_attn.dt_bias", ("dt_bias",), _same), ("linear_attn.A_log", ("a_log",), _same), ("linear_attn.norm.weight", ("norm",), _same),
    ("linear_attn.out_proj.weight", ("out",), lambda w, s: w.T.reshape(s.gdn.num_value_heads, s.gdn.value_dim, w.shape[0])),
]


def _q_part(part: int):
    def f(w, s):  # (N 2H, D) -> per head [query | gate] -> [N, D, H]
        b = s.backbone
        return w.reshape(b.num_heads, 2, b.head_dim, -1)[:, part].transpose(0, 2, 1)
    return f


def _kv_heads(w, s):  # (K H, D) -> [K, D, H]
    return w.reshape(s.backbone.num_kv_heads, s.backbone.head_dim, -1).transpose(0, 2, 1)


_FULL_ROWS = _LAYER_COMMON + [
    ("self_attn.q_proj.weight", ("q",), _q_part(0)), ("self_attn.q_proj.weight", ("q_gate",), _q_part(1)),
    ("self_attn.k_proj.weight", ("kv", 0), _kv_heads), ("self_attn.v_proj.weight", ("kv", 1), _kv_heads),
    ("self_attn.o_proj.weight", ("out",), lambda w, s: w.T.reshape(s.backbone.num_heads, s.backbone.head_dim, -1)),
    ("self_attn.q_norm.weight", ("q_norm", "scale"), _same), ("self_attn.k_norm.weight", ("k_norm", "scale"), _same),
]


def text_prefix(names) -> str:
    """'model.language_model.' (the multimodal checkpoints) or 'model.' (a text-only one)."""
    return "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."


def hf_shapes(spec: Qwen35Spec, prefix: str = "model.language_model.") -> dict[str, tuple[int, ...]]:
    """Every HF tensor name `spec` expects (vision included when the spec has it), with its HF shape."""
    b, g = spec.backbone, spec.gdn
    d, n, k, h, f = b.width, b.num_heads, b.num_kv_heads, b.head_dim, b.mlp_dim
    hv, dv = g.num_value_heads, g.value_dim
    out = {prefix + "embed_tokens.weight": (b.vocab_size, d), prefix + "norm.weight": (d,)}
    if not b.tie_embeddings:
        out["lm_head.weight"] = (b.vocab_size, d)
    common = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (f, d),
              "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    lin = {"linear_attn.in_proj_qkv.weight": (g.conv_channels, d), "linear_attn.in_proj_z.weight": (hv * dv, d),
           "linear_attn.in_proj_b.weight": (hv, d), "linear_attn.in_proj_a.weight": (hv, d),
           "linear_attn.conv1d.weight": (g.conv_channels, 1, g.conv_kernel), "linear_attn.dt_bias": (hv,),
           "linear_attn.A_log": (hv,), "linear_attn.norm.weight": (dv,), "linear_attn.out_proj.weight": (d, hv * dv)}
    full = {"self_attn.q_proj.weight": (2 * n * h, d), "self_attn.k_proj.weight": (k * h, d), "self_attn.v_proj.weight": (k * h, d),
            "self_attn.o_proj.weight": (d, n * h), "self_attn.q_norm.weight": (h,), "self_attn.k_norm.weight": (h,)}
    for i, kind in enumerate(spec.layer_types):
        for name, shape in (common | (lin if kind == LINEAR else full)).items():
            out[f"{prefix}layers.{i}.{name}"] = shape
    return out | _vision_shapes(spec)


def _vl_twin(spec: Qwen35Spec) -> BackboneSpec:
    """A minimal Qwen3-VL spec carrying Qwen3.5's vision tower: hf.py's ViT table is reused through it (its
    one-layer text part is never read from the checkpoint)."""
    b = spec.backbone
    return BackboneSpec(family="qwen3_vl", width=b.width, depth=1, num_heads=1, num_kv_heads=1, head_dim=2, mlp_dim=1,
                        vocab_size=1, mlp="swiglu", norm_plus_one=False, qk_norm=True, rope=RopeSpec(), embed_scale=False,
                        tie_embeddings=True, vision=b.vision)


def _vision_shapes(spec: Qwen35Spec) -> dict[str, tuple[int, ...]]:
    if not isinstance(spec.backbone.vision, Qwen3VisionSpec):
        return {}
    return {kk: vv for kk, vv in hf.hf_shapes(_vl_twin(spec)).items() if kk.startswith("model.visual.")}


def _check_names(spec: Qwen35Spec, tensors: Mapping[str, Any], prefix: str) -> None:
    expected = hf_shapes(spec, prefix)
    got = {kk: tuple(np.shape(vv)) for kk, vv in tensors.items() if not kk.startswith("mtp.")}
    if spec.backbone.tie_embeddings:
        got.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    misshaped = sorted(kk for kk in set(expected) & set(got) if expected[kk] != got[kk])
    if missing or unexpected or misshaped:
        parts = [f"{what} {len(v)}: " + ", ".join(hf._collapse(v)) for what, v in (("missing", missing), ("unexpected", unexpected)) if v]  # noqa: SLF001
        if misshaped:
            parts.append(f"mis-shaped {len(misshaped)}: " + ", ".join(f"{kk} {got[kk]} (expected {expected[kk]})" for kk in misshaped))
        raise ValueError(f"checkpoint does not match the Qwen3.5 spec (width {spec.backbone.width}, "
                         f"{spec.layer_types.count(LINEAR)} linear + {spec.layer_types.count(FULL)} full layers): "
                         + "; ".join(parts) + " — load it with the spec read from its own config.json (ckpts.qwen35.load)")


def from_hf(spec: Qwen35Spec, tensors: Mapping[str, Any], dtype: str = "float32") -> tuple[Decoder, qwen3_vl.Vision | None]:
    """(decoder, vision or None) from {HF name: array}; names and shapes are checked first."""
    prefix = text_prefix(tensors.keys())
    _check_names(spec, tensors, prefix)
    abstract = qwen35.abstract_decoder(spec, dtype)
    per_group = {kind: spec.group.count(kind) for kind in (LINEAR, FULL)}
    values: dict[tuple, dict[tuple[int, int], np.ndarray]] = {}  # (kind, leaf path) -> {(group, slot): array}
    rank = {LINEAR: 0, FULL: 0}
    for i, kind in enumerate(spec.layer_types):
        g, slot = divmod(rank[kind], per_group[kind])
        rank[kind] += 1
        for name, path, layout in (_LINEAR_ROWS if kind == LINEAR else _FULL_ROWS):
            arr = np.asarray(layout(np.asarray(tensors[f"{prefix}layers.{i}.{name}"]), spec))
            values.setdefault((kind,) + path, {})[(g, slot)] = arr

    def assemble(kind, tree):
        def leaf(p, want):
            names = (kind,) + tuple(q.name for q in p)
            if names in values:
                got = values[names]
            else:  # a stacked pair (gating: gate, up; kv: K, V): [..., 2, ...] from two HF tensors
                pair = [values[names + (sub,)] for sub in (0, 1)]
                got = {key: np.stack([pair[0][key], pair[1][key]]) for key in pair[0]}
            arr = np.stack([np.stack([got[(g, s)] for s in range(per_group[kind])]) for g in range(spec.num_groups)])
            if arr.shape != tuple(want.shape):  # a table/layout bug, not a user error
                raise AssertionError(f"{'.'.join(names)}: converted {arr.shape}, expected {want.shape}")
            return jnp.asarray(arr, dtype)
        return jax.tree_util.tree_map_with_path(leaf, tree)

    layers = qwen35.HybridLayers(linear=assemble(LINEAR, abstract.layers.linear), full=assemble(FULL, abstract.layers.full))
    decoder = Decoder(embedding=jnp.asarray(tensors[prefix + "embed_tokens.weight"], dtype), layers=layers,
                      final_norm=RMSNorm(scale=jnp.asarray(tensors[prefix + "norm.weight"], dtype)),
                      lm_head=None if spec.backbone.tie_embeddings else jnp.asarray(tensors["lm_head.weight"], dtype))
    vision = None
    if isinstance(spec.backbone.vision, Qwen3VisionSpec):
        twin = _vl_twin(spec)
        sub = {kk: (tensors[kk] if kk.startswith("model.visual.") else np.zeros(vv, np.float32))
               for kk, vv in hf.hf_shapes(twin).items()}
        _, vision = hf.from_hf(twin, sub, dtype)
    return decoder, vision


class Qwen35Checkpoint(NamedTuple):
    spec: Qwen35Spec
    decoder: Decoder
    vision: qwen3_vl.Vision | None
    config: dict  # config.json as read (token ids such as image_token_id live here)


def load(directory: str | Path, dtype: str = "float32", spec: Qwen35Spec | None = None) -> Qwen35Checkpoint:
    """Reads config.json and the safetensors of an HF Qwen3.5 directory (spec from config.json by default).

    config.json is held against the weights' header first (`check_config`), non-finite weights are refused
    naming the tensor (`limits.check_finite`); both raise one-line ValueErrors.
    """
    directory = Path(directory)
    cfg_path = directory / "config.json"
    config = limits.read_json(cfg_path) if cfg_path.exists() else {}
    tensors = read_checkpoint_tensors(directory)
    if spec is None:
        _unsupported(config.get("model_type") not in MODEL_TYPES, f"model_type {config.get('model_type')!r} (expected {MODEL_TYPES})")
        check_config(config, {k: v.shape for k, v in tensors.items()}, str(cfg_path))
        spec = spec_from_config(config, tensors.keys())
    limits.check_finite(tensors, str(directory))
    decoder, vision = from_hf(spec, tensors, dtype)
    return Qwen35Checkpoint(spec=spec, decoder=decoder, vision=vision, config=config)


def is_qwen35_dir(directory: str | Path) -> bool:
    """True for a directory holding safetensors and a Qwen3.5 config.json (`hf.is_qwen35`)."""
    directory = Path(directory)
    cfg = directory / "config.json"
    if not (cfg.is_file() and any((directory / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))):
        return False
    try:
        return hf.is_qwen35(limits.read_json(cfg))
    except (ValueError, OSError):
        return False
