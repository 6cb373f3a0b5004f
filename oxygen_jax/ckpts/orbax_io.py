"""Reading orbax PyTree directories without silent damage: one-line errors, checked values.

Damage never loads silently and never surfaces as a TensorStore dump: every failure to read an
orbax directory (missing or garbled `_METADATA`, `_sharding` or OCDBT manifest, truncated or
garbage data files) raises `CheckpointError` (a ValueError) with one line naming the directory or
file, the leaf when known, and the cause; the orbax/TensorStore exception is kept as
`__cause__`. What orbax reads without complaint is checked by the callers: our checkpoints
against their checksums (`ckpts.own`), openpi checkpoints (which carry none) with `check_values`
against what trained weights can be: every value finite and |x| <= a bound
(`ckpts.openpi.MAX_ABS_WEIGHT`). A corrupted exponent bit (the usual visible effect of a flipped
byte) gives |x| ~ 1e17..1e38 or NaN/inf and is caught; a flip confined to low mantissa bits of an
openpi checkpoint is not detectable without a checksum.

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

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import orbax.checkpoint as ocp
from flax.traverse_util import flatten_dict, unflatten_dict

PathLike = str | os.PathLike


class CheckpointError(ValueError):
    """A checkpoint directory is damaged, incomplete or holds values no trained model has.

    The message is one line naming the directory or file (and the leaf when known) and the cause;
    the underlying orbax / TensorStore exception, if any, is `__cause__`.
    """


def is_pytree_item(path: Path) -> bool:
    """An orbax PyTree item: `_METADATA` is the handler's tree metadata, `checkpoint` the pre-OCDBT msgpack file."""
    return (path / "_METADATA").is_file() or (path / "checkpoint").is_file()


def _looks_like_item(path: Path) -> bool:
    """An orbax PyTree item that may have lost its `_METADATA` (its other parts are there)."""
    return (path / "manifest.ocdbt").exists() or any(path.glob("ocdbt.process_*")) or (path / "_sharding").exists()


def resolve_params_item(path: PathLike) -> Path:
    """The absolute `params` item directory for a params dir, a step dir or a checkpoint root."""
    p = Path(path).expanduser().resolve()  # orbax refuses relative paths
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {p}")
    if not p.is_dir():
        raise ValueError(f"checkpoint path is not a directory: {p}")
    if is_pytree_item(p):
        return p
    sub = p / "params"
    for item in (p, sub):
        if item.is_dir() and not is_pytree_item(item) and _looks_like_item(item):
            raise CheckpointError(f"{item / '_METADATA'} is missing: the checkpoint item is incomplete (tree metadata lost)")
    if sub.is_dir():
        if is_pytree_item(sub):
            return sub
        raise ValueError(f"{sub} is not an orbax PyTree checkpoint (no _METADATA file)")
    if (p / "_CHECKPOINT_METADATA").is_file():
        items = sorted(c.name for c in p.iterdir() if c.is_dir())
        raise ValueError(f"orbax checkpoint {p} has no 'params' item (items present: {items})")
    raise ValueError(
        f"{p} is not an orbax checkpoint: expected a PyTree item (with a _METADATA file) or a directory "
        f"containing params/"
    )


def one_line(e: BaseException, limit: int = 400, *, within: Path | None = None) -> str:
    """An exception as one short line: TensorStore's `[tensorstore_spec=...]` tail and newlines dropped.
    Paths inside `within` are written relative to its parent, so a deep temporary directory cannot
    push the name of the damaged file past the length limit."""
    text = re.split(r"\s*\[tensorstore_spec=", str(e), maxsplit=1)[0]
    if within is not None:
        for root in {str(within.parent), str(within.resolve().parent)}:
            text = text.replace(root.rstrip("/") + "/", "")
    text = " ".join(text.split()) or type(e).__name__
    if not text.startswith(type(e).__name__) and not re.match(r"[A-Z_]+:", text):
        text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_json_file(path: Path, what: str, required_key: str | None = None) -> None:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        cause = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else one_line(e, 120)
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


def read_tree_metadata(item: Path) -> Mapping[str, Any]:
    """The stored tree of array metadata (nested dicts), raising `CheckpointError` on any damage."""
    _check_item_files(item)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        meta = handler.metadata(item)
    except Exception as e:  # orbax/TensorStore raise assorted types for damaged directories
        _quiet_late_orbax_callbacks()
        raise CheckpointError(
            f"{item}: cannot read the checkpoint's metadata, it is damaged or incomplete: {one_line(e, within=item)}"
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


def restore_arrays(item: Path, stored: Mapping[tuple[str, ...], Any], partial: bool) -> dict[tuple[str, ...], np.ndarray]:
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
        raise CheckpointError(f"{item}: cannot read {where}, the checkpoint is damaged or incomplete: {one_line(e, within=item)}") from e
    return {k: np.asarray(v) for k, v in flatten_dict(restored).items()}


def _abs_bits(x: np.ndarray) -> np.ndarray:
    """|x| as unsigned integers, ordered like |x| for finite values; NaN/inf above every finite one."""
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
    return x.view(uint) & uint((1 << (8 * x.dtype.itemsize - 1)) - 1)


_CHECK_CHUNK = 1 << 22  # elements per integer pass: a full-size embedding table is never copied whole


def _is_float(x: np.ndarray) -> bool:
    return np.issubdtype(x.dtype, np.floating) or x.dtype.kind == "V" or "float" in x.dtype.name


def check_block(item: Path, path: str, x: np.ndarray, max_abs: float | None, offset: int | None = None) -> None:
    """Raises `CheckpointError` if `x` (leaf `path`, or its elements from `offset` on) holds a non-finite
    value or |x| > max_abs. One integer pass in chunks of `_CHECK_CHUNK` elements (the bits of |x| are
    ordered like |x|): about one read of the values and a few MiB of memory."""
    if not _is_float(x) or x.size == 0:
        return
    inf_bits = _abs_bits(np.asarray(np.inf, x.dtype).reshape(1))[0]
    limit = inf_bits - 1 if max_abs is None else min(_abs_bits(np.asarray(max_abs, x.dtype).reshape(1))[0], inf_bits - 1)
    flat = np.ascontiguousarray(x).reshape(-1)
    if max(_abs_bits(flat[i:i + _CHECK_CHUNK]).max() for i in range(0, flat.size, _CHECK_CHUNK)) <= limit:
        return
    x32 = flat.astype(np.float32)
    where = f"among {x.size}" if offset is None else f"in elements {offset}..{offset + x.size - 1}"
    bad = int(np.count_nonzero(~np.isfinite(x32)))
    if bad:
        raise CheckpointError(
            f"{item}: leaf {path!r} holds {bad} non-finite value(s) (NaN/inf) {where}; the checkpoint is damaged"
        )
    top = float(np.max(np.abs(x32)))
    raise CheckpointError(
        f"{item}: leaf {path!r} has max |x| = {top:.3g}, above {max_abs:g}, which no trained weight reaches; the "
        f"checkpoint is damaged (if this is a genuine weight, pass a larger max_abs)"
    )


def check_values(item: Path, arrays: Mapping[str, np.ndarray], max_abs: float | None) -> None:
    """Raises `CheckpointError` naming the first leaf with a non-finite value or |x| > max_abs (`check_block`)."""
    for path, x in arrays.items():
        check_block(item, path, x, max_abs)


def read_json_item(src: Path, name: str) -> Any:
    """A JsonSave item of a composite checkpoint (the file `<name>/metadata`)."""
    path = src / name / "metadata"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint's {name} item is incomplete")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:
        cause = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else one_line(e, 120)
        raise CheckpointError(f"{path} is garbled (not valid JSON: {cause}); the checkpoint is damaged") from e
