"""Reading RLDS datasets stored as TFDS TFRecord shards (how LIBERO and DROID are distributed), without TensorFlow.

tfds can turn one serialized episode into numpy by itself (`features.deserialize_example_np`); what needs
TensorFlow in tfds' own reader is only the TFRecord file framing, so it is parsed here, with both CRCs
checked. A shard is a plain concatenation of records:

    uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data[length] | uint32 masked_crc32c(data)

`masked_crc32c(x) = rotr15(crc32c(x)) + 0xA282EAD8 (mod 2**32)`. Record k of a shard starts at byte
`sum(16 + length_j for j < k)`; one record is one RLDS episode (a `tf.train.Example`).

    src = RldsTFRecordSource("…/libero_10_no_noops/1.0.0", "train")   # indexes the shards (headers only)
    ep = src[0]           # {"steps": [step dict, …], "episode_metadata": {…}}; images uint8 [Hi, Wi, 3]
    stack_steps(ep["steps"])["observation"]["image"]                  # uint8 [Te, Hi, Wi, 3]

Images are decoded with Pillow here (tfds would pick OpenCV when it is installed), so pixels do not
depend on which optional decoder happens to be installed; `decode_images=False` returns the stored
encoded bytes (e.g. to re-package episodes without a second JPEG loss). Text stays UTF-8 `bytes`, as
tfds returns it.

Axes: Te steps of an episode, Hi/Wi image height/width (besides the letters of `oxygen_jax.axes`).
"""

from __future__ import annotations

import functools
import io
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

# -------------------------------------------------------------------------------------------------
# CRC-32C (Castagnoli), vectorised with numpy
# -------------------------------------------------------------------------------------------------

_POLY = 0x82F63B78  # CRC-32C (Castagnoli) polynomial, bit-reflected
_MASK_DELTA = 0xA282EAD8
_LANE_BYTES = 32  # bytes per lane in the vectorised CRC (a power of two, so lane shifts are cached powers)
_SMALL = 512  # below this many bytes a plain Python loop is faster than numpy
_CHUNK = 1 << 20  # bytes per vectorised pass


def _byte_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
    return table


_TABLE = _byte_table()
_TABLE_LIST = [int(v) for v in _TABLE]


def _crc_update_py(reg: int, data: bytes | np.ndarray) -> int:
    """The raw CRC register after feeding `data` (no initial value or final xor applied)."""
    table = _TABLE_LIST
    for b in bytes(data):
        reg = table[(reg ^ b) & 0xFF] ^ (reg >> 8)
    return reg


def _apply(tables: np.ndarray, reg):
    """A GF(2)-linear map of the 32-bit register given as 4 byte-sliced tables [4, 256]; int or uint32 array."""
    if isinstance(reg, (int, np.integer)):
        reg = int(reg)
        return int(tables[0, reg & 0xFF] ^ tables[1, (reg >> 8) & 0xFF] ^ tables[2, (reg >> 16) & 0xFF] ^ tables[3, reg >> 24])
    return tables[0][reg & 0xFF] ^ tables[1][(reg >> 8) & 0xFF] ^ tables[2][(reg >> 16) & 0xFF] ^ tables[3][reg >> 24]


def _tables_from_columns(columns: Sequence[int]) -> np.ndarray:
    """Byte-sliced lookup tables [4, 256] of the linear map whose image of bit i is `columns[i]`."""
    bits = (np.arange(256)[:, None] >> np.arange(8)) & 1  # [256, 8]
    cols = np.asarray(columns, np.uint32).reshape(4, 8)
    return np.stack([np.bitwise_xor.reduce(np.where(bits, cols[k], 0).astype(np.uint32), axis=1) for k in range(4)])


@functools.lru_cache(maxsize=64)
def _zero_shift(log2_bytes: int) -> np.ndarray:
    """Tables of "feed 2**log2_bytes zero bytes into the register" (squaring the one-byte map)."""
    if log2_bytes == 0:
        columns = [_crc_update_py(1 << i, b"\0") for i in range(32)]
    else:
        half = _zero_shift(log2_bytes - 1)
        columns = [_apply(half, _apply(half, 1 << i)) for i in range(32)]
    return _tables_from_columns(columns)


def _shift_zeros(reg: int, num_bytes: int) -> int:
    """The register after `num_bytes` zero bytes: one cached power-of-two map per set bit of the count."""
    bit = 0
    while num_bytes:
        if num_bytes & 1:
            reg = _apply(_zero_shift(bit), reg)
        num_bytes >>= 1
        bit += 1
    return reg


def _crc_raw_zero_init(data: np.ndarray) -> int:
    """The raw register of `data` [n] uint8 from a zero register, computed on many lanes at once.

    The register update is linear over GF(2), so crc(A ‖ B) = shift_|B|(crc(A)) ^ crc(B) when B starts from
    zero. The data, front-padded with zeros (which leave a zero register at zero), is cut into K = 2**q lanes
    of 32 bytes; all lanes advance together, then neighbours are merged pairwise (log2 K levels, each shift
    a cached power of two).
    """
    n = data.size
    lanes = 1 << max(0, (-(-n // _LANE_BYTES) - 1).bit_length())
    padded = np.zeros(lanes * _LANE_BYTES, np.uint32)
    padded[padded.size - n :] = data
    block = padded.reshape(lanes, _LANE_BYTES)
    regs = np.zeros(lanes, np.uint32)
    for j in range(_LANE_BYTES):
        regs = _TABLE[(regs ^ block[:, j]) & 0xFF] ^ (regs >> 8)
    level = _LANE_BYTES.bit_length() - 1  # log2 of the bytes each register covers
    while regs.size > 1:
        regs = _apply(_zero_shift(level), regs[0::2]) ^ regs[1::2]
        level += 1
    return int(regs[0])


def crc32c(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """CRC-32C (Castagnoli; reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF).

    Example: `crc32c(b"123456789") == 0xE3069283`. About 100-300 MB/s on one CPU core for large inputs.
    """
    arr = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    if arr.size < _SMALL:
        return _crc_update_py(0xFFFFFFFF, arr.tobytes()) ^ 0xFFFFFFFF
    raw = 0
    for start in range(0, arr.size, _CHUNK):  # bounded lane arrays for large inputs
        chunk = arr[start : start + _CHUNK]
        raw = _shift_zeros(raw, chunk.size) ^ _crc_raw_zero_init(chunk)
    return (_shift_zeros(0xFFFFFFFF, arr.size) ^ raw) ^ 0xFFFFFFFF


def masked_crc32c(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """TFRecord's masked CRC: the CRC-32C rotated right by 15 bits plus 0xA282EAD8 (mod 2**32)."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# -------------------------------------------------------------------------------------------------
# TFRecord framing
# -------------------------------------------------------------------------------------------------


class TFRecordError(ValueError):
    """A TFRecord file is truncated or fails a CRC check (the message names the file and record index)."""


_HEADER = struct.Struct("<QI")  # length, masked crc of the length bytes


def index_records(path: str | os.PathLike, *, check_crc: bool = True) -> list[tuple[int, int]]:
    """(data offset, data length) of every record in one TFRecord file, reading only the 12-byte headers.

    Checks each length CRC (when `check_crc`) and that the file holds exactly whole records; the data
    CRCs are checked when records are read (`read_record`).
    Raises:
      TFRecordError naming the file, the record index and its byte offset.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    out, offset = [], 0
    with open(path, "rb") as f:
        while offset < size:
            k = len(out)
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                raise TFRecordError(f"{path}: truncated header of record {k} at byte {offset}; the file is incomplete")
            length, length_crc = _HEADER.unpack(header)
            if check_crc and masked_crc32c(header[:8]) != length_crc:
                raise TFRecordError(
                    f"{path}: record {k} at byte {offset}: length CRC mismatch (corrupt file; re-download or re-convert it)"
                )
            end = offset + _HEADER.size + length + 4
            if end > size:
                raise TFRecordError(
                    f"{path}: record {k} at byte {offset} claims {length} data bytes but the file ends at byte {size}"
                )
            out.append((offset + _HEADER.size, length))
            offset = end
            f.seek(offset)
    return out


def read_record(f, path: str, index: int, offset: int, length: int, *, check_crc: bool = True) -> bytes:
    """The data of record `index` (data at `offset`, `length` bytes) from the open binary file `f`.

    Raises:
      TFRecordError naming the file and record index when the data CRC does not match or the file is short.
    """
    f.seek(offset)
    blob = f.read(length + 4)
    if len(blob) != length + 4:
        raise TFRecordError(f"{path}: record {index} at byte {offset - _HEADER.size} is truncated")
    data, (stored,) = blob[:length], struct.unpack("<I", blob[length:])
    if check_crc and masked_crc32c(data) != stored:
        raise TFRecordError(
            f"{path}: record {index} at byte {offset - _HEADER.size}: data CRC mismatch (corrupt file; "
            "re-download or re-convert it)"
        )
    return data


def iter_records(path: str | os.PathLike, *, check_crc: bool = True) -> Iterator[bytes]:
    """Every record's data in file order, both CRCs checked (see `index_records`, `read_record`)."""
    path = os.fspath(path)
    records = index_records(path, check_crc=check_crc)
    with open(path, "rb") as f:
        for k, (offset, length) in enumerate(records):
            yield read_record(f, path, k, offset, length, check_crc=check_crc)


# -------------------------------------------------------------------------------------------------
# tfds features: which leaves are images
# -------------------------------------------------------------------------------------------------


def image_feature_paths(features) -> list[tuple[str, ...]]:
    """Paths of every `tfds.features.Image` under FeaturesDicts and (RLDS) Dataset features, in key order.

    Example (LIBERO RLDS): [("steps", "observation", "image"), ("steps", "observation", "wrist_image")].
    """
    import tensorflow_datasets as tfds

    def walk(feature, prefix):
        if isinstance(feature, tfds.features.Image):
            yield prefix
        elif isinstance(feature, tfds.features.Dataset):
            yield from walk(feature.feature, prefix)
        elif isinstance(feature, tfds.features.FeaturesDict):
            for key in sorted(feature.keys()):
                yield from walk(feature[key], prefix + (key,))

    return list(walk(features, ()))


def skip_image_decoding(features) -> dict:
    """A tfds `decoders` tree that leaves every image feature as its encoded bytes."""
    import tensorflow_datasets as tfds

    tree: dict = {}
    for path in image_feature_paths(features):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tfds.decode.SkipDecoding()
    return tree


def decode_image(data: bytes, where: str = "image") -> np.ndarray:
    """Encoded image bytes (JPEG, PNG, …) → uint8 [Hi, Wi, 3] RGB, decoded by Pillow."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img if img.mode == "RGB" else img.convert("RGB"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot decode the stored image bytes ({e})") from e


def _decode_step_images(step: dict, image_paths: Sequence[tuple[str, ...]], where: str) -> dict:
    step = _copy_dicts(step)
    for path in image_paths:
        node = step
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = decode_image(node[path[-1]], f"{where} {'/'.join(path)}")
    return step


def _copy_dicts(tree):
    return {k: _copy_dicts(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


def materialize_episode(episode: Mapping, features, *, decode_images: bool = True, where: str = "episode") -> dict:
    """A tfds-deserialized episode (images left encoded) → plain dicts with `steps` as a list of step dicts.

    Args:
      episode: `deserialize_example_np(record, decoders=skip_image_decoding(features))` output, or an
        `as_data_source(..., decoders=…)` element.
      features: the dataset's top-level `FeaturesDict`.
      decode_images: decode every image feature with Pillow (else keep the encoded bytes).
    """
    step_images = [p[1:] for p in image_feature_paths(features) if p[0] == "steps"]
    top_images = [p for p in image_feature_paths(features) if p[0] != "steps"]
    out = _copy_dicts({k: v for k, v in episode.items() if k != "steps"})
    if decode_images and top_images:
        out = _decode_step_images(out, top_images, where)
    if "steps" in episode:
        steps = episode["steps"]
        out["steps"] = [
            _decode_step_images(steps[t], step_images, f"{where} step {t}") if decode_images else _copy_dicts(steps[t])
            for t in range(len(steps))
        ]
    return out


def stack_steps(steps: Sequence[Mapping]) -> dict:
    """A list of Te step dicts → one dict of the same structure with every leaf stacked on a leading Te axis.

    Arrays and numeric scalars become numpy arrays [Te, ...]; `bytes` leaves (text, encoded images) become
    object arrays [Te] (fixed-width numpy bytes would drop trailing NUL bytes).
    """
    if not steps:
        raise ValueError("stack_steps needs at least one step")
    first = steps[0]
    out = {}
    for key, value in first.items():
        column = [s[key] for s in steps]
        if isinstance(value, Mapping):
            out[key] = stack_steps(column)
        elif isinstance(value, (bytes, str)):
            arr = np.empty(len(column), object)
            arr[:] = column
            out[key] = arr
        else:
            out[key] = np.stack([np.asarray(v) for v in column])
    return out


# -------------------------------------------------------------------------------------------------
# An RLDS TFRecord split as a random-access source of episodes
# -------------------------------------------------------------------------------------------------


def load_builder(dataset_dir: str | os.PathLike):
    """`tfds.builder_from_directory` with a one-line error when the folder is not a tfds dataset version."""
    import tensorflow_datasets as tfds

    path = Path(dataset_dir)
    if not (path / "dataset_info.json").is_file() or not (path / "features.json").is_file():
        found = sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else "nothing (no such directory)"
        raise FileNotFoundError(
            f"{path}: not a tfds dataset folder (needs dataset_info.json and features.json; found {found}); "
            "pass the version folder, e.g. …/<name>/1.0.0"
        )
    return tfds.builder_from_directory(os.fspath(path))


def split_info(builder, split: str, path) -> object:
    """The builder's `SplitInfo` for `split`, or a one-line error listing the splits that exist."""
    splits = builder.info.splits
    if split not in splits:
        raise ValueError(f"{path}: no split {split!r}; the dataset has splits {sorted(splits.keys())}")
    return splits[split]


class RldsTFRecordSource(Sequence):
    """Random access to the episodes of one split of a TFDS TFRecord dataset, without TensorFlow.

    Episodes are numbered in file order: shard 0 first, records in file order (what
    `as_dataset(split, shuffle_files=False)` with `interleave_cycle_length=1` yields). Opening reads only
    the record headers; each `src[i]` reads one record, checks its CRC and deserializes it with tfds.

    Args:
      dataset_dir: the dataset version folder (holding dataset_info.json, features.json and the shards).
      split: e.g. "train".
      decode_images: decode images (uint8 [Hi, Wi, 3], Pillow) or keep their encoded bytes.
      check_crc: verify both CRCs of every record (a mismatch raises `TFRecordError`).
    """

    def __init__(self, dataset_dir: str | os.PathLike, split: str, *, decode_images: bool = True,
                 check_crc: bool = True):
        self.path = Path(dataset_dir)
        self.split = split
        self.decode_images = decode_images
        self.check_crc = check_crc
        self.builder = load_builder(self.path)
        fmt = str(self.builder.info.file_format.value if self.builder.info.file_format else "tfrecord")
        if fmt != "tfrecord":
            raise ValueError(
                f"{self.path}: stored as {fmt}, not tfrecord; read it with tfds' "
                "builder_from_directory(...).as_data_source(split) (or training.data.frames.open_memory_dataset)"
            )
        info = split_info(self.builder, split, self.path)
        self.features = self.builder.info.features
        self._decoders = skip_image_decoding(self.features)
        self._records: list[tuple[str, int, int, int]] = []  # (shard path, index in shard, data offset, length)
        for shard, expected in zip(info.filepaths, info.shard_lengths):
            shard = os.fspath(shard)
            if not os.path.isfile(shard):
                raise FileNotFoundError(f"{self.path}: split {split!r} shard {os.path.basename(shard)} is missing")
            records = index_records(shard, check_crc=check_crc)
            if len(records) != expected:
                raise TFRecordError(
                    f"{shard}: holds {len(records)} records but dataset_info.json lists {expected}; "
                    "the shard is incomplete or from another version"
                )
            self._records += [(shard, k, off, n) for k, (off, n) in enumerate(records)]

    def __len__(self) -> int:
        return len(self._records)

    def record(self, i: int) -> bytes:
        """The serialized `tf.train.Example` of episode `i` (CRC-checked)."""
        shard, k, offset, length = self._records[self._check_index(i)]
        with open(shard, "rb") as f:
            return read_record(f, shard, k, offset, length, check_crc=self.check_crc)

    def __getitem__(self, i: int) -> dict:
        i = self._check_index(i)
        shard, k, _, _ = self._records[i]
        raw = self.features.deserialize_example_np(self.record(i), decoders=self._decoders)
        where = f"{os.path.basename(shard)} record {k}"
        return materialize_episode(raw, self.features, decode_images=self.decode_images, where=where)

    def _check_index(self, i) -> int:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"episode index must be an int, got {type(i).__name__}")
        n = len(self._records)
        if not -n <= i < n:
            raise IndexError(f"episode {i} out of range: split {self.split!r} has {n} episodes")
        return int(i) % n

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self[i]
