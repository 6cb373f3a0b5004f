"""Our own checkpoints: `save_params` / `restore_params`, every array verified against its SHA-256.

A checkpoint is a composite orbax directory with three items: `params/` (openpi's
`{"params": <nested openpi dict>}` tree, so openpi tools and `load_openpi_params` can read it
too), `config/` (the `ModelConfig` as JSON) and `checksums/` (JSON: a SHA-256 of every array's
bytes), so a restore needs only the path and verifies every array. The dtype of the result comes
from the target config, not from what was stored. Reads go through `orbax_io`: a damaged
directory or array is a one-line `CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax.traverse_util import flatten_dict, unflatten_dict

from oxygen_jax.ckpts.orbax_io import CheckpointError, PathLike, read_json_item, read_tree_metadata, restore_arrays
from oxygen_jax.models.pi05.config import ExpertConfig, ModelConfig
from oxygen_jax.models.pi05.params import OPENPI_PATHS, Params, from_openpi_dict, openpi_shapes, to_openpi_dict
from oxygen_jax.models.siglip import SiglipConfig


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


def stored_config(path: PathLike) -> ModelConfig | None:
    """The `ModelConfig` saved in our checkpoint at `path`, or None when it has no config/ item (not ours)."""
    src = Path(path).expanduser().resolve()
    return _config_from_json(read_json_item(src, "config")) if (src / "config").is_dir() else None


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
    # Written by this process alone (in a multi-process run the others never reach orbax's barriers).
    only_me = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(), active_processes={jax.process_index()})
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(multiprocessing_options=only_me)), multiprocessing_options=only_me)
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
    stored = stored_config(src)
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
    sums = read_json_item(src, "checksums") if (src / "checksums").exists() else None
    if sums is None:
        warnings.warn(
            f"{src} has no checksums/ item (written before checksums were added): its arrays cannot be verified; "
            "save it again with save_params to add them",
            stacklevel=2,
        )
    item = src / "params"
    tree = read_tree_metadata(item)
    meta = flatten_dict(tree.get("params", {})) if isinstance(tree.get("params"), Mapping) else {}
    want_paths = {tuple(k.split("/")) for k in OPENPI_PATHS}
    missing = sorted("/".join(k) for k in want_paths - set(meta))
    if missing:
        raise CheckpointError(
            f"{item}: the stored tree lacks {len(missing)} leaves (e.g. {missing[0]!r}); the checkpoint is damaged"
        )
    # Restore as stored (the checksums are of the stored bytes), then cast to the target dtype.
    flat = restore_arrays(item, {("params", *k): None for k in want_paths}, partial=len(meta) > len(want_paths))
    arrays = {"/".join(k[1:]): v for k, v in flat.items()}
    if sums is not None:
        _verify_checksums(src, arrays, sums)
    np_dtype = np.dtype(config.jnp_dtype)  # cast on the host: no device program per leaf shape
    return config, from_openpi_dict({k: v.astype(np_dtype, copy=False) for k, v in arrays.items()}, config)
