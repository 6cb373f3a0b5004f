"""Our own checkpoints: `save_params` / `restore_params`, every array verified against its SHA-256.

A checkpoint is a composite orbax directory with three items: `params/` (openpi's
`{"params": <nested openpi dict>}` tree, so openpi tools and `load_openpi_params` can read it
too), `config/` (the `ModelConfig` as JSON) and `checksums/` (JSON: a SHA-256 of every array's
bytes), so a restore needs only the path and verifies every array. The dtype of the result comes
from the target config, not from what was stored. Reads go through `orbax_io`: a damaged
directory or array is a one-line `CheckpointError`.

Parameters holding `nn.quant.QArray` leaves (`python -m oxygen_jax.quantize`) add two items:
`quantized/` ({"values": tree, "scales": tree}, openpi paths; int8 or float8_e4m3fn values, float32
scales) and `quantization/` (JSON: format, weights "int8" | "fp8", the quantized leaves, provenance).
Those leaves are absent from `params/`, so a reader that knows no quantization (openpi's, an older
`restore_params`) refuses the directory for its missing leaves instead of reading integers as weights.
Their checksums are keyed `quantized/values/<path>` and `quantized/scales/<path>`; `restore_params`
returns them as `QArray`s (values as stored, scales in the target dtype).
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

from oxygen_jax.ckpts.leaf_stream import LeafReader, aligned_empty, mapped_pieces
from oxygen_jax.ckpts.orbax_io import (CheckpointError, PathLike, check_block, read_json_item, read_tree_metadata,
                                       restore_arrays)
from oxygen_jax.models.pi05.config import ExpertConfig, ModelConfig
from oxygen_jax.models.pi05.params import (LAYER_STACKED, Params, from_layer_pieces, from_openpi_dict, openpi_paths, openpi_shapes,
                                           to_openpi_dict)
from oxygen_jax.models.vision.siglip import SiglipConfig
from oxygen_jax.nn.quant import QMAX, STORED_DTYPE, QArray, weight_dtype_of


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


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    return unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})


_CHECKSUM_FORMAT = 1
_QUANT_FORMAT = 1
_SCALE_MAX_WEIGHT = 1e4  # a scale whose largest weight (scale * QMAX) passes this is damaged (the weights' bound)


def _quantized_flat(quant: Mapping[str, QArray]) -> dict[str, np.ndarray]:
    """The quantized leaves' arrays under their checksum keys."""
    out = {}
    for k, q in quant.items():
        out[f"quantized/values/{k}"], out[f"quantized/scales/{k}"] = q.values, q.scale
    return out


def _read_quantization(src: Path, paths: set[str]) -> dict | None:
    """The `quantization/` item, checked against the config's leaf paths; None when the checkpoint has none."""
    if not (src / "quantization").exists():
        if (src / "quantized").exists():
            raise CheckpointError(f"{src}: a quantized/ item without its quantization/ description; the checkpoint is damaged")
        return None
    info = read_json_item(src, "quantization")
    leaves = info.get("leaves") if isinstance(info, Mapping) else None
    if not isinstance(info, Mapping) or info.get("format") != _QUANT_FORMAT or info.get("weights") not in STORED_DTYPE:
        raise CheckpointError(f"{src / 'quantization'}: unknown quantization format or weights "
                              f"({info.get('format') if isinstance(info, Mapping) else info!r}); damaged or newer than this code")
    if not isinstance(leaves, list) or not leaves or not all(isinstance(k, str) for k in leaves):
        raise CheckpointError(f"{src / 'quantization'}: 'leaves' must list the quantized leaf paths; the checkpoint is damaged")
    unknown = sorted(set(leaves) - paths)
    if unknown:
        raise CheckpointError(f"{src / 'quantization'}: {len(unknown)} quantized leaves are no leaves of this model "
                              f"(e.g. {unknown[0]!r}); the checkpoint is damaged or of another model")
    if not (src / "quantized").is_dir():
        raise CheckpointError(f"{src}: the quantization/ item names {len(leaves)} leaves but quantized/ is missing; "
                              "the checkpoint is damaged")
    return dict(info)


def _verify_digest(src: Path, key: str, dtype: np.dtype, shape: tuple, sha256: str, sums: Mapping[str, Any]) -> None:
    """`_verify_checksums` for one leaf hashed as it was read."""
    entry = sums.get("leaves", {}).get(key) if isinstance(sums.get("leaves"), Mapping) else None
    if sums.get("format") != _CHECKSUM_FORMAT or entry is None:
        raise CheckpointError(f"{src}: leaf {key!r} has no stored checksum (or an unknown checksum format); the "
                              "checkpoint is damaged")
    if entry.get("dtype") != dtype.name or tuple(entry.get("shape", ())) != shape:
        raise CheckpointError(f"{src}: leaf {key!r} is stored as {dtype.name}{list(shape)} but was saved as "
                              f"{entry.get('dtype')}{entry.get('shape')}; the checkpoint is damaged")
    if sha256 != entry.get("sha256"):
        raise CheckpointError(f"{src}: leaf {key!r} ({dtype.name}{list(shape)}) does not match its saved SHA-256: the "
                              "checkpoint is damaged; restore it from a good copy")


def _check_fp8_values(src: Path, path: str, values) -> None:
    """Refuses float8_e4m3fn values holding a NaN byte (x111 1111), one line."""
    parts = values if isinstance(values, list) else [values]
    nan = sum(int(np.count_nonzero((np.asarray(v).view(np.uint8) & 0x7F) == 0x7F)) for v in parts)
    if nan:
        raise CheckpointError(f"{src / 'quantized'}: values of {path!r} hold {nan} NaN(s); the checkpoint is damaged")


def _check_quantized(src: Path, quant: Mapping[str, QArray], weights: str, shapes: Mapping[str, tuple]) -> None:
    """Refuses, in one line, a quantized leaf unless its values (an array or its metadata) have the declared
    dtype and the config's shape, and its scale the values' rank, per axis 1 or the values' size, and finite
    values in (0, 1e4 / QMAX]."""
    item = src / "quantized"
    for path, q in quant.items():
        values, scale = q.values, q.scale
        if np.dtype(values.dtype) != STORED_DTYPE[weights] or tuple(values.shape) != shapes[path]:
            raise CheckpointError(f"{item}: values of {path!r} are {np.dtype(values.dtype).name}{list(values.shape)}, expected "
                                  f"{STORED_DTYPE[weights].name}{list(shapes[path])} ({weights}); the checkpoint is damaged")
        if (scale.dtype != np.float32 or scale.ndim != values.ndim
                or any(s not in (1, n) for s, n in zip(scale.shape, values.shape))):
            raise CheckpointError(f"{item}: the scale of {path!r} is {scale.dtype.name}{list(scale.shape)}, which does not "
                                  f"fit its values {list(values.shape)} (float32, each axis 1 or the values' size); "
                                  "the scales are of another checkpoint or damaged")
        check_block(item, f"scales/{path}", scale, _SCALE_MAX_WEIGHT / QMAX[weights])
        if not (scale > 0).all():
            raise CheckpointError(f"{item}: the scale of {path!r} holds {int(np.count_nonzero(scale <= 0))} value(s) <= 0; "
                                  "the checkpoint is damaged")


def _canonical_bytes(x) -> np.ndarray:
    """An array's bytes in its own dtype, C order, little-endian (what checksums hash), as uint8 [n]."""
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    if a.dtype.itemsize > 1 and (a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big")):
        a = a.byteswap()
    return a.view(np.uint8)


def _array_sha256(x) -> str:
    """SHA-256 of an array's bytes in its own dtype, C order, little-endian (the canonical form)."""
    return hashlib.sha256(_canonical_bytes(x)).hexdigest()


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
    path: PathLike, params: Params, config: ModelConfig | None = None, *, overwrite: bool = False,
    provenance: Mapping[str, Any] | None = None,
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
      provenance: JSON-able facts stored in the `quantization/` item (e.g. the float source and the
        layer kinds); only with quantized leaves.

    Returns:
      The absolute checkpoint path.
    """
    return save_flat(path, to_openpi_dict(params), params.config if config is None else config, overwrite=overwrite,
                     provenance=provenance)


def save_flat(path: PathLike, flat: Mapping[str, Any], config: ModelConfig, *, overwrite: bool = False,
              provenance: Mapping[str, Any] | None = None, lean: bool = False) -> Path:
    """`save_params` of a flat {openpi path: array or `QArray`} dict (host or device arrays): what a writer that
    never builds `Params` hands over (`python -m oxygen_jax.quantize` streams its source into one).

    `lean`: orbax gets device arrays over the host buffers (on a CPU `jax.device_put` keeps a 64-byte-aligned
    buffer, `leaf_stream.aligned_empty`, instead of copying it) and writes them uncompressed, so the write holds no
    second copy of the arrays: orbax stages a copy of every numpy array and a compressed copy of every array at
    once (2x the arrays above them, measured). The same arrays and checksums either way (zstd only on disk).
    """
    dest = Path(path).expanduser().resolve()  # orbax refuses relative paths
    if dest.exists() and not overwrite:
        raise FileExistsError(f"checkpoint directory already exists: {dest} (pass overwrite=True to replace it)")
    from_openpi_dict({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in flat.items()}, config)  # shapes
    quant = {k: QArray(values=np.asarray(v.values), scale=np.asarray(v.scale, np.float32))
             for k, v in flat.items() if isinstance(v, QArray)}
    if provenance is not None and not quant:
        raise ValueError("provenance= describes quantized leaves, and these parameters have none")
    flat = {k: np.asarray(v) for k, v in flat.items() if k not in quant}  # one device-to-host copy, hashed and written
    # Written by this process alone (in a multi-process run the others never reach orbax's barriers).
    only_me = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(), active_processes={jax.process_index()})
    save, put, handlers = ocp.args.StandardSave, (lambda a: a), {}
    if lean:
        # Host arrays on the host device (zero-copy): the default device may be a GPU, a round trip orbax undoes.
        save, put = ocp.args.PyTreeSave, lambda a: jax.device_put(a, jax.local_devices(backend="cpu")[0])
        handlers = {name: ocp.PyTreeCheckpointHandler(use_compression=False, multiprocessing_options=only_me)
                    for name in ("params", "quantized")[:1 + bool(quant)]}
        handlers |= {name: ocp.JsonCheckpointHandler(multiprocessing_options=only_me)
                     for name in ("config", "checksums", "quantization")[:2 + bool(quant)]}
    items = {}
    if quant:
        kinds = {weight_dtype_of(q.values.dtype) for q in quant.values()}
        if len(kinds) > 1:
            raise ValueError(f"a checkpoint holds one kind of quantized weights, these mix {sorted(kinds)}")
        items["quantized"] = save({
            "values": _nested({k: put(q.values) for k, q in quant.items()}),
            "scales": _nested({k: put(q.scale) for k, q in quant.items()})})
        items["quantization"] = ocp.args.JsonSave({
            "format": _QUANT_FORMAT, "weights": kinds.pop(), "leaves": sorted(quant), "provenance": dict(provenance or {})})
    # The synchronous Checkpointer has finished writing when save() returns (the async ones need
    # wait_until_finished()).
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(multiprocessing_options=only_me), **handlers), multiprocessing_options=only_me)
    try:
        checkpointer.save(
            dest,
            args=ocp.args.Composite(
                checksums=ocp.args.JsonSave(_checksums(flat | _quantized_flat(quant))),  # of the host bytes
                params=save(_nested_openpi({k: put(v) for k, v in flat.items()})),
                config=ocp.args.JsonSave(_config_to_json(config)),
                **items,
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
      (config, `Params` of `jax.Array` leaves in `config.dtype`); a quantized checkpoint's quantized
      leaves are `nn.quant.QArray`s (values as stored, scales in `config.dtype`), which the layer loop
      dequantizes, so the result serves like any other.

    Raises:
      FileNotFoundError: `path` does not exist.
      CheckpointError: a damaged directory or an array whose bytes differ from its checksum, or a
        quantized leaf whose values or scale do not fit (one line naming the file or leaf). Checkpoints written before checksums existed load with a
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
        diff = [f"    {k}: stored {have.get(k)}, requested {want[k]}" for k in want if want[k] != have.get(k)]
        if diff:
            lines = "\n".join(diff)
            raise ValueError(f"{src}: the requested config's dimensions differ from the stored ones:\n{lines}")
    quant_info = _read_quantization(src, set(openpi_paths(config)))
    quantized = set(quant_info["leaves"]) if quant_info else set()
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
    want_paths = {tuple(k.split("/")) for k in openpi_paths(config) if k not in quantized}
    missing = sorted("/".join(k) for k in want_paths - set(meta))
    if missing:
        raise CheckpointError(
            f"{item}: the stored tree lacks {len(missing)} leaves (e.g. {missing[0]!r}); the checkpoint is damaged"
        )
    if quant_info:
        return config, _restore_streamed(src, config, sorted("/".join(k) for k in want_paths), quant_info, sums)
    # Restore as stored (the checksums are of the stored bytes), then cast to the target dtype.
    flat = restore_arrays(item, {("params", *k): None for k in want_paths}, partial=len(meta) > len(want_paths))
    arrays = {"/".join(k[1:]): v for k, v in flat.items()}
    if sums is not None:
        _verify_checksums(src, arrays, sums)
    np_dtype = np.dtype(config.jnp_dtype)  # cast on the host: no device program per leaf shape
    return config, from_openpi_dict({k: v.astype(np_dtype, copy=False) for k, v in arrays.items()}, config)


def float_leaf_reader(path: PathLike, config: ModelConfig):
    """(config, read) for reading our float checkpoint one leaf at a time (`own.restore_params`'s checks: the
    config's dims are the stored ones, every leaf's bytes against its checksum).

    `read(openpi path, per_layer)` yields the leaf in `config.dtype`, whole or, with `per_layer`, its layers one at a
    time, each read in its stored dtype, hashed and cast; the checksum is verified after its last piece.
    """
    src = Path(path).expanduser().resolve()
    stored = stored_config(src)
    if stored is None or openpi_shapes(stored) != openpi_shapes(config):
        raise ValueError(f"{src} holds no config/ item of these dimensions (an oxygen_jax float checkpoint, saved by "
                         "save_params, is read leaf by leaf)")
    if (src / "quantization").is_dir():
        raise ValueError(f"{src} is already quantized: quantize its float source")
    sums = read_json_item(src, "checksums") if (src / "checksums").exists() else None
    meta = flatten_dict(dict(read_tree_metadata(src / "params")))
    reader, np_dtype = LeafReader(src / "params"), np.dtype(config.jnp_dtype)

    def read(k: str, per_layer: bool):
        key = ("params", *k.split("/"))
        if key not in meta:
            raise CheckpointError(f"{src / 'params'}: no array {k!r}; the checkpoint is damaged")
        stored_dtype, shape = np.dtype(meta[key].dtype), tuple(meta[key].shape)
        digest = hashlib.sha256()
        for piece in reader.pieces(key, k, shape, stored_dtype, per_layer, None):
            digest.update(_canonical_bytes(piece))
            yield piece.astype(np_dtype, copy=False)
        if sums is not None:
            _verify_digest(src, k, stored_dtype, shape, digest.hexdigest(), sums)

    return config, read


def quantization_info(path: PathLike) -> dict | None:
    """The `quantization/` item of our checkpoint at `path` (format, weights, leaves, provenance with the float
    source's `source_fingerprint`), or None for a checkpoint that holds no quantized leaves."""
    src = Path(path).expanduser().resolve()
    return read_json_item(src, "quantization") if (src / "quantization").is_dir() else None


def _restore_streamed(src: Path, config: ModelConfig, floats: list[str], info: Mapping[str, Any],
                      sums: Mapping[str, Any] | None) -> Params:
    with mapped_pieces():
        return _stream_leaves(src, config, floats, info, sums)


def _stream_leaves(src: Path, config: ModelConfig, floats: list[str], info: Mapping[str, Any],
                   sums: Mapping[str, Any] | None) -> Params:
    """A quantized checkpoint, streamed (`leaf_stream`) into the default backend's layout (`for_backend`):
    each leaf read a layer (or, for a leaf without layers, a row) at a time, its stored bytes hashed as they
    come and checked against the checksum, cast and put on the device; on a CPU every layer of a stack is its
    own device buffer (`Unstacked`) from the start. The weights are held once, plus one leaf on the host."""
    shapes, np_dtype = openpi_shapes(config), np.dtype(config.jnp_dtype)
    unstacked = jax.default_backend() == "cpu"
    items = {name: (LeafReader(src / name), flatten_dict(dict(read_tree_metadata(src / name))))
             for name in ("params", "quantized")}

    def meta(item: str, key: tuple[str, ...]):
        if key not in items[item][1]:
            raise CheckpointError(f"{src / item}: no array {'/'.join(key)!r}; the checkpoint is damaged")
        return items[item][1][key]

    def read(item: str, key: tuple[str, ...], checksum_key: str, dtype, path: str):
        """The leaf cast to `dtype`: a device array, or on a CPU a list of per-layer device arrays (stacks)."""
        m = meta(item, key)
        stored, shape = np.dtype(m.dtype), tuple(m.shape)
        per_layer = unstacked and path in LAYER_STACKED
        if stored.kind == "V" and stored.itemsize == 1:  # float8: orbax reads it whole (the stream knows no fp8)
            whole = restore_arrays(src / item, {key: None}, partial=True)[key]
            pieces = iter(whole) if shape else iter([whole])
            del whole
        else:
            pieces = items[item][0].pieces(key, checksum_key, shape, stored, per_layer=bool(shape), max_abs=None)
        # Host buffers 64-byte aligned, so `device_put` keeps them as the device's (no second copy on a CPU).
        digest, out = hashlib.sha256(), [] if per_layer else aligned_empty(shape, dtype)
        for i, piece in enumerate(pieces):  # one layer (stacks) or row, in C order: the bytes hashed in order
            digest.update(_canonical_bytes(piece))
            if per_layer:
                if piece.dtype != dtype:
                    piece, stored_piece = aligned_empty(piece.shape, dtype), piece
                    piece[...] = stored_piece
                    del stored_piece
                out.append(jax.device_put(piece))
            elif shape:
                out[i] = piece
            else:
                out[...] = piece
        if sums is not None:
            _verify_digest(src, checksum_key, stored, shape, digest.hexdigest(), sums)
        return out if per_layer else jax.device_put(out)

    stored_shapes = {k: tuple(meta("params", ("params", *k.split("/"))).shape) for k in floats}
    from_openpi_dict({k: jax.ShapeDtypeStruct(v, np_dtype) for k, v in stored_shapes.items()}
                     | {k: jax.ShapeDtypeStruct(shapes[k], np_dtype) for k in info["leaves"]}, config)  # float shapes
    values: dict[str, Any] = {}
    for path in sorted(floats, key=lambda k: -np.prod(stored_shapes[k])):  # the largest first, while little is resident
        values[path] = read("params", ("params", *path.split("/")), path, np_dtype, path)
    for path in info["leaves"]:
        key = tuple(path.split("/"))
        values_key, scales_key = ("values", *key), ("scales", *key)
        # The (small) scale, as stored, and the values' metadata are checked before the values are read.
        sm = meta("quantized", scales_key)  # read by the stream too: orbax's reader keeps a 100 MB cache
        scale = next(items["quantized"][0].pieces(scales_key, f"scales/{path}", tuple(sm.shape), np.dtype(sm.dtype),
                                                  per_layer=False, max_abs=None))
        if sums is not None:
            _verify_checksums(src, {f"quantized/scales/{path}": scale}, sums)
        stored_values = meta("quantized", values_key)
        _check_quantized(src, {path: QArray(values=jax.ShapeDtypeStruct(tuple(stored_values.shape), stored_values.dtype),
                                            scale=scale)}, info["weights"], shapes)
        v = read("quantized", values_key, f"quantized/values/{path}", np.dtype(stored_values.dtype), path)
        if info["weights"] == "fp8":
            _check_fp8_values(src, path, v)
        s_dev = jax.device_put(scale.astype(np_dtype))
        values[path] = ([QArray(values=x, scale=s_dev[i]) for i, x in enumerate(v)] if isinstance(v, list)
                        else QArray(values=v, scale=s_dev))
    return from_layer_pieces(values, config)
