"""Rows of the data parquet files, read a row group at a time with pyarrow and kept in a small byte-bounded cache.

`RowReader.read(file, start, stop, columns)` returns {column: values} for rows [start, stop) of one file, where
values are numpy arrays for numeric columns (scalars [R], vectors [R, D], ArrayND [R, *shape] as
`features[...]['shape']` says) and Python lists for everything else (strings, the PNG struct {bytes, path},
language lists). Only the requested columns of the row groups that cover [start, stop) are read, so text-only
access never touches image bytes; LeRobot writes one row group per episode, so one read serves an episode.

What a file may make the reader allocate is bounded before it is decoded: a row group's requested columns
hold at most `MAX_ROW_GROUP_BYTES` uncompressed (the footer says so before any page is read), strings and
bytes are read dictionary-encoded (a value repeated on every row, as `language_persistent` repeats the
episode's spans, is held once, not once per row), and a string over `MAX_STRING_BYTES` or a list cell over
`MAX_LIST_ITEMS` entries is refused before any Python object is built from the column. Numbers must be of
a numeric type and finite where they are floats (`column_values(..., finite=True)`).

Axes: R rows, D feature dims.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

MAX_ROW_GROUP_BYTES = 1 << 30  # uncompressed bytes of the requested columns of one row group (one episode)
MAX_STRING_BYTES = 64 << 10  # one string cell (a task, a language row's content, a tool call)
MAX_LIST_ITEMS = 1 << 16  # entries of one list cell (a frame's language rows)

_NUMERIC = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
            "uint64", "bool")


def _numeric(dtype: str | None) -> bool:
    return dtype in _NUMERIC


def _check_text(array: pa.Array, where: str) -> None:
    """Refuses a string over `MAX_STRING_BYTES` or a list cell over `MAX_LIST_ITEMS` anywhere inside `array`
    (lists, structs, dictionary-encoded values), before anything is turned into Python objects."""
    t = array.type
    if pa.types.is_dictionary(t):
        _check_text(array.dictionary, where)
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        if len(array) and not pa.types.is_fixed_size_list(t):
            longest = pc.max(pc.list_value_length(array)).as_py() or 0
            if longest > MAX_LIST_ITEMS:
                raise ValueError(f"{where}: a cell holds {longest} list entries, above the cap {MAX_LIST_ITEMS}")
        _check_text(array.flatten(), where)
    elif pa.types.is_struct(t):
        for i in range(t.num_fields):
            _check_text(array.field(i), where)
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        longest = pc.max(pc.binary_length(array)).as_py() if len(array) else 0
        if (longest or 0) > MAX_STRING_BYTES:
            raise ValueError(f"{where}: a string of {longest} bytes, above the cap {MAX_STRING_BYTES} (the file is "
                             "damaged or not a robot dataset)")


def column_values(column: pa.ChunkedArray | pa.Array, feature: Mapping | None, where: str, finite: bool = False):
    """One arrow column -> numpy [R, *shape] for numeric features, else a Python list (see the module docstring).
    `finite`: also refuse a NaN or infinite float."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if feature is None or not _numeric(feature.get("dtype")):
        _check_text(column, where)
        return column.to_pylist()
    rows, values = len(column), column
    while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type) or \
            pa.types.is_large_list(values.type):
        if values.null_count:
            raise ValueError(f"{where}: null entries in a list column")
        values = values.flatten()
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type)):
        raise ValueError(f"{where}: holds {values.type} values, but info.json declares {feature.get('dtype')}")
    if values.null_count:
        raise ValueError(f"{where}: null values")
    flat = values.to_numpy(zero_copy_only=False)
    shape = feature.get("shape") or [1]
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and 0 < s <= MAX_LIST_ITEMS for s in shape):
        raise ValueError(f"{where}: info.json declares the shape {shape!r:.60}, expected a list of sizes")
    shape = [int(s) for s in shape]
    inner = int(np.prod(shape))
    if flat.size != rows * inner:
        raise ValueError(f"{where}: {flat.size} values in {rows} rows, expected shape {shape} per row "
                         "(info.json features disagree with the file)")
    is_list = values is not column  # a list column keeps its per-row axes even for shape [1]
    out = flat.reshape([rows] + (shape if is_list or shape != [1] else [])).astype(feature["dtype"], copy=False)
    if finite and out.dtype.kind == "f" and not np.isfinite(out).all():
        bad = np.argwhere(~np.isfinite(out))[0]
        raise ValueError(f"{where}: holds {out[tuple(bad)]} at row {int(bad[0])}; non-finite numbers are refused "
                         "(the recording is damaged)")
    return out


class RowReader:
    """Cached row-group reads of LeRobot data parquets (see the module docstring).

    Args:
      root: the dataset folder (files are given relative to it).
      features: `info.json` features (how numeric columns are shaped).
      cache_bytes: bound on the arrow bytes kept (least recently used row groups are dropped first); 0 keeps
        nothing between calls.
    """

    def __init__(self, root: Path, features: Mapping[str, Mapping], cache_bytes: int = 256 << 20):
        self.root, self.features, self.cache_bytes = Path(root), features, int(cache_bytes)
        self._files: dict[str, tuple[pq.ParquetFile, np.ndarray]] = {}
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cached_bytes = 0

    def __getstate__(self) -> dict:  # workers (grain, multiprocessing) get a copy without open files or cache
        return {**self.__dict__, "_files": {}, "_cache": collections.OrderedDict(), "_cached_bytes": 0}

    def _file(self, file: str) -> tuple[pq.ParquetFile, np.ndarray]:
        if file not in self._files:
            path = self.root / file
            if not path.is_file():
                what = "not a regular file" if path.exists() else "no such data file"
                raise FileNotFoundError(f"{path}: {what} (named by the episode table)")
            try:
                leaves = pq.ParquetFile(path).schema
                texts = [leaves.column(i).path for i in range(len(leaves)) if leaves.column(i).physical_type == "BYTE_ARRAY"]
                pf = pq.ParquetFile(path, read_dictionary=texts)  # repeated strings and bytes held once
            except (pa.ArrowInvalid, OSError) as e:
                raise ValueError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
            self._files[file] = (pf, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        return self._files[file]

    def columns(self, file: str) -> list[str]:
        return self._file(file)[0].schema_arrow.names

    def _group(self, file: str, g: int, columns: tuple[str, ...]) -> pa.Table:
        key = (file, g, columns)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        pf = self._file(file)[0]
        group = pf.metadata.row_group(g)
        size = sum(group.column(i).total_uncompressed_size for i in range(group.num_columns)
                   if any(group.column(i).path_in_schema == c or group.column(i).path_in_schema.startswith(c + ".")
                          for c in columns))
        if size > MAX_ROW_GROUP_BYTES:
            raise ValueError(f"{self.root / file}: row group {g}: columns {list(columns)} hold {size} bytes "
                             f"uncompressed, above the cap {MAX_ROW_GROUP_BYTES} (one episode's rows)")
        try:
            table = pf.read_row_group(g, columns=list(columns))
        except (pa.ArrowInvalid, OSError, KeyError) as e:
            raise ValueError(f"{self.root / file}: row group {g}: {str(e).splitlines()[0]}") from None
        if self.cache_bytes > 0:
            self._cache[key] = table
            self._cached_bytes += table.nbytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes
        return table

    def read(self, file: str, start: int, stop: int, columns: Sequence[str]) -> dict:
        """{column: values} of rows [start, stop) of `file` (see the module docstring)."""
        pf, bounds = self._file(file)
        names = pf.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ValueError(f"{self.root / file}: column {missing[0]!r} is missing (the file has {names})")
        if not 0 <= start < stop <= bounds[-1]:
            raise ValueError(f"{self.root / file}: rows [{start}, {stop}) requested but the file has {bounds[-1]} rows "
                             "(the episode table disagrees with the data file)")
        first = int(np.searchsorted(bounds, start, side="right") - 1)
        last = int(np.searchsorted(bounds, stop - 1, side="right") - 1)
        cols = tuple(columns)
        tables = [self._group(file, g, cols) for g in range(first, last + 1)]
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        table = table.slice(start - int(bounds[first]), stop - start)
        return {c: column_values(table.column(c), self.features.get(c), f"{self.root / file}: column {c!r}")
                for c in cols}
