"""Reading orbax leaves from disk piece by piece, so a restore never holds a leaf twice.

TensorStore (under orbax) decodes a zarr chunk whole, and an array orbax writes from one host is
one chunk: restoring a leaf holds its compressed bytes and its decoded copy at once (2x the leaf,
more with a cast), and splitting a layer stack afterwards holds it once more. At π0.5's full size
the VLM's MLP gate alone is 4.8 GB in float32. `LeafReader.pieces` instead reads a leaf's
compressed bytes in byte ranges of `_RANGE_BYTES`, decompresses them as a zstd stream into the
pieces the caller keeps (the whole leaf, or one piece per layer), casting and value-checking
`_BLOCK` elements at a time: the transient memory is a few tens of MiB, whatever the leaf's size.

The fast path reads zarr v2 arrays stored as one C-order chunk, zstd-compressed or raw, with no
filters (what orbax 0.12.8 writes, openpi's released and training checkpoints included). Any other
layout (several chunks, zarr3, an absent chunk holding the fill value) is restored by orbax one leaf
at a time and then split: correct, but the transient memory is that leaf's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np
import tensorstore as ts
import zstandard
from orbax.checkpoint._src.serialization import tensorstore_utils as _ts_utils

from oxygen_jax.ckpts.orbax_io import CheckpointError, _quiet_late_orbax_callbacks, check_block, one_line, restore_arrays

_RANGE_BYTES = 32 << 20  # compressed bytes per read
_BLOCK = 4 << 20  # elements per cast / value check

# orbax's context caches 100 MB of OCDBT data; B-tree nodes are all a sequential reader re-reads.
_CONTEXT = {"cache_pool#ocdbt": {"total_bytes_limit": 8 << 20}, "file_io_concurrency": {"limit": 32}}

_ZARR_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16)}
_ALIGN = 64  # XLA:CPU uses a host array this aligned as the device buffer (`jax.device_put` makes no copy)


_M_MMAP_THRESHOLD = -3  # glibc mallopt: allocations from this size on come straight from mmap
_PIECE_MMAP = 1 << 20  # while streaming: every piece-sized buffer is mapped, and unmapped when freed
_GLIBC_MMAP_MAX = 32 << 20  # glibc's own dynamic threshold settles here (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)


@contextlib.contextmanager
def mapped_pieces():
    """glibc only (elsewhere nothing): buffers of 1 MiB and more come from mmap while a checkpoint streams.

    The stream frees a stored-dtype piece, a read range or a scratch block (4-32 MiB) after every layer while
    the cast pieces it keeps interleave with them on the heap; glibc keeps such holes resident (about 100 MiB
    at π0.5's full size, measured in docs/quantization.md). Mapped, each is returned to the system when freed.
    Afterwards the threshold is glibc's dynamic one's ceiling, where a process that frees large buffers ends.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, _PIECE_MMAP):
        yield
        return
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_MAX)


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """`np.empty(shape, dtype)` starting on a 64-byte boundary: on a CPU, `jax.device_put` of it keeps this memory
    instead of copying it, so a streamed piece never exists twice (a large `np.empty` is 16 bytes off a page)."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start:start + n].view(dtype).reshape(shape)


def _zarr_dtype(name: str) -> np.dtype | None:
    if name in _ZARR_DTYPES:
        return _ZARR_DTYPES[name]
    try:
        dt = np.dtype(name)
    except TypeError:
        return None
    return dt if dt.kind in "fiub" and dt.byteorder in ("<", "=", "|") else None


class _RangeFile:
    """A read-only file over one kvstore value, read in byte ranges (for zstd's stream reader)."""

    def __init__(self, store: ts.KvStore, key: bytes):
        self._store, self._key, self._offset, self._end = store, key, 0, False

    def read(self, size: int = -1) -> bytes:
        if self._end:
            return b""
        size = _RANGE_BYTES if size is None or size < 0 else size
        try:
            data = self._store.read(self._key, byte_range=slice(self._offset, self._offset + size)).result().value
        except ValueError as e:  # OUT_OF_RANGE: fewer than `size` bytes are left
            if "OUT_OF_RANGE" not in str(e):
                raise
            data = self._store.read(self._key, byte_range=slice(self._offset, None)).result().value
            self._end = True
        self._offset += len(data)
        self._end = self._end or len(data) < size
        return data


class LeafReader:
    """Streams leaves of one orbax PyTree item (an OCDBT directory) into host arrays."""

    def __init__(self, item: Path):
        self.item = item
        spec = _ts_utils.build_kvstore_tspec(str(item), name=None, use_ocdbt=True)
        spec.pop("path", None)
        try:
            self._store = ts.KvStore.open(spec, context=ts.Context(_CONTEXT)).result()
        except Exception as e:
            _quiet_late_orbax_callbacks()
            raise CheckpointError(f"{item}: cannot open the checkpoint's arrays: {one_line(e, within=item)}") from e

    def _fail(self, path: str, e: BaseException):
        _quiet_late_orbax_callbacks()
        raise CheckpointError(
            f"{self.item}: cannot read array {path!r}, the checkpoint is damaged or incomplete: {one_line(e, within=self.item)}"
        ) from e

    def _zarray(self, name: str, path: str) -> dict[str, Any] | None:
        try:
            r = self._store.read(f"{name}/.zarray".encode()).result()
        except Exception as e:
            self._fail(path, e)
        if r.state != "value":
            return None  # zarr3 or another layout: orbax reads it
        try:
            return json.loads(r.value)
        except ValueError as e:
            self._fail(path, e)

    def _fast_layout(self, meta: dict[str, Any] | None, shape: tuple[int, ...]):
        """(stored dtype, compressed?, chunk key separator) when the leaf is one C-order chunk we can stream, else None."""
        if not meta or meta.get("zarr_format") != 2 or meta.get("filters") or meta.get("order", "C") != "C":
            return None
        if tuple(meta.get("shape", ())) != shape or tuple(meta.get("chunks", ())) != shape:
            return None
        comp = meta.get("compressor")
        if comp is not None and comp.get("id") != "zstd":
            return None
        dt, sep = _zarr_dtype(str(meta.get("dtype"))), meta.get("dimension_separator", ".")
        return None if dt is None or sep not in (".", "/") else (dt, comp is not None, sep)

    def pieces(self, stored: tuple[str, ...], path: str, shape: tuple[int, ...], dtype: np.dtype, per_layer: bool,
               max_abs: float | None) -> Iterator[np.ndarray]:
        """Yields the leaf at the stored key path cast to `dtype`: whole, or its shape[0] slices when `per_layer`.

        Args:
          stored: the leaf's key path in the item's tree; path: the leaf as errors name it.
          shape: the stored shape (checked against the array's metadata).
          max_abs: refuse non-finite values and |x| > max_abs (`orbax_io.check_block`).
        """
        dtype, name = np.dtype(dtype), ".".join(stored)  # orbax names an array by its keys joined with "."
        layout = self._fast_layout(self._zarray(name, path), shape)
        if layout is not None:
            key = f"{name}/{layout[2].join('0' * len(shape)) or '0'}".encode()
            try:
                present = self._store.read(key, byte_range=slice(0, 0)).result().state == "value"
            except Exception as e:
                self._fail(path, e)
            if present:
                yield from self._stream(key, path, shape, layout, dtype, per_layer, max_abs)
                return
        yield from self._via_orbax(stored, path, dtype, per_layer, max_abs)

    def _stream(self, key, path, shape, layout, dtype, per_layer, max_abs) -> Iterator[np.ndarray]:
        stored, compressed, _ = layout
        src = _RangeFile(self._store, key)
        reader = zstandard.ZstdDecompressor().stream_reader(src, read_size=_RANGE_BYTES) if compressed else src
        scratch = np.empty(min(_BLOCK, max(math.prod(shape), 1)), stored)
        parts, piece_shape = (shape[0], shape[1:]) if per_layer else (1, shape)
        done = 0
        try:
            for _ in range(parts):
                out = aligned_empty(piece_shape, dtype)
                flat = out.reshape(-1)
                for i in range(0, flat.size, scratch.size):
                    n = min(scratch.size, flat.size - i)
                    self._fill(reader, scratch[:n], path)
                    check_block(self.item, path, scratch[:n], max_abs, offset=done)
                    flat[i:i + n] = scratch[:n]
                    done += n
                yield out
            if reader.read(1):
                raise CheckpointError(f"{self.item}: array {path!r} holds more data than its shape {shape}; the checkpoint is damaged")
        except CheckpointError:
            raise
        except Exception as e:  # zstd / TensorStore errors on damaged data
            self._fail(path, e)

    def _fill(self, reader, block: np.ndarray, path: str) -> None:
        view = memoryview(block.view(np.uint8).reshape(-1))
        got = 0
        while got < len(view):
            if hasattr(reader, "readinto"):
                n = reader.readinto(view[got:])
            else:
                data = reader.read(len(view) - got)
                n = len(data)
                view[got:got + n] = data
            if not n:
                raise CheckpointError(f"{self.item}: array {path!r} ends early (truncated data); the checkpoint is damaged")
            got += n

    def _via_orbax(self, key, path, dtype, per_layer, max_abs) -> Iterator[np.ndarray]:
        arr = restore_arrays(self.item, {key: dtype}, partial=True)[key]
        check_block(self.item, path, arr, max_abs)
        if not per_layer:
            yield arr
            return
        for i in range(arr.shape[0]):
            yield np.array(arr[i])
