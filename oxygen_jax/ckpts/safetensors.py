"""safetensors files: read (memory-mapped, bfloat16 through ml_dtypes) and write, plus an HF checkpoint's tensors.

Format: a u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} (and an
optional `__metadata__`), then the raw little-endian buffers. Read by hand, without the `safetensors`
package: a memory map views each buffer in its dtype (bfloat16 through ml_dtypes), so nothing is
copied until a tensor is converted.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(jnp.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_CODES = {v: k for k, v in _DTYPES.items()}


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """{name: array} of one .safetensors file, memory-mapped (read-only, no copy until converted)."""
    path = Path(path)
    header, start = _header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
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


def read_checkpoint_tensors(directory: str | Path) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint directory: `model.safetensors` or a sharded index."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(read_safetensors(directory / f))
    return out
