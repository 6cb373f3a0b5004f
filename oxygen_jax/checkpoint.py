"""Checkpoints: restoring openpi π0.5 parameters, and saving/restoring our own.

Two on-disk formats are handled, both orbax PyTree checkpoints:

* **openpi** (`load_openpi_params`): an item directory `params/` whose tree is
  `{"params": <nested dict>}` with "/"-joined leaf paths such as
  `PaliGemma/llm/layers/attn/q_einsum/w` (see `params.OPENPI_PATHS`). Two layouts exist:

  - released (`gs://openpi-assets/checkpoints/<model>/params`): plain paths;
  - training (`<exp>/<step>/params`, written by an orbax CheckpointManager from an `nnx.State`):
    every leaf path carries an extra trailing `value` component, which is stripped.

  The model dimensions are not stored anywhere: `infer_model_config` reads them off the shapes.
  Extra keys are ignored (as openpi does); missing and mis-shaped keys are errors listing all of
  them. Norm statistics live beside the item in `assets/<asset_id>/norm_stats.json`
  (`load_openpi_norm_stats`).

* **ours** (`save_params` / `restore_params`): a composite checkpoint directory with two items,
  `params/` (the same `{"params": <nested openpi dict>}` tree, so openpi tools and
  `load_openpi_params` can read it too) and `config/` (the `ModelConfig` as JSON), so a restore
  needs only the path. Arrays are restored into `abstract_params(config)`, so the dtype comes from
  the target config, not from what was stored.

`check_manifest` compares a parameter manifest (JSON list of openpi leaf shapes) with the tree a
config implies, without allocating anything.

orbax-checkpoint 0.12.8 notes (all verified):
  * paths must be absolute;
  * `PyTreeCheckpointer().metadata(path)` returns a `StepMetadata`; its `.item_metadata` is a
    dict-like tree-metadata object that is not a `Mapping` (the plain dict is `.item_metadata.tree`);
  * restoring a subset of the stored keys needs `PyTreeRestore(..., partial_restore=True)`;
  * `RestoreArgs(restore_type=np.ndarray, dtype=...)` restores host arrays cast to `dtype`;
  * the synchronous `ocp.Checkpointer` has no `wait_until_finished` (save returns when done);
  * items saved inside a CheckpointManager step have no `_CHECKPOINT_METADATA` of their own, so
    reading their metadata logs an absl warning; it is harmless.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from oxygen_jax.config import DType, ExpertConfig, ModelConfig, PromptAttention, SiglipConfig, model_config
from oxygen_jax.normalize import NormStats, load_norm_stats
from oxygen_jax.params import (
    OPENPI_PATHS,
    Params,
    abstract_params,
    from_openpi_dict,
    openpi_shapes,
    to_openpi_dict,
)

PathLike = str | os.PathLike

_LLM = "PaliGemma/llm"
_IMG = "PaliGemma/img"
_BLOCK = f"{_IMG}/Transformer/encoderblock"

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


def _is_pytree_item(path: Path) -> bool:
    # `_METADATA` is the PyTree handler's tree metadata; `checkpoint` is the pre-OCDBT msgpack file.
    return (path / "_METADATA").is_file() or (path / "checkpoint").is_file()


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


def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """{key path: leaf} for a tree of nested mappings."""
    if isinstance(tree, Mapping):
        out: dict[tuple[str, ...], Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, prefix + (str(k),)))
        return out
    return {prefix: tree}


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    """Inverse of `_flatten`."""
    root: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return root


def _read_openpi_metadata(item: Path) -> tuple[dict[str, Any], bool]:
    """({openpi path: array metadata}, whether stored paths carry a trailing `value`)."""
    try:
        meta = ocp.PyTreeCheckpointer().metadata(item)
    except Exception as e:  # orbax raises assorted types for unreadable directories
        raise ValueError(f"cannot read orbax metadata from {item}: {type(e).__name__}: {e}") from e
    # 0.12.8 wraps the tree in a StepMetadata whose `item_metadata` is a tree-metadata object (dict-like,
    # but not a Mapping; the plain dict is its `.tree`); older versions return the dict itself.
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if tree is None or not isinstance(tree, Mapping) or "params" not in tree:
        keys = sorted(tree.keys()) if isinstance(tree, Mapping) else type(tree).__name__
        raise ValueError(f"orbax checkpoint {item} has no 'params' entry at the top of its tree (found: {keys})")
    flat = _flatten(tree["params"])
    if not flat:
        raise ValueError(f"orbax checkpoint {item} has an empty 'params' tree")
    # nnx.State serialisation appends `value` to every leaf; only strip when all leaves have it.
    has_value = all(len(k) > 1 and k[-1] == "value" for k in flat)
    if has_value:
        flat = {k[:-1]: v for k, v in flat.items()}
    return {"/".join(k): v for k, v in flat.items()}, has_value


def _missing_report(missing: list[str]) -> str:
    return f"  missing ({len(missing)}):\n" + "\n".join(f"    {k}" for k in missing)


def load_openpi_params(
    path: PathLike,
    *,
    dtype: DType = "float32",
    prompt_attention: PromptAttention = "bidirectional",
) -> tuple[ModelConfig, Params]:
    """Restores an openpi π0.5 checkpoint, every leaf cast to `dtype`.

    Keys and shapes are checked from the orbax metadata before any array is read; arrays are then
    restored as host numpy arrays already in `dtype` and handed to `params.from_openpi_dict`.

    Args:
      path: an openpi `params` item directory (released or training layout), or a directory that
        contains one (a training step directory such as `<exp>/<step>`, or a released checkpoint
        root with `params/` and `assets/`). Relative paths are resolved.
      dtype: every leaf is cast to this on restore ("float32" or "bfloat16"), as openpi's
        inference restore does; it is also the returned config's dtype.
      prompt_attention: the returned config's prompt attention ("bidirectional" = openpi).

    Returns:
      (config inferred from the stored shapes, `Params` built by `from_openpi_dict`, whose leaves
      are arrays in `config.dtype`).

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: not an orbax checkpoint, no `params` item, or keys missing / mis-shaped (every
        such key is listed, with expected and stored shapes). Extra keys are ignored; ignored LoRA
        leaves additionally emit a UserWarning, since the adapters are then not applied.
    """
    item = _resolve_params_item(path)
    meta, has_value = _read_openpi_metadata(item)
    missing = [k for k in OPENPI_PATHS if k not in meta]
    try:
        config = infer_model_config(
            {k: tuple(m.shape) for k, m in meta.items()}, dtype=dtype, prompt_attention=prompt_attention
        )
    except ValueError as e:
        if missing:  # report every missing key, not only the first one inference tripped on
            report = _missing_report(missing)
            raise ValueError(f"openpi checkpoint {item} does not match the π0.5 tree:\n{report}") from e
        raise ValueError(f"openpi checkpoint {item}: {e}") from e

    wanted = set(OPENPI_PATHS)
    extras = sorted(set(meta) - wanted)
    lora = [k for k in extras if "lora" in k]
    if lora:
        warnings.warn(
            f"{item}: ignoring {len(lora)} LoRA leaves (e.g. {lora[0]!r}); oxygen_jax does not support LoRA "
            "yet, so the fine-tuned adapters are NOT applied",
            stacklevel=2,
        )

    # Check keys and shapes from the metadata before reading any array.
    np_dtype = np.dtype(config.jnp_dtype)
    try:
        from_openpi_dict(
            {k: jax.ShapeDtypeStruct(tuple(meta[k].shape), np_dtype) for k in wanted if k in meta}, config
        )
    except ValueError as e:
        raise ValueError(f"openpi checkpoint {item}: {e}") from e

    suffix = ("value",) if has_value else ()
    stored = {("params", *k.split("/"), *suffix): meta[k] for k in OPENPI_PATHS}
    target = _nest(stored)
    restore_args = _nest({k: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np_dtype) for k in stored})
    restored = ocp.PyTreeCheckpointer().restore(
        item,
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=bool(extras)),
    )
    flat = _flatten(restored["params"])
    arrays = {"/".join(k[: len(k) - len(suffix)]): np.asarray(v) for k, v in flat.items()}
    return config, from_openpi_dict(arrays, config)


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
    return _nest({("params", *k.split("/")): v for k, v in flat.items()})


def save_params(
    path: PathLike, params: Params, config: ModelConfig | None = None, *, overwrite: bool = False
) -> Path:
    """Saves `params` and its config to the new directory `path` (items `params/` and `config/`).

    The write is atomic (orbax writes a temporary directory and renames it) and finished when
    this returns. `params/` has openpi's tree, so `load_openpi_params(path)` reads it as well.

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
    # The synchronous Checkpointer has finished writing when save() returns (the async ones need
    # wait_until_finished()).
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        checkpointer.save(
            dest,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(_nested_openpi(flat)),
                config=ocp.args.JsonSave(_config_to_json(config)),
            ),
            force=overwrite,
        )
    finally:
        checkpointer.close()
    return dest


def restore_params(path: PathLike, config: ModelConfig | None = None) -> tuple[ModelConfig, Params]:
    """Restores a checkpoint written by `save_params`.

    Args:
      path: the directory passed to `save_params`.
      config: target config; default the stored one. Its dimensions must equal the stored ones;
        its dtype decides the restored dtype (orbax casts into the target), e.g.
        `restore_params(p, stored.replace(dtype="bfloat16"))`.

    Returns:
      (config, `Params` of `jax.Array` leaves in `config.dtype`).
    """
    src = Path(path).expanduser().resolve()
    if not src.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {src}")
    if not (src / "params").is_dir():
        raise ValueError(f"{src} is not an oxygen_jax checkpoint: no params/ item")
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        stored = None
        if (src / "config").is_dir():
            raw = checkpointer.restore(src, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
            stored = _config_from_json(raw)
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
        # orbax casts into the target's dtype (from `config`), whatever dtype was stored.
        target = _nested_openpi(
            {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in to_openpi_dict(abstract_params(config)).items()}
        )
        restored = checkpointer.restore(src, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    finally:
        checkpointer.close()
    flat = {"/".join(k[1:]): v for k, v in _flatten(restored["params"]).items()}
    return config, from_openpi_dict(flat, config)


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
    note: str = ""  # "missing", "unexpected", "mis-shaped", "unsupported LoRA leaf", "LoRA leaf (ignored)"


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
        return [r for r in self.rows if "LoRA" in r.note]

    def summary(self) -> str:
        lines = [f"{sum(r.ok for r in self.rows)}/{len(self.rows)} leaves ok"]
        lines += [f"  {r.note}: {r.path} expected {r.expected} got {r.got}" for r in self.rows if not r.ok]
        if self.preset is not None:
            lines.append(f"preset {self.preset!r}: {'exact match' if self.matches_preset else 'differs'}")
            lines += [f"  {r.note}: {r.path} preset {r.expected} got {r.got}" for r in self.preset_rows]
        return "\n".join(lines)


def _compare(
    got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], allow_lora: bool
) -> list[ManifestRow]:
    rows = []
    for k, exp in expected.items():
        g = got.get(k)
        if g is None:
            rows.append(ManifestRow(k, exp, None, False, "missing"))
        else:
            rows.append(ManifestRow(k, exp, g, g == exp, "" if g == exp else "mis-shaped"))
    for k in sorted(set(got) - set(expected)):
        if "lora" in k:
            note = "LoRA leaf (ignored)" if allow_lora else "unsupported LoRA leaf"
            rows.append(ManifestRow(k, None, got[k], allow_lora, note))
        else:
            rows.append(ManifestRow(k, None, got[k], False, "unexpected"))
    return rows


def check_manifest(
    manifest_path: PathLike,
    config: ModelConfig | None = None,
    *,
    preset: str | None = "pi05",
    allow_lora: bool = False,
) -> ManifestCheck:
    """Compares a parameter manifest with the π0.5 tree, allocating nothing.

    The manifest is JSON with `"leaves": {openpi path: {"shape": [...], "dtype": ...}}` (the format
    of the shared `pi05_param_manifest.json`).

    Args:
      manifest_path: the manifest file.
      config: compared with `openpi_shapes(config)`; default: inferred from the manifest.
      preset: also compare with this preset's abstract tree (`jax.eval_shape` of the parameter
        init, flattened with `to_openpi_dict`); None skips it.
      allow_lora: openpi LoRA leaves (`lora_a`/`lora_b`) are unsupported. False: they are rows with
        ok=False and note "unsupported LoRA leaf". True: listed as ignored, ok=True.

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
    rows = _compare(got, openpi_shapes(config), allow_lora)
    preset_rows: list[ManifestRow] = []
    if preset is not None:
        tree = to_openpi_dict(abstract_params(model_config(preset)))  # eval_shape: no allocation
        preset_shapes = {k: tuple(v.shape) for k, v in tree.items()}
        preset_rows = [r for r in _compare(got, preset_shapes, allow_lora) if not r.ok]
    return ManifestCheck(config=config, rows=tuple(rows), preset=preset, preset_rows=tuple(preset_rows))
