"""safetensors files: read (memory-mapped, bfloat16 through ml_dtypes) and write, plus an HF checkpoint's tensors.

Format: a u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} (and an
optional `__metadata__`), then the raw little-endian buffers. Read by hand, without the `safetensors`
package: a memory map views each buffer in its dtype (bfloat16 through ml_dtypes), so nothing is
copied until a tensor is converted.

The layout is checked before any tensor is viewed, as the format's own reader does: the header is at
most `MAX_HEADER_BYTES` of UTF-8 JSON; every tensor's byte span holds exactly its dtype x shape; the
spans, sorted, start at 0, touch without gap or overlap and end exactly at the end of the file (a
truncated file is named as such). A sharded checkpoint's `model.safetensors.index.json` may name only
relative paths inside the checkpoint directory (no absolute path, no `..`; links the directory itself
holds are followed, as in the Hugging Face cache), every shard must be a regular file, and the index and
the shards must agree tensor by tensor. Errors are one line naming the file and the tensor.

Example of a layout: header {"a": F32 [2] at [0, 8), "b": BF16 [3] at [8, 14)} needs a data section of
exactly 14 bytes; [0, 8) and [6, 14) overlap, [0, 8) and [9, 15) leave a gap, and 13 bytes are a truncation.
"""

from __future__ import annotations

import json
import math
import numbers
import struct
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import jax.numpy as jnp
import numpy as np

MAX_HEADER_BYTES = 100_000_000  # the format's own limit on the JSON header (and ours on an index file)

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(jnp.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_CODES = {v: k for k, v in _DTYPES.items()}
_INDEX = "model.safetensors.index.json"


def _is_count(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0


def _regular_file(path: Path) -> None:
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a regular file"
        raise ValueError(f"{path} {what}: safetensors weights are read from regular files only")


def _check_layout(path: Path, header: Mapping, data_bytes: int) -> None:
    """One-line ValueError unless every tensor's span fits its dtype x shape and the spans tile the data."""
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and not isinstance(info, dict):
                raise ValueError(f"{path}: __metadata__ must be an object of strings, got {type(info).__name__}")
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise ValueError(f"{path}: tensor {name}: expected {{dtype, shape, data_offsets}} in the header, got {info!r:.80}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype!r} (reads {sorted(_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise ValueError(f"{path}: tensor {name}: shape must be a list of non-negative integers, got {shape!r:.80}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise ValueError(f"{path}: tensor {name}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                             f"got {offsets!r:.80}")
        need = math.prod(shape) * _DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != need:
            raise ValueError(f"{path}: tensor {name}: {dtype} {shape} needs {need} bytes but its data_offsets "
                             f"{offsets} span {offsets[1] - offsets[0]}; the header is damaged")
        spans.append((offsets[0], offsets[1], name))
    end, before = 0, None
    for lo, hi, name in sorted(spans):
        if lo < end:
            raise ValueError(f"{path}: tensor {name} at bytes [{lo}, {hi}) overlaps tensor {before} (ends at {end}); "
                             "the header is damaged")
        if lo > end:
            raise ValueError(f"{path}: bytes [{end}, {lo}) before tensor {name} belong to no tensor; the header is damaged")
        end, before = hi, name
    if end > data_bytes:
        raise ValueError(f"{path}: tensor {before} ends at data byte {end} but the file holds {data_bytes} data bytes: "
                         "the file is truncated")
    if end < data_bytes:
        raise ValueError(f"{path}: {data_bytes - end} bytes after the last tensor ({before or 'none'}) belong to no "
                         "tensor; the file is damaged")


def _header(path: Path) -> tuple[dict, int]:
    """(header, byte where the data starts) of a .safetensors file whose layout is checked (module docstring)."""
    path = Path(path)
    _regular_file(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for safetensors (an 8-byte header length comes first)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} is above the format's limit {MAX_HEADER_BYTES}: not a "
                             "safetensors file, or a damaged one")
        if 8 + n > size:
            raise ValueError(f"{path}: header length {n} runs past the end of the file ({size} bytes): the file is "
                             "truncated or not safetensors")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: the header is not UTF-8 (byte {e.start} of {n}): the file is damaged") from None
    except ValueError as e:
        raise ValueError(f"{path}: the header is not JSON ({e}): the file is damaged") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header must be a JSON object of tensors, got {type(header).__name__}")
    _check_layout(path, header, size - 8 - n)
    return header, 8 + n


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """{name: array} of one .safetensors file, memory-mapped (read-only, no copy until converted).

    Raises:
      ValueError: one line naming the file (and tensor) when the layout is not sound (module docstring).
    """
    path = Path(path)
    header, start = _header(path)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if path.stat().st_size == start:  # nothing to map (no tensor holds a byte)
        return {k: np.zeros(v["shape"], _DTYPES[v["dtype"]]) for k, v in tensors.items()}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start)
    out = {}
    for name, info in tensors.items():
        lo, hi = info["data_offsets"]
        out[name] = data[lo:hi].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def write_safetensors(path: str | Path, tensors: Mapping[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Writes {name: array} as one .safetensors file (names sorted, header padded to 8 bytes)."""
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in sorted(tensors.items())}
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, a in arrays.items():
        if a.dtype not in _CODES:
            raise ValueError(f"tensor {name}: dtype {a.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _CODES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays.values():
            f.write(a.tobytes())


def _weight_map(directory: Path, index: Path) -> dict[str, str]:
    """{tensor: shard file} of a sharded checkpoint's index, every file a relative path inside `directory`."""
    _regular_file(index)
    if index.stat().st_size > MAX_HEADER_BYTES:
        raise ValueError(f"{index}: {index.stat().st_size} bytes, beyond the limit {MAX_HEADER_BYTES} for an index")
    try:
        data = json.loads(index.read_bytes().decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError
        raise ValueError(f"{index}: not a JSON index ({str(e)[:120]})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: expected {{\"weight_map\": {{tensor: shard file}}}}")
    for name, file in weight_map.items():
        parts = PurePosixPath(file).parts
        if not file or "\\" in file or PurePosixPath(file).is_absolute() or ".." in parts:
            raise ValueError(f"{index}: tensor {name} maps to {file!r}, outside the checkpoint directory; shards are "
                             "relative paths inside it")
    return weight_map


def read_checkpoint_tensors(directory: str | Path) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint directory: `model.safetensors` or a sharded index (checked: module docstring)."""
    directory = Path(directory)
    index = directory / _INDEX
    if index.exists():
        weight_map = _weight_map(directory, index)
    elif (directory / "model.safetensors").exists():
        weight_map = None
    else:
        raise FileNotFoundError(f"{directory}: no model.safetensors or {_INDEX}")
    if weight_map is None:
        return read_safetensors(directory / "model.safetensors")
    out: dict[str, np.ndarray] = {}
    for file in sorted(set(weight_map.values())):
        shard = read_safetensors(directory / file)
        for name in shard:
            if name in out:
                raise ValueError(f"{directory / file}: tensor {name} is stored in two shards")
            if weight_map.get(name) != file:
                raise ValueError(f"{directory / file}: holds tensor {name}, which {index.name} "
                                 + (f"maps to {weight_map[name]}" if name in weight_map else "does not list"))
        out.update(shard)
    missing = sorted(set(weight_map) - set(out))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{index}: maps tensor {missing[0]}{more} to {weight_map[missing[0]]}, which does not hold it")
    return out
