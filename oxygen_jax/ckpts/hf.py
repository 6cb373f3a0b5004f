"""Hugging Face Qwen3 / Qwen3-VL checkpoints: config.json -> spec, HF names <-> pytrees.

Everything is derived from the checkpoint directory: `config.json` gives the `BackboneSpec`
(`spec_from_config`), the safetensors (`ckpts.safetensors`) give the weights. `_ENTRIES` is the
one table of HF names: each row names an HF tensor (with `{i}` for a layer / ViT block and `{j}`
for a DeepStack merger), the leaf of `backbone.Decoder` / `qwen3_vl.Vision` it fills, and the layout change
between them (HF linears are torch `(out, in)`; ours are `[in, out]` with heads split). Loading,
export (`to_hf`) and the expected names and shapes (`hf_shapes`) all come from it, and every
converted array is checked against `backbone.abstract_decoder` / `qwen3_vl.abstract_vision`.

A checkpoint that does not fit the spec (another family, other dims) fails with one line naming
every missing, unexpected and mis-shaped tensor (layer indices collapsed to `{0..N}`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.ckpts import limits
from oxygen_jax.ckpts.safetensors import read_checkpoint_tensors
from oxygen_jax.models import backbone
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.backbone import BackboneSpec, Decoder, Qwen3VisionSpec, RopeSpec
from oxygen_jax.nn.layers import stack_layers

# --------------------------------------------------------------------------------------------------
# config.json -> spec

HFFamily = Literal["qwen3", "qwen3_vl"]
_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3Model": "qwen3", "Qwen3VLForConditionalGeneration": "qwen3_vl",
                  "Qwen3VLModel": "qwen3_vl"}


def detect_family(config: Mapping | None, names=()) -> HFFamily:
    """The checkpoint family from config.json (`model_type`, else `architectures`) and the tensor names.

    Vision tensors (`model.visual.*`) mean Qwen3-VL. The two sources must agree when both speak. A Qwen3.5
    checkpoint (`is_qwen35`; it has `model.visual.*` too) is refused, naming its own loader.
    """
    names = list(names)
    if is_qwen35(config, names):
        raise ValueError("a Qwen3.5 checkpoint (model_type 'qwen3_5' / linear_attention layers), not Qwen3 / Qwen3-VL: "
                         "load it with oxygen_jax.ckpts.qwen35.load")
    from_names = None
    if names:
        from_names = "qwen3_vl" if any(n.startswith("model.visual.") for n in names) else (
            "qwen3" if any(n.startswith("model.layers.") for n in names) else None)
    from_config = None
    if config:
        mt = config.get("model_type")
        from_config = mt if mt in ("qwen3", "qwen3_vl") else None
        if from_config is None:
            found = {_ARCHITECTURES[a] for a in config.get("architectures") or () if a in _ARCHITECTURES}
            from_config = found.pop() if len(found) == 1 else None
    if from_config and from_names and from_config != from_names:
        raise ValueError(f"config.json says {from_config!r} but the tensors look like {from_names!r} "
                         f"({'with' if from_names == 'qwen3_vl' else 'without'} model.visual.* weights)")
    family = from_config or from_names
    if family is None:
        raise ValueError("not a Qwen3 / Qwen3-VL checkpoint: config.json model_type is "
                         f"{(config or {}).get('model_type')!r} and no model.layers.* or model.visual.* tensors")
    return family


def is_qwen35(config: Mapping | None, names=()) -> bool:
    """True for a Qwen3.5 checkpoint: `model_type` 'qwen3_5' / 'qwen3_5_text', a 'linear_attention' entry in
    `layer_types`, or Gated DeltaNet tensors (`.linear_attn.`) among the names."""
    text = (config or {}).get("text_config") or config or {}
    return ((config or {}).get("model_type") in ("qwen3_5", "qwen3_5_text") or "linear_attention" in (text.get("layer_types") or ())
            or any(".linear_attn." in n for n in names))


def _rope_params(text: Mapping) -> dict:
    """rope_parameters (transformers 5) merged over the older rope_theta / rope_scaling fields."""
    params = dict(text.get("rope_scaling") or {})
    if "rope_theta" in text:
        params["rope_theta"] = text["rope_theta"]
    params.update(text.get("rope_parameters") or {})
    return params


def _unsupported(cond: bool, what: str) -> None:
    if cond:
        raise ValueError(f"unsupported checkpoint: {what}")


def spec_from_config(config: Mapping, names=()) -> BackboneSpec:
    """A `BackboneSpec` from an HF config.json dict (Qwen3 or Qwen3-VL); `names` settle a missing tie flag."""
    family = detect_family(config, names)
    text = config["text_config"] if family == "qwen3_vl" else config
    _unsupported(text.get("hidden_act", "silu") != "silu", f"hidden_act {text.get('hidden_act')!r} (Qwen3 uses 'silu')")
    _unsupported(bool(text.get("attention_bias", False)), "attention_bias=true")
    _unsupported(bool(text.get("use_sliding_window", False)), "use_sliding_window=true")
    _unsupported(any(t != "full_attention" for t in text.get("layer_types") or ()), f"layer_types {text.get('layer_types')}")
    rope = _rope_params(text)
    _unsupported(rope.get("rope_type", "default") != "default", f"rope_type {rope.get('rope_type')!r}")
    theta = float(rope.get("rope_theta", 10_000.0))
    if family == "qwen3_vl":
        _unsupported(not rope.get("mrope_interleaved", False), "non-interleaved M-RoPE (Qwen2-VL style); Qwen3-VL interleaves")
        rope_spec = RopeSpec(theta=theta, kind="mrope_interleaved", mrope_section=tuple(int(s) for s in rope["mrope_section"]))
    else:
        rope_spec = RopeSpec(theta=theta)
    ties = [c["tie_word_embeddings"] for c in (config, text) if "tie_word_embeddings" in c]
    if len(set(ties)) > 1:
        raise ValueError(f"config.json disagrees with itself on tie_word_embeddings: {ties}")
    tie = bool(ties[0]) if ties else ("lm_head.weight" not in set(names))
    heads = int(text["num_attention_heads"])
    vision = None
    if family == "qwen3_vl":
        v = config["vision_config"]
        _unsupported(v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh", f"vision hidden_act {v.get('hidden_act')!r}")
        vrope = v.get("rope_parameters") or {}
        vision = Qwen3VisionSpec(
            depth=int(v["depth"]), width=int(v["hidden_size"]), num_heads=int(v["num_heads"]),
            mlp_dim=int(v["intermediate_size"]), out_width=int(v["out_hidden_size"]),
            num_position_embeddings=int(v["num_position_embeddings"]),
            deepstack_layers=tuple(int(i) for i in v.get("deepstack_visual_indexes") or ()),
            patch_size=int(v.get("patch_size", 16)), temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)), in_channels=int(v.get("in_channels", 3)),
            rope_theta=float(vrope.get("rope_theta", 10_000.0)),
        )
    return BackboneSpec(
        family=family, width=int(text["hidden_size"]), depth=int(text["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads", heads)),
        head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads), mlp_dim=int(text["intermediate_size"]),
        vocab_size=int(text["vocab_size"]), mlp="swiglu", norm_plus_one=False, qk_norm=True, rope=rope_spec,
        embed_scale=False, tie_embeddings=tie, prefix_attention="causal", norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        vision=vision,
    )


def _indices(shapes: Mapping[str, Any], prefix: str) -> list[int]:
    """The distinct integers i of the names `prefix` + "{i}." + ..., sorted."""
    found = {int(m.group(1)) for k in shapes if k.startswith(prefix) and (m := re.match(r"(\d+)\.", k[len(prefix):]))}
    return sorted(found)


def _against(where: str, field: str, value: int, shapes: Mapping[str, Any], name: str, axis: int) -> None:
    if name in shapes and len(shapes[name]) > axis and int(shapes[name][axis]) != value:
        raise ValueError(f"{where}: {field} is {value} but the weights' {name} has {shapes[name][axis]} there "
                         f"(shape {tuple(shapes[name])}); the config is not this checkpoint's")


def _count_against(where: str, field: str, value: int, shapes: Mapping[str, Any], prefix: str) -> None:
    got = _indices(shapes, prefix)
    if len(got) != value:
        held = f"{len(got)} ({prefix}{_braced(got)}.*)" if got else f"none ({prefix}*)"
        raise ValueError(f"{where}: {field} is {value} but the weights hold {held}; the config is not this checkpoint's")


def _braced(values: list[int]) -> str:
    """{0..3} for 0, 1, 2, 3; {0,2} for 0, 2; {5} for 5 (the collapsed form of `name_mismatches`)."""
    return "{" + _span(values).strip("{}") + "}"


def check_config(config: Mapping, shapes: Mapping[str, Any], where: str, *, fields: str = "") -> None:
    """Checks an HF Qwen3 / Qwen3-VL / Qwen3.5 config.json against the weights' header before a spec is built.

    Every size field the spec reads must be an integer within its cap (`ckpts.limits`), and the layer and
    block counts and the main widths must be what the tensor names and shapes say, so a config that claims a
    million layers costs microseconds, not a million-layer table of names.

    Args:
      config: the config.json dict (`text_config` / `vision_config`, or a flat text config).
      shapes: {HF tensor name: shape} (a safetensors header; `read_checkpoint_tensors` views nothing yet).
      where: the config file, for messages; `fields`: where `config` sits inside it (e.g. "vlm_config.").
    Raises:
      ValueError: one line naming the file, the field, its value and what the weights hold.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: {fields or 'the config'} must be a JSON object, got {type(config).__name__}")
    text_key = "text_config" if isinstance(config.get("text_config"), Mapping) else None
    text = config[text_key] if text_key else config
    tf = f"{fields}{text_key}." if text_key else fields
    names = list(shapes)
    tp = next((p for p in ("model.language_model.", "model.") if any(n.startswith(p + "layers.") for n in names)), "model.")

    caps: list[tuple[int, str, int]] = []  # applied after the comparisons, which name both sides

    def need(d, key, f, cap):
        if d.get(key) is None:
            raise ValueError(f"{where}: {f}{key} is missing (a Qwen config needs it)")
        value = limits.int_field(d[key], f + key, where, cap=None)
        caps.append((value, f + key, cap))
        return value

    depth = need(text, "num_hidden_layers", tf, limits.MAX_LAYERS)
    _count_against(where, f"{tf}num_hidden_layers", depth, shapes, tp + "layers.")
    width, vocab = need(text, "hidden_size", tf, limits.MAX_WIDTH), need(text, "vocab_size", tf, limits.MAX_VOCAB)
    _against(where, f"{tf}hidden_size", width, shapes, tp + "embed_tokens.weight", 1)
    _against(where, f"{tf}vocab_size", vocab, shapes, tp + "embed_tokens.weight", 0)
    _against(where, f"{tf}intermediate_size", need(text, "intermediate_size", tf, limits.MAX_WIDTH), shapes,
             tp + "layers.0.mlp.gate_proj.weight", 0)
    for key in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
        if text.get(key) is not None or key == "num_attention_heads":
            need(text, key, tf, limits.MAX_HEADS)
    for key in ("head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
        if text.get(key) is not None:
            need(text, key, tf, limits.MAX_WIDTH)
    vision = config.get("vision_config")
    if vision:
        _check_vision(vision, shapes, where, fields, need)
    for value, field, cap in caps:
        limits.int_field(value, field, where, cap=cap)


def _check_vision(vision, shapes: Mapping[str, Any], where: str, fields: str, need: Callable) -> None:
    names = list(shapes)
    vf, vp = f"{fields}vision_config.", "model.visual."
    if not isinstance(vision, Mapping):
        raise ValueError(f"{where}: {vf[:-1]} must be a JSON object, got {type(vision).__name__}")
    vdepth = need(vision, "depth", vf, limits.MAX_LAYERS)
    _count_against(where, f"{vf}depth", vdepth, shapes, vp + "blocks.")
    _against(where, f"{vf}hidden_size", need(vision, "hidden_size", vf, limits.MAX_WIDTH), shapes,
             vp + "blocks.0.norm1.weight", 0)
    _against(where, f"{vf}intermediate_size", need(vision, "intermediate_size", vf, limits.MAX_WIDTH), shapes,
             vp + "blocks.0.mlp.linear_fc1.weight", 0)
    need(vision, "num_heads", vf, limits.MAX_HEADS)
    _against(where, f"{vf}out_hidden_size", need(vision, "out_hidden_size", vf, limits.MAX_WIDTH), shapes,
             vp + "merger.linear_fc2.weight", 0)
    _against(where, f"{vf}num_position_embeddings", need(vision, "num_position_embeddings", vf, limits.MAX_WIDTH),
             shapes, vp + "pos_embed.weight", 0)
    patch = vp + "patch_embed.proj.weight"
    for key, axis in (("in_channels", 1), ("temporal_patch_size", 2), ("patch_size", 3)):
        if vision.get(key) is not None:
            _against(where, f"{vf}{key}", need(vision, key, vf, limits.MAX_WIDTH), shapes, patch, axis)
    if vision.get("spatial_merge_size") is not None:
        need(vision, "spatial_merge_size", vf, limits.MAX_WIDTH)
    deep = vision.get("deepstack_visual_indexes") or []
    if not isinstance(deep, list) or len(deep) > limits.MAX_LAYERS:
        raise ValueError(f"{where}: {vf}deepstack_visual_indexes must be a list of at most {limits.MAX_LAYERS} block indices")
    for i in deep:
        limits.int_field(i, f"{vf}deepstack_visual_indexes entry", where, cap=min(vdepth, limits.MAX_LAYERS) - 1, low=0)
    if any(n.startswith(vp) for n in names):
        _count_against(where, f"{vf}deepstack_visual_indexes (length)", len(deep), shapes, vp + "deepstack_merger_list.")


def config_from_spec(spec: BackboneSpec, **extra) -> dict:
    """An HF config.json dict (transformers 5 field names) for a Qwen3 / Qwen3-VL `spec`; inverse of
    `spec_from_config`. `extra` adds top-level fields (e.g. `image_token_id` for Qwen3-VL)."""
    _require_family(spec)
    rope: dict[str, Any] = {"rope_theta": spec.rope.theta, "rope_type": "default"}
    if spec.rope.kind == "mrope_interleaved":
        rope.update(mrope_interleaved=True, mrope_section=list(spec.rope.mrope_section))
    text = {
        "hidden_size": spec.width, "num_hidden_layers": spec.depth, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "intermediate_size": spec.mlp_dim,
        "vocab_size": spec.vocab_size, "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": spec.norm_eps,
        "rope_parameters": rope, "tie_word_embeddings": spec.tie_embeddings,
    }
    if spec.family == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **text, **extra}
    v = spec.vision
    vision = {
        "model_type": "qwen3_vl_vision", "depth": v.depth, "hidden_size": v.width, "num_heads": v.num_heads,
        "intermediate_size": v.mlp_dim, "out_hidden_size": v.out_width, "num_position_embeddings": v.num_position_embeddings,
        "deepstack_visual_indexes": list(v.deepstack_layers), "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size, "spatial_merge_size": v.spatial_merge_size,
        "in_channels": v.in_channels, "hidden_act": "gelu_pytorch_tanh",
        "rope_parameters": {"rope_theta": v.rope_theta, "rope_type": "axial"},
    }
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "text_config": {"model_type": "qwen3_vl_text", **text}, "vision_config": vision,
            "tie_word_embeddings": spec.tie_embeddings, **extra}


def _require_family(spec: BackboneSpec) -> None:
    if spec.family not in ("qwen3", "qwen3_vl") or (spec.family == "qwen3_vl") != isinstance(spec.vision, Qwen3VisionSpec):
        raise ValueError(f"HF Qwen checkpoints hold family 'qwen3' (no vision) or 'qwen3_vl' (Qwen3-VL ViT), got "
                         f"{spec.family!r} with vision {type(spec.vision).__name__}")
    maths = dict(mlp=spec.mlp, norm_plus_one=spec.norm_plus_one, qk_norm=spec.qk_norm, embed_scale=spec.embed_scale)
    if maths != dict(mlp="swiglu", norm_plus_one=False, qk_norm=True, embed_scale=False):
        raise ValueError(f"HF Qwen3 weights need mlp='swiglu', norm_plus_one=False, qk_norm=True, embed_scale=False; the spec has {maths}")


# --------------------------------------------------------------------------------------------------
# The name table


class _Layout(NamedTuple):
    to_ours: Callable  # (hf array, spec) -> our leaf slice
    to_hf: Callable  # (our leaf slice, spec) -> hf array


_SAME = _Layout(lambda w, s: w, lambda w, s: w)
_LINEAR = _Layout(lambda w, s: w.T, lambda w, s: w.T)  # torch (out, in) <-> [in, out]


def _heads_in(n: Callable) -> _Layout:  # (n*H, D) <-> [n, D, H]
    return _Layout(lambda w, s: w.reshape(n(s), s.head_dim, -1).transpose(0, 2, 1),
                   lambda w, s: w.transpose(0, 2, 1).reshape(n(s) * s.head_dim, -1))


_HEADS_OUT = _Layout(lambda w, s: w.T.reshape(s.num_heads, s.head_dim, -1),  # (D, N*H) <-> [N, H, D]
                     lambda w, s: w.reshape(s.num_heads * s.head_dim, -1).T)
_QKV = _Layout(lambda w, s: w.reshape(3, s.vision.num_heads, s.vision.head_dim, -1).transpose(3, 0, 1, 2),  # (3W, W) <-> [W, 3, Nv, Hv]
               lambda w, s: w.transpose(1, 2, 3, 0).reshape(3 * s.vision.width, -1))
_QKV_BIAS = _Layout(lambda w, s: w.reshape(3, s.vision.num_heads, s.vision.head_dim), lambda w, s: w.reshape(-1))
_PROJ = _Layout(lambda w, s: w.T.reshape(s.vision.num_heads, s.vision.head_dim, -1),  # (W, W) <-> [Nv, Hv, W]
                lambda w, s: w.reshape(s.vision.width, -1).T)
_PATCH = _Layout(lambda w, s: w.reshape(w.shape[0], -1).T,  # Conv3d (W, C, Tp, P, P) <-> [Pd, W]
                 lambda w, s: w.T.reshape(-1, s.vision.in_channels, s.vision.temporal_patch_size, s.vision.patch_size, s.vision.patch_size))


class _Entry(NamedTuple):
    hf: str  # name after the family prefix; {i} layer or ViT block, {j} DeepStack merger
    part: Literal["text", "vision", "head"]
    attr: tuple[str, ...]  # leaf path in Decoder ("text", "head") or Vision ("vision")
    sub: int | None  # index on the axis after the stacking axis (kv: 0 = K, 1 = V; gating: 0 = gate, 1 = up)
    layout: _Layout


def _text_entries() -> list[_Entry]:
    lyr = "layers.{i}."
    rows = [
        ("embed_tokens.weight", ("embedding",), None, _SAME),
        ("norm.weight", ("final_norm", "scale"), None, _SAME),
        (lyr + "self_attn.q_proj.weight", ("layers", "q"), None, _heads_in(lambda s: s.num_heads)),
        (lyr + "self_attn.k_proj.weight", ("layers", "kv"), 0, _heads_in(lambda s: s.num_kv_heads)),
        (lyr + "self_attn.v_proj.weight", ("layers", "kv"), 1, _heads_in(lambda s: s.num_kv_heads)),
        (lyr + "self_attn.o_proj.weight", ("layers", "out"), None, _HEADS_OUT),
        (lyr + "self_attn.q_norm.weight", ("layers", "q_norm", "scale"), None, _SAME),
        (lyr + "self_attn.k_norm.weight", ("layers", "k_norm", "scale"), None, _SAME),
        (lyr + "mlp.gate_proj.weight", ("layers", "gating"), 0, _LINEAR),
        (lyr + "mlp.up_proj.weight", ("layers", "gating"), 1, _LINEAR),
        (lyr + "mlp.down_proj.weight", ("layers", "linear"), None, _LINEAR),
        (lyr + "input_layernorm.weight", ("layers", "attn_norm", "scale"), None, _SAME),
        (lyr + "post_attention_layernorm.weight", ("layers", "ffw_norm", "scale"), None, _SAME),
    ]
    return [_Entry(n, "text", a, sub, lay) for n, a, sub, lay in rows]


def _vision_entries() -> list[_Entry]:
    blk = "blocks.{i}."
    rows = [
        ("patch_embed.proj.weight", ("patch", "kernel"), _PATCH), ("patch_embed.proj.bias", ("patch", "bias"), _SAME),
        ("pos_embed.weight", ("pos_embed",), _SAME),
        (blk + "norm1.weight", ("blocks", "ln1", "scale"), _SAME), (blk + "norm1.bias", ("blocks", "ln1", "bias"), _SAME),
        (blk + "norm2.weight", ("blocks", "ln2", "scale"), _SAME), (blk + "norm2.bias", ("blocks", "ln2", "bias"), _SAME),
        (blk + "attn.qkv.weight", ("blocks", "qkv", "kernel"), _QKV), (blk + "attn.qkv.bias", ("blocks", "qkv", "bias"), _QKV_BIAS),
        (blk + "attn.proj.weight", ("blocks", "out", "kernel"), _PROJ), (blk + "attn.proj.bias", ("blocks", "out", "bias"), _SAME),
        (blk + "mlp.linear_fc1.weight", ("blocks", "fc1", "kernel"), _LINEAR), (blk + "mlp.linear_fc1.bias", ("blocks", "fc1", "bias"), _SAME),
        (blk + "mlp.linear_fc2.weight", ("blocks", "fc2", "kernel"), _LINEAR), (blk + "mlp.linear_fc2.bias", ("blocks", "fc2", "bias"), _SAME),
    ]
    for hf, ours in (("merger.", "merger"), ("deepstack_merger_list.{j}.", "deepstack")):
        rows += [
            (hf + "norm.weight", (ours, "norm", "scale"), _SAME), (hf + "norm.bias", (ours, "norm", "bias"), _SAME),
            (hf + "linear_fc1.weight", (ours, "fc1", "kernel"), _LINEAR), (hf + "linear_fc1.bias", (ours, "fc1", "bias"), _SAME),
            (hf + "linear_fc2.weight", (ours, "fc2", "kernel"), _LINEAR), (hf + "linear_fc2.bias", (ours, "fc2", "bias"), _SAME),
        ]
    return [_Entry(n, "vision", a, None, lay) for n, a, lay in rows]


_ENTRIES: tuple[_Entry, ...] = tuple(
    _text_entries() + _vision_entries() + [_Entry("lm_head.weight", "head", ("lm_head",), None, _SAME)]
)
_PREFIX = {("qwen3", "text"): "model.", ("qwen3_vl", "text"): "model.language_model.", ("qwen3_vl", "vision"): "model.visual.",
           ("qwen3", "head"): "", ("qwen3_vl", "head"): ""}


def _abstract(spec: BackboneSpec, dtype: str) -> dict[str, Any]:
    trees = {"text": backbone.abstract_decoder(spec, dtype)}
    if isinstance(spec.vision, Qwen3VisionSpec):
        trees["vision"] = qwen3_vl.abstract_vision(spec.vision, dtype)
    return trees


def _leaf_paths(tree) -> dict[tuple[str, ...], Any]:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out[tuple(k.name for k in path)] = leaf
    return out


def _expand(entry: _Entry, spec: BackboneSpec) -> list[tuple[str, int | None]]:
    """(full HF name, stacking index) for every tensor of one table row under `spec`."""
    if entry.part == "head" and spec.tie_embeddings:
        return []
    if entry.part == "vision" and not isinstance(spec.vision, Qwen3VisionSpec):
        return []
    prefix = _PREFIX[(spec.family, entry.part)]
    if "{i}" in entry.hf:
        count = spec.depth if entry.part == "text" else spec.vision.depth
        return [(prefix + entry.hf.format(i=i), i) for i in range(count)]
    if "{j}" in entry.hf:
        return [(prefix + entry.hf.format(j=j), j) for j in range(len(spec.vision.deepstack_layers))]
    return [(prefix + entry.hf, None)]


def _part_of(entry: _Entry) -> str:
    return "vision" if entry.part == "vision" else "text"


def _slice_shape(leaf_shape: tuple[int, ...], index: int | None, sub: int | None) -> tuple[int, ...]:
    shape = leaf_shape[1:] if index is not None else leaf_shape
    return shape[1:] if sub is not None else shape


def hf_shapes(spec: BackboneSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name `spec` expects, with its HF-layout shape (derived, never allocated)."""
    _require_family(spec)
    trees = {k: _leaf_paths(t) for k, t in _abstract(spec, "float32").items()}
    out = {}
    for e in _ENTRIES:
        names = _expand(e, spec)
        if not names:
            continue
        ours = trees[_part_of(e)][e.attr]
        sds = jax.ShapeDtypeStruct(_slice_shape(ours.shape, names[0][1], e.sub), ours.dtype)
        shape = tuple(jax.eval_shape(lambda w, e=e: e.layout.to_hf(w, spec), sds).shape)  # the same for every layer
        out.update({name: shape for name, _ in names})
    return out


_INDEX = re.compile(r"(?<=[./])\d+(?=[./]|$)")  # an integer path component: layers.3.mlp -> 3


def _span(values: list[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    if values == list(range(values[0], values[-1] + 1)):
        return f"{{{values[0]}..{values[-1]}}}"
    return "{" + ",".join(map(str, values)) + "}"


def _collapse(names) -> list[str]:
    """Groups names that differ only in integer components: layers.0.x, layers.1.x -> layers.{0..1}.x."""
    groups: dict[str, list[list[int]]] = {}
    for n in names:
        groups.setdefault(_INDEX.sub("#", n), []).append([int(d) for d in _INDEX.findall(n)])
    out = []
    for key, rows in sorted(groups.items()):
        pieces = key.split("#")
        columns = [sorted(set(c)) for c in zip(*rows)]
        out.append(pieces[0] + "".join(_span(c) + p for c, p in zip(columns, pieces[1:])))
    return out


def name_mismatches(expected: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The missing, unexpected and mis-shaped names of `got` against `expected` ({name: shape}), as
    message parts with layer indices collapsed (`layers.{0..N}`); empty when they agree. Other
    checkpoint layouts built on these names (`ckpts.xr0`) report with it."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    misshaped = sorted(k for k in set(expected) & set(got) if tuple(expected[k]) != tuple(got[k]))
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: " + ", ".join(_collapse(missing)))
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: " + ", ".join(_collapse(unexpected)))
    if misshaped:
        parts.append(f"mis-shaped {len(misshaped)}: " + ", ".join(f"{k} {tuple(got[k])} (expected {tuple(expected[k])})"
                                                              for k in misshaped))
    return parts


def check_names(spec: BackboneSpec, tensors: Mapping[str, Any]) -> None:
    """Raises a one-line ValueError naming every missing, unexpected and mis-shaped tensor for `spec`.

    A tied spec ignores a stored `lm_head.weight` (HF saves it for some tied models).
    """
    expected = hf_shapes(spec)
    got = {k: tuple(np.shape(v)) for k, v in tensors.items()}
    if spec.tie_embeddings:
        got.pop("lm_head.weight", None)
    parts = name_mismatches(expected, got)
    if not parts:
        return
    raise ValueError(f"checkpoint does not match the {spec.family} spec (width {spec.width}, depth {spec.depth}): "
                     + "; ".join(parts) + " — load it with the spec of its own family (hf.load reads it from config.json)")


def from_hf(spec: BackboneSpec, tensors: Mapping[str, Any], dtype: str = "float32") -> tuple[Decoder, qwen3_vl.Vision | None]:
    """Builds (decoder, vision or None) from {HF name: array}; names and shapes are checked first."""
    check_names(spec, tensors)
    trees = _abstract(spec, dtype)
    values: dict[str, dict[tuple[str, ...], Any]] = {k: {} for k in trees}
    pieces: dict[tuple[str, tuple[str, ...]], dict[tuple[int | None, int | None], np.ndarray]] = {}
    for e in _ENTRIES:
        for name, index in _expand(e, spec):
            pieces.setdefault((_part_of(e), e.attr), {})[(index, e.sub)] = e.layout.to_ours(np.asarray(tensors[name]), spec)
    for (part, attr), got in pieces.items():
        subs = sorted({s for _, s in got}, key=lambda s: -1 if s is None else s)
        indices = sorted({i for i, _ in got}, key=lambda i: -1 if i is None else i)
        slices = [got[(i, None)] if subs == [None] else np.stack([got[(i, s)] for s in subs]) for i in indices]
        arr = slices[0] if indices == [None] else np.stack(slices)
        want = _leaf_paths(trees[part])[attr]
        if tuple(arr.shape) != tuple(want.shape):  # a table/layout bug, not a user error
            raise AssertionError(f"{part}.{'.'.join(attr)}: converted {arr.shape}, expected {want.shape}")
        values[part][attr] = jnp.asarray(arr, dtype)
    built = {part: jax.tree_util.tree_map_with_path(lambda p, _, part=part: values[part][tuple(k.name for k in p)], tree)
             for part, tree in trees.items()}
    return built["text"], built.get("vision")


def to_hf(spec: BackboneSpec, decoder: Decoder, vision: qwen3_vl.Vision | None = None) -> dict[str, np.ndarray]:
    """{HF name: numpy array in HF layout} of our weights (stacked layers); inverse of `from_hf`."""
    trees = {"text": _leaf_paths(_stacked(decoder))}
    if vision is not None:
        trees["vision"] = _leaf_paths(_stacked(vision))
    trees = {part: {attr: np.asarray(leaf) for attr, leaf in leaves.items()} for part, leaves in trees.items()}  # one copy each
    out = {}
    for e in _ENTRIES:
        if _part_of(e) not in trees:
            continue
        for name, index in _expand(e, spec):
            leaf = trees[_part_of(e)][e.attr]
            leaf = leaf[index] if index is not None else leaf
            leaf = leaf[e.sub] if e.sub is not None else leaf
            out[name] = np.ascontiguousarray(e.layout.to_hf(leaf, spec))
    return out


def _stacked(tree):
    return dataclasses.replace(tree, **{f: stack_layers(getattr(tree, f)) for f in ("layers", "blocks") if hasattr(tree, f)})


# --------------------------------------------------------------------------------------------------
# A checkpoint directory


class HFCheckpoint(NamedTuple):
    spec: BackboneSpec
    decoder: Decoder
    vision: qwen3_vl.Vision | None
    config: dict  # config.json as read (token ids such as image_token_id live here)


def load(directory: str | Path, dtype: str = "float32", spec: BackboneSpec | None = None) -> HFCheckpoint:
    """Reads config.json and the safetensors of an HF Qwen3 / Qwen3-VL directory.

    `spec` defaults to `spec_from_config`, after `check_config` has held config.json against the weights'
    header; passing another family's spec raises `check_names`' error. Non-finite weights are refused
    naming the tensor (`limits.check_finite`).
    """
    directory = Path(directory)
    cfg_path = directory / "config.json"
    config = limits.read_json(cfg_path) if cfg_path.exists() else {}
    tensors = read_checkpoint_tensors(directory)
    if spec is None:
        detect_family(config, tensors.keys())  # another family is named as such, before its fields are read
        check_config(config, {k: v.shape for k, v in tensors.items()}, str(cfg_path))
        spec = spec_from_config(config, tensors.keys())
    limits.check_finite(tensors, str(directory))
    decoder, vision = from_hf(spec, tensors, dtype)
    return HFCheckpoint(spec=spec, decoder=decoder, vision=vision, config=config)

