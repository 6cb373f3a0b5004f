"""Checkpoints: restoring openpi π0.5 parameters (and LoRA adapters), saving/restoring our own.

Two on-disk formats are handled, both orbax PyTree checkpoints:

* **openpi** (`load_openpi_params`, `load_openpi_lora`): an item directory `params/` whose tree is
  `{"params": <nested dict>}` with "/"-joined leaf paths such as
  `PaliGemma/llm/layers/attn/q_einsum/w` (see `params.OPENPI_PATHS`). Two layouts exist:

  - released (`gs://openpi-assets/checkpoints/<model>/params`): plain paths;
  - training (`<exp>/<step>/params`, written by an orbax CheckpointManager from an `nnx.State`):
    every leaf path carries an extra trailing `value` component, which is stripped. A LoRA
    fine-tune stores its frozen `PaliGemma/llm` leaves as bfloat16 there; every leaf is cast to
    the requested dtype on restore.

  The model dimensions are not stored anywhere: `infer_model_config` reads them off the shapes.
  LoRA leaves (`lora_a` / `lora_b`, 20 for π0.5 with LoRA on both experts) are merged into the
  base weights by default, or returned separately by `load_openpi_lora`; ranks are read off their
  shapes, alpha is not stored (see `oxygen_jax.models.lora`). Other extra keys are ignored (as openpi
  does); missing and mis-shaped keys are errors listing all of them. Norm statistics live beside
  the item in `assets/<asset_id>/norm_stats.json` (`load_openpi_norm_stats`).

* **ours** (`save_params` / `restore_params`): a composite checkpoint directory with three items,
  `params/` (the same `{"params": <nested openpi dict>}` tree, so openpi tools and
  `load_openpi_params` can read it too), `config/` (the `ModelConfig` as JSON) and `checksums/`
  (JSON: a SHA-256 of every array's bytes), so a restore needs only the path and verifies every
  array. The dtype of the result comes from the target config, not from what was stored.

Damage never loads silently and never surfaces as a TensorStore dump: every failure to read an
orbax directory (missing or garbled `_METADATA`, `_sharding` or OCDBT manifest, truncated or
garbage data files) raises `CheckpointError` (a ValueError) with one line naming the directory or
file, the leaf when known, and the cause; the orbax/TensorStore exception is kept as
`__cause__`. What orbax reads without complaint is checked too: our checkpoints against their
checksums, openpi checkpoints (which carry none) against what trained weights can be: every
value finite and |x| <= `MAX_ABS_WEIGHT`. A corrupted exponent bit (the usual visible effect of a
flipped byte) gives |x| ~ 1e17..1e38 or NaN/inf and is caught; a flip confined to low mantissa
bits of an openpi checkpoint is not detectable without a checksum.

`check_manifest` compares a parameter manifest (JSON list of openpi leaf shapes) with the tree a
config implies, LoRA leaves included, without allocating anything.

orbax-checkpoint 0.12.8 notes (all verified):
  * paths must be absolute;
  * `PyTreeCheckpointer().metadata(path)` swallows read errors (it logs them and returns an empty
    `StepMetadata`), so the handler's own `metadata()` is called, which raises them;
  * restoring a subset of the stored keys needs `PyTreeRestore(..., partial_restore=True)`;
  * `RestoreArgs(restore_type=np.ndarray, dtype=...)` restores host arrays cast to `dtype`
    (`dtype=None`: as stored);
  * the synchronous `ocp.Checkpointer` has no `wait_until_finished` (save returns when done);
  * data files are zstd-compressed OCDBT values; near-incompressible float data is stored in raw
    zstd blocks, so a flipped byte there decodes without error into a wrong value;
  * items saved inside a CheckpointManager step have no `_CHECKPOINT_METADATA` of their own, so
    reading their metadata logs an absl warning; it is harmless.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax.traverse_util import flatten_dict, unflatten_dict

from oxygen_jax.models import lora as lora_lib
from oxygen_jax.models.pi05.config import DType, ExpertConfig, ModelConfig, PromptAttention, SiglipConfig, model_config
from oxygen_jax.robots.normalize import NormStats, load_norm_stats
from oxygen_jax.models.pi05.params import (
    OPENPI_PATHS, Params, abstract_params, from_openpi_dict, openpi_shapes, to_openpi_dict,
)

PathLike = str | os.PathLike

_LLM = "PaliGemma/llm"
_IMG = "PaliGemma/img"
_BLOCK = f"{_IMG}/Transformer/encoderblock"

MAX_ABS_WEIGHT = 1e4
"""Largest |value| accepted in an openpi checkpoint leaf (`load_openpi_params(max_abs=...)`).

Trained transformer weights are O(1): projection and embedding entries are ~1e-2..1, norm scales
and biases at most O(10..100) (Gemma's RMSNorm scales are its largest). 1e4 leaves two orders of
magnitude of headroom above that, while a corrupted float32/bfloat16 exponent bit (the effect of
the flipped bytes this guards against) moves a value by a factor of 2^64..2^128 (≈ 1e17..1e38)
or makes it NaN/inf. It has not been checked against every released checkpoint: if a real leaf
exceeds it, pass a larger `max_abs` (or None to skip the check) and report it.
"""


class CheckpointError(ValueError):
    """A checkpoint directory is damaged, incomplete or holds values no trained model has.

    The message is one line naming the directory or file (and the leaf when known) and the cause;
    the underlying orbax / TensorStore exception, if any, is `__cause__`.
    """


# ---------------------------------------------------------------------------------------------
# Config inference
# ---------------------------------------------------------------------------------------------


def _shape(shapes: Mapping[str, Iterable[int]], key: str, rank: int, layout: str) -> tuple[int, ...]:
    """The shape stored under `key`, which must exist and have `rank` axes (named in `layout`)."""
    if key not in shapes:
        raise ValueError(f"cannot infer the model config: missing key {key!r}")
    shape = tuple(int(d) for d in shapes[key])
    if len(shape) != rank:
        raise ValueError(f"cannot infer the model config: {key!r} has shape {shape}, expected {layout}")
    return shape


def _infer_expert(shapes: Mapping[str, Iterable[int]], sfx: str) -> tuple[ExpertConfig, dict[str, str]]:
    q_key = f"{_LLM}/layers/attn/q_einsum{sfx}/w"
    kv_key = f"{_LLM}/layers/attn/kv_einsum{sfx}/w"
    mlp_key = f"{_LLM}/layers/mlp{sfx}/gating_einsum"
    depth, heads, width, head_dim = _shape(shapes, q_key, 4, "[L, N, D, H]")
    kv_heads = _shape(shapes, kv_key, 5, "[L, 2, K, D, H]")[2]
    mlp_dim = _shape(shapes, mlp_key, 4, "[L, 2, D, F]")[3]
    # Which key each field was read from, for error messages.
    source = {"depth": q_key, "num_heads": q_key, "head_dim": q_key, "num_kv_heads": kv_key}
    try:
        expert = ExpertConfig(
            width=width, depth=depth, mlp_dim=mlp_dim, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim
        )
    except ValueError as e:
        raise ValueError(f"invalid expert dimensions from {q_key!r}, {kv_key!r}, {mlp_key!r}: {e}") from e
    return expert, source


def _infer_siglip(shapes: Mapping[str, Iterable[int]]) -> SiglipConfig:
    stem_key = f"{_IMG}/embedding/kernel"
    q_key = f"{_BLOCK}/MultiHeadDotProductAttention_0/query/kernel"
    mlp_key = f"{_BLOCK}/MlpBlock_0/Dense_0/kernel"
    pos_key = f"{_IMG}/pos_embedding"
    ph, pw, channels, width = _shape(shapes, stem_key, 4, "[p, p, 3, W] (HWIO)")
    if ph != pw or channels != 3:
        raise ValueError(
            f"{stem_key!r} has shape {(ph, pw, channels, width)}: expected a square RGB patch [p, p, 3, W]"
        )
    depth, q_width, heads, head_dim = _shape(shapes, q_key, 4, "[L, W, Nv, Hv]")
    if q_width != width:
        raise ValueError(f"{q_key!r} has width {q_width} but {stem_key!r} has width {width}")
    if heads * head_dim != width:
        # SiglipConfig has no head_dim field: it derives head_dim = width // num_heads.
        raise ValueError(
            f"{q_key!r} has shape {(depth, q_width, heads, head_dim)}: SigLIP head_dim {head_dim} x heads {heads} "
            f"!= width {width}; SiglipConfig derives head_dim = width // num_heads and cannot represent this"
        )
    mlp_dim = _shape(shapes, mlp_key, 3, "[L, W, Fv]")[2]
    num_patches = _shape(shapes, pos_key, 3, "[1, Np, W]")[1]
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(f"{pos_key!r} has {num_patches} patches, not a square grid: cannot infer image_size")
    try:
        return SiglipConfig(
            width=width, depth=depth, mlp_dim=mlp_dim, num_heads=heads, patch_size=ph, image_size=side * ph
        )
    except ValueError as e:
        keys = ", ".join(repr(k) for k in (stem_key, q_key, mlp_key, pos_key))
        raise ValueError(f"invalid SigLIP dimensions from {keys}: {e}") from e


def infer_model_config(
    shapes: Mapping[str, Iterable[int]],
    *,
    dtype: DType = "float32",
    prompt_attention: PromptAttention = "bidirectional",
) -> ModelConfig:
    """Infers a π0.5 `ModelConfig` from openpi parameter shapes.

    Each dimension is read from one key (Gemma experts from `q_einsum`/`kv_einsum`/`gating_einsum`,
    vocabulary from the embedder, SigLIP from the stem kernel, the stacked query kernel, the first
    MLP kernel and `pos_embedding`, action_dim from `action_in_proj`). The remaining keys are not
    cross-checked here: pass the shapes to `from_openpi_dict` or `check_manifest` for that, which
    list every mismatch with both shapes.

    Args:
      shapes: {openpi path: shape}, paths as in `params.OPENPI_PATHS` (no `params/` prefix, no
        trailing `value`). Extra keys are ignored.
      dtype: `ModelConfig.dtype` of the result.
      prompt_attention: `ModelConfig.prompt_attention` of the result.

    Raises:
      ValueError: naming the key that is missing, has the wrong rank, or disagrees with another.

    Example: `infer_model_config(openpi_shapes(model_config("pi05")))` == `model_config("pi05")`.
    """
    vlm, vlm_src = _infer_expert(shapes, "")
    act, act_src = _infer_expert(shapes, "_1")
    for field, key in vlm_src.items():
        a, b = getattr(vlm, field), getattr(act, field)
        if a != b:
            raise ValueError(
                f"the experts attend jointly and must share {field}: {key!r} gives {a}, {act_src[field]!r} gives {b}"
            )
    emb_key = f"{_LLM}/embedder/input_embedding"
    vocab = _shape(shapes, emb_key, 2, "[V, D]")[0]
    action_dim = _shape(shapes, "action_in_proj/kernel", 2, "[A, D_act]")[0]
    siglip = _infer_siglip(shapes)
    try:
        return ModelConfig(
            vlm=vlm, action_expert=act, siglip=siglip, vocab_size=vocab, action_dim=action_dim,
            dtype=dtype, prompt_attention=prompt_attention,
        )
    except ValueError as e:
        raise ValueError(f"checkpoint shapes give an invalid ModelConfig: {e}") from e


# ---------------------------------------------------------------------------------------------
# openpi checkpoints
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Reading orbax directories without silent damage
# ---------------------------------------------------------------------------------------------


def _is_pytree_item(path: Path) -> bool:
    # `_METADATA` is the PyTree handler's tree metadata; `checkpoint` is the pre-OCDBT msgpack file.
    return (path / "_METADATA").is_file() or (path / "checkpoint").is_file()


def _looks_like_item(path: Path) -> bool:
    """An orbax PyTree item that may have lost its `_METADATA` (its other parts are there)."""
    return (path / "manifest.ocdbt").exists() or any(path.glob("ocdbt.process_*")) or (path / "_sharding").exists()


def _resolve_params_item(path: PathLike) -> Path:
    """The absolute `params` item directory for a params dir, a step dir or a checkpoint root."""
    p = Path(path).expanduser().resolve()  # orbax refuses relative paths
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {p}")
    if not p.is_dir():
        raise ValueError(f"checkpoint path is not a directory: {p}")
    if _is_pytree_item(p):
        return p
    sub = p / "params"
    for item in (p, sub):
        if item.is_dir() and not _is_pytree_item(item) and _looks_like_item(item):
            raise CheckpointError(f"{item / '_METADATA'} is missing: the checkpoint item is incomplete (tree metadata lost)")
    if sub.is_dir():
        if _is_pytree_item(sub):
            return sub
        raise ValueError(f"{sub} is not an orbax PyTree checkpoint (no _METADATA file)")
    if (p / "_CHECKPOINT_METADATA").is_file():
        items = sorted(c.name for c in p.iterdir() if c.is_dir())
        raise ValueError(f"orbax checkpoint {p} has no 'params' item (items present: {items})")
    raise ValueError(
        f"{p} is not an orbax checkpoint: expected a PyTree item (with a _METADATA file) or a directory "
        f"containing params/"
    )


def _one_line(e: BaseException, limit: int = 400) -> str:
    """An exception as one short line: TensorStore's `[tensorstore_spec=...]` tail and newlines dropped."""
    text = re.split(r"\s*\[tensorstore_spec=", str(e), maxsplit=1)[0]
    text = " ".join(text.split()) or type(e).__name__
    if not text.startswith(type(e).__name__) and not re.match(r"[A-Z_]+:", text):
        text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_json_file(path: Path, what: str, required_key: str | None = None) -> None:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        cause = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else _one_line(e, 120)
        raise CheckpointError(f"{path} is garbled ({what} is not valid JSON: {cause}); the checkpoint is damaged") from e
    if required_key is not None and (not isinstance(data, dict) or required_key not in data):
        raise CheckpointError(f"{path} is garbled ({what} has no {required_key!r} entry); the checkpoint is damaged")


def _check_item_files(item: Path) -> None:
    """Cheap structural checks of a PyTree item that name the broken file (orbax's errors do not)."""
    if not (item / "_METADATA").is_file():
        if (item / "checkpoint").is_file():
            return  # pre-OCDBT msgpack layout: nothing more to check here
        raise CheckpointError(f"{item / '_METADATA'} is missing: the checkpoint item is incomplete (tree metadata lost)")
    _check_json_file(item / "_METADATA", "the tree metadata", "tree_metadata")
    if (item / "_sharding").exists():
        _check_json_file(item / "_sharding", "the sharding metadata")
    if any(item.glob("ocdbt.process_*")) and not (item / "manifest.ocdbt").is_file():
        raise CheckpointError(
            f"{item / 'manifest.ocdbt'} is missing: the OCDBT index of the arrays is lost; the checkpoint is incomplete"
        )


def _quiet_late_orbax_callbacks() -> None:
    """Silences the echo of a failed restore: TensorStore reads still in flight complete into
    orbax's already closed asyncio loop, and Python prints each resulting "RuntimeError: Event
    loop is closed" as an unraisable exception (screens of tracebacks after the one-line error).
    Installed only once a restore has failed; drops exactly those, passes the rest on."""
    previous = sys.unraisablehook
    if getattr(previous, "_oxygen_quiet", False):
        return

    def hook(unraisable):
        if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
            return
        previous(unraisable)

    hook._oxygen_quiet = True
    sys.unraisablehook = hook


def _read_tree_metadata(item: Path) -> Mapping[str, Any]:
    """The stored tree of array metadata (nested dicts), raising `CheckpointError` on any damage."""
    _check_item_files(item)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        meta = handler.metadata(item)
    except Exception as e:  # orbax/TensorStore raise assorted types for damaged directories
        _quiet_late_orbax_callbacks()
        raise CheckpointError(
            f"{item}: cannot read the checkpoint's metadata, it is damaged or incomplete: {_one_line(e)}"
        ) from e
    finally:
        handler.close()
    # 0.12.8 returns a tree-metadata object (dict-like, not a Mapping; the dict is `.tree`).
    tree = getattr(meta, "tree", meta)
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"{item}: the checkpoint's metadata holds no tree (found: {type(tree).__name__})")
    return tree


def _leaf_from_tensorstore(message: str) -> str | None:
    """The "/"-joined leaf path of an array named in a TensorStore error ("params.a.b.value/0.0")."""
    m = re.search(r'"([A-Za-z0-9_.\-]+)/[0-9.]+"', message)
    if not m:
        return None
    parts = m.group(1).split(".")
    if parts and parts[0] == "params":
        parts = parts[1:]
    if parts and parts[-1] == "value":
        parts = parts[:-1]
    return "/".join(parts) or None


def _restore_arrays(item: Path, stored: Mapping[tuple[str, ...], Any], partial: bool) -> dict[tuple[str, ...], np.ndarray]:
    """Restores the arrays at the stored key paths as host numpy arrays.

    Args:
      stored: {stored key path: numpy dtype to cast to, or None for the stored dtype}.
      partial: the item holds other keys too.
    """
    target = unflatten_dict({k: 0 for k in stored})
    restore_args = unflatten_dict({k: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dt) for k, dt in stored.items()})
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            item, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=partial)
        )
    except Exception as e:
        _quiet_late_orbax_callbacks()
        leaf = _leaf_from_tensorstore(str(e))
        where = f"array {leaf!r}" if leaf else "an array"
        raise CheckpointError(f"{item}: cannot read {where}, the checkpoint is damaged or incomplete: {_one_line(e)}") from e
    return {k: np.asarray(v) for k, v in flatten_dict(restored).items()}


def _abs_bits(x: np.ndarray) -> np.ndarray:
    """|x| as unsigned integers, ordered like |x| for finite values; NaN/inf above every finite one."""
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
    return x.view(uint) & uint((1 << (8 * x.dtype.itemsize - 1)) - 1)


def _check_values(item: Path, arrays: Mapping[str, np.ndarray], max_abs: float | None) -> None:
    """Raises `CheckpointError` naming the first leaf with a non-finite value or |x| > max_abs.

    One integer pass per leaf (the bits of |x| are ordered like |x|), so this costs about one
    read of the parameters.
    """
    for path, x in arrays.items():
        if not (np.issubdtype(x.dtype, np.floating) or x.dtype.kind == "V" or "float" in x.dtype.name) or x.size == 0:
            continue
        inf_bits = _abs_bits(np.asarray(np.inf, x.dtype).reshape(1))[0]
        limit = inf_bits - 1 if max_abs is None else min(_abs_bits(np.asarray(max_abs, x.dtype).reshape(1))[0], inf_bits - 1)
        if _abs_bits(np.ascontiguousarray(x).reshape(-1)).max() <= limit:
            continue
        x32 = x.astype(np.float32)
        bad = int(np.count_nonzero(~np.isfinite(x32)))
        if bad:
            raise CheckpointError(
                f"{item}: leaf {path!r} holds {bad} non-finite value(s) (NaN/inf) among {x.size}; the checkpoint is damaged"
            )
        top = float(np.max(np.abs(x32)))
        raise CheckpointError(
            f"{item}: leaf {path!r} has max |x| = {top:.3g}, above {max_abs:g}, which no trained weight reaches; the "
            f"checkpoint is damaged (if this is a genuine weight, pass a larger max_abs)"
        )


# ---------------------------------------------------------------------------------------------
# openpi checkpoints
# ---------------------------------------------------------------------------------------------


def _read_openpi_metadata(item: Path) -> tuple[dict[str, Any], bool]:
    """({openpi path: array metadata}, whether stored paths carry a trailing `value`)."""
    tree = _read_tree_metadata(item)
    if "params" not in tree or not isinstance(tree["params"], Mapping):
        raise ValueError(f"orbax checkpoint {item} has no 'params' entry at the top of its tree (found: {sorted(tree)})")
    flat = flatten_dict(tree["params"])
    if not flat:
        raise ValueError(f"orbax checkpoint {item} has an empty 'params' tree")
    # nnx.State serialisation appends `value` to every leaf; only strip when all leaves have it.
    has_value = all(len(k) > 1 and k[-1] == "value" for k in flat)
    if has_value:
        flat = {k[:-1]: v for k, v in flat.items()}
    return {"/".join(k): v for k, v in flat.items()}, has_value


def _missing_report(missing: list[str]) -> str:
    return f"  missing ({len(missing)}):\n" + "\n".join(f"    {k}" for k in missing)


@dataclasses.dataclass(frozen=True)
class _OpenpiItem:
    item: Path
    meta: dict[str, Any]  # {openpi path: array metadata}
    has_value: bool
    config: ModelConfig
    lora_paths: tuple[str, ...]

    def restore(self, dtypes: Mapping[str, Any], max_abs: float | None) -> dict[str, np.ndarray]:
        """{openpi path: host array} for the paths in `dtypes` (each cast to its dtype), value-checked."""
        suffix = ("value",) if self.has_value else ()
        stored = {("params", *k.split("/"), *suffix): dt for k, dt in dtypes.items()}
        flat = _restore_arrays(self.item, stored, partial=len(stored) < len(self.meta))
        arrays = {"/".join(k[1 : len(k) - len(suffix)]): v for k, v in flat.items()}
        _check_values(self.item, arrays, max_abs)
        return arrays


def _open_openpi(path: PathLike, dtype: DType, prompt_attention: PromptAttention) -> _OpenpiItem:
    """Reads the metadata, infers the config and checks every key and shape (LoRA included)."""
    item = _resolve_params_item(path)
    meta, has_value = _read_openpi_metadata(item)
    missing = [k for k in OPENPI_PATHS if k not in meta]
    shapes = {k: tuple(m.shape) for k, m in meta.items()}
    try:
        config = infer_model_config(shapes, dtype=dtype, prompt_attention=prompt_attention)
    except ValueError as e:
        if missing:  # report every missing key, not only the first one inference tripped on
            report = _missing_report(missing)
            raise ValueError(f"openpi checkpoint {item} does not match the π0.5 tree:\n{report}") from e
        raise ValueError(f"openpi checkpoint {item}: {e}") from e
    # Check keys and shapes from the metadata before reading any array.
    np_dtype = np.dtype(config.jnp_dtype)
    try:
        from_openpi_dict({k: jax.ShapeDtypeStruct(shapes[k], np_dtype) for k in OPENPI_PATHS if k in meta}, config)
    except ValueError as e:
        raise ValueError(f"openpi checkpoint {item}: {e}") from e
    lora_problems = lora_lib.check_openpi_shapes(shapes, config)
    if lora_problems:
        lines = "\n".join(f"    {p}" for p in lora_problems)
        raise ValueError(f"openpi checkpoint {item}: LoRA leaves do not fit the model:\n{lines}")
    lora_paths = tuple(sorted(k for k in meta if lora_lib.is_lora_path(k)))
    return _OpenpiItem(item=item, meta=meta, has_value=has_value, config=config, lora_paths=lora_paths)


LoraMode = Literal["merge", "ignore"]


def load_openpi_params(
    path: PathLike,
    *,
    dtype: DType = "float32",
    prompt_attention: PromptAttention = "bidirectional",
    lora: LoraMode = "merge",
    lora_alpha: float | Mapping[str, float | None] | None = None,
    lora_rslora: bool = False,
    max_abs: float | None = MAX_ABS_WEIGHT,
) -> tuple[ModelConfig, Params]:
    """Restores an openpi π0.5 checkpoint, every leaf cast to `dtype`.

    Keys and shapes (LoRA leaves included) are checked from the orbax metadata before any array
    is read; arrays are then restored as host numpy arrays, checked for damage (non-finite values,
    |x| > `max_abs`) and handed to `params.from_openpi_dict`.

    Args:
      path: an openpi `params` item directory (released or training layout), or a directory that
        contains one (a training step directory such as `<exp>/<step>`, or a released checkpoint
        root with `params/` and `assets/`). Relative paths are resolved.
      dtype: every leaf is cast to this on restore ("float32" or "bfloat16"), as openpi's
        inference restore does; it is also the returned config's dtype.
      prompt_attention: the returned config's prompt attention ("bidirectional" = openpi).
      lora: what to do with LoRA leaves, if the checkpoint has any. "merge" (default): fold them
        into the base weights (`lora.merge`, computed in float32 before the cast to `dtype`), which
        gives the model openpi runs; "ignore": return the base weights only. For the adapters as
        a pytree, call `load_openpi_lora` (e.g. with `lora="ignore"` here: base + separate).
      lora_alpha: the alpha the adapters were trained with (not stored in checkpoints): one number
        for both experts, or {"vlm": a0, "action_expert": a1}; None = rank, i.e. scaling 1 (all of
        openpi's LoRA variants). Only the attention LoRA depends on it.
      lora_rslora: the adapters were trained with rank-stabilised scaling (alpha / sqrt(rank)).
      max_abs: refuse leaves with |x| above this (`MAX_ABS_WEIGHT`); None checks finiteness only.

    Returns:
      (config inferred from the stored shapes, `Params` built by `from_openpi_dict`, whose leaves
      are arrays in `config.dtype`).

    Raises:
      FileNotFoundError: `path` does not exist.
      CheckpointError: a damaged or incomplete orbax directory, or a leaf holding NaN/inf or
        |x| > max_abs (one line naming the file or leaf).
      ValueError: not an orbax checkpoint, no `params` item, or keys missing / mis-shaped (every
        such key is listed, with expected and stored shapes). Extra non-LoRA keys are ignored.
    """
    if lora not in ("merge", "ignore"):
        raise ValueError(f"lora must be 'merge' or 'ignore', got {lora!r} (adapters as a pytree: load_openpi_lora)")
    ck = _open_openpi(path, dtype, prompt_attention)
    config = ck.config
    np_dtype = np.dtype(config.jnp_dtype)
    merging = lora == "merge" and bool(ck.lora_paths)
    dtypes = {k: np_dtype for k in OPENPI_PATHS}
    if merging:  # merge in float32; the merged weights are cast to `dtype` by from_openpi_dict
        targets = {lora_lib.openpi_weight_path(t, sfx) for _, sfx in lora_lib.EXPERTS for t in lora_lib.TARGETS}
        dtypes.update({k: np.dtype(np.float32) for k in (*targets, *ck.lora_paths) if k in ck.meta})
    arrays = ck.restore(dtypes, max_abs)
    if merging:
        adapters = lora_lib.from_openpi(arrays, config, alpha=lora_alpha, rslora=lora_rslora)
        arrays = lora_lib.merge_openpi(arrays, adapters, dtype=np_dtype)
    return config, from_openpi_dict({k: arrays[k] for k in OPENPI_PATHS}, config)


def load_openpi_lora(
    path: PathLike,
    *,
    dtype: DType = "float32",
    alpha: float | Mapping[str, float | None] | None = None,
    rslora: bool = False,
    max_abs: float | None = MAX_ABS_WEIGHT,
) -> lora_lib.ModelLora | None:
    """The LoRA adapters of an openpi checkpoint as a pytree, without the base weights.

    `load_openpi_params(path, lora="ignore")` gives the matching base parameters. A VLM bank for
    per-row serving: `lora.stack_adapters([adapters.vlm], config)`.

    Args:
      path: as for `load_openpi_params` (either layout).
      dtype: leaf dtype of the adapters.
      alpha, rslora: as `lora_alpha`, `lora_rslora` of `load_openpi_params`.
      max_abs: as for `load_openpi_params`.

    Returns:
      `lora.ModelLora` (an expert without LoRA leaves is None; leaves are openpi's, [L, ...]), or
      None when the checkpoint has no LoRA leaf.
    """
    ck = _open_openpi(path, dtype, "bidirectional")
    if not ck.lora_paths:
        return None
    arrays = ck.restore({k: np.dtype(ck.config.jnp_dtype) for k in ck.lora_paths}, max_abs)
    return lora_lib.from_openpi(jax.device_put(arrays), ck.config, alpha=alpha, rslora=rslora)


def _assets_dir(checkpoint_dir: Path) -> Path | None:
    """`assets/` inside a checkpoint root / step dir, or beside the `params` item we were handed."""
    if (checkpoint_dir / "assets").is_dir():
        return checkpoint_dir / "assets"
    if _is_pytree_item(checkpoint_dir) and (checkpoint_dir.parent / "assets").is_dir():
        return checkpoint_dir.parent / "assets"
    return None


def load_openpi_norm_stats(checkpoint_dir: PathLike, asset_id: str | None = None) -> dict[str, NormStats] | None:
    """Reads `assets/<asset_id>/norm_stats.json` of an openpi checkpoint.

    Args:
      checkpoint_dir: the checkpoint root or step directory (containing `params/` and `assets/`),
        or the `params` item itself (then `assets/` is its sibling).
      asset_id: the asset directory, relative to `assets/` (may contain "/", e.g. a dataset repo id).
        Default: the only one present.

    Returns:
      `normalize.load_norm_stats` of that file ({"state": NormStats, "actions": NormStats}), or None
      when the checkpoint has no norm stats at all (no `assets/`, or no norm_stats.json in it).

    Raises:
      FileNotFoundError: `checkpoint_dir` does not exist, or `asset_id` was given and not found.
      ValueError: several asset ids are present and none was chosen.
    """
    root = Path(checkpoint_dir).expanduser().resolve()
    if not root.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {root}")
    assets = _assets_dir(root)
    found = (
        sorted(str(p.parent.relative_to(assets)) for p in assets.rglob("norm_stats.json")) if assets else []
    )
    if asset_id is None:
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"{assets} holds norm stats for several asset ids {found}; pass asset_id=")
        asset_id = found[0]
    elif asset_id not in found:
        raise FileNotFoundError(f"no norm_stats.json for asset id {asset_id!r} under {assets or root} (found {found})")
    return load_norm_stats(assets / asset_id / "norm_stats.json")




# ---------------------------------------------------------------------------------------------
# Our own checkpoints
# ---------------------------------------------------------------------------------------------


def _config_to_json(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def _config_from_json(d: Mapping[str, Any]) -> ModelConfig:
    d = dict(d)
    return ModelConfig(
        vlm=ExpertConfig(**d.pop("vlm")),
        action_expert=ExpertConfig(**d.pop("action_expert")),
        siglip=SiglipConfig(**d.pop("siglip")),
        **d,
    )




def _nested_openpi(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`{"params": nested dict}` from {openpi path: leaf}: openpi's stored tree, so openpi tools read ours."""
    return unflatten_dict({("params", *k.split("/")): v for k, v in flat.items()})


_CHECKSUM_FORMAT = 1


def _array_sha256(x) -> str:
    """SHA-256 of an array's bytes in its own dtype, C order, little-endian (the canonical form)."""
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    if a.dtype.itemsize > 1 and (a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big")):
        a = a.byteswap()
    return hashlib.sha256(a.view(np.uint8)).hexdigest()


def _checksums(flat: Mapping[str, Any]) -> dict:
    leaves = {}
    for k, v in flat.items():
        host = np.asarray(v)
        leaves[k] = {"dtype": host.dtype.name, "shape": list(host.shape), "sha256": _array_sha256(host)}
    return {"format": _CHECKSUM_FORMAT, "algorithm": "sha256", "byte_order": "little", "leaves": leaves}


def _verify_checksums(src: Path, arrays: Mapping[str, np.ndarray], sums: Mapping[str, Any]) -> None:
    """Raises `CheckpointError` naming the first leaf whose bytes differ from its stored checksum."""
    if sums.get("format") != _CHECKSUM_FORMAT or not isinstance(sums.get("leaves"), Mapping):
        raise CheckpointError(
            f"{src / 'checksums'}: unknown checksum format {sums.get('format')!r}; the checkpoint is damaged or newer "
            "than this code"
        )
    leaves = sums["leaves"]
    for path, x in arrays.items():
        entry = leaves.get(path)
        if entry is None:
            raise CheckpointError(f"{src}: leaf {path!r} has no stored checksum; the checkpoint is damaged")
        if entry.get("dtype") != x.dtype.name or tuple(entry.get("shape", ())) != x.shape:
            raise CheckpointError(
                f"{src}: leaf {path!r} is stored as {x.dtype.name}{list(x.shape)} but was saved as "
                f"{entry.get('dtype')}{entry.get('shape')}; the checkpoint is damaged"
            )
        if _array_sha256(x) != entry.get("sha256"):
            raise CheckpointError(
                f"{src}: leaf {path!r} ({x.dtype.name}{list(x.shape)}) does not match its saved SHA-256: the checkpoint is "
                "damaged; restore it from a good copy"
            )


def save_params(
    path: PathLike, params: Params, config: ModelConfig | None = None, *, overwrite: bool = False
) -> Path:
    """Saves `params`, its config and per-array checksums to the new directory `path`.

    Items `params/` (openpi's tree, so `load_openpi_params(path)` reads it as well), `config/`
    (JSON) and `checksums/` (JSON: SHA-256 of every array's bytes, verified by `restore_params`).
    The write is atomic (orbax writes a temporary directory and renames it) and finished when this
    returns.

    Args:
      path: destination directory; must not exist unless `overwrite`.
      params: the parameters; leaf shapes must match the config (checked).
      config: stored as JSON beside the arrays, so `restore_params(path)` needs nothing else.
        Default: `params.config`.
      overwrite: replace an existing directory.

    Returns:
      The absolute checkpoint path.
    """
    dest = Path(path).expanduser().resolve()  # orbax refuses relative paths
    if dest.exists() and not overwrite:
        raise FileExistsError(f"checkpoint directory already exists: {dest} (pass overwrite=True to replace it)")
    config = params.config if config is None else config
    flat = to_openpi_dict(params)
    from_openpi_dict({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in flat.items()}, config)  # shapes
    flat = {k: np.asarray(v) for k, v in flat.items()}  # one device-to-host copy, hashed and written
    # The synchronous Checkpointer has finished writing when save() returns (the async ones need
    # wait_until_finished()).
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        checkpointer.save(
            dest,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(_nested_openpi(flat)),
                config=ocp.args.JsonSave(_config_to_json(config)),
                checksums=ocp.args.JsonSave(_checksums(flat)),
            ),
            force=overwrite,
        )
    finally:
        checkpointer.close()
    return dest


def _read_json_item(src: Path, name: str) -> Any:
    """A JsonSave item of a composite checkpoint (the file `<name>/metadata`)."""
    path = src / name / "metadata"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint's {name} item is incomplete")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:
        cause = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else _one_line(e, 120)
        raise CheckpointError(f"{path} is garbled (not valid JSON: {cause}); the checkpoint is damaged") from e


def restore_params(path: PathLike, config: ModelConfig | None = None) -> tuple[ModelConfig, Params]:
    """Restores a checkpoint written by `save_params`, verifying every array against its checksum.

    Args:
      path: the directory passed to `save_params`.
      config: target config; default the stored one. Its dimensions must equal the stored ones;
        its dtype decides the restored dtype (arrays are verified as stored, then cast), e.g.
        `restore_params(p, stored.replace(dtype="bfloat16"))`.

    Returns:
      (config, `Params` of `jax.Array` leaves in `config.dtype`).

    Raises:
      FileNotFoundError: `path` does not exist.
      CheckpointError: a damaged directory or an array whose bytes differ from its checksum (one
        line naming the file or leaf). Checkpoints written before checksums existed load with a
        UserWarning and unverified arrays.
      ValueError: not our checkpoint, or `config` dimensions differ from the stored ones.
    """
    src = Path(path).expanduser().resolve()
    if not src.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {src}")
    if not (src / "params").is_dir():
        raise ValueError(f"{src} is not an oxygen_jax checkpoint: no params/ item")
    stored = _config_from_json(_read_json_item(src, "config")) if (src / "config").is_dir() else None
    if config is None:
        if stored is None:
            raise ValueError(f"{src} has no config/ item; pass config= (or use load_openpi_params)")
        config = stored
    elif stored is not None:
        want, have = openpi_shapes(config), openpi_shapes(stored)
        diff = [f"    {k}: stored {have[k]}, requested {want[k]}" for k in want if want[k] != have[k]]
        if diff:
            lines = "\n".join(diff)
            raise ValueError(f"{src}: the requested config's dimensions differ from the stored ones:\n{lines}")
    sums = _read_json_item(src, "checksums") if (src / "checksums").exists() else None
    if sums is None:
        warnings.warn(
            f"{src} has no checksums/ item (written before checksums were added): its arrays cannot be verified; "
            "save it again with save_params to add them",
            stacklevel=2,
        )
    item = src / "params"
    tree = _read_tree_metadata(item)
    meta = flatten_dict(tree.get("params", {})) if isinstance(tree.get("params"), Mapping) else {}
    want_paths = {tuple(k.split("/")) for k in OPENPI_PATHS}
    missing = sorted("/".join(k) for k in want_paths - set(meta))
    if missing:
        raise CheckpointError(
            f"{item}: the stored tree lacks {len(missing)} leaves (e.g. {missing[0]!r}); the checkpoint is damaged"
        )
    # Restore as stored (the checksums are of the stored bytes), then cast to the target dtype.
    flat = _restore_arrays(item, {("params", *k): None for k in want_paths}, partial=len(meta) > len(want_paths))
    arrays = {"/".join(k[1:]): v for k, v in flat.items()}
    if sums is not None:
        _verify_checksums(src, arrays, sums)
    np_dtype = np.dtype(config.jnp_dtype)  # cast on the host: no device program per leaf shape
    return config, from_openpi_dict({k: v.astype(np_dtype, copy=False) for k, v in arrays.items()}, config)


# ---------------------------------------------------------------------------------------------
# Manifest check
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ManifestRow:
    """One leaf of a manifest comparison. `expected`/`got` is None where the leaf is absent."""

    path: str
    expected: tuple[int, ...] | None
    got: tuple[int, ...] | None
    ok: bool
    note: str = ""  # "missing", "unexpected", "mis-shaped", "LoRA leaf", "mis-shaped LoRA leaf", "unknown LoRA leaf"


@dataclasses.dataclass(frozen=True)
class ManifestCheck:
    """Result of `check_manifest`.

    Attributes:
      config: the config the manifest was compared with (given or inferred).
      rows: one row per leaf in the manifest or the expected tree (our table order, then extras).
      preset: name of the preset also compared with (None if skipped).
      preset_rows: the rows that differ from the preset's abstract tree (empty = exact match).
    """

    config: ModelConfig
    rows: tuple[ManifestRow, ...]
    preset: str | None = None
    preset_rows: tuple[ManifestRow, ...] = ()

    def _with(self, note: str) -> list[ManifestRow]:
        return [r for r in self.rows if r.note == note]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def matches_preset(self) -> bool:
        return self.preset is not None and not self.preset_rows

    @property
    def missing(self) -> list[ManifestRow]:
        return self._with("missing")

    @property
    def unexpected(self) -> list[ManifestRow]:
        return self._with("unexpected")

    @property
    def misshaped(self) -> list[ManifestRow]:
        return self._with("mis-shaped")

    @property
    def lora(self) -> list[ManifestRow]:
        """Every LoRA row (fitting or not)."""
        return [r for r in self.rows if "LoRA" in r.note]

    def summary(self) -> str:
        lines = [f"{sum(r.ok for r in self.rows)}/{len(self.rows)} leaves ok"]
        if self.lora:
            lines[0] += f" ({len(self.lora)} LoRA leaves)"
        lines += [f"  {r.note}: {r.path} expected {r.expected} got {r.got}" for r in self.rows if not r.ok]
        if self.preset is not None:
            lines.append(f"preset {self.preset!r}: {'exact match' if self.matches_preset else 'differs'}")
            lines += [f"  {r.note}: {r.path} preset {r.expected} got {r.got}" for r in self.preset_rows]
        return "\n".join(lines)


def load_params(path: PathLike, *, dtype: DType = "float32", prompt_attention: PromptAttention = "bidirectional"
                ) -> tuple[ModelConfig, Params, str]:
    """Parameters from either kind of checkpoint directory, restored once in `dtype`: (config, params, kind).

    An oxygen_jax checkpoint (`save_params`, it has a config/ item) keeps its dimensions and takes `dtype`
    and `prompt_attention`; anything else is read as openpi's (`load_openpi_params`). `kind` is
    "checkpoint" or "openpi checkpoint", for messages. The entry points (run, serve) load through here.
    """
    src = Path(path).expanduser()
    if (src / "config").is_dir():
        stored = _config_from_json(_read_json_item(src.resolve(), "config"))
        cfg, params = restore_params(src, stored.replace(dtype=dtype, prompt_attention=prompt_attention))
        return cfg, params, "checkpoint"
    cfg, params = load_openpi_params(src, dtype=dtype, prompt_attention=prompt_attention)
    return cfg, params, "openpi checkpoint"

def _compare(
    got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], config: ModelConfig
) -> list[ManifestRow]:
    rows = []
    for k, exp in expected.items():
        g = got.get(k)
        if g is None:
            rows.append(ManifestRow(k, exp, None, False, "missing"))
        else:
            rows.append(ManifestRow(k, exp, g, g == exp, "" if g == exp else "mis-shaped"))
    lora_expected = lora_lib.expected_openpi_shapes(got, config)  # ranks inferred from the manifest
    for k in sorted(set(got) - set(expected)):
        if k not in lora_expected:
            rows.append(ManifestRow(k, None, got[k], False, "unexpected"))
        elif lora_expected[k] is None:
            rows.append(ManifestRow(k, None, got[k], False, "unknown LoRA leaf"))
        else:
            ok = got[k] == lora_expected[k]
            rows.append(ManifestRow(k, lora_expected[k], got[k], ok, "LoRA leaf" if ok else "mis-shaped LoRA leaf"))
    return rows


def check_manifest(
    manifest_path: PathLike,
    config: ModelConfig | None = None,
    *,
    preset: str | None = "pi05",
) -> ManifestCheck:
    """Compares a parameter manifest with the π0.5 tree, allocating nothing.

    The manifest is JSON with `"leaves": {openpi path: {"shape": [...], "dtype": ...}}` (the format
    of the shared `pi05_param_manifest.json` and `pi05_lora_param_manifest.json`). LoRA leaves are
    checked against the shapes their expert and rank imply (ranks read off the `lora_a` leaves).

    Args:
      manifest_path: the manifest file.
      config: compared with `openpi_shapes(config)`; default: inferred from the manifest.
      preset: also compare with this preset's abstract tree (`jax.eval_shape` of the parameter
        init, flattened with `to_openpi_dict`); None skips it.

    Returns:
      A `ManifestCheck`; `.ok` is True when every leaf matches.
    """
    with open(Path(manifest_path).expanduser()) as f:
        manifest = json.load(f)
    if "leaves" not in manifest:
        raise ValueError(f"{manifest_path}: not a parameter manifest (no 'leaves' entry)")
    got = {k: tuple(int(d) for d in v["shape"]) for k, v in manifest["leaves"].items()}
    if config is None:
        config = infer_model_config(got)
    rows = _compare(got, openpi_shapes(config), config)
    preset_rows: list[ManifestRow] = []
    if preset is not None:
        preset_config = model_config(preset)
        tree = to_openpi_dict(abstract_params(preset_config))  # eval_shape: no allocation
        preset_shapes = {k: tuple(v.shape) for k, v in tree.items()}
        preset_rows = [r for r in _compare(got, preset_shapes, preset_config) if not r.ok]
    return ManifestCheck(config=config, rows=tuple(rows), preset=preset, preset_rows=tuple(preset_rows))
