"""Xiaomi-Robotics-0 (XR0) checkpoints in their released layout: config.json + safetensors -> `ModelSpec`, `ModelParams`.

A released XR0 directory is what `MiBoTForActionGeneration.save_pretrained` writes (the HF remote code
`modeling_mibot.py` / `configuration_mibot.py` shipped inside every checkpoint; the layout is described in
../shared/fixtures/xr0_tiny/README.md and docs/model_families.md):

    config.json   {"model_type": "mibot", "architectures": ["MiBoTForActionGeneration"],
                   "vlm_config": {text_config, vision_config, image_token_id, ...},   (a Qwen3-VL config)
                   "dit_config": {hidden_size, num_hidden_layers, head_dim, num_key_value_heads},
                   "state_dim", "state_length", "action_dim", "action_length"}
    *.safetensors vlm.*                  the Qwen3-VL weights under HF's names (`ckpts.hf`), tied lm_head absent
                  dit.layers.{i}.*       adaln_table [6, D], attn.qkv_proj (3D, D) + bias, attn.o_proj,
                                         attn.{q,k}_norm [H], mlp.{gate,up,down}_proj, 4 RMSNorms
                  state_projector.layers.{0,2}, action_projector.layers.{0,2}, action_output_layer.layers.{0,2},
                  t_embedder.mlp.{0,2}, t_projector.layers.0 (+ bias), sink.weight [1, D]

Every dimension comes from the files: the backbone from `vlm_config` (`hf.spec_from_config`), the DiT's
width, depth, head dim and cache KV heads from `dit_config`, its MLP width and time-feature width from
the tensors, N = D / head_dim heads (modeling_mibot views qkv as (3, D / head_dim, head_dim)), and DiT
layer i reads backbone layer L_vlm - L_dit + i. The horizon is not the config's `action_length` (the
pretraining horizon; the forward never reads it) but the robot's action mask: pass `action_mask`
[Ha, Ad] (the released processor's `get_action_mask(robot_type)`, std > 1e-5 per timestep and dim) or
`horizon`; with neither, the checkpoint's own mask is used when its config.json carries one
(`action_mask`: [Ha][Ad] of 0 / 1, `config_action_mask`), else `action_length` and an all-ones mask.
The released processor's per-robot statistics (from which `get_action_mask(robot_type)` derives the
mask) are not read here: their file layout is not known to this project.

Errors are one line: a directory of another family (a Qwen3-VL HF directory, a StarVLA directory) names
what it found; missing, unexpected and mis-shaped tensors are listed together (`hf.name_mismatches`).

Axes (`oxygen_jax.axes`, plus those of `models.heads`): D DiT width (Da), N heads, K KV heads, H head dim,
F MLP, Ha horizon, Ad action dim, Ds state dim, Dt time features, L layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.ckpts import hf, limits
from oxygen_jax.ckpts.safetensors import read_checkpoint_tensors
from oxygen_jax.models import heads as hd
from oxygen_jax.models.heads.joint import JointHead, JointKvSpec, JointLayers
from oxygen_jax.models.heads.parts import Linear, Mlp
from oxygen_jax.models.mot import ModelParams, ModelSpec

MODEL_TYPE = "mibot"
ARCHITECTURE = "MiBoTForActionGeneration"
NUM_STEPS = 5  # modeling_mibot `forward(..., num_steps=5)`
_VLM = "vlm."
_TIE = "vlm.lm_head.weight"


class XR0Checkpoint(NamedTuple):
    spec: ModelSpec
    params: ModelParams  # stacked layers (`mot.for_backend` lays them out)
    config: dict  # config.json as read


def read_config(directory: str | Path) -> dict:
    """config.json of an XR0 directory; a one-line ValueError when the directory is not one."""
    d = Path(directory)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        found = "config.yaml (a StarVLA checkpoint?)" if (d / "config.yaml").is_file() else "no config.json"
        raise ValueError(f"{d} is not an XR0 checkpoint: it has {found}; XR0 ships config.json with model_type "
                         f"{MODEL_TYPE!r} beside its safetensors")
    config = limits.read_json(cfg_path)
    if not isinstance(config, dict) or not is_xr0_config(config):
        config = config if isinstance(config, dict) else {}
        raise ValueError(f"{d} is not an XR0 checkpoint: config.json has model_type {config.get('model_type')!r} and "
                         f"architectures {config.get('architectures')} (XR0: {MODEL_TYPE!r}, {ARCHITECTURE}); "
                         "a Qwen3 / Qwen3-VL directory loads with ckpts.hf.load")
    for key in ("vlm_config", "dit_config", "state_dim", "action_dim"):
        if key not in config:
            raise ValueError(f"{d}/config.json: an XR0 config needs {key!r} (has {sorted(config)})")
    _check_sizes(config, str(cfg_path), caps=False)
    return config


def _check_sizes(config: Mapping, where: str, *, caps: bool = True) -> None:
    """Every size field of an XR0 config.json is an integer (within its cap, `ckpts.limits`, with `caps`:
    the fields `check_config` holds against the weights are capped after that comparison); one line naming it."""
    for key in ("vlm_config", "dit_config"):
        if not isinstance(config[key], Mapping):
            raise ValueError(f"{where}: {key} must be a JSON object, got {type(config[key]).__name__}")
    dit = config["dit_config"]
    fields = [("state_dim", config["state_dim"], limits.MAX_STATE_DIM, True),
              ("action_dim", config["action_dim"], limits.MAX_ACTION_DIM, True),
              ("action_length", config.get("action_length"), limits.MAX_HORIZON, False),
              ("state_length", config.get("state_length"), limits.MAX_HORIZON, False)]
    fields += [(f"dit_config.{key}", dit.get(key), cap, True) for key, cap in (
        ("hidden_size", limits.MAX_WIDTH), ("num_hidden_layers", limits.MAX_LAYERS), ("head_dim", limits.MAX_WIDTH),
        ("num_key_value_heads", limits.MAX_HEADS), ("intermediate_size", limits.MAX_WIDTH))]
    required = {"state_dim", "action_dim", "dit_config.hidden_size", "dit_config.num_hidden_layers", "dit_config.head_dim"}
    for field, value, cap, compared in fields:
        if value is not None or field in required:
            limits.int_field(value, field, where, cap=cap if caps or not compared else None)


def check_config(config: Mapping, shapes: Mapping[str, Any], where: str) -> None:
    """Holds an XR0 config.json against the weights' header before anything is built (`hf.check_config` for
    `vlm_config`; the DiT's depth, width, head dim, MLP width, state and action dims against its tensors).

    Raises:
      ValueError: one line naming `where`, the field, its value and what the weights hold.
    """
    hf.check_config(config["vlm_config"], {k[len(_VLM):]: v for k, v in shapes.items() if k.startswith(_VLM)}, where,
                    fields="vlm_config.")
    dit = config["dit_config"]
    hf._count_against(where, "dit_config.num_hidden_layers", int(dit["num_hidden_layers"]), shapes, "dit.layers.")  # noqa: SLF001
    rows = (("dit_config.hidden_size", dit.get("hidden_size"), "sink.weight", 1),
            ("dit_config.head_dim", dit.get("head_dim"), "dit.layers.0.attn.q_norm.weight", 0),
            ("dit_config.intermediate_size", dit.get("intermediate_size"), "dit.layers.0.mlp.gate_proj.weight", 0),
            ("state_dim", config["state_dim"], "state_projector.layers.0.weight", 1),
            ("action_dim", config["action_dim"], "action_projector.layers.0.weight", 1))
    for field, value, name, axis in rows:
        if value is not None:
            hf._against(where, field, int(value), shapes, name, axis)  # noqa: SLF001
    _check_sizes(config, where)  # the caps, after the comparisons that name both sides


def is_xr0_config(config: Mapping) -> bool:
    """True for a MiBoT config.json (`model_type` 'mibot' or the architecture `MiBoTForActionGeneration`)."""
    return config.get("model_type") == MODEL_TYPE or ARCHITECTURE in (config.get("architectures") or ())


def is_xr0_dir(path: str | Path) -> bool:
    """True for a directory holding an XR0 config.json (the tensors are checked when loading)."""
    p = Path(path) / "config.json"
    try:
        return p.is_file() and is_xr0_config(limits.read_json(p))
    except (OSError, ValueError, AttributeError):
        return False


def _mask_rows(action_mask) -> tuple[tuple[int, ...], ...]:
    m = np.asarray(action_mask)
    if m.ndim == 2 and (m.shape[0] > limits.MAX_HORIZON or m.shape[1] > limits.MAX_ACTION_DIM):
        raise ValueError(f"action_mask of shape {m.shape} is above the caps of {limits.MAX_HORIZON} steps x "
                         f"{limits.MAX_ACTION_DIM} dims (oxygen_jax.ckpts.limits)")
    if m.ndim != 2 or not np.all((m == 0) | (m == 1)):
        raise ValueError(f"action_mask must be [Ha, Ad] of 0 / 1 (the processor's get_action_mask for one robot), "
                         f"got shape {m.shape}")
    return tuple(tuple(int(v) for v in row) for row in m)


def config_action_mask(config: Mapping) -> np.ndarray | None:
    """float32 [Ha, Ad] of config.json's `action_mask` (one robot's mask), or None when it has none."""
    if config.get("action_mask") is None:
        return None
    try:
        m = np.asarray(config["action_mask"], np.float32)
    except (TypeError, ValueError):
        raise ValueError("config.json action_mask must be [Ha, action_dim] of 0 / 1 (a list of equal rows)") from None
    if m.ndim != 2 or m.shape[1] != int(config["action_dim"]):
        raise ValueError(f"config.json action_mask must be [Ha, action_dim = {config['action_dim']}] of 0 / 1, "
                         f"got shape {m.shape}")
    _mask_rows(m)
    return m


def head_spec(config: Mapping, tensors: Mapping[str, Any], vlm_depth: int, *, name: str = "xr0",
              horizon: int | None = None, action_mask=None, num_steps: int = NUM_STEPS) -> JointKvSpec:
    """The XR0 `JointKvSpec` of a config.json dict and the checkpoint's tensors (for the MLP / time widths).

    Raises:
      ValueError: a field the native model does not have (state_length != 1, width not a multiple of
        head_dim, a horizon that disagrees with the action mask).
    """
    dit = config["dit_config"]
    width, depth, head_dim = int(dit["hidden_size"]), int(dit["num_hidden_layers"]), int(dit["head_dim"])
    if width % head_dim:
        raise ValueError(f"dit_config.hidden_size {width} is not a multiple of head_dim {head_dim} (XR0 has D / head_dim heads)")
    if int(config.get("state_length", 1)) != 1:
        raise ValueError(f"state_length {config['state_length']} is not supported: the head has one state token (XR0 releases use 1)")
    if not 0 < depth <= vlm_depth:
        raise ValueError(f"dit_config.num_hidden_layers {depth} must be in [1, {vlm_depth}] (one VLM cache layer per DiT layer)")
    eps = float(dit.get("rms_norm_eps", 1e-6))
    if eps != 1e-6:
        raise ValueError(f"dit_config.rms_norm_eps {eps} is not supported (the DiT's RMSNorms use 1e-6)")
    gate = tensors.get("dit.layers.0.mlp.gate_proj.weight")
    mlp = int(dit.get("intermediate_size") or (np.shape(gate)[0] if gate is not None else 4 * width))
    temb = tensors.get("t_embedder.mlp.0.weight")
    time_dim = int(np.shape(temb)[1]) if temb is not None else 256
    action_dim = int(config["action_dim"])
    rows = None if action_mask is None else _mask_rows(action_mask)
    if rows is not None:
        if horizon is not None and horizon != len(rows):
            raise ValueError(f"horizon {horizon} disagrees with the action mask's {len(rows)} rows (the native horizon is its length)")
        horizon = len(rows)
    horizon = int(horizon if horizon is not None else config.get("action_length", 0))
    return JointKvSpec(
        name=name, width=width, depth=depth, num_heads=width // head_dim,
        num_kv_heads=int(dit.get("num_key_value_heads", width // head_dim)), head_dim=head_dim, mlp_dim=mlp,
        action_dim=action_dim, horizon=horizon, num_steps=num_steps, t_direction="0_to_1", time_input="continuous",
        time_scale=1000, time_embed_dim=time_dim, kv_layers=tuple(range(vlm_depth - depth, vlm_depth)), sink=True,
        state_dim=int(config["state_dim"]), suffix_mask="causal", action_mask=rows,
    )


def head_shapes(h: JointKvSpec) -> dict[str, tuple[int, ...]]:
    """Every native head tensor name with its torch-layout shape."""
    d, f, a, s, hd_ = h.width, h.mlp_dim, h.action_dim, h.state_dim, h.head_dim
    out = {"sink.weight": (1, d), "state_projector.layers.0.weight": (d, s), "state_projector.layers.2.weight": (d, d),
           "action_projector.layers.0.weight": (d, a), "action_projector.layers.2.weight": (d, d),
           "action_output_layer.layers.0.weight": (a, d), "action_output_layer.layers.2.weight": (a, a),
           "t_embedder.mlp.0.weight": (d, h.time_embed_dim), "t_embedder.mlp.2.weight": (d, d),
           "t_projector.layers.0.weight": (6 * d, d), "t_projector.layers.0.bias": (6 * d,)}
    for i in range(h.depth):
        p = f"dit.layers.{i}."
        out |= {p + "adaln_table": (6, d), p + "attn.qkv_proj.weight": (3 * d, d), p + "attn.qkv_proj.bias": (3 * d,),
                p + "attn.o_proj.weight": (d, d), p + "attn.q_norm.weight": (hd_,), p + "attn.k_norm.weight": (hd_,),
                p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)}
        out |= {p + f"{n}_layernorm.weight": (d,) for n in ("input", "middle", "post", "final")}
    return out


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """{native name: shape} of a one-head XR0 `spec`: `vlm.` + the Qwen3-VL names, then the head's."""
    return {_VLM + k: v for k, v in hf.hf_shapes(spec.backbone).items()} | head_shapes(spec.heads[0])


def check_tensors(spec: ModelSpec, tensors: Mapping[str, Any], where: str = "checkpoint") -> None:
    """One-line ValueError listing every missing, unexpected and mis-shaped tensor (a stored tied
    `vlm.lm_head.weight` is ignored)."""
    got = {k: tuple(np.shape(v)) for k, v in tensors.items() if not (k == _TIE and spec.backbone.tie_embeddings)}
    parts = hf.name_mismatches(expected_shapes(spec), got)
    if parts:
        h = spec.heads[0]
        raise ValueError(f"{where} does not match the XR0 layout of its config.json (VLM {spec.backbone.width} x "
                         f"{spec.backbone.depth}, DiT {h.width} x {h.depth}): " + "; ".join(parts))


def _lin_t(w) -> np.ndarray:
    return np.asarray(w, np.float32).T  # torch (out, in) -> [in, out]


def _mlp(t: Mapping[str, Any], prefix: str) -> Mlp:
    return Mlp(fc1=Linear(kernel=_lin_t(t[prefix + "0.weight"])), fc2=Linear(kernel=_lin_t(t[prefix + "2.weight"])))


def _layer(t: Mapping[str, Any], h: JointKvSpec, i: int) -> dict[str, Any]:
    p, d, n, hdim = f"dit.layers.{i}.", h.width, h.num_heads, h.head_dim
    qkv = np.asarray(t[p + "attn.qkv_proj.weight"], np.float32).reshape(3, n, hdim, d)  # .view(B, Q, 3, N, H)
    bias = np.asarray(t[p + "attn.qkv_proj.bias"], np.float32).reshape(3, n, hdim)
    return dict(
        q_kernel=qkv[0].transpose(2, 0, 1), q_bias=bias[0], kv_kernel=qkv[1:].transpose(0, 3, 1, 2), kv_bias=bias[1:],
        out=_lin_t(t[p + "attn.o_proj.weight"]).reshape(n, hdim, d), q_norm=np.asarray(t[p + "attn.q_norm.weight"]),
        k_norm=np.asarray(t[p + "attn.k_norm.weight"]),
        norms=np.stack([np.asarray(t[p + f"{x}_layernorm.weight"]) for x in ("input", "middle", "post", "final")]),
        gating=np.stack([_lin_t(t[p + "mlp.gate_proj.weight"]), _lin_t(t[p + "mlp.up_proj.weight"])]),
        linear=_lin_t(t[p + "mlp.down_proj.weight"]), adaln=np.asarray(t[p + "adaln_table"]),
    )


def head_from_native(h: JointKvSpec, tensors: Mapping[str, Any], dtype: str = "float32") -> JointHead:
    """The `JointHead` (stacked layers) of the native head tensors; shapes are checked by `check_tensors`
    first and the result against `heads.abstract_head`."""
    per = [_layer(tensors, h, i) for i in range(h.depth)]
    st = {k: np.stack([p[k] for p in per]) for k in per[0]}
    d = h.width
    tproj = np.asarray(tensors["t_projector.layers.0.weight"], np.float32)
    head = JointHead(
        time_mlp=_mlp(tensors, "t_embedder.mlp."),
        time_proj=Linear(kernel=tproj.T.reshape(d, 6, d), bias=np.asarray(tensors["t_projector.layers.0.bias"]).reshape(6, d)),
        sink=np.asarray(tensors["sink.weight"]), state_in=_mlp(tensors, "state_projector.layers."),
        action_in=_mlp(tensors, "action_projector.layers."), action_out=_mlp(tensors, "action_output_layer.layers."),
        layers=JointLayers(q=Linear(kernel=st["q_kernel"], bias=st["q_bias"]),
                           kv=Linear(kernel=st["kv_kernel"], bias=st["kv_bias"]), out=st["out"], q_norm=st["q_norm"],
                           k_norm=st["k_norm"], norms=st["norms"], gating=st["gating"], linear=st["linear"],
                           adaln=st["adaln"]),
    )
    want = hd.abstract_head(h, dtype)
    bad = [jax.tree_util.keystr(p) for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(head), jax.tree.leaves(want))
           if tuple(np.shape(a)) != tuple(b.shape)]
    if bad or jax.tree.structure(head) != jax.tree.structure(want):  # a table bug, not a user error
        raise AssertionError(f"XR0 head conversion does not fit heads.abstract_head: {bad or 'tree structure'}")
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), head)


def model_spec(config: Mapping, tensors: Mapping[str, Any], *, name: str = "xr0", horizon: int | None = None,
               action_mask=None, num_steps: int = NUM_STEPS, language: bool = False) -> ModelSpec:
    """The one-head `ModelSpec` of an XR0 config.json and its tensors (see the module docstring)."""
    vlm_config = config["vlm_config"]
    vlm_names = [k[len(_VLM):] for k in tensors if k.startswith(_VLM)]
    # The release ran on transformers 4.57.1; the DiT reads K/V only, which both hidden-state
    # conventions share, but the spec records the version (`models.hidden_states`).
    backbone = hf.spec_from_config(vlm_config, vlm_names).replace(hidden_states="transformers_4_57")
    head = head_spec(config, tensors, backbone.depth, name=name, horizon=horizon, action_mask=action_mask,
                     num_steps=num_steps)
    return ModelSpec(backbone=backbone, heads=(head,), language=language, image_token_id=vlm_config.get("image_token_id"))


def from_native(spec: ModelSpec, tensors: Mapping[str, Any], dtype: str = "float32", where: str = "checkpoint") -> ModelParams:
    """`ModelParams` (stacked layers) of a one-head XR0 `spec` from {native name: array}; names and shapes first."""
    check_tensors(spec, tensors, where)
    vlm = {k[len(_VLM):]: v for k, v in tensors.items() if k.startswith(_VLM) and k != _TIE}
    decoder, vision = hf.from_hf(spec.backbone, vlm, dtype)
    h = spec.heads[0]
    return ModelParams(decoder=decoder, vision=vision, heads={h.name: head_from_native(h, tensors, dtype)})


def load(directory: str | Path, dtype: str = "float32", *, name: str = "xr0", horizon: int | None = None,
         action_mask=None, num_steps: int = NUM_STEPS, language: bool = False) -> XR0Checkpoint:
    """Reads config.json and the safetensors of a released XR0 directory.

    Args:
      name: the head's name in the model.
      horizon / action_mask: the robot's chunk (see the module docstring); default config.json's
        `action_mask`, else `action_length` and all ones.
      num_steps: Euler steps (native default 5).
      language: keep every backbone layer's K/V for a language decoder on the same prefix.
    Raises:
      ValueError: not an XR0 directory, a size above its cap (`ckpts.limits`), a config.json the weights'
        header contradicts (checked before anything is built), tensors that do not fit it, or non-finite
        weights (one line each, naming the file and the field or tensor).
    """
    d = Path(directory)
    config = read_config(d)
    if action_mask is None and horizon is None:
        try:
            action_mask = config_action_mask(config)
        except ValueError as e:
            raise ValueError(f"{d}: {e}") from None
    if horizon is not None:
        limits.int_field(horizon, "horizon", str(d), cap=limits.MAX_HORIZON)
    limits.int_field(num_steps, "num_steps", str(d), cap=limits.MAX_STEPS)
    tensors = read_checkpoint_tensors(d)
    check_config(config, {k: v.shape for k, v in tensors.items()}, str(d / "config.json"))
    spec = model_spec(config, tensors, name=name, horizon=horizon, action_mask=action_mask, num_steps=num_steps,
                      language=language)
    limits.check_finite(tensors, str(d))
    return XR0Checkpoint(spec=spec, params=from_native(spec, tensors, dtype, where=str(d)), config=config)


def robot_action_mask(active_dims: Sequence[int] | int, horizon: int, action_dim: int) -> np.ndarray:
    """float32 [Ha, Ad]: 1 on the robot's dims (the first `active_dims` if an int), 0 on the padding dims."""
    m = np.zeros((horizon, action_dim), np.float32)
    if isinstance(active_dims, int):
        m[:, :active_dims] = 1
    else:
        m[:, list(active_dims)] = 1
    return m
