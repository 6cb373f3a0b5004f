"""LeRobot π0.5 and π0 checkpoints: the `pretrained_model/` folder LeRobot's `save_pretrained` writes.

    pretrained_model/config.json                         the policy config (draccus): `type` "pi05" | "pi0",
                                                         input / output features, image_resolution, chunk_size,
                                                         max_state_dim / max_action_dim, tokenizer_max_length, ...
    pretrained_model/model.safetensors                   the weights, PyTorch names (below)
    pretrained_model/policy_preprocessor.json            the input pipeline: normaliser (mode per feature type,
      + policy_preprocessor_step_<k>_normalizer_processor.safetensors   eps, statistics), prompt step, tokenizer
    pretrained_model/policy_postprocessor.json           the un-normaliser of the action
      + policy_postprocessor_step_<k>_unnormalizer_processor.safetensors

`load(path)` returns the `ModelConfig`, the π0.5 / π0 `Params` (our openpi-path table, `models.pi05.params`)
and the robot I/O the processor files describe (`robots.lerobot.LeRobotIO`: normalisation mode and statistics
per feature, eps, cameras in `input_features` order, empty cameras, image resolution, prompt length, chunk,
state / action dims, tokenizer name).

Sizes come from the tensors (config.json names only `gemma_2b` / `gemma_300m`): widths, depths, MLP widths,
vocabulary (`embed_tokens.weight`), SigLIP patch, width, depth, MLP and image size (position table). Two
numbers are not in any tensor shape: the Gemma query-head count, which LeRobot fixes at 8 for both experts
(its `get_gemma_config` and the attention reshape `1 * 8 * head_dim`), so head_dim = q rows / 8 and
KV heads = k rows / head_dim; and SigLIP's head count, which LeRobot takes from PaliGemma's So400m (16 heads
at width 1152). Any other SigLIP width is not one LeRobot builds: pass `vision_heads=` for it.

Tensor names, each with or without LeRobot's `model.` prefix (openpi's PyTorch conversion,
`examples/convert_jax_model_to_pytorch.py`, writes them without it; transformers' older PaliGemma names
`paligemma.language_model.model.*`, `paligemma.vision_tower.*` and `paligemma.multi_modal_projector.*` are read
too). Under `paligemma_with_expert.`:

    paligemma.model.language_model.embed_tokens.weight [V, D]  (else paligemma.lm_head.weight, as LeRobot copies it)
    paligemma.model.language_model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, mlp.{gate,up,down}_proj.weight,
        input_layernorm.weight, post_attention_layernorm.weight; .norm.weight
    gemma_expert.model.layers.{i}.* as above; π0.5: input_layernorm.dense.{weight [3 Da, Da], bias},
        post_attention_layernorm.dense.*, norm.dense.* (adaRMS); π0: the plain .weight norms
    paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.{weight [W, 3, p, p], bias},
        embeddings.position_embedding.weight [Np, W], encoder.layers.{i}.{layer_norm1, layer_norm2,
        self_attn.{q,k,v,out}_proj, mlp.fc1, mlp.fc2}.{weight, bias}, post_layernorm.{weight, bias}
    paligemma.model.multi_modal_projector.linear.{weight [D, W], bias}
and at the top: action_in_proj, action_out_proj; π0.5 time_mlp_in / time_mlp_out (older π0.5 conversions:
action_time_mlp_*, read as LeRobot does); π0 state_proj, action_time_mlp_in [Da, 2 Da], action_time_mlp_out.

What is refused, in one line each: a missing tensor (LeRobot's own loader leaves it at its random
initialisation and goes on; this one stops, naming it), a mis-shaped one, a NaN / inf or |x| > `max_abs`
weight, statistics that are not finite or out of order, a processor step it cannot reproduce (relative actions,
image normalisation, unknown steps), a missing file ("LeRobot π0 checkpoint DIR missing FILE"). Tensors it does
not use other than the two lm_heads (π0.5's stray state_proj, anything else) are reported (`unused`, a warning).
LeRobot's π0-FAST folders (config.json `type` 'pi0fast' / 'pi0_fast') are refused by `refuse_unread`, naming
openpi's π0-FAST checkpoint to use instead (no fixture here checks a reading of their layout).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from oxygen_jax.ckpts import limits
from oxygen_jax.ckpts.openpi import MAX_ABS_WEIGHT
from oxygen_jax.ckpts.orbax_io import PathLike
from oxygen_jax.ckpts.safetensors import read_safetensors
from oxygen_jax.models.pi05.config import DType, ExpertConfig, ModelConfig
from oxygen_jax.models.pi05.params import Params, from_openpi_dict, openpi_shapes
from oxygen_jax.models.vision.siglip import SiglipConfig
from oxygen_jax.robots.lerobot import (
    ACTION_KEY, EMPTY_CAMERA, STATE_KEY, STATS_OF, FeatureNorm, LeRobotIO, check_feature_stats,
)

TYPES = {"pi05": "π0.5", "pi0": "π0"}  # config.json `type` -> what messages call it
UNREAD_TYPES = ("pi0fast", "pi0_fast")  # LeRobot's π0-FAST (PI0FASTPolicy, later PI0FastPolicy): refused, named
NUM_HEADS = 8  # LeRobot's Gemma query heads, both experts (`get_gemma_config`, `compute_layer_complete`)
SO400M_WIDTH, SO400M_HEADS = 1152, 16  # PaliGemma's SigLIP, the only one LeRobot builds
WEIGHTS = "model.safetensors"
IO_FOLDER = "lerobot_io"  # in a checkpoint of ours made from a LeRobot policy: its `io_files`, read by `read_io`
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor.json", "policy_postprocessor.json"

_PG = "paligemma_with_expert.paligemma"
_LLM, _EXPERT = f"{_PG}.model.language_model", "paligemma_with_expert.gemma_expert.model"
_VIS, _PROJ = f"{_PG}.model.vision_tower.vision_model", f"{_PG}.model.multi_modal_projector.linear"
_LM_HEADS = (f"{_PG}.lm_head.weight", "paligemma_with_expert.gemma_expert.lm_head.weight")
# transformers < 4.52 named PaliGemma's parts one level up; its own conversion map, applied to ours.
_LEGACY = ((f"{_PG}.language_model.model.", f"{_LLM}."), (f"{_PG}.language_model.lm_head.", f"{_PG}.lm_head."),
           (f"{_PG}.vision_tower.", f"{_PG}.model.vision_tower."),
           (f"{_PG}.multi_modal_projector.", f"{_PG}.model.multi_modal_projector."))
_PROMPT_STEP = {"pi05": "pi05_prepare_state_tokenizer_processor_step", "pi0": "pi0_new_line_processor"}
_PASSIVE_STEPS = {"to_batch_processor", "device_processor"}  # steps that change no value


@dataclasses.dataclass(frozen=True)
class LeRobotCheckpoint:
    """A restored LeRobot π checkpoint.

    Attributes:
      config: `ModelConfig` (variant "pi05" or "pi0", sizes from the tensors).
      params: `Params` in `config.dtype`, layer stacks stacked (`params.for_backend` lays them out).
      io: the robot I/O of its config.json and processor files (`robots.lerobot.make_observation`,
        `robot_actions` apply it).
      directory: the `pretrained_model` folder read.
      tensor_names: "lerobot" (`model.`-prefixed) or "openpi" (openpi's PyTorch conversion: no prefix).
      embedding: the tensor the token embedding came from (`embed_tokens.weight`, else the PaliGemma lm_head).
      unused: tensors in model.safetensors it did not use, other than the two lm_heads.
    """

    config: ModelConfig
    params: Params
    io: LeRobotIO
    directory: Path
    tensor_names: str
    embedding: str
    unused: tuple[str, ...]


# -------------------------------------------------------------------------------------------------
# Recognising the folder
# -------------------------------------------------------------------------------------------------


def policy_dir(path: PathLike) -> Path:
    """The folder holding config.json: `path` itself, or its `pretrained_model/` child."""
    p = Path(path).expanduser()
    return p / "pretrained_model" if (p / "pretrained_model").is_dir() else p


def _config_type(directory: Path):
    try:
        cfg = limits.read_json(directory / "config.json")
    except (OSError, ValueError):
        return None
    return cfg.get("type") if isinstance(cfg, dict) else None


def _policy_type(directory: Path) -> str | None:
    kind = _config_type(directory)
    return kind if kind in TYPES else None


def refuse_unread(path: PathLike) -> None:
    """One-line ValueError for a LeRobot π0-FAST policy folder (config.json `type` in `UNREAD_TYPES`, in `path` or its
    `pretrained_model/` child): no reader maps its weights and processor files, and no fixture would check one."""
    d = policy_dir(path)
    kind = _config_type(d)
    if kind in UNREAD_TYPES:
        raise ValueError(f"{d / 'config.json'}: type {kind!r} is LeRobot's π0-FAST policy, which is not read here (no "
                         "reader for its weights and processor files): use openpi's π0-FAST checkpoint instead "
                         "(pi0_fast_base, pi0_fast_droid or pi0_fast_libero: params/ with assets/ and its FAST "
                         "processor folder)")


def is_lerobot_dir(path: PathLike) -> bool:
    """A LeRobot π0.5 / π0 policy folder: config.json with `type` "pi05" or "pi0" (in `path` or its
    `pretrained_model/` child), or a `pretrained_model/` child at all (whose missing files `load` then names)."""
    p = Path(path).expanduser()
    return (p / "pretrained_model").is_dir() or _policy_type(p) is not None


# -------------------------------------------------------------------------------------------------
# config.json and the processor files
# -------------------------------------------------------------------------------------------------


def _field(cfg: Mapping, name: str, where: str, *, cap: int | None, low: int = 1) -> int:
    if name not in cfg:
        raise ValueError(f"{where}: no {name!r}")
    return limits.int_field(cfg[name], name, where, cap=cap, low=low)


def _feature_dim(features: Any, key: str, where: str, cap: int) -> int:
    entry = features.get(key) if isinstance(features, Mapping) else None
    shape = entry.get("shape") if isinstance(entry, Mapping) else None
    if not isinstance(shape, list) or len(shape) != 1:
        raise ValueError(f"{where}: feature {key!r} needs a shape [dim] (got {entry!r:.80})")
    return limits.int_field(shape[0], f"{key} shape", where, cap=cap)


def _cameras(cfg: Mapping, where: str) -> tuple[tuple[str, ...], int]:
    feats = cfg.get("input_features")
    if not isinstance(feats, Mapping):
        raise ValueError(f"{where}: input_features must be an object of features")
    cams = [k for k, v in feats.items() if isinstance(v, Mapping) and v.get("type") == "VISUAL"]
    empty = _field(cfg, "empty_cameras", where, cap=limits.MAX_HEADS, low=0) if "empty_cameras" in cfg else 0
    cams += [c for c in (EMPTY_CAMERA.format(i) for i in range(empty)) if c not in cams]  # saved configs may hold them
    if not cams:
        raise ValueError(f"{where}: input_features name no VISUAL camera")
    return tuple(cams), empty


def _steps(path: Path, kind: str) -> dict[str, dict]:
    """{registry_name: step} of a processor file; refuses steps whose effect this module does not reproduce."""
    data = limits.read_json(path)
    steps = data.get("steps") if isinstance(data, Mapping) else None
    if not isinstance(steps, list) or not all(isinstance(s, Mapping) and isinstance(s.get("registry_name"), str)
                                              for s in steps):
        raise ValueError(f"{path}: expected {{\"steps\": [{{\"registry_name\": ..., \"config\": ...}}, ...]}}")
    known = {"rename_observations_processor", "relative_actions_processor", "normalizer_processor", _PROMPT_STEP[kind],
             "tokenizer_processor", "absolute_actions_processor", "unnormalizer_processor", *_PASSIVE_STEPS}
    out = {}
    for s in steps:
        name = s["registry_name"]
        if name not in known:
            raise ValueError(f"{path}: processor step {name!r} is not one this loader reproduces (it reads "
                             f"{sorted(known)}); the checkpoint's inputs would differ from LeRobot's")
        cfg = s.get("config") or {}
        if name in ("relative_actions_processor", "absolute_actions_processor") and cfg.get("enabled"):
            raise ValueError(f"{path}: {name} is enabled (actions relative to the state); not supported: the actions "
                             "would be wrong")
        out[name] = dict(s)
    return out


def _state_tensors(directory: Path, step: Mapping, where: str) -> dict[str, np.ndarray]:
    name = step.get("state_file")
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
        raise ValueError(f"{where}: state_file must be a .safetensors file name inside the folder, got {name!r:.80}")
    if not (directory / name).is_file():
        raise ValueError(f"{where}: names {name}, which the folder lacks")
    tensors = read_safetensors(directory / name)
    limits.check_finite(tensors, str(directory / name))
    return tensors


def _norms(directory: Path, step: Mapping, keys: Mapping[str, int], where: str) -> dict[str, FeatureNorm]:
    """{feature key: FeatureNorm} of a (un)normaliser step, for the features in `keys` ({key: dim, 0 = camera})."""
    cfg = step.get("config") or {}
    feats, norm_map = cfg.get("features"), cfg.get("norm_map")
    if not isinstance(feats, Mapping) or not isinstance(norm_map, Mapping):
        raise ValueError(f"{where}: the {step['registry_name']} step needs config.features and config.norm_map")
    eps = cfg.get("eps", 1e-8)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{where}: eps must be a finite number >= 0, got {eps!r:.40}")
    tensors, out = None, {}
    for key, dim in keys.items():
        if key not in feats:
            continue
        kind = feats[key].get("type") if isinstance(feats[key], Mapping) else None
        mode = norm_map.get(kind, "IDENTITY")
        if mode not in STATS_OF:
            raise ValueError(f"{where}: {key} uses normalisation {mode!r}; LeRobot's modes are {sorted(STATS_OF)}")
        if dim == 0 and mode != "IDENTITY":
            raise ValueError(f"{where}: camera {key} is normalised with {mode}; not supported (LeRobot's π configs use "
                             "IDENTITY for images)")
        stats = {}
        if STATS_OF[mode]:
            tensors = _state_tensors(directory, step, where) if tensors is None else tensors
            for stat in STATS_OF[mode]:
                name = f"{key}.{stat}"
                if name not in tensors:
                    raise ValueError(f"{directory / step['state_file']}: no tensor {name} ({mode} needs {STATS_OF[mode]})")
                if tensors[name].shape != (dim,):
                    raise ValueError(f"{directory / step['state_file']}: {name} has shape {tensors[name].shape}, "
                                     f"expected ({dim},)")
                stats[stat] = np.array(tensors[name], np.float32)
            check_feature_stats(f"{directory / step['state_file']}: {key}", mode, stats)
        out[key] = FeatureNorm(mode=mode, stats=stats, eps=float(eps))
    return out


def read_io(path: PathLike, *, weights: bool = True) -> LeRobotIO:
    """The robot I/O of a LeRobot π policy folder (config.json and the processor files), no weights read.

    `weights=False`: a folder of the I/O files alone (`io_files`, e.g. a quantized checkpoint's copy)."""
    d = policy_dir(path)
    kind = _require_files(d, weights=weights)
    where = str(d / "config.json")
    cfg = limits.read_json(d / "config.json")
    cameras, empty = _cameras(cfg, where)
    state_dim = _feature_dim(cfg["input_features"], STATE_KEY, where, limits.MAX_STATE_DIM)
    action_dim = _feature_dim(cfg.get("output_features"), ACTION_KEY, where, limits.MAX_ACTION_DIM)
    res = cfg.get("image_resolution")
    if not (isinstance(res, list) and len(res) == 2 and res[0] == res[1]):
        raise ValueError(f"{where}: image_resolution must be a square [side, side], got {res!r:.60}")
    side = limits.int_field(res[0], "image_resolution", where, cap=limits.MAX_WIDTH)
    chunk = _field(cfg, "chunk_size", where, cap=limits.MAX_HORIZON)
    steps = _field(cfg, "n_action_steps", where, cap=chunk) if "n_action_steps" in cfg else chunk
    max_state, max_action = (_field(cfg, k, where, cap=limits.MAX_ACTION_DIM) for k in ("max_state_dim", "max_action_dim"))
    if state_dim > max_state or action_dim > max_action:
        raise ValueError(f"{where}: state / action dims {state_dim} / {action_dim} exceed max_state_dim / max_action_dim "
                         f"{max_state} / {max_action}")
    pre = _steps(d / PREPROCESSOR, kind)
    post = _steps(d / POSTPROCESSOR, kind)
    for needed in ("normalizer_processor", "tokenizer_processor", _PROMPT_STEP[kind]):
        if needed not in pre:
            raise ValueError(f"{d / PREPROCESSOR}: no {needed} step; a LeRobot {TYPES[kind]} preprocessor has one")
    if "unnormalizer_processor" not in post:
        raise ValueError(f"{d / POSTPROCESSOR}: no unnormalizer_processor step")
    tok = pre["tokenizer_processor"].get("config") or {}
    tok_where = f"{d / PREPROCESSOR}: tokenizer_processor"
    if tok.get("padding_side", "right") != "right" or tok.get("task_key", "task") != "task":
        raise ValueError(f"{tok_where}: padding_side {tok.get('padding_side')!r} / task_key {tok.get('task_key')!r}; "
                         "only right padding of 'task' is read")
    max_len = _field(tok, "max_length", tok_where, cap=limits.MAX_WIDTH)
    rename = (pre.get("rename_observations_processor", {}).get("config") or {}).get("rename_map") or {}
    if not isinstance(rename, Mapping) or not all(isinstance(v, str) for v in rename.values()):
        raise ValueError(f"{d / PREPROCESSOR}: rename_map must map names to names")
    keys = {STATE_KEY: state_dim, ACTION_KEY: action_dim, **{c: 0 for c in cameras}}
    return LeRobotIO(
        variant=kind, cameras=cameras, empty_cameras=empty, image_resolution=(side, side), state_dim=state_dim,
        action_dim=action_dim, max_state_dim=max_state, max_action_dim=max_action, chunk_size=chunk,
        n_action_steps=steps, tokenizer_max_length=max_len, tokenizer_name=str(tok.get("tokenizer_name", "")),
        normalize=_norms(d, pre["normalizer_processor"], keys, f"{d / PREPROCESSOR}"),
        unnormalize=_norms(d, post["unnormalizer_processor"], {ACTION_KEY: action_dim}, f"{d / POSTPROCESSOR}"),
        rename_map=dict(rename),
    )


def io_files(path: PathLike) -> list[Path]:
    """The files of a LeRobot π policy folder that `read_io` reads (config.json, the two processor files and the
    statistics files their steps name), checked by reading them (a one-line ValueError otherwise)."""
    d = policy_dir(path)
    read_io(d)
    kind = _policy_type(d)
    steps = (_steps(d / PREPROCESSOR, kind)["normalizer_processor"], _steps(d / POSTPROCESSOR, kind)["unnormalizer_processor"])
    named = {s.get("state_file") for s in steps}  # plain file names in the folder only (read_io checked the needed)
    return [d / "config.json", d / PREPROCESSOR, d / POSTPROCESSOR,
            *(d / n for n in sorted(n for n in named if isinstance(n, str) and Path(n).name == n and (d / n).is_file()))]


def _require_files(d: Path, weights: bool = True) -> str:
    """The policy type; one line naming the first missing file otherwise."""
    if not (d / "config.json").is_file():
        raise ValueError(f"LeRobot checkpoint {d} missing config.json")
    kind = _policy_type(d)
    if kind is None:
        cfg = limits.read_json(d / "config.json")
        got = cfg.get("type") if isinstance(cfg, dict) else None
        raise ValueError(f"{d / 'config.json'}: type {got!r} is not a LeRobot π policy (expected 'pi05' or 'pi0')")
    for name in (WEIGHTS, PREPROCESSOR, POSTPROCESSOR)[0 if weights else 1:]:
        if not (d / name).is_file():
            hint = (" (LeRobot before 0.4 kept statistics in model.safetensors: re-save it with a current LeRobot)"
                    if name != WEIGHTS else "")
            raise ValueError(f"LeRobot {TYPES[kind]} checkpoint {d} missing {name}{hint}")
    return kind


# -------------------------------------------------------------------------------------------------
# Tensors -> sizes
# -------------------------------------------------------------------------------------------------


def _canonical(tensors: Mapping[str, np.ndarray], where: str) -> tuple[dict[str, np.ndarray], str]:
    """Names without LeRobot's `model.` prefix and with transformers' current PaliGemma names; the naming found."""
    out, prefixed = {}, 0
    for key, value in tensors.items():
        name = key.removeprefix("model.")
        prefixed += name != key
        for old, new in _LEGACY:
            if name.startswith(old):
                name = new + name[len(old):]
        if name in out:
            raise ValueError(f"{where}: holds tensor {name} twice (with and without the 'model.' prefix, or under an "
                             "old and a new name)")
        out[name] = value
    return out, "lerobot" if prefixed else "openpi"


def _depth(names, base: str, where: str) -> int:
    found = {int(m.group(1)) for n in names if (m := re.match(re.escape(base) + r"\.(\d+)\.", n))}
    if not found:
        raise ValueError(f"{where}: no tensor {base}.0.*; not a LeRobot π checkpoint's weights")
    return limits.int_field(max(found) + 1, f"{base} depth", where, cap=limits.MAX_LAYERS)


def _shape(tensors: Mapping[str, np.ndarray], name: str, rank: int, where: str) -> tuple[int, ...]:
    if name not in tensors:
        raise ValueError(f"{where}: missing tensor {name}; cannot read the model's sizes without it")
    shape = tuple(int(d) for d in tensors[name].shape)
    if len(shape) != rank:
        raise ValueError(f"{where}: tensor {name} has shape {shape}, expected {rank} axes")
    return shape


def _expert(tensors, base: str, heads: int, where: str) -> ExpertConfig:
    depth = _depth(tensors, f"{base}.layers", where)
    q_rows, width = _shape(tensors, f"{base}.layers.0.self_attn.q_proj.weight", 2, where)
    k_rows = _shape(tensors, f"{base}.layers.0.self_attn.k_proj.weight", 2, where)[0]
    mlp = _shape(tensors, f"{base}.layers.0.mlp.gate_proj.weight", 2, where)[0]
    head_dim = q_rows // heads
    if q_rows % heads or k_rows % max(head_dim, 1) or head_dim == 0:
        raise ValueError(f"{where}: {base} q_proj rows {q_rows} / k_proj rows {k_rows} do not split into {heads} heads "
                         "(LeRobot's Gemma has 8 query heads; pass num_heads= for another)")
    try:
        return ExpertConfig(width=width, depth=depth, mlp_dim=mlp, num_heads=heads, num_kv_heads=k_rows // head_dim,
                            head_dim=head_dim)
    except ValueError as e:
        raise ValueError(f"{where}: {base} sizes from its tensors are not a Gemma expert: {e}") from None


def _siglip(tensors, vision_heads: int | None, where: str) -> SiglipConfig:
    width, channels, ph, pw = _shape(tensors, f"{_VIS}.embeddings.patch_embedding.weight", 4, where)
    if channels != 3 or ph != pw:
        raise ValueError(f"{where}: patch_embedding.weight has shape {(width, channels, ph, pw)}: expected [W, 3, p, p]")
    patches = _shape(tensors, f"{_VIS}.embeddings.position_embedding.weight", 2, where)[0]
    side = math.isqrt(patches)
    if side * side != patches:
        raise ValueError(f"{where}: position_embedding holds {patches} positions, not a square grid of patches")
    if vision_heads is None:
        if width != SO400M_WIDTH:
            raise ValueError(f"{where}: SigLIP width {width} is not LeRobot's So400m ({SO400M_WIDTH}, {SO400M_HEADS} "
                             "heads) and no tensor stores its head count: pass vision_heads=")
        vision_heads = SO400M_HEADS
    mlp = _shape(tensors, f"{_VIS}.encoder.layers.0.mlp.fc1.weight", 2, where)[0]
    try:
        return SiglipConfig(width=width, depth=_depth(tensors, f"{_VIS}.encoder.layers", where), mlp_dim=mlp,
                            num_heads=vision_heads, patch_size=ph, image_size=side * ph)
    except ValueError as e:
        raise ValueError(f"{where}: SigLIP sizes from its tensors: {e}") from None


def infer_config(tensors: Mapping[str, np.ndarray], variant: str, *, dtype: DType = "float32", num_heads: int = NUM_HEADS,
                 vision_heads: int | None = None, where: str = WEIGHTS) -> ModelConfig:
    """The `ModelConfig` of canonical tensors (`model.` prefix removed): every size from a shape (module docstring)."""
    vlm = _expert(tensors, _LLM, num_heads, where)
    act = _expert(tensors, _EXPERT, num_heads, where)
    emb = f"{_LLM}.embed_tokens.weight" if f"{_LLM}.embed_tokens.weight" in tensors else _LM_HEADS[0]
    vocab = limits.int_field(_shape(tensors, emb, 2, where)[0], "vocabulary", where, cap=limits.MAX_VOCAB)
    action_dim = _shape(tensors, "action_in_proj.weight", 2, where)[1]
    vision = _siglip(tensors, vision_heads, where)
    try:
        return ModelConfig(vlm=vlm, action_expert=act, siglip=vision, vocab_size=vocab,
                           action_dim=limits.int_field(action_dim, "action dim", where, cap=limits.MAX_ACTION_DIM),
                           dtype=dtype, variant=variant)
    except ValueError as e:
        raise ValueError(f"{where}: sizes from the tensors give no valid model: {e}") from None


# -------------------------------------------------------------------------------------------------
# Tensors -> our openpi-path table
# -------------------------------------------------------------------------------------------------


class _Rule(NamedTuple):
    openpi: str  # the leaf's openpi path (`params.openpi_shapes`)
    sources: tuple[tuple[str, ...], ...]  # per layer (one entry when not stacked): the HF tensors it is built from
    convert: Callable[..., np.ndarray]  # HF arrays of one entry -> that entry's openpi array
    stacked: bool


def _t(w):
    return w.T


def _heads_in(n: int, h: int):  # [n*h, D] (torch Linear rows) -> [n, D, h]
    return lambda w: w.reshape(n, h, w.shape[-1]).transpose(0, 2, 1)


def _expert_rules(base: str, sfx: str, e: ExpertConfig, adaptive: bool) -> list[_Rule]:
    llm, n, k, h = "PaliGemma/llm", e.num_heads, e.num_kv_heads, e.head_dim
    layer = lambda *names: tuple(tuple(f"{base}.layers.{i}.{x}" for x in names) for i in range(e.depth))  # noqa: E731
    rules = [
        _Rule(f"{llm}/layers/attn/q_einsum{sfx}/w", layer("self_attn.q_proj.weight"), _heads_in(n, h), True),
        _Rule(f"{llm}/layers/attn/kv_einsum{sfx}/w", layer("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
              lambda kw, vw: np.stack([_heads_in(k, h)(kw), _heads_in(k, h)(vw)]), True),
        _Rule(f"{llm}/layers/attn/attn_vec_einsum{sfx}/w", layer("self_attn.o_proj.weight"),
              lambda w: w.T.reshape(n, h, w.shape[0]), True),
        _Rule(f"{llm}/layers/mlp{sfx}/gating_einsum", layer("mlp.gate_proj.weight", "mlp.up_proj.weight"),
              lambda g, u: np.stack([g.T, u.T]), True),
        _Rule(f"{llm}/layers/mlp{sfx}/linear", layer("mlp.down_proj.weight"), _t, True),
    ]
    norms = (("pre_attention_norm", "input_layernorm"), ("pre_ffw_norm", "post_attention_layernorm"))
    for ours, hf in norms:
        if adaptive:
            rules += [_Rule(f"{llm}/layers/{ours}{sfx}/Dense_0/kernel", layer(f"{hf}.dense.weight"), _t, True),
                      _Rule(f"{llm}/layers/{ours}{sfx}/Dense_0/bias", layer(f"{hf}.dense.bias"), np.asarray, True)]
        else:
            rules.append(_Rule(f"{llm}/layers/{ours}{sfx}/scale", layer(f"{hf}.weight"), np.asarray, True))
    if adaptive:
        rules += [_Rule(f"{llm}/final_norm{sfx}/Dense_0/kernel", ((f"{base}.norm.dense.weight",),), _t, False),
                  _Rule(f"{llm}/final_norm{sfx}/Dense_0/bias", ((f"{base}.norm.dense.bias",),), np.asarray, False)]
    else:
        rules.append(_Rule(f"{llm}/final_norm{sfx}/scale", ((f"{base}.norm.weight",),), np.asarray, False))
    return rules


def _siglip_rules(s: SiglipConfig) -> list[_Rule]:
    img, blk, nv, hv = "PaliGemma/img", "PaliGemma/img/Transformer/encoderblock", s.num_heads, s.head_dim
    layer = lambda name: tuple((f"{_VIS}.encoder.layers.{i}.{name}",) for i in range(s.depth))  # noqa: E731
    one = lambda name: ((name,),)  # noqa: E731
    rules = [
        _Rule(f"{img}/embedding/kernel", one(f"{_VIS}.embeddings.patch_embedding.weight"),
              lambda w: w.transpose(2, 3, 1, 0), False),
        _Rule(f"{img}/embedding/bias", one(f"{_VIS}.embeddings.patch_embedding.bias"), np.asarray, False),
        _Rule(f"{img}/pos_embedding", one(f"{_VIS}.embeddings.position_embedding.weight"), lambda w: w[None], False),
        _Rule(f"{img}/Transformer/encoder_norm/scale", one(f"{_VIS}.post_layernorm.weight"), np.asarray, False),
        _Rule(f"{img}/Transformer/encoder_norm/bias", one(f"{_VIS}.post_layernorm.bias"), np.asarray, False),
        _Rule(f"{img}/head/kernel", one(f"{_PROJ}.weight"), _t, False),
        _Rule(f"{img}/head/bias", one(f"{_PROJ}.bias"), np.asarray, False),
    ]
    for ours, hf in (("LayerNorm_0", "layer_norm1"), ("LayerNorm_1", "layer_norm2")):
        rules += [_Rule(f"{blk}/{ours}/scale", layer(f"{hf}.weight"), np.asarray, True),
                  _Rule(f"{blk}/{ours}/bias", layer(f"{hf}.bias"), np.asarray, True)]
    mha = f"{blk}/MultiHeadDotProductAttention_0"
    for ours, hf in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        rules += [_Rule(f"{mha}/{ours}/kernel", layer(f"self_attn.{hf}.weight"), lambda w: w.T.reshape(-1, nv, hv), True),
                  _Rule(f"{mha}/{ours}/bias", layer(f"self_attn.{hf}.bias"), lambda b: b.reshape(nv, hv), True)]
    return rules + [
        _Rule(f"{mha}/out/kernel", layer("self_attn.out_proj.weight"), lambda w: w.T.reshape(nv, hv, -1), True),
        _Rule(f"{mha}/out/bias", layer("self_attn.out_proj.bias"), np.asarray, True),
        _Rule(f"{blk}/MlpBlock_0/Dense_0/kernel", layer("mlp.fc1.weight"), _t, True),
        _Rule(f"{blk}/MlpBlock_0/Dense_0/bias", layer("mlp.fc1.bias"), np.asarray, True),
        _Rule(f"{blk}/MlpBlock_0/Dense_1/kernel", layer("mlp.fc2.weight"), _t, True),
        _Rule(f"{blk}/MlpBlock_0/Dense_1/bias", layer("mlp.fc2.bias"), np.asarray, True),
    ]


def _linear_rules(ours: str, hf: str) -> list[_Rule]:
    return [_Rule(f"{ours}/kernel", ((f"{hf}.weight",),), _t, False), _Rule(f"{ours}/bias", ((f"{hf}.bias",),), np.asarray, False)]


def _rules(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> tuple[list[_Rule], str]:
    """Every leaf's rule, and the tensor the embedding comes from."""
    pi05 = config.variant == "pi05"
    emb = f"{_LLM}.embed_tokens.weight" if f"{_LLM}.embed_tokens.weight" in tensors else _LM_HEADS[0]
    rules = [_Rule("PaliGemma/llm/embedder/input_embedding", ((emb,),), np.asarray, False)]
    rules += _expert_rules(_LLM, "", config.vlm, adaptive=False)
    rules += _expert_rules(_EXPERT, "_1", config.action_expert, adaptive=pi05)
    rules += _siglip_rules(config.siglip) + _linear_rules("action_in_proj", "action_in_proj")
    rules += _linear_rules("action_out_proj", "action_out_proj")
    if pi05:  # older π0.5 conversions named the time MLP action_time_mlp_* (LeRobot renames them the same way)
        old = "time_mlp_in.weight" not in tensors and "action_time_mlp_in.weight" in tensors
        for name in ("time_mlp_in", "time_mlp_out"):
            rules += _linear_rules(name, f"action_{name}" if old else name)
    else:
        rules += _linear_rules("state_proj", "state_proj")
        rules += [r for name in ("action_time_mlp_in", "action_time_mlp_out") for r in _linear_rules(name, name)]
    return rules, emb


def _convert(rule: _Rule, tensors: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype, where: str) -> np.ndarray:
    """One leaf in `dtype` [shape] (a stack over layers when `rule.stacked`); one line naming a mis-shaped tensor."""
    parts = []
    for names in rule.sources:
        try:
            part = rule.convert(*(np.asarray(tensors[n], np.float32) for n in names))
        except ValueError:
            part = None
        want = shape[1:] if rule.stacked else shape
        if part is None or part.shape != want:
            got = ", ".join(f"{n} {tuple(tensors[n].shape)}" for n in names)
            raise ValueError(f"{where}: tensor {got} does not fit the model whose sizes the other tensors give "
                             f"(its openpi leaf {rule.openpi} should be {want})")
        parts.append(part.astype(dtype))
    return np.stack(parts) if rule.stacked else parts[0]


class _Opened(NamedTuple):
    """A policy folder read up to its conversion: every check done, the tensors memory-mapped."""

    directory: Path
    io: LeRobotIO
    config: ModelConfig
    rules: dict[str, _Rule]  # openpi path -> its rule
    tensors: Mapping[str, np.ndarray]
    names: str
    embedding: str
    unused: tuple[str, ...]
    where: str


def _open(path: PathLike, dtype: DType, num_heads: int, vision_heads: int | None, max_abs: float | None) -> _Opened:
    d = policy_dir(path)
    kind = _require_files(d)
    io = read_io(d)
    where = str(d / WEIGHTS)
    tensors, names = _canonical(read_safetensors(d / WEIGHTS), where)
    config = infer_config(tensors, kind, dtype=dtype, num_heads=num_heads, vision_heads=vision_heads, where=where)
    if config.siglip.image_size != io.image_resolution[0] or config.action_dim != io.max_action_dim:
        raise ValueError(f"{where}: tensors give images of {config.siglip.image_size} px and action dim "
                         f"{config.action_dim}, config.json image_resolution {io.image_resolution[0]} and max_action_dim "
                         f"{io.max_action_dim}")
    rules, emb = _rules(config, tensors)
    expected = openpi_shapes(config)
    if {r.openpi for r in rules} != set(expected):
        raise ValueError(f"{where}: the models floor's {TYPES[kind]} parameter table differs from this reader's "
                         f"({sorted({r.openpi for r in rules} ^ set(expected))[:3]}); the two must be updated together")
    needed = [n for r in rules for names_ in r.sources for n in names_]
    missing = [n for n in needed if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: missing tensor {missing[0]}{more}; LeRobot would leave it at random initialisation, "
                         "this loader refuses")
    limits.check_finite({n: tensors[n] for n in needed}, where, max_abs=max_abs)
    unused = tuple(sorted(set(tensors) - set(needed) - set(_LM_HEADS)))
    return _Opened(d, io, config, {r.openpi: r for r in rules}, tensors, names, emb, unused, where)


def _warn_unused(ck: _Opened) -> None:
    if ck.unused:
        warnings.warn(f"{ck.where}: {len(ck.unused)} tensor(s) not used by a {TYPES[ck.config.variant]} model, e.g. "
                      f"{ck.unused[0]}", stacklevel=3)


def load(path: PathLike, dtype: DType = "float32", *, num_heads: int = NUM_HEADS, vision_heads: int | None = None,
         max_abs: float | None = MAX_ABS_WEIGHT) -> LeRobotCheckpoint:
    """Restores a LeRobot π0.5 / π0 policy folder (or the folder holding its `pretrained_model/`).

    Args:
      path: the `pretrained_model` folder LeRobot writes, or its parent.
      dtype: every leaf's dtype and the config's ("float32" or "bfloat16").
      num_heads: the Gemma query heads (LeRobot: 8, fixed).
      vision_heads: SigLIP's heads; None: LeRobot's So400m (16), refused for any other SigLIP width.
      max_abs: refuse weights with |x| above it (`ckpts.openpi.MAX_ABS_WEIGHT`); None checks finiteness only.
    Returns:
      `LeRobotCheckpoint` (config, stacked params, io, what was read).
    Raises:
      ValueError: one line naming the file and the tensor, field or step at fault (module docstring).
    """
    ck = _open(path, dtype, num_heads, vision_heads, max_abs)
    expected, np_dtype = openpi_shapes(ck.config), np.dtype(ck.config.jnp_dtype)
    flat = {k: _convert(r, ck.tensors, expected[k], np_dtype, ck.where) for k, r in ck.rules.items()}
    _warn_unused(ck)
    params = from_openpi_dict(flat, ck.config, consume=True)
    return LeRobotCheckpoint(config=ck.config, params=params, io=ck.io, directory=ck.directory, tensor_names=ck.names,
                             embedding=("model." if ck.names == "lerobot" else "") + ck.embedding, unused=ck.unused)


def float_leaf_reader(path: PathLike, dtype: DType = "float32", *, num_heads: int = NUM_HEADS,
                      vision_heads: int | None = None):
    """(config, read) for converting a LeRobot π policy one leaf at a time (`oxygen_jax.quantize` streams it), after
    every check `load` makes. `read(openpi path, per_layer)` yields the leaf in `dtype` as `load` converts it, whole
    or, with `per_layer` (a stacked leaf), its layers one at a time; model.safetensors stays memory-mapped."""
    ck = _open(path, dtype, num_heads, vision_heads, MAX_ABS_WEIGHT)
    _warn_unused(ck)
    expected, np_dtype = openpi_shapes(ck.config), np.dtype(ck.config.jnp_dtype)

    def read(k: str, per_layer: bool):
        rule, shape = ck.rules[k], expected[k]
        if not (per_layer and rule.stacked):
            yield _convert(rule, ck.tensors, shape, np_dtype, ck.where)
            return
        for names in rule.sources:
            yield _convert(rule._replace(sources=(names,), stacked=False), ck.tensors, shape[1:], np_dtype, ck.where)

    return ck.config, read
