"""Memory-annotated robot frames: the frame dict and its storage format, a tfds RLDS dataset written and read
without TensorFlow.

A *frame* is one camera snapshot with its textual-memory label, as a plain dict:

    {"image": uint8 [Px, Px, 3], "wrist_image": uint8 [Px, Px, 3], "state": float32 [Ds],
     "language_instruction": str, "memory": str, "task": str, "init_index": int, **extras}

`extras` are optional scalar metadata (str, int, float or bool, the same keys in every frame), e.g. a scene
description or a task id. Stored layout (RLDS; every frame is a one-step episode, because memory labels
are per frame and frames are independent training examples, so random access to frames is random access
to episodes):

    steps[1]: observation/{image, wrist_image: Image(Px, Px, 3) JPEG; state: float32 [Ds]},
              language_instruction: Text, memory: Text, is_first = is_last = is_terminal = True
    episode_metadata: task: Text, init_index: int64, <extra>: Text | int64 | float64 | bool

written as array_record (images are JPEG-encoded here with Pillow: tfds would need TensorFlow to encode
raw arrays) in generation order, so `open_memory_dataset(path, split)[i]` is the i-th frame written.
`open_memory_dataset` also reads other RLDS datasets with these step features (multi-step episodes,
TFRecord shards as LIBERO/DROID ship): their steps become frames
in episode order; a missing `task` reads as the language instruction and a missing `init_index` as -1.

The trainer's batches of these frames are `training.memory.data`'s. Axes (`oxygen_jax.axes`): Px image
side (stored), Ds state dims; Hi/Wi image height/width of other RLDS datasets.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from training.data.rlds_tfrecord import (
    RldsTFRecordSource,
    decode_image,
    load_builder,
    skip_image_decoding,
    split_info,
)

_IMAGE_KEYS = ("image", "wrist_image")
_TEXT_KEYS = ("language_instruction", "memory", "task")
REQUIRED_FRAME_KEYS = (*_IMAGE_KEYS, "state", "language_instruction", "memory", "task", "init_index")
# Feature paths every memory dataset must have (task / init_index are optional on read).
REQUIRED_FEATURES = (
    "steps/observation/image", "steps/observation/wrist_image", "steps/observation/state",
    "steps/language_instruction", "steps/memory",
)
_METADATA_FILE = "metadata.json"  # tfds' MetadataDict file; holds our one-step-episode marker
_ONE_STEP = "one_step_episodes"
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")

# -------------------------------------------------------------------------------------------------
# Writing (tfds, array_record, no TensorFlow)
# -------------------------------------------------------------------------------------------------


def write_array_record_dataset(
    out_dir: str | os.PathLike,
    name: str,
    features,
    splits: Mapping[str, Iterable[dict]],
    *,
    version: str = "1.0.0",
    description: str = "",
    metadata: Mapping | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes examples with tfds into `out_dir/name/version/` as array_record, in the order given.

    Works without TensorFlow as long as every image leaf is already encoded (PNG/JPEG bytes).

    Args:
      out_dir: the tfds data_dir.
      name: dataset name (snake_case: lower-case letters, digits, underscores).
      features: a `tfds.features.FeaturesDict`.
      splits: split name → iterable of examples (nested dicts matching `features`); consumed once.
      metadata: JSON-able dict stored as `metadata.json` next to `dataset_info.json`.
      overwrite: replace an existing `out_dir/name/version` (otherwise that raises FileExistsError).
    Returns:
      The dataset version folder (what `tfds.builder_from_directory` and `open_memory_dataset` take).
    """
    import tensorflow_datasets as tfds

    if not _NAME_RE.match(name):
        raise ValueError(f"dataset name {name!r} must be snake_case (lower-case letters, digits, underscores)")
    if not splits:
        raise ValueError("splits is empty; pass e.g. {'train': frames, 'heldout': frames}")
    bad = [s for s in splits if not re.match(r"^[A-Za-z0-9_]+$", s)]
    if bad:
        raise ValueError(f"split names {bad} must be letters, digits and underscores (e.g. 'train', 'heldout')")
    out = Path(out_dir).resolve()
    target = out / name / version
    if target.exists():
        if not overwrite:
            raise FileExistsError(f"{target} already exists; choose another out_dir or name, or pass overwrite=True")
        shutil.rmtree(target)
    data, feats, ver, meta = splits, features, version, dict(metadata or {})

    class _Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version(ver)

        def _info(self):
            # Built directly: `dataset_info_from_configs` needs a builder module folder on disk.
            return tfds.core.DatasetInfo(
                builder=self, description=description, features=feats, disable_shuffling=True,
                metadata=tfds.core.MetadataDict(meta),
            )

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(examples) for split, examples in data.items()}

        def _generate_examples(self, examples):
            # Integer keys + disable_shuffling: records are stored in generation order.
            yield from enumerate(examples)

    _Builder.name = name
    # No source folder: tfds would look for checksums next to this module (and trips over a missing
    # optional `importlib_resources` import for modules inside a package).
    _Builder.code_path = None
    with tempfile.TemporaryDirectory(prefix="tfds_downloads_") as downloads:
        builder = _Builder(data_dir=os.fspath(out), file_format="array_record")
        builder.download_and_prepare(download_dir=downloads)
    return target


def _extra_kind(value, where: str) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    if isinstance(value, (str, bytes)):
        return "str"
    raise ValueError(
        f"{where}: extra metadata must be a str, int, float or bool scalar, got {type(value).__name__}; "
        "encode structured values as a string first (e.g. json.dumps)"
    )


def memory_features(*, image_size: int = 224, state_dim: int = 8, extras: Mapping[str, str] | None = None):
    """The tfds `FeaturesDict` of a memory dataset (see the module docstring).

    Args:
      image_size: Px, the stored square image side.
      state_dim: Ds.
      extras: extra metadata name → kind ("str", "int", "float", "bool"), stored under episode_metadata.
    """
    import tensorflow_datasets as tfds

    f = tfds.features
    kinds = {"str": f.Text, "int": lambda: f.Scalar(np.int64), "float": lambda: f.Scalar(np.float64),
             "bool": lambda: f.Scalar(np.bool_)}
    image = lambda: f.Image(shape=(image_size, image_size, 3), dtype=np.uint8, encoding_format="jpeg")  # noqa: E731
    step = {
        "observation": {"image": image(), "wrist_image": image(), "state": f.Tensor(shape=(state_dim,), dtype=np.float32)},
        "language_instruction": f.Text(),
        "memory": f.Text(),
        "is_first": f.Scalar(np.bool_),
        "is_last": f.Scalar(np.bool_),
        "is_terminal": f.Scalar(np.bool_),
    }
    meta = {"task": f.Text(), "init_index": f.Scalar(np.int64)}
    for key, kind in (extras or {}).items():
        meta[key] = kinds[kind]()
    return f.FeaturesDict({"steps": f.Dataset(step), "episode_metadata": meta})


def _encode_jpeg(img: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    # 4:4:4 chroma: with the default 4:2:0, saturated edges of few-pixel objects (a can in the basket at
    # 224², a block at 56²) change by up to ~125 levels; 4:4:4 keeps them within ~20 for ~1.8x the bytes.
    Image.fromarray(img).save(buf, format="JPEG", quality=quality, subsampling=0)
    return buf.getvalue()


def _frame_episode(frame, where: str, *, image_size: int, state_dim: int, extras: Mapping[str, str],
                   jpeg_quality: int) -> dict:
    """Validates one frame dict and turns it into a one-step RLDS episode with JPEG bytes."""
    if not isinstance(frame, Mapping):
        raise ValueError(f"{where}: a frame must be a dict, got {type(frame).__name__}")
    missing = [k for k in REQUIRED_FRAME_KEYS if k not in frame]
    if missing:
        raise ValueError(f"{where}: missing {missing}; a frame needs {list(REQUIRED_FRAME_KEYS)}")
    unknown = sorted(set(frame) - set(REQUIRED_FRAME_KEYS) - set(extras))
    absent = sorted(set(extras) - set(frame))
    if unknown or absent:
        raise ValueError(
            f"{where}: extra keys differ from the first frame's {sorted(extras)} (unexpected {unknown}, "
            f"missing {absent}); every frame must carry the same extra metadata"
        )
    images = {}
    for key in _IMAGE_KEYS:
        img = np.asarray(frame[key])
        if img.dtype != np.uint8 or img.shape != (image_size, image_size, 3):
            raise ValueError(
                f"{where}: {key!r} must be uint8 [{image_size}, {image_size}, 3] RGB pixels (image_size={image_size}), "
                f"got {img.dtype} {img.shape}"
            )
        images[key] = _encode_jpeg(np.ascontiguousarray(img), jpeg_quality)
    state = np.asarray(frame["state"])
    if state.shape != (state_dim,) or not np.issubdtype(state.dtype, np.floating) or not np.isfinite(state).all():
        raise ValueError(f"{where}: 'state' must be {state_dim} finite floats, got {state.dtype} {state.shape}")
    texts = {}
    for key in _TEXT_KEYS:
        value = frame[key]
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        if not isinstance(value, str):
            raise ValueError(f"{where}: {key!r} must be a str, got {type(value).__name__}")
        texts[key] = value
    init_index = frame["init_index"]
    if isinstance(init_index, (bool, np.bool_)) or not isinstance(init_index, (int, np.integer)):
        raise ValueError(f"{where}: 'init_index' must be an int, got {type(init_index).__name__}")
    meta = {"task": texts["task"], "init_index": int(init_index)}
    for key, kind in extras.items():
        if _extra_kind(frame[key], f"{where}: {key!r}") != kind:
            raise ValueError(f"{where}: {key!r} must be {kind}, as in the first frame; got {type(frame[key]).__name__}")
        meta[key] = frame[key]
    step = {
        "observation": {**images, "state": state.astype(np.float32)},
        "language_instruction": texts["language_instruction"],
        "memory": texts["memory"],
        "is_first": True, "is_last": True, "is_terminal": True,
    }
    return {"steps": [step], "episode_metadata": meta}


def write_memory_dataset(
    out_dir: str | os.PathLike,
    splits: Mapping[str, Iterable[Mapping]],
    *,
    image_size: int = 224,
    state_dim: int = 8,
    name: str = "memory_frames",
    version: str = "1.0.0",
    jpeg_quality: int = 95,
    overwrite: bool = False,
) -> Path:
    """Writes memory frames as a tfds RLDS dataset (array_record, one-step episodes), without TensorFlow.

    Args:
      out_dir: the tfds data_dir; the dataset goes to `out_dir/name/version/`.
      splits: split name → iterable of frame dicts (module docstring), e.g. {"train": …, "heldout": …};
        iterables are consumed once, so generators stream. Extra scalar keys are inferred from the first
        frame of the first split and stored as episode metadata; every frame must then carry them.
      image_size: Px; both images must be uint8 [Px, Px, 3] (no resizing here: resize in the generator).
      state_dim: Ds.
      jpeg_quality: Pillow JPEG quality (images are stored 4:4:4, i.e. without chroma subsampling).
      overwrite: replace an existing dataset of the same name and version.
    Returns:
      The dataset version folder, to pass to `open_memory_dataset`.
    Raises:
      ValueError naming the split, frame index and field of the first bad frame (nothing is skipped).
    """
    if not isinstance(splits, Mapping) or not splits:
        raise ValueError("splits must be a non-empty dict: split name → iterable of frame dicts")
    streams = {s: iter(frames) for s, frames in splits.items()}
    firsts = {}
    for s, it in streams.items():
        try:
            firsts[s] = next(it)
        except StopIteration:
            raise ValueError(f"split {s!r} has no frames") from None
    first_split = next(iter(firsts))
    first = firsts[first_split]
    if not isinstance(first, Mapping):
        raise ValueError(f"split {first_split!r} frame 0: a frame must be a dict, got {type(first).__name__}")
    extras = {k: _extra_kind(v, f"split {first_split!r} frame 0: {k!r}")
              for k, v in first.items() if k not in REQUIRED_FRAME_KEYS}
    if any("/" in k for k in extras):
        raise ValueError(f"extra metadata names must not contain '/': {sorted(extras)}")

    def episodes(split):
        for i, frame in enumerate(itertools.chain([firsts[split]], streams[split])):
            yield _frame_episode(frame, f"split {split!r} frame {i}", image_size=image_size, state_dim=state_dim,
                                 extras=extras, jpeg_quality=jpeg_quality)

    return write_array_record_dataset(
        out_dir, name, memory_features(image_size=image_size, state_dim=state_dim, extras=extras),
        {s: episodes(s) for s in streams}, version=version, overwrite=overwrite,
        description="Memory-annotated robot frames (one-step RLDS episodes), written by training.data.frames.",
        metadata={_ONE_STEP: True},
    )


# -------------------------------------------------------------------------------------------------
# Reading
# -------------------------------------------------------------------------------------------------


def _feature_paths(features) -> dict[str, object]:
    """'steps/observation/image' → feature, through FeaturesDicts and (RLDS) Dataset features."""
    import tensorflow_datasets as tfds

    out = {}

    def walk(feature, prefix):
        if isinstance(feature, tfds.features.Dataset):
            walk(feature.feature, prefix)
        elif isinstance(feature, tfds.features.FeaturesDict):
            for key in feature.keys():
                walk(feature[key], f"{prefix}/{key}" if prefix else key)
        else:
            out[prefix] = feature

    walk(features, "")
    return out


def check_memory_features(features, path) -> None:
    """Raises a one-line ValueError naming the first missing or mistyped memory feature and the dataset."""
    import tensorflow_datasets as tfds

    have = _feature_paths(features)
    for key in REQUIRED_FEATURES:
        if key not in have:
            raise ValueError(
                f"{path}: dataset has no feature {key!r}, needed for memory training (it has {sorted(have)}); "
                "write memory datasets with training.data.frames.write_memory_dataset"
            )
    for key in REQUIRED_FEATURES[:2]:
        feat = have[key]
        if not isinstance(feat, tfds.features.Image) or feat.shape[-1] != 3 or feat.np_dtype != np.uint8:
            raise ValueError(f"{path}: feature {key!r} must be a uint8 RGB Image [height, width, 3], got {feat!r}")
    state = have["steps/observation/state"]
    if not isinstance(state, tfds.features.Tensor) or len(state.shape) != 1 or not np.issubdtype(state.np_dtype, np.floating):
        raise ValueError(f"{path}: feature 'steps/observation/state' must be a float Tensor [Ds], got {state!r}")
    for key in REQUIRED_FEATURES[3:]:
        if not isinstance(have[key], tfds.features.Text):
            raise ValueError(f"{path}: feature {key!r} must be Text, got {have[key]!r}")


def as_text(value) -> str:
    """A stored text field (UTF-8 bytes from RLDS, or str) as str."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _scalar(value):
    """A 0-d numpy value or numpy scalar → the Python scalar (text as str)."""
    if isinstance(value, np.ndarray):
        value = value[()]
    if isinstance(value, np.generic):
        value = value.item()
    return value.decode("utf-8") if isinstance(value, bytes) else value


class MemoryFrameSource(Sequence):
    """Random access to the frames of one split of a memory dataset (see `open_memory_dataset`).

    `src[i]` is a frame dict: images uint8 [Hi, Wi, 3] (decoded by Pillow), state float32 [Ds], text as str,
    init_index int, plus the episode's other scalar metadata as Python scalars.
    """

    def __init__(self, path: str | os.PathLike, split: str):
        self.path = Path(path)
        self.split = split
        builder = load_builder(self.path)
        split_info(builder, split, self.path)
        self.features = builder.info.features
        check_memory_features(self.features, self.path)
        fmt = builder.info.file_format.value if builder.info.file_format else "tfrecord"
        if fmt == "tfrecord":
            self._episodes = RldsTFRecordSource(self.path, split, decode_images=False)
        else:
            self._episodes = builder.as_data_source(split, decoders=skip_image_decoding(self.features))
        meta_file = self.path / _METADATA_FILE
        one_step = meta_file.is_file() and json.loads(meta_file.read_text()).get(_ONE_STEP) is True
        if one_step:
            self._starts = None  # frame i = episode i
            self._len = len(self._episodes)
        else:  # general RLDS: count steps once (each episode is read, its images are not decoded)
            counts = [len(self._episodes[e]["steps"]) for e in range(len(self._episodes))]
            self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            self._len = int(self._starts[-1])
        self._cached: tuple[int, Mapping] | None = None

    def __len__(self) -> int:
        return self._len

    def locate(self, i: int) -> tuple[int, int]:
        """(episode index, step index) of frame `i`."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, (bool, np.bool_)):
            raise TypeError(f"frame index must be an int, got {type(i).__name__}")
        if not -self._len <= i < self._len:
            raise IndexError(f"frame {i} out of range: split {self.split!r} of {self.path} has {self._len} frames")
        i = int(i) % self._len
        if self._starts is None:
            return i, 0
        e = int(np.searchsorted(self._starts, i, side="right") - 1)
        return e, i - int(self._starts[e])

    def _episode(self, e: int) -> Mapping:
        if self._cached is None or self._cached[0] != e:  # consecutive steps of one episode share a read
            self._cached = (e, self._episodes[e])
        return self._cached[1]

    def __getitem__(self, i: int) -> dict:
        e, t = self.locate(i)
        episode = self._episode(e)
        where = f"{self.path} split {self.split!r} frame {i}"
        obs = episode["steps"][t]["observation"]
        frame = {key: decode_image(obs[key], f"{where} {key!r}") for key in _IMAGE_KEYS}
        frame["state"] = np.asarray(obs["state"], np.float32)
        return {**frame, **self._texts(episode, t)}

    def texts(self, i: int) -> dict:
        """Frame `i` without images and state: its text and scalar metadata only (no JPEG is decoded)."""
        e, t = self.locate(i)
        return self._texts(self._episode(e), t)

    def _texts(self, episode: Mapping, t: int) -> dict:
        step = episode["steps"][t]
        frame = {"language_instruction": as_text(step["language_instruction"])}
        frame["memory"] = as_text(step["memory"])
        meta = episode.get("episode_metadata", {})
        frame["task"] = as_text(meta["task"]) if "task" in meta else frame["language_instruction"]
        frame["init_index"] = int(meta["init_index"]) if "init_index" in meta else -1
        for key, value in meta.items():
            if key not in frame and key not in _IMAGE_KEYS and key != "state" and not isinstance(value, Mapping) \
                    and np.ndim(value) == 0:
                frame[key] = _scalar(value)
        return frame

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self[i]


def frame_texts(source: Sequence[Mapping], keys: Sequence[str], limit: int | None = None) -> list[dict]:
    """[{key: frame[key] for the keys the frame has}] of the first `limit` frames (all by default), without
    decoding images when the source can skip them (`MemoryFrameSource.texts`); any other sequence of frame
    dicts is indexed as is. For label passes: tokenizer corpora, suffix lengths, baselines, frame picking."""
    n = len(source) if limit is None else min(limit, len(source))
    read = getattr(source, "texts", None) or source.__getitem__  # a source with texts(i) skips its images
    return [{k: f[k] for k in keys if k in f} for f in map(read, range(n))]


def open_memory_dataset(path: str | os.PathLike, split: str) -> MemoryFrameSource:
    """Opens one split of a memory dataset (the folder `write_memory_dataset` returned, or any tfds RLDS
    version folder, array_record or TFRecord, with the required step features) as random-access frames.

    Raises:
      FileNotFoundError if `path` is not a tfds dataset folder; ValueError (one line, naming the feature and
      the path) if a required feature is missing or mistyped, or the split does not exist.
    """
    return MemoryFrameSource(path, split)
