"""Random access to the frames of a LeRobot dataset (v3.0 or v2.x) by feature name, as `LeRobotDataset[i]` of
LeRobot returns them, without torch: pyarrow for the parquet rows, PyAV for the videos, Pillow for PNG cameras.

    ds = LeRobotDataset("path/to/dataset", delta_timestamps={"actions": [0.0, 0.1, 0.2, 0.3]})
    item = ds.item(5)      # {"image": uint8 [H, W, 3], "state": float32 [Ds], "actions": float32 [4, Da],
                           #  "actions_is_pad": bool [4], "timestamp": float32, "index": int64, ..., "task": str,
                           #  "subtask" / "plan" / "memory" / "interjection" / "speech": str ('' without
                           #  language columns; a plain string column of that name is used as is)}
    ds.texts(5)            # the same without cameras (no image bytes read, no video decoded)

Frame i is the i-th frame in dataset order (global `index` order) of the selected episodes (`episodes=`: a
list of episode indices, default all). Cameras come back as uint8 HWC whatever `names` says; video frames are
the frame nearest to the row's video time (`training.data.lerobot.video`), image features are their PNG/JPEG bytes
decoded. `delta_timestamps` samples a feature at `index + round(dt * fps)` clamped to the episode, as openpi
trains (`{"actions": [k / fps for k in range(H)]}`): rows past the episode end repeat its last row and
`<key>_is_pad` flags them, e.g. an episode of 8 frames, H = 5, frame 6 -> rows 6, 7, 7, 7, 7, pad F F T T T.

Axes: H chunk rows (delta timestamps), Ds state dims, Da action dims.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from training.data.lerobot import language
from training.data.lerobot.meta import DEFAULT_COLUMNS, DatasetMeta, read_meta
from training.data.lerobot.rows import RowReader
from training.data.lerobot.video import TOLERANCE_S, VideoFrames

LANGUAGE_TEXT_KEYS = ("subtask", "plan", "memory", "interjection", "speech")


def decode_image(value, where: str, size: tuple[int, int] | None = None) -> np.ndarray:
    """A parquet image cell ({bytes, path} struct, or raw bytes) -> uint8 RGB [H, W, 3] via Pillow (lossless).

    `size` (H, W): the image must have exactly this size, read from its header before any pixel is decoded
    (a 12000 x 12000 PNG in a 64 px camera is refused without allocating its 432 MB)."""
    data = value.get("bytes") if isinstance(value, Mapping) else value
    if not data or not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"{where}: the image cell holds no bytes")
    try:
        with warnings.catch_warnings():  # Pillow only warns below 2x its pixel limit; no camera comes near it
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        with img:
            if size is not None and (img.height, img.width) != tuple(size):
                raise ValueError(f"the image is {img.height} x {img.width} px but info.json says {size[0]} x {size[1]}")
            return np.asarray(img if img.mode == "RGB" else img.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"{where}: cannot decode the stored image bytes ({e})") from None


class LeRobotDataset:
    """Frames of a LeRobot dataset by feature name (see the module docstring).

    Args:
      root: the dataset folder (meta/, data/, videos/).
      episodes: episode indices to read (dataset order is kept), default all.
      delta_timestamps: {feature: [seconds, ...]} chunks (multiples of 1 / fps within `tolerance_s`).
      video_cache_mb: decoded video frames kept for frames read again (0: none). Reading in time order decodes
        each frame once either way; a random access decodes from the key frame before it (`training.data.lerobot.video`).
      row_cache_mb: parquet row groups kept.
      tolerance_s: largest accepted |video frame time - query time|.
      finite: numeric features that must hold finite numbers (e.g. the state and action the key map uses);
        a NaN or inf there is a one-line ValueError naming the file, episode, frame and feature.
    """

    def __init__(self, root: str | Path, *, episodes: Sequence[int] | None = None,
                 delta_timestamps: Mapping[str, Sequence[float]] | None = None, video_cache_mb: float = 512,
                 row_cache_mb: float = 256, tolerance_s: float = TOLERANCE_S, finite: Sequence[str] = ()):
        self.meta: DatasetMeta = read_meta(root)
        self.root = self.meta.root
        by_index = {e.index: e for e in self.meta.episodes}
        if episodes is not None:
            unknown = [int(e) for e in episodes if int(e) not in by_index]
            if unknown:
                raise ValueError(f"{self.root}: episode {unknown[0]} is not in meta/ (the dataset has episodes "
                                 f"{min(by_index)}..{max(by_index)}); fix the episode list")
            keep = {int(e) for e in episodes}
            self.episodes = tuple(e for e in self.meta.episodes if e.index in keep)
        else:
            self.episodes = self.meta.episodes
        self._starts = np.concatenate([[0], np.cumsum([e.length for e in self.episodes])]).astype(np.int64)
        feats = self.meta.features
        self.delta_indices = self._delta_indices(delta_timestamps or {}, tolerance_s)
        self.rows = RowReader(self.root, feats, int(row_cache_mb * (1 << 20)))
        self.video = VideoFrames(int(video_cache_mb * (1 << 20)), tolerance_s)
        self.image_keys = tuple(k for k in self.meta.camera_keys if feats[k]["dtype"] == "image")
        self.video_keys = self.meta.video_keys
        self.finite = tuple(finite)

    def _delta_indices(self, delta: Mapping[str, Sequence[float]], tol: float) -> dict[str, np.ndarray]:
        out = {}
        for key, dts in delta.items():
            if key not in self.meta.features or self.meta.features[key].get("dtype") in ("video", "image", "language"):
                raise ValueError(f"delta_timestamps: {key!r} is not a numeric feature of {self.root} "
                                 f"(features: {sorted(self.meta.features)})")
            steps = np.asarray(list(dts), np.float64) * self.meta.fps
            if steps.size == 0 or np.any(np.abs(steps - np.round(steps)) / self.meta.fps > tol):
                raise ValueError(f"delta_timestamps[{key!r}] = {list(dts)} must be non-empty multiples of 1/fps "
                                 f"(fps {self.meta.fps:g})")
            out[key] = np.round(steps).astype(np.int64)
        return out

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """(position in `self.episodes`, frame within that episode) of frame `i`."""
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"frame index must be an int, got {type(i).__name__}")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"frame {i} out of range: {self.root} has {n} frames (selected episodes)")
        i = int(i) % n
        e = int(np.searchsorted(self._starts, i, side="right") - 1)
        return e, i - int(self._starts[e])

    def episode_of(self, frames: np.ndarray) -> np.ndarray:
        """int64 [N]: the position in `self.episodes` of each frame index in `frames` (in range)."""
        return np.searchsorted(self._starts, np.asarray(frames, np.int64), side="right") - 1

    def _columns(self, file: str, cameras: bool) -> list[str]:
        have = set(self.rows.columns(file))
        wanted = [k for k, f in self.meta.features.items()
                  if f.get("dtype") != "video" and (cameras or f.get("dtype") != "image")]
        missing = [k for k in DEFAULT_COLUMNS if k not in have]
        if missing:
            raise ValueError(f"{self.root / file}: column {missing[0]!r} is missing (every LeRobot data file has it)")
        return [k for k in wanted if k in have] + [k for k in DEFAULT_COLUMNS if k not in wanted]

    def _read(self, i: int, cameras: bool) -> dict:
        e, r = self.locate(i)
        ep = self.episodes[e]
        try:
            return self._read_row(ep, r, cameras)
        except (ValueError, OSError) as err:  # one line naming the episode and frame; the file and field follow
            kind = FileNotFoundError if isinstance(err, FileNotFoundError) else ValueError
            raise kind(f"episode {ep.index} frame {r}: {str(err).splitlines()[0]}") from None

    def _read_row(self, ep, r: int, cameras: bool) -> dict:
        where = f"{self.root / ep.data_file}"
        row = self.rows.read(ep.data_file, ep.row_offset + r, ep.row_offset + r + 1, self._columns(ep.data_file, cameras))
        item = {k: v[0] for k, v in row.items()}
        if int(item["episode_index"]) != ep.index or int(item["frame_index"]) != r:
            raise ValueError(f"{where}: row {ep.row_offset + r} has episode_index {int(item['episode_index'])} "
                             f"frame_index {int(item['frame_index'])}, expected {ep.index} / {r} from the episode "
                             "table (meta/ and data/ disagree)")
        task_index = int(item["task_index"])
        if task_index not in self.meta.tasks:
            raise ValueError(f"{where}: field 'task_index' {task_index} has no task in meta/tasks")
        item["task"] = self.meta.tasks[task_index]
        t = float(item["timestamp"])
        if not 0 <= t < 1e9:
            raise ValueError(f"{where}: field 'timestamp' is {t}, not a time in seconds")
        texts = language.frame_texts(item.get(language.PERSISTENT), item.get(language.EVENTS), t, where)
        for key, text in texts.items():  # a plain string column of that name (some exports have one) wins
            item.setdefault(key, text)
        for key, offsets in self.delta_indices.items():
            want = r + offsets
            rows = np.clip(want, 0, ep.length - 1)
            lo, hi = int(rows.min()), int(rows.max()) + 1
            block = self.rows.read(ep.data_file, ep.row_offset + lo, ep.row_offset + hi, [key])[key]
            item[key] = np.asarray(block)[rows - lo]
            item[f"{key}_is_pad"] = want != rows
        for key in self.finite:
            values = np.asarray(item.get(key, 0.0)).reshape(-1)
            if values.dtype.kind == "f" and not np.isfinite(values).all():
                raise ValueError(f"{where}: field {key!r} holds {values[~np.isfinite(values)][0]}; non-finite "
                                 "numbers are refused (the recording is damaged)")
        if cameras:
            for key in self.image_keys:
                item[key] = decode_image(item[key], f"{where}: column {key!r} row {ep.row_offset + r}",
                                         self.meta.image_shape(key))
            for key in self.video_keys:
                path, start = ep.videos[key]
                try:
                    item[key] = self.video.frame(self.root / path, start + t, self.meta.fps, self.meta.image_shape(key))
                except ValueError as e:
                    raise ValueError(f"camera {key!r}: {e}") from None
        return item

    def item(self, i: int) -> dict:
        """Frame `i` by feature name, cameras decoded (see the module docstring)."""
        return self._read(i, True)

    def texts(self, i: int) -> dict:
        """Frame `i` without cameras: numbers, strings and language (no image bytes read, no video decoded)."""
        return self._read(i, False)

    def __getitem__(self, i: int) -> dict:
        return self.item(i)
