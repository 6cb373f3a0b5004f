"""What a checkpoint file may declare: documented caps on sizes, and the checks that read a file's numbers.

A file is read before it is trusted. A config field is an integer within its cap before any spec is
built from it, and a tensor is finite before it becomes a weight; both checks cost no memory beyond a
bounded chunk. Every error is one line naming the file, the field or tensor, and what was found.

The caps sit far above every model this project reads (Qwen3 / Qwen3-VL / Qwen3.5 up to 94 layers,
widths up to 25,600 and a 151,936-token vocabulary; π0.5, XR0 and StarVLA chunks of 10-50 steps and at
most 32 action dims) and far below what would exhaust a host: a config that claims a million layers or
a 10^9-step horizon is refused in microseconds instead of being built.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

MAX_LAYERS = 512  # layers of one stack: decoder layers, ViT blocks, DiT blocks, DeepStack mergers
MAX_WIDTH = 1 << 17  # any hidden, MLP, head, projection or position-table width (131,072)
MAX_HEADS = 1024  # attention heads (query or key-value) of one layer
MAX_VOCAB = 1 << 21  # vocabulary rows (2,097,152)
MAX_HORIZON = 1024  # action steps of one chunk (Ha): config action_length / action_horizon, an --action-mask's rows
MAX_ACTION_DIM = 1024  # action dims (Ad)
MAX_STATE_DIM = 4096  # state dims (Ds)
MAX_STEPS = 1000  # denoising steps of one chunk
MAX_TIME_BUCKETS = 1 << 16  # discrete flow-matching time buckets (StarVLA: 1000)
MAX_CONFIG_BYTES = 16 << 20  # a config.json / config.yaml / statistics / adapter.json / --action-mask .json file

_CHUNK = 1 << 22  # elements checked at a time (16 MiB of float32): no full-size temporary


def int_field(value: Any, field: str, where: str, *, cap: int | None, low: int = 1) -> int:
    """`value` as an int in [low, cap], else a one-line ValueError naming `where` and `field`.

    Integral floats pass (JSON writers emit 4.0 for 4); bools, strings, NaN, inf and fractions do not.
    `cap=None` checks the type only, for a field compared with the weights before its cap applies.

    Example: int_field(4.0, "num_hidden_layers", "config.json", cap=MAX_LAYERS) -> 4;
    int_field(1e6, ...) raises "config.json: num_hidden_layers 1000000 is above the cap 512 (...)".
    """
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        ok, value = True, int(value)
    if not ok:
        raise ValueError(f"{where}: {field} must be an integer in [{low}, {cap or 'its cap'}], got {value!r:.60}")
    value = int(value)
    if value < low:
        raise ValueError(f"{where}: {field} {value} is below {low}")
    if cap is not None and value > cap:
        raise ValueError(f"{where}: {field} {value} is above the cap {cap} (oxygen_jax.ckpts.limits; no released "
                         "model comes near it): the file is damaged or not a checkpoint this code reads")
    return value


def read_text(path: str | os.PathLike, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes` (a device, FIFO or link to one is refused
    before it is opened; a file that grows while read is cut at the cap and refused)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: {'not a regular file' if path.exists() else 'no such file'} (configs and "
                         "statistics are read from regular files only)")
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{path}: {size} bytes, larger than {max_bytes}, the cap on a config or statistics file")
    with open(path, "rb") as f:
        raw = f.read(size + 1)  # + 1: a file that grew since stat() is seen and refused
    if len(raw) > max_bytes:
        raise ValueError(f"{path}: larger than {max_bytes} bytes, the cap on a config or statistics file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_json(path: str | os.PathLike, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """The JSON value of a regular file of at most `max_bytes` (`read_text`); one-line ValueErrors."""
    try:
        return json.loads(read_text(path, max_bytes))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def first_bad(a: np.ndarray, max_abs: float | None = None) -> tuple[int, float] | None:
    """(flat index, value) of the first non-finite element of `a` (or one with |x| > max_abs), else None.

    Integer and bool arrays are always fine. Reads `a` in bounded chunks (a memory map stays a memory map).
    """
    a = np.asarray(a)
    if a.dtype.kind not in "fc":
        return None
    flat = a.reshape(-1)
    for start in range(0, flat.size, _CHUNK):
        part = flat[start:start + _CHUNK]
        bad = ~np.isfinite(part)
        if max_abs is not None:
            bad |= np.abs(part) > max_abs
        if bad.any():
            i = int(np.argmax(bad))
            return start + i, float(part[i])
    return None


def check_finite(tensors: Mapping[str, Any], where: str, *, max_abs: float | None = None) -> None:
    """A one-line ValueError naming the first tensor with a NaN or inf (or |x| > max_abs), its index and value.

    Args:
      tensors: {name: array} (memory-mapped arrays are read chunk by chunk).
      where: the file or directory, for the message.
      max_abs: also refuse magnitudes above it (None: finiteness only).
    """
    for name, a in tensors.items():
        found = first_bad(a, max_abs)
        if found is not None:
            index, value = found
            at = np.unravel_index(index, np.shape(a)) if np.ndim(a) else ()
            what = "a non-finite value" if not math.isfinite(value) else f"a value beyond ±{max_abs:g}"
            raise ValueError(f"{where}: tensor {name} holds {what} ({value!r} at {tuple(int(i) for i in at)}); "
                             "the weights are damaged, refusing to load them")
