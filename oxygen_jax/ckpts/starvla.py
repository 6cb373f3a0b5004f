"""StarVLA checkpoints (QwenPI_v3, QwenGR00T): `model.state_dict()` + `config.yaml` -> `ModelSpec` + `ModelParams`.

What StarVLA saves (starVLA/starVLA @ 0ed0aad, `training/train_starvla.py`; ../shared/docs/starvla_native.md
section 3): `accelerator.get_state_dict(model)` as `<run>/final_model/model.safetensors` or
`<run>/checkpoints/steps_<N>_model.safetensors`, with `<run>/config.yaml` and `<run>/dataset_statistics.json`
beside them; `baseframework.from_pretrained(<file>)` reads `parents[1]/config.yaml`. Names:

    qwen_vl_interface.model.model.visual.*          the Qwen3-VL ViT     (HF names under `qwen_vl_interface.model.`)
    qwen_vl_interface.model.model.language_model.*  the Qwen3-VL text stack
    qwen_vl_interface.model.lm_head.weight          a stored copy of the tied embedding (ignored when tied)
    action_model.model.*                            the DiT: timestep_encoder, transformer_blocks.{i}, proj_out_{1,2}
    action_model.{action_encoder,action_decoder,state_encoder}.*, action_model.{future_tokens,position_embedding}.weight
    project_layers.{i}.{0,1}.*                      QwenPI_v3 only: LayerNorm + Linear per read hidden state

Accepted directories: a run directory (`config.yaml` + `final_model/` or `checkpoints/`), a flat one
(`config.yaml` + `model.safetensors`, as the shared fixtures are), or the path of the .safetensors file.
The base VLM's HF config (which StarVLA's `from_pretrained` loads through `framework.qwenvl.base_vlm`)
is `vlm_config.json` beside `config.yaml`, else `<base_vlm>/config.json` when `base_vlm` is a directory.

Every dimension comes from the files: the DiT width, depth, MLP width, time features, output width,
future tokens, positions, state and decoder widths from the tensor shapes, the horizon, action dim,
steps and bucket count from `config.yaml`, the attention heads as StarVLA derives them (QwenPI_v3:
`attention_head_dim`, default 64, and width / head_dim heads; GR00T: its `DiTConfig` table by
`action_model_type` (DiT-B 12 x 64, DiT-L 32 x 48; an added entry is read from a `meta.json`
`injected.dit_config_entry` next to the checkpoint, as the tiny fixture records it) overridden by
`diffusion_model_cfg`), the block pattern from `interleave_self_attention` (or its alias
`use_canonical_forward`; default: interleaved for GR00T, all-cross for QwenPI_v3), for any block count
(interleaved: block i self-attends when i is odd). QwenPI_v3 may have no `project_layers` (StarVLA makes
them identities when the DiT is as wide as the VLM). Weights StarVLA stores but never runs at inference
(QwenPI_v3's `state_encoder`, DiT `proj_out_*` and, interleaved, the self blocks' `project_layers`) are
accepted and listed in `StarVLACheckpoint.unused`. Both heads read the backbone's hidden states in the
transformers 4.57 convention, StarVLA's pin (`models.hidden_states`).

Errors are one line naming the file and what does not fit: another kind of directory (an HF or XR0
checkpoint), a framework other than the one asked for, or missing / unexpected / mis-shaped tensors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.ckpts import hf, limits
from oxygen_jax.ckpts.safetensors import _header, read_safetensors
from oxygen_jax.models import heads as hd
from oxygen_jax.models.heads.cross import (
    ActionEncoder, BlockPair, CrossBlocks, CrossHead, CrossHiddenSpec, CrossLastSpec, CrossSpec, HiddenProj, cross_blocks,
)
from oxygen_jax.models.heads.parts import Linear, Mlp
from oxygen_jax.models.mot import ModelParams, ModelSpec
from oxygen_jax.nn.layers import LayerNorm
from oxygen_jax.robots.normalize import check_statistics

FRAMEWORKS = ("QwenPI_v3", "QwenGR00T")
HEAD_NAMES = {"QwenPI_v3": "starvla_qwenpi_v3", "QwenGR00T": "gr00t"}
HIDDEN_STATES = "transformers_4_57"  # StarVLA's requirements.txt pins transformers 4.57.0
# GR00T_ActionHeader.DiTConfig @ 0ed0aad: the only source of a GR00T DiT's head count.
DIT_CONFIG = {"DiT-B": {"input_embedding_dim": 768, "attention_head_dim": 64, "num_attention_heads": 12},
              "DiT-L": {"input_embedding_dim": 1536, "attention_head_dim": 48, "num_attention_heads": 32}}
VLM = "qwen_vl_interface.model."
_AM = "action_model."


class StarVLACheckpoint(NamedTuple):
    spec: ModelSpec  # the backbone (hidden_states="transformers_4_57") + one head (+ language if asked)
    params: ModelParams  # stacked layers
    framework: str  # "QwenPI_v3" or "QwenGR00T"
    config: dict  # config.yaml as read
    vlm_config: dict  # the base VLM's HF config
    dataset_statistics: dict | None  # dataset_statistics.json ({dataset: {"action": {q01, q99, mask?}, ...}}), if present
    unused: tuple[str, ...]  # stored tensors StarVLA's inference never runs (collapsed names)
    files: dict  # {"weights", "config", "vlm_config", "dataset_statistics"}: the paths read


def _fail(path, msg: str):
    raise ValueError(f"{path}: {msg}")


# --------------------------------------------------------------------------------------------------
# Files


def _run_files(path: Path) -> tuple[Path, Path]:
    """(weights file, config.yaml) of a StarVLA checkpoint path; a one-line error for anything else."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"StarVLA checkpoint path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".safetensors":
            _fail(path, "StarVLA weights are read from a .safetensors file (a .pt state_dict: convert it with "
                        "safetensors.torch.save_file first)")
        for cfg in (path.parent / "config.yaml", path.parents[1] / "config.yaml"):
            if cfg.is_file():
                return path, cfg
        _fail(path, "no config.yaml beside it or in its run directory (StarVLA's from_pretrained reads parents[1]/config.yaml)")
    cfg = path / "config.yaml"
    if not cfg.is_file():
        kind = ("a Hugging Face checkpoint (config.json)" if (path / "config.json").is_file() else "no StarVLA run")
        _fail(path, f"not a StarVLA checkpoint: no config.yaml ({kind}); StarVLA runs hold config.yaml and "
                    "model.safetensors, final_model/model.safetensors or checkpoints/steps_<N>_model.safetensors")
    for cand in (path / "model.safetensors", path / "final_model" / "model.safetensors"):
        if cand.is_file():
            return cand, cfg
    steps = sorted(path.glob("checkpoints/steps_*_model.safetensors"),
                   key=lambda p: int(re.search(r"steps_(\d+)_", p.name).group(1)))
    if steps:
        return steps[-1], cfg
    _fail(path, "config.yaml found but no model.safetensors, final_model/model.safetensors or "
                "checkpoints/steps_<N>_model.safetensors")


def statistics_file(path) -> Path:
    """Where `load` reads a StarVLA checkpoint path's dataset_statistics.json (beside its config.yaml; it may
    not exist). Raises what `load` raises for a path that is not a StarVLA checkpoint."""
    return _run_files(Path(path))[1].parent / "dataset_statistics.json"


def read_yaml(path: Path) -> dict:
    """config.yaml as a dict: a regular file of at most `limits.MAX_CONFIG_BYTES`; one-line errors."""
    import yaml  # PyYAML (installed with flax / orbax-checkpoint)

    try:
        out = yaml.safe_load(limits.read_text(path))
    except yaml.YAMLError as e:
        _fail(path, f"config.yaml is not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(out, dict):
        _fail(path, "config.yaml is not a mapping")
    return out


def is_starvla(path) -> bool:
    """True for a directory (or .safetensors file) that `load` reads: config.yaml with a StarVLA
    `framework.name` and weights under `qwen_vl_interface.model.` (no tensors are read)."""
    try:
        weights, cfg = _run_files(Path(path))
        name = (read_yaml(cfg).get("framework") or {}).get("name")
        header, _ = _header(weights)
    except (ValueError, FileNotFoundError, OSError):
        return False
    return name is not None and any(k.startswith(VLM) for k in header)


def _vlm_config(path: Path, cfg: Mapping) -> tuple[dict, Path]:
    local = path.parent / "vlm_config.json"
    if local.exists():
        return limits.read_json(local), local
    base = Path(str(((cfg.get("framework") or {}).get("qwenvl") or {}).get("base_vlm", ""))).expanduser()
    if base.is_dir() and (base / "config.json").is_file():
        return limits.read_json(base / "config.json"), base / "config.json"
    _fail(path.parent, f"the base VLM's config is needed: put its HF config.json beside config.yaml as vlm_config.json, "
                       f"or make framework.qwenvl.base_vlm ({str(base)!r}) a directory with config.json")


# --------------------------------------------------------------------------------------------------
# config.yaml + shapes -> CrossSpec


def _cfg(d: Mapping, key: str, where: str, path):
    if key not in d or d[key] is None:
        _fail(path, f"config.yaml has no {where}.{key}")
    return d[key]


def _shape(tensors, name, path) -> tuple[int, ...]:
    if name not in tensors:
        _fail(path, f"missing tensor {name} (needed to read the head's dimensions)")
    return tuple(tensors[name].shape)


def _block_count(tensors) -> int:
    found = {int(m.group(1)) for k in tensors if (m := re.match(r"action_model\.model\.transformer_blocks\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


def _dit_heads(framework, am, dit, width: int, path) -> tuple[int, int]:
    """(heads, head_dim) of the DiT as StarVLA builds it (its width is heads x head_dim).

    QwenPI_v3 (`share_tools.populate_layerwise_dit_cfg`, which overrides any stored head count): head_dim =
    `attention_head_dim` (default 64), heads = width // head_dim. GR00T: `DiTConfig[action_model_type]`
    overridden key by key by `diffusion_model_cfg`.
    """
    if framework == "QwenPI_v3":
        head_dim = int(dit.get("attention_head_dim") or 64)
        return width // head_dim, head_dim
    kind = am.get("action_model_type")
    entry = DIT_CONFIG.get(kind)
    meta = path.parent / "meta.json"
    if entry is None and meta.is_file():  # a DiTConfig entry added next to StarVLA's table (the tiny fixtures)
        injected = (limits.read_json(meta).get("injected") or {}).get("dit_config_entry") or {}
        entry = injected.get(f"DiTConfig_{str(kind).replace('-', '_')}")
    merged = {**(entry or {}), **{k: v for k, v in dit.items() if v is not None}}
    if not (merged.get("num_attention_heads") and merged.get("attention_head_dim")):
        _fail(path, f"{framework}: action_model.action_model_type {kind!r} is not in StarVLA's DiTConfig table "
                    f"{sorted(DIT_CONFIG)} and diffusion_model_cfg has no num_attention_heads / attention_head_dim")
    return int(merged["num_attention_heads"]), int(merged["attention_head_dim"])


def _interleaved(framework: str, dit: Mapping) -> bool:
    """StarVLA's `DiT` block pattern switch: `interleave_self_attention` (its alias `use_canonical_forward`
    wins when set); the framework's default config when absent: QwenGR00T interleaves, QwenPI_v3 does not."""
    if dit.get("use_canonical_forward") is not None:
        return bool(dit["use_canonical_forward"])
    return bool(dit.get("interleave_self_attention", framework == "QwenGR00T"))


def check_config(framework: str, cfg: Mapping, shapes: Mapping[str, Any], path) -> None:
    """Holds config.yaml's head fields against the weights' header before anything is built: every size an
    integer within its cap (`ckpts.limits`), the DiT blocks (and QwenPI_v3's project_layers) numbered 0..n-1
    with n <= `limits.MAX_LAYERS`, `action_dim` the action encoder's input width, `action_horizon` at most
    the position table's rows. One-line ValueError naming the file and the field.
    """
    am = ((cfg.get("framework") or {}).get("action_model")) or {}
    dit = am.get("diffusion_model_cfg") or {}
    if not isinstance(am, Mapping) or not isinstance(dit, Mapping):
        _fail(path, "config.yaml framework.action_model (and its diffusion_model_cfg) must be mappings")
    where, f = str(path), "framework.action_model."
    for prefix in (_AM + "model.transformer_blocks.", "project_layers."):
        found = hf._indices(shapes, prefix)  # noqa: SLF001
        if len(found) > limits.MAX_LAYERS or found != list(range(len(found))):
            _fail(path, f"the weights number their {prefix}* {hf._braced(found[:8])}{'...' if len(found) > 8 else ''} "  # noqa: SLF001
                        f"({len(found)} blocks): expected 0..n-1 with n <= {limits.MAX_LAYERS}")
    action_dim = limits.int_field(_cfg(am, "action_dim", "framework.action_model", path), f + "action_dim", where, cap=None)
    hf._against(where, f + "action_dim", action_dim, shapes, _AM + "action_encoder.layer1.weight", 1)  # noqa: SLF001
    limits.int_field(action_dim, f + "action_dim", where, cap=limits.MAX_ACTION_DIM)
    horizon = limits.int_field(_cfg(am, "action_horizon", "framework.action_model", path), f + "action_horizon", where,
                               cap=limits.MAX_HORIZON)
    rows = shapes.get(_AM + "position_embedding.weight")
    if rows is not None and len(rows) and horizon > int(rows[0]):
        _fail(path, f"{f}action_horizon {horizon} is longer than the weights' position table "
                    f"({_AM}position_embedding.weight has {rows[0]} rows)")
    for key, cap in (("num_inference_timesteps", limits.MAX_STEPS), ("num_timestep_buckets", limits.MAX_TIME_BUCKETS)):
        if am.get(key) is not None:
            limits.int_field(am[key], f + key, where, cap=cap)
    for key, cap in (("num_attention_heads", limits.MAX_HEADS), ("attention_head_dim", limits.MAX_WIDTH)):
        if dit.get(key):
            limits.int_field(dit[key], f"{f}diffusion_model_cfg.{key}", where, cap=cap)


def head_spec(framework: str, cfg: Mapping, tensors: Mapping[str, Any], vlm_depth: int, vlm_width: int, path="") -> CrossSpec:
    """The `CrossSpec` of a StarVLA head from its config.yaml and the tensor shapes (nothing hard-wired).

    Any DiT depth, either block pattern (cross_self: block i self-attends when i is odd, 5 blocks = cross
    0, 2, 4), QwenPI_v3 with or without its per-layer projections (none when the DiT is as wide as the VLM).
    """
    fw = cfg.get("framework") or {}
    am = fw.get("action_model") or {}
    dit = am.get("diffusion_model_cfg") or {}
    d_fut, da = _shape(tensors, _AM + "future_tokens.weight", path)
    max_pos, _ = _shape(tensors, _AM + "position_embedding.weight", path)
    depth = _block_count(tensors)
    if not depth:
        _fail(path, "no action_model.model.transformer_blocks.* tensors: not a StarVLA DiT head")
    heads, head_dim = _dit_heads(framework, am, dit, da, path)
    q_width = _shape(tensors, _AM + "model.transformer_blocks.0.attn1.to_q.weight", path)[0]
    if heads * head_dim != q_width or q_width != da:
        _fail(path, f"{framework}: {heads} heads x {head_dim} do not fit to_q's width {q_width} and the DiT width {da}")
    mlp_dim = _shape(tensors, _AM + "model.transformer_blocks.0.ff.net.0.proj.weight", path)[0]
    time_dim = _shape(tensors, _AM + "model.timestep_encoder.timestep_embedder.linear_1.weight", path)[1]
    io_hidden = _shape(tensors, _AM + "action_decoder.layer1.weight", path)[0]
    action_dim = int(_cfg(am, "action_dim", "framework.action_model", path))
    horizon = int(_cfg(am, "action_horizon", "framework.action_model", path))
    if not am.get("add_pos_embed", True):
        _fail(path, "action_model.add_pos_embed: false is not implemented (both StarVLA heads add the position table)")
    if dit.get("positional_embeddings"):
        _fail(path, f"diffusion_model_cfg.positional_embeddings {dit['positional_embeddings']!r} is not implemented "
                    "(StarVLA's heads set it to null: the blocks add no position embedding of their own)")
    pattern = "cross_self" if _interleaved(framework, dit) and depth > 1 else "all_cross"  # 1 block: cross either way
    common = dict(
        name=HEAD_NAMES[framework], width=da, depth=depth, num_heads=heads, head_dim=head_dim, mlp_dim=mlp_dim,
        action_dim=action_dim, horizon=horizon, num_steps=int(am.get("num_inference_timesteps", 4)), t_direction="0_to_1",
        time_input="bucket", time_scale=int(am.get("num_timestep_buckets", 1000)), time_embed_dim=time_dim,
        vlm_width=vlm_width, num_future_tokens=d_fut, max_positions=max_pos, io_hidden=io_hidden,
        hidden_states=HIDDEN_STATES, block_pattern=pattern,
    )
    if framework == "QwenPI_v3":
        n_proj = len({k.split(".")[1] for k in tensors if k.startswith("project_layers.")})
        if depth > vlm_depth:
            _fail(path, f"QwenPI_v3's {depth} DiT blocks read hidden_states[-{depth}:], more than the VLM's {vlm_depth} layers")
        if n_proj == 0 and da != vlm_width:
            _fail(path, f"config.yaml says QwenPI_v3 but the weights have no project_layers.*, which only a DiT as wide as "
                        f"the VLM ({vlm_width}) may omit; this one is {da} wide (a QwenGR00T checkpoint?)")
        if n_proj not in (0, depth):
            _fail(path, f"QwenPI_v3 needs one project_layers entry per DiT block ({depth}), found {n_proj}")
        proj = _shape(tensors, "project_layers.0.1.weight", path)[0] if n_proj else None
        reads = tuple(vlm_depth - depth + 1 + i for i in cross_blocks(depth, pattern))  # block i: hidden_states[-depth:][i]
        return CrossHiddenSpec(hidden_layers=reads, hidden_proj=proj, **common)
    out_dim = _shape(tensors, _AM + "model.proj_out_2.weight", path)[0]
    state_dim = _shape(tensors, _AM + "state_encoder.layer1.weight", path)[1] if _AM + "state_encoder.layer1.weight" in tensors else 0
    return CrossLastSpec(hidden_layer=vlm_depth, state_dim=state_dim, dit_output_dim=out_dim, **common)


# --------------------------------------------------------------------------------------------------
# The name table of a head: StarVLA name -> (shape, converter)


def _lin(w, b=None, out_shape=None) -> Linear:
    """torch Linear (out, in) -> our kernel [in, *out_shape]."""
    k = np.asarray(w).T
    if out_shape is not None:
        k = k.reshape((k.shape[0],) + tuple(out_shape))
    bias = None if b is None else np.asarray(b).reshape(k.shape[1:])
    return Linear(kernel=k, bias=bias)


def expected_shapes(spec: CrossSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the head needs, with its torch shape (StarVLA's names under `action_model.` / `project_layers.`)."""
    da, nh, fo, ad = spec.width, spec.num_heads * spec.head_dim, spec.io_hidden, spec.action_dim
    dit = _AM + "model."
    out = {
        dit + "timestep_encoder.timestep_embedder.linear_1.weight": (da, spec.time_embed_dim),
        dit + "timestep_encoder.timestep_embedder.linear_1.bias": (da,),
        dit + "timestep_encoder.timestep_embedder.linear_2.weight": (da, da),
        dit + "timestep_encoder.timestep_embedder.linear_2.bias": (da,),
        _AM + "action_encoder.layer1.weight": (da, ad), _AM + "action_encoder.layer1.bias": (da,),
        _AM + "action_encoder.layer2.weight": (da, 2 * da), _AM + "action_encoder.layer2.bias": (da,),
        _AM + "action_encoder.layer3.weight": (da, da), _AM + "action_encoder.layer3.bias": (da,),
        _AM + "position_embedding.weight": (spec.max_positions, da),
        _AM + "future_tokens.weight": (spec.num_future_tokens, da),
    }
    dec_in = spec.dit_output_dim or da
    out |= {_AM + "action_decoder.layer1.weight": (fo, dec_in), _AM + "action_decoder.layer1.bias": (fo,),
            _AM + "action_decoder.layer2.weight": (ad, fo), _AM + "action_decoder.layer2.bias": (ad,)}
    for i in range(spec.depth):
        ctx = spec.context_width if i in spec.cross_blocks else da
        b = f"{dit}transformer_blocks.{i}."
        out |= {b + "norm1.linear.weight": (2 * da, da), b + "norm1.linear.bias": (2 * da,),
                b + "attn1.to_q.weight": (nh, da), b + "attn1.to_q.bias": (nh,),
                b + "attn1.to_k.weight": (nh, ctx), b + "attn1.to_k.bias": (nh,),
                b + "attn1.to_v.weight": (nh, ctx), b + "attn1.to_v.bias": (nh,),
                b + "attn1.to_out.0.weight": (da, nh), b + "attn1.to_out.0.bias": (da,),
                b + "ff.net.0.proj.weight": (spec.mlp_dim, da), b + "ff.net.0.proj.bias": (spec.mlp_dim,),
                b + "ff.net.2.weight": (da, spec.mlp_dim), b + "ff.net.2.bias": (da,)}
    if spec.hidden_proj:
        for i in spec.cross_blocks:  # QwenPI_v3 projects every block's entry; self blocks never read theirs
            out |= {f"project_layers.{i}.0.weight": (spec.vlm_width,), f"project_layers.{i}.0.bias": (spec.vlm_width,),
                    f"project_layers.{i}.1.weight": (spec.hidden_proj, spec.vlm_width),
                    f"project_layers.{i}.1.bias": (spec.hidden_proj,)}
    if spec.dit_output_dim:
        out |= {dit + "proj_out_1.weight": (2 * da, da), dit + "proj_out_1.bias": (2 * da,),
                dit + "proj_out_2.weight": (spec.dit_output_dim, da), dit + "proj_out_2.bias": (spec.dit_output_dim,)}
    if spec.state_dim:
        out |= {_AM + "state_encoder.layer1.weight": (fo, spec.state_dim), _AM + "state_encoder.layer1.bias": (fo,),
                _AM + "state_encoder.layer2.weight": (da, fo), _AM + "state_encoder.layer2.bias": (da,)}
    return out


def _never_run(framework: str, spec: CrossSpec) -> re.Pattern:
    """Stored by StarVLA, never run by its inference (QwenPI_v3: `return_pre_output=True`, state=None, and
    the projections of self blocks' hidden states when interleaved)."""
    if framework == "QwenPI_v3":
        self_blocks = "|".join(str(i) for i in range(spec.depth) if i not in spec.cross_blocks)
        projections = rf"|project_layers\.({self_blocks})\." if self_blocks and spec.hidden_proj else ""
        return re.compile(rf"action_model\.(model\.proj_out_[12]|state_encoder)\.{projections}")
    return re.compile(r"(?!)")


def _check_head_names(path, framework: str, spec: CrossSpec, tensors: Mapping[str, Any]) -> list[str]:
    expected = expected_shapes(spec)
    head_keys = {k: tuple(v.shape) for k, v in tensors.items() if not k.startswith(VLM)}
    skip = _never_run(framework, spec)
    unused = sorted(k for k in head_keys if k not in expected and skip.match(k))
    missing = sorted(set(expected) - set(head_keys))
    unexpected = sorted(k for k in set(head_keys) - set(expected) if not skip.match(k))
    misshaped = sorted(k for k in set(expected) & set(head_keys) if expected[k] != head_keys[k])
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: " + ", ".join(hf._collapse(missing)))
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: " + ", ".join(hf._collapse(unexpected)))
        if misshaped:
            parts.append(f"mis-shaped {len(misshaped)}: " + ", ".join(f"{k} {head_keys[k]} (expected {expected[k]})" for k in misshaped))
        _fail(path, f"the {framework} head does not match its config.yaml: " + "; ".join(parts))
    return unused


def head_params(spec: CrossSpec, tensors: Mapping[str, Any], dtype: str = "float32") -> CrossHead:
    """Our `CrossHead` (stacked blocks) from StarVLA's tensors; names and shapes checked by `load` first."""
    t = lambda name: np.asarray(tensors[name], np.float32)  # noqa: E731
    dit = _AM + "model."
    n, h, da = spec.num_heads, spec.head_dim, spec.width

    def lin(prefix, out_shape=None):
        return _lin(t(prefix + ".weight"), t(prefix + ".bias"), out_shape)

    def mlp(prefix):
        return Mlp(fc1=lin(prefix + ".layer1"), fc2=lin(prefix + ".layer2"))

    def block(i):
        b = f"{dit}transformer_blocks.{i}."
        k, v = lin(b + "attn1.to_k", (n, h)), lin(b + "attn1.to_v", (n, h))
        out_w = t(b + "attn1.to_out.0.weight").T.reshape(n, h, da)
        return CrossBlocks(ada=lin(b + "norm1.linear", (2, da)), q=lin(b + "attn1.to_q", (n, h)),
                           kv=Linear(kernel=np.stack([k.kernel, v.kernel]), bias=np.stack([k.bias, v.bias])),
                           out=Linear(kernel=out_w, bias=t(b + "attn1.to_out.0.bias")),
                           ff_in=lin(b + "ff.net.0.proj"), ff_out=lin(b + "ff.net.2"))

    def stacked(indices):
        blocks = [block(i) for i in indices]
        return CrossBlocks(**{f.name: Linear(kernel=np.stack([getattr(x, f.name).kernel for x in blocks]),
                                             bias=np.stack([getattr(x, f.name).bias for x in blocks]))
                              for f in dataclasses.fields(CrossBlocks)})

    cross = spec.cross_blocks
    selfs = [i for i in range(spec.depth) if i not in cross]
    blocks = BlockPair(cross=stacked(cross), self_=stacked(selfs)) if selfs else stacked(cross)
    proj = None
    if spec.hidden_proj:
        lc = cross  # cross block j reads project_layers[its block index]
        proj = HiddenProj(norm=LayerNorm(scale=np.stack([t(f"project_layers.{i}.0.weight") for i in lc]),
                                         bias=np.stack([t(f"project_layers.{i}.0.bias") for i in lc])),
                          proj=Linear(kernel=np.stack([t(f"project_layers.{i}.1.weight").T for i in lc]),
                                      bias=np.stack([t(f"project_layers.{i}.1.bias") for i in lc])))
    enc = ActionEncoder(w1=lin(_AM + "action_encoder.layer1"), w2=lin(_AM + "action_encoder.layer2"),
                        w3=lin(_AM + "action_encoder.layer3"))
    te = dit + "timestep_encoder.timestep_embedder."
    params = CrossHead(
        hidden_proj=proj, time_mlp=Mlp(fc1=lin(te + "linear_1"), fc2=lin(te + "linear_2")), action_in=enc,
        positions=t(_AM + "position_embedding.weight"),
        future=t(_AM + "future_tokens.weight") if spec.num_future_tokens else None,
        state_in=mlp(_AM + "state_encoder") if spec.state_dim else None, blocks=blocks,
        out_mod=lin(dit + "proj_out_1", (2, da)) if spec.dit_output_dim else None,
        out_proj=lin(dit + "proj_out_2") if spec.dit_output_dim else None, action_out=mlp(_AM + "action_decoder"),
    )
    want = hd.abstract_head(spec, dtype)
    got_shapes = jax.tree.map(lambda a: tuple(a.shape), params)
    want_shapes = jax.tree.map(lambda a: tuple(a.shape), want)
    if got_shapes != want_shapes:  # a table bug, not a user error
        raise AssertionError(f"converted head {got_shapes} does not match {want_shapes}")
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


# --------------------------------------------------------------------------------------------------
# Loading


def load(path, dtype: str = "float32", *, framework: str | None = None, language: bool = False) -> StarVLACheckpoint:
    """Restores a StarVLA QwenPI_v3 / QwenGR00T checkpoint (see the module docstring for what is read).

    Args:
      path: a run directory, a flat checkpoint directory or the .safetensors file.
      framework: "QwenPI_v3" or "QwenGR00T" to insist on one (a checkpoint of the other fails); None: config.yaml's.
      language: also keep a language decoder on the shared prefix (the restored Qwen3-VL with its tied head),
        as `ckpts.load.load_model` does for the runtime.
    Returns:
      `StarVLACheckpoint`: a single-head `ModelSpec` and its parameters (stacked layers).
    """
    weights, cfg_path = _run_files(Path(path))
    cfg = read_yaml(cfg_path)
    name = (cfg.get("framework") or {}).get("name")
    if name not in FRAMEWORKS:
        _fail(cfg_path, f"framework.name is {name!r}; this loader reads StarVLA's {FRAMEWORKS}")
    if framework is not None and framework != name:
        _fail(cfg_path, f"a {name} checkpoint, not {framework} (framework.name in config.yaml)")
    tensors = read_safetensors(weights)
    if not any(k.startswith(VLM) for k in tensors):
        roots = sorted({k.split(".")[0] for k in tensors})
        _fail(weights, f"no qwen_vl_interface.model.* tensors (found {roots[:6]}): not a StarVLA Qwen-VL checkpoint")
    if name == "QwenGR00T" and any(k.startswith("project_layers.") for k in tensors):
        _fail(weights, "config.yaml says QwenGR00T but the weights hold QwenPI_v3's project_layers.*")
    vlm_cfg, vlm_path = _vlm_config(weights, cfg)
    vlm_tensors = {k[len(VLM):]: v for k, v in tensors.items() if k.startswith(VLM)}
    hf.check_config(vlm_cfg, {k: v.shape for k, v in vlm_tensors.items()}, str(vlm_path))
    check_config(name, cfg, {k: v.shape for k, v in tensors.items()}, cfg_path)
    stats_path = cfg_path.parent / "dataset_statistics.json"
    stats = read_dataset_statistics(stats_path) if stats_path.exists() else None
    limits.check_finite(tensors, str(weights))
    bspec = hf.spec_from_config(vlm_cfg, vlm_tensors.keys()).replace(hidden_states=HIDDEN_STATES)
    try:
        decoder, vision = hf.from_hf(bspec, vlm_tensors, dtype)
    except ValueError as e:
        _fail(weights, f"the Qwen3-VL backbone under {VLM}* does not match {vlm_path.name}: {e}")
    head = head_spec(name, cfg, tensors, bspec.depth, bspec.width, weights)
    unused = _check_head_names(weights, name, head, tensors)
    image_id = vlm_cfg.get("image_token_id")
    spec = ModelSpec(backbone=bspec, heads=(head,), language=language,
                     image_token_id=None if image_id is None else int(image_id))
    params = ModelParams(decoder=decoder, vision=vision, heads={head.name: head_params(head, tensors, dtype)})
    return StarVLACheckpoint(spec=spec, params=params, framework=name, config=cfg, vlm_config=vlm_cfg,
                             dataset_statistics=stats, unused=tuple(hf._collapse(unused)),
                             files={"weights": weights, "config": cfg_path, "vlm_config": vlm_path,
                                    "dataset_statistics": stats_path if stats is not None else None})


# --------------------------------------------------------------------------------------------------
# Action (un)normalisation with dataset_statistics.json


def _entry_stats(action: Any, where: str) -> dict[str, np.ndarray]:
    """{"q01", "q99", "mask"} of one dataset's `action` entry, checked (`read_dataset_statistics`)."""
    if not isinstance(action, Mapping) or action.get("q01") is None or action.get("q99") is None:
        raise ValueError(f"{where}: needs 'q01' and 'q99' lists (StarVLA un-normalises with them)")
    try:
        q01, q99 = np.asarray(action["q01"], np.float64), np.asarray(action["q99"], np.float64)
        mask = np.asarray(action["mask"] if action.get("mask") is not None else np.ones(q01.shape, bool))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: q01 / q99 / mask must be flat lists of numbers") from None
    if q01.ndim != 1 or q01.shape != q99.shape or mask.shape != q01.shape:
        raise ValueError(f"{where}: q01, q99 and mask must be lists of one length, got {q01.shape}, {q99.shape}, {mask.shape}")
    if mask.dtype != bool and not (np.issubdtype(mask.dtype, np.number) and np.isin(mask, (0, 1)).all()):
        raise ValueError(f"{where}: mask must hold booleans (or 0 / 1)")
    check_statistics(where, q01=q01, q99=q99)
    return {"q01": q01.astype(np.float32), "q99": q99.astype(np.float32), "mask": mask.astype(bool)}


def read_dataset_statistics(path: str | Path) -> dict:
    """StarVLA's `dataset_statistics.json` ({dataset: {"action": {q01, q99, mask?}, ...}}), checked before use.

    Every dataset's action statistics must be finite, within ±`normalize.STATS_MAX_ABS`, with q01 <= q99 per
    dim and a mask of the same length. q01 == q99 is accepted: StarVLA's rule maps such a constant dim to
    q01 (0.5 (a + 1)(q99 - q01) + q01 = q01 for any a), a well-defined value, and its training normalisation
    of that dim is finite too. Raises a one-line ValueError naming the file, the dataset and the field.
    """
    path = Path(path)
    stats = limits.read_json(path)
    if not isinstance(stats, dict) or not stats:
        _fail(path, "expected a non-empty object {dataset: {\"action\": {\"q01\": [...], \"q99\": [...]}}}")
    for key, entry in stats.items():
        if isinstance(entry, Mapping) and "action" in entry:
            _entry_stats(entry["action"], f"{path}: {key}.action")
    return stats


def action_stats(stats: Mapping | None, key: str | None = None) -> dict[str, np.ndarray]:
    """{"q01", "q99", "mask"} float32 / bool [Ad] of one dataset's actions (`key` None: the only one).

    The entry is checked as `read_dataset_statistics` checks a file: finite, bounded, q01 <= q99.
    """
    if not stats:
        raise ValueError("no dataset_statistics.json with this checkpoint: StarVLA's actions stay normalised")
    if key is None:
        if len(stats) != 1:
            raise ValueError(f"dataset_statistics.json has {sorted(stats)}: pass the dataset key to un-normalise with")
        key = next(iter(stats))
    if key not in stats or not isinstance(stats[key], Mapping) or "action" not in stats[key]:
        raise ValueError(f"dataset_statistics.json has no {key!r} entry with 'action' statistics; it has {sorted(stats)}")
    return _entry_stats(stats[key]["action"], f"dataset_statistics.json: {key}.action")


def unnormalize_actions(actions, stats: Mapping[str, np.ndarray], gripper_dim: int | None = 6) -> np.ndarray:
    """StarVLA's deployment un-normalisation of `normalized_actions` [..., Ad]: clip to [-1, 1],
    the gripper dimension thresholded to {0, 1} at 0.5, then 0.5 (a + 1)(q99 - q01) + q01 where `mask`.

    Example: q01 = -2, q99 = 2, a = 0.5 -> 1.0; a = 3 -> clipped to 1 -> 2.0 (gripper: 1.0).
    """
    a = np.clip(np.asarray(actions, np.float32), -1.0, 1.0)
    if gripper_dim is not None and a.shape[-1] > gripper_dim:
        a[..., gripper_dim] = np.where(a[..., gripper_dim] < 0.5, 0.0, 1.0)
    q01, q99 = stats["q01"], stats["q99"]
    return np.where(stats["mask"], 0.5 * (a + 1.0) * (q99 - q01) + q01, a).astype(np.float32)
