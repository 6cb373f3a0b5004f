"""A LeRobot dataset's metadata: `meta/info.json`, the episode table, tasks, and where every episode's rows and
video frames live, for codebase v3.0 and v2.x (v2.0 / v2.1).

Nothing here reads a frame. `read_meta(root)` returns a `DatasetMeta` holding one `Episode` per episode in
dataset order (the global `index` order):

    v3.0: meta/episodes/chunk-*/file-*.parquet (one row per episode; `stats/*` columns are not read)
          data file  = info.data_path.format(chunk_index=row['data/chunk_index'], file_index=row['data/file_index'])
          video file = info.video_path.format(video_key=k, chunk_index=row['videos/k/chunk_index'], ...),
          video time of a row = row['videos/k/from_timestamp'] + timestamp (several episodes per mp4)
    v2.x: meta/episodes.jsonl; episode_chunk = episode_index // chunks_size; one parquet and one mp4 per episode,
          video time of a row = its timestamp

An episode's first row inside its data file (`Episode.row_offset`) is the number of rows of the episodes before
it in the same file (rows are stored in `index` order), e.g. episodes of lengths 8, 6, 10 in one file start at
rows 0, 8, 14; a second file starts again at 0.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
CAMERA_DTYPES = ("video", "image")
LANGUAGE_DTYPE = "language"
DEFAULT_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")


@dataclasses.dataclass(frozen=True)
class Episode:
    """Where one episode lives.

    Attributes:
      index: `episode_index`.
      length: number of frames.
      start: global `index` of its first frame (`dataset_from_index`; v2: the sum of earlier lengths).
      data_file: the parquet holding its rows, relative to the dataset root.
      row_offset: its first row inside `data_file`.
      videos: video key -> (mp4 path relative to the root, from_timestamp in seconds inside that file).
      tasks: the episode's task strings as the episode table lists them.
    """

    index: int
    length: int
    start: int
    data_file: str
    row_offset: int
    videos: Mapping[str, tuple[str, float]]
    tasks: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class DatasetMeta:
    """`meta/` of one dataset (see the module docstring).

    Attributes:
      root: the dataset folder (holds meta/, data/, videos/).
      version: `codebase_version`, e.g. "v3.0".
      fps: frames per second (int in LeRobot's files).
      features: `info.json` features (key -> {dtype, shape, names, ...}).
      episodes: every episode in dataset order.
      tasks: task_index -> task string.
      info: the whole `info.json`.
    """

    root: Path
    version: str
    fps: float
    features: Mapping[str, Mapping]
    episodes: tuple[Episode, ...]
    tasks: Mapping[int, str]
    info: Mapping

    @property
    def camera_keys(self) -> tuple[str, ...]:
        """Video and image features, in `info.json` order."""
        return tuple(k for k, f in self.features.items() if f.get("dtype") in CAMERA_DTYPES)

    @property
    def video_keys(self) -> tuple[str, ...]:
        return tuple(k for k, f in self.features.items() if f.get("dtype") == "video")

    @property
    def language_keys(self) -> tuple[str, ...]:
        """`language_persistent` / `language_events` when the dataset has them (dtype "language")."""
        return tuple(k for k, f in self.features.items() if f.get("dtype") == LANGUAGE_DTYPE)

    @property
    def is_v3(self) -> bool:
        return self.version.startswith("v3")

    def image_shape(self, key: str) -> tuple[int, int]:
        """(height, width) of a camera feature, read through its `names` (HWC or CHW shapes both occur)."""
        feat = self.features[key]
        shape, names = list(feat.get("shape") or ()), feat.get("names")
        if isinstance(names, list) and len(names) == len(shape) == 3 and "height" in names and "width" in names:
            return int(shape[names.index("height")]), int(shape[names.index("width")])
        if len(shape) == 3:
            return (int(shape[1]), int(shape[2])) if shape[0] in (1, 3, 4) and shape[2] not in (1, 3, 4) \
                else (int(shape[0]), int(shape[1]))
        raise ValueError(f"{self.root / 'meta/info.json'}: features.{key}.shape {shape} is not a 3-D image shape")

    def episode_starts(self) -> np.ndarray:
        """int64 [E + 1]: cumulative frame counts (frame i of the dataset is in episode searchsorted(...) - 1)."""
        return np.concatenate([[0], np.cumsum([e.length for e in self.episodes])]).astype(np.int64)


def read_json(path: Path) -> object:
    """A JSON file, or a one-line ValueError naming it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file (is this a LeRobot dataset folder with meta/?)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None


def read_jsonl(path: Path) -> list[dict]:
    """One JSON object per non-empty line, or a one-line ValueError naming the file and line."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file (a v2.x LeRobot dataset needs it)") from None
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
    return out


def _info(root: Path) -> dict:
    path = root / "meta" / "info.json"
    info = read_json(path)
    if not isinstance(info, dict):
        raise ValueError(f"{path}: expected a JSON object")
    version = info.get("codebase_version")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: codebase_version {version!r} is not supported; this reader reads "
                         f"{', '.join(SUPPORTED_VERSIONS)} (convert with LeRobot's converters)")
    for field in ("fps", "features", "data_path"):
        if field not in info:
            raise ValueError(f"{path}: field {field!r} is missing")
    if not isinstance(info["features"], dict):
        raise ValueError(f"{path}: field 'features' must be an object")
    if any(f.get("dtype") == "video" for f in info["features"].values()) and not info.get("video_path"):
        raise ValueError(f"{path}: field 'video_path' is missing but features include videos")
    return info


def _tasks(root: Path, v3: bool) -> dict[int, str]:
    if v3:
        path = root / "meta" / "tasks.parquet"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (a v3.0 dataset needs its task table)")
        table = pq.read_table(path)
        for col in ("task", "task_index"):
            if col not in table.column_names:
                raise ValueError(f"{path}: column {col!r} is missing (has {table.column_names})")
        return {int(i): str(t) for i, t in zip(table.column("task_index").to_pylist(), table.column("task").to_pylist())}
    path = root / "meta" / "tasks.jsonl"
    rows = read_jsonl(path)
    try:
        return {int(r["task_index"]): str(r["task"]) for r in rows}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: every line needs 'task_index' and 'task' ({e!r})") from None


def _episodes_v3(root: Path, info: dict) -> list[Episode]:
    files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{root / 'meta' / 'episodes'}: no chunk-*/file-*.parquet (a v3.0 dataset needs them)")
    video_keys = [k for k, f in info["features"].items() if f.get("dtype") == "video"]
    need = ["episode_index", "length", "data/chunk_index", "data/file_index", "dataset_from_index"]
    for k in video_keys:
        need += [f"videos/{k}/chunk_index", f"videos/{k}/file_index", f"videos/{k}/from_timestamp"]
    rows = []
    for path in files:
        names = pq.read_schema(path).names
        missing = [c for c in need if c not in names]
        if missing:
            raise ValueError(f"{path}: column {missing[0]!r} is missing")
        cols = need + (["tasks"] if "tasks" in names else [])
        table = pq.read_table(path, columns=cols).to_pydict()
        rows += [{c: table[c][r] for c in cols} for r in range(len(table["episode_index"]))]
    rows.sort(key=lambda r: r["dataset_from_index"])
    out, next_row = [], {}
    for r in rows:
        data = info["data_path"].format(chunk_index=r["data/chunk_index"], file_index=r["data/file_index"])
        videos = {k: (info["video_path"].format(video_key=k, chunk_index=r[f"videos/{k}/chunk_index"],
                                                file_index=r[f"videos/{k}/file_index"]),
                      float(r[f"videos/{k}/from_timestamp"])) for k in video_keys}
        offset = next_row.get(data, 0)
        next_row[data] = offset + int(r["length"])
        out.append(Episode(int(r["episode_index"]), int(r["length"]), int(r["dataset_from_index"]), data, offset,
                           videos, tuple(r.get("tasks") or ())))
    return out


def _episodes_v2(root: Path, info: dict) -> list[Episode]:
    path = root / "meta" / "episodes.jsonl"
    chunks = int(info.get("chunks_size") or 1000)
    video_keys = [k for k, f in info["features"].items() if f.get("dtype") == "video"]
    out, start = [], 0
    for n, r in enumerate(sorted(read_jsonl(path), key=lambda r: r.get("episode_index", -1))):
        try:
            e, length = int(r["episode_index"]), int(r["length"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: line {n + 1} needs integer 'episode_index' and 'length'") from None
        chunk = e // chunks
        data = info["data_path"].format(episode_chunk=chunk, episode_index=e)
        videos = {k: (info["video_path"].format(episode_chunk=chunk, video_key=k, episode_index=e), 0.0)
                  for k in video_keys}
        out.append(Episode(e, length, start, data, 0, videos, tuple(r.get("tasks") or ())))
        start += length
    return out


def read_meta(root: str | Path) -> DatasetMeta:
    """Reads `meta/` of a LeRobot dataset (v3.0 or v2.x); errors are one line naming the file and field."""
    root = Path(root)
    if not (root / "meta" / "info.json").is_file():
        raise FileNotFoundError(f"{root}: no meta/info.json; pass the LeRobot dataset folder (it holds meta/, data/)")
    info = _info(root)
    v3 = info["codebase_version"].startswith("v3")
    episodes = _episodes_v3(root, info) if v3 else _episodes_v2(root, info)
    if not episodes:
        raise ValueError(f"{root / 'meta'}: the dataset has no episodes")
    return DatasetMeta(root=root, version=info["codebase_version"], fps=float(info["fps"]),
                       features=info["features"], episodes=tuple(episodes), tasks=_tasks(root, v3), info=info)
