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
import math
import numbers
import posixpath
import re
import string
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from oxygen_jax.ckpts.limits import int_field, read_text

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
MAX_FPS = 10_000.0  # frames per second (LeRobot's datasets record 5-60)
MAX_TEXT_CHARS = 4096  # a task string or a label (LeRobot's are a few hundred characters at most)
MAX_META_BYTES = 256 << 20  # one meta/ JSON or JSONL file (episodes_stats.jsonl of 10^4 episodes: ~100 MB)
MAX_IMAGE_SIDE = 8192  # pixels of an image side (cameras record 64-2048)
MAX_INDEX = 1 << 40  # an episode / chunk / file index, an episode length, a global frame index
# The fields each path template may name, per version (LeRobot's own templates use exactly these).
_TEMPLATE_FIELDS = {("v3", "data_path"): {"chunk_index", "file_index"},
                    ("v3", "video_path"): {"video_key", "chunk_index", "file_index"},
                    ("v2", "data_path"): {"episode_chunk", "episode_index"},
                    ("v2", "video_path"): {"episode_chunk", "video_key", "episode_index"}}
_FORMAT_SPEC = re.compile(r"0?[0-9]{0,2}d?")  # '03d', '06d', '' (no fill characters, widths below 100)
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
        """(height, width) of a camera feature, read through its `names` (HWC or CHW shapes both occur); every
        decoded image must have this size (a side within `MAX_IMAGE_SIDE`)."""
        feat = self.features[key]
        where = f"{self.root / 'meta/info.json'}: features.{key}.shape"
        shape, names = feat.get("shape") or (), feat.get("names")
        if not isinstance(shape, (list, tuple)) or len(shape) != 3:
            raise ValueError(f"{where} {shape!r:.60} is not a 3-D image shape")
        shape = [int_field(s, f"dimension {n}", where, cap=MAX_IMAGE_SIDE) for n, s in enumerate(shape)]
        if isinstance(names, list) and len(names) == 3 and "height" in names and "width" in names:
            return shape[names.index("height")], shape[names.index("width")]
        return (shape[1], shape[2]) if shape[0] in (1, 3, 4) and shape[2] not in (1, 3, 4) else (shape[0], shape[1])

    def episode_starts(self) -> np.ndarray:
        """int64 [E + 1]: cumulative frame counts (frame i of the dataset is in episode searchsorted(...) - 1)."""
        return np.concatenate([[0], np.cumsum([e.length for e in self.episodes])]).astype(np.int64)


def _text(path: Path, what: str) -> str:
    """A regular file's UTF-8 text within `MAX_META_BYTES` (a device, FIFO or link to one is refused unopened)."""
    if not path.exists() and not path.is_symlink():
        raise FileNotFoundError(f"{path}: no such file ({what})")
    return read_text(path, MAX_META_BYTES)


def read_json(path: Path) -> object:
    """A JSON file, or a one-line ValueError naming it."""
    text = _text(path, "is this a LeRobot dataset folder with meta/?")
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None


def read_jsonl(path: Path) -> list[dict]:
    """One JSON object per non-empty line, or a one-line ValueError naming the file and line."""
    lines = _text(path, "a v2.x LeRobot dataset needs it").splitlines()
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
        raise ValueError(f"{path}: codebase_version {version!r:.40} is not supported; this reader reads "
                         f"{', '.join(SUPPORTED_VERSIONS)} (convert with LeRobot's converters)")
    for field in ("fps", "features", "data_path"):
        if field not in info:
            raise ValueError(f"{path}: field {field!r} is missing")
    fps = info["fps"]
    if not (isinstance(fps, numbers.Real) and not isinstance(fps, bool) and math.isfinite(fps) and 0 < fps <= MAX_FPS):
        raise ValueError(f"{path}: fps must be a number in (0, {MAX_FPS:g}], got {fps!r:.40}")
    features = info["features"]
    if not isinstance(features, dict) or not all(isinstance(f, dict) for f in features.values()):
        raise ValueError(f"{path}: field 'features' must map every feature name to an object")
    video = any(f.get("dtype") == "video" for f in features.values())
    if video and not info.get("video_path"):
        raise ValueError(f"{path}: field 'video_path' is missing but features include videos")
    v = "v3" if version.startswith("v3") else "v2"
    for field in ("data_path", "video_path") if video else ("data_path",):
        _check_template(info[field], _TEMPLATE_FIELDS[v, field], f"{path}: {field}")
    return info


def _check_template(template, allowed: set[str], where: str) -> None:
    """A path template names only `allowed` fields, plainly ('{file_index:03d}'), and is a relative path."""
    if not isinstance(template, str) or not template or len(template) > 1024:
        raise ValueError(f"{where} must be a path template string, got {template!r:.60}")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{where} {template!r:.80} is not a valid template ({e})") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in allowed or conversion or not _FORMAT_SPEC.fullmatch(spec or ""):
            raise ValueError(f"{where} {template!r:.80}: field {{{name}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}} is not allowed; a template names "
                             f"{', '.join(sorted(allowed))} only, optionally zero-padded ({{file_index:03d}})")


def _relative(template: str, where: str, **fields) -> str:
    """`template` filled in: a normalised relative path that stays inside the dataset folder (no '..', not
    absolute), e.g. 'data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet' -> 'data/chunk-000/file-002.parquet'."""
    text = template.format(**fields)
    norm = posixpath.normpath(text)
    if text.startswith("/") or "\\" in text or "\0" in text or norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"{where}: the path {text!r:.120} leaves the dataset folder (absolute or '..'); a dataset "
                         "names its files relative to its root")
    return norm


def _inside(root: Path, rel: str, where: str, seen: dict[str, str]) -> str:
    """`rel` if `root / rel`, links resolved, lies inside `root` (cached per path in `seen`)."""
    if rel not in seen:
        base = root.resolve()
        target = (root / rel).resolve()
        if target != base and base not in target.parents:
            raise ValueError(f"{where}: {rel} resolves to {target}, outside the dataset folder {base} (a link "
                             "leaving it); copy the files into the dataset folder")
        seen[rel] = rel
    return seen[rel]


def _tasks(root: Path, v3: bool) -> dict[int, str]:
    if v3:
        path = root / "meta" / "tasks.parquet"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (a v3.0 dataset needs its task table)")
        table = pq.read_table(path)
        for col in ("task", "task_index"):
            if col not in table.column_names:
                raise ValueError(f"{path}: column {col!r} is missing (has {table.column_names})")
        pairs = zip(table.column("task_index").to_pylist(), table.column("task").to_pylist())
    else:
        path = root / "meta" / "tasks.jsonl"
        rows = read_jsonl(path)
        if not all(isinstance(r, dict) and "task_index" in r and "task" in r for r in rows):
            raise ValueError(f"{path}: every line needs 'task_index' and 'task'")
        pairs = ((r["task_index"], r["task"]) for r in rows)
    out = {}
    for n, (i, task) in enumerate(pairs):
        if not isinstance(task, str) or len(task) > MAX_TEXT_CHARS:
            raise ValueError(f"{path}: task {n} must be a string of at most {MAX_TEXT_CHARS} characters, got "
                             f"{type(task).__name__} {str(task)[:40]!r}")
        out[_index(i, "task_index", f"{path}: task {n}")] = task
    return out


def _index(value, field: str, where: str, low: int = 0) -> int:
    return int_field(value, field, where, cap=MAX_INDEX, low=low)


def _seconds(value, field: str, where: str) -> float:
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{where}: {field} must be a finite number of seconds >= 0, got {value!r:.40}")
    return float(value)


def _task_strings(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) and len(t) <= MAX_TEXT_CHARS for t in value):
        raise ValueError(f"{where}: tasks must be a list of strings of at most {MAX_TEXT_CHARS} characters")
    return tuple(value)


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
        rows += [{c: table[c][r] for c in cols} | {"_where": f"{path} row {r}"}
                 for r in range(len(table["episode_index"]))]
    for r in rows:
        r["dataset_from_index"] = _index(r["dataset_from_index"], "dataset_from_index", r["_where"])
    rows.sort(key=lambda r: r["dataset_from_index"])
    out, next_row, seen = [], {}, {}
    for r in rows:
        where = r["_where"]
        length = _index(r["length"], "length", where, low=1)
        data = _inside(root, _relative(info["data_path"], f"{where}: data_path",
                                       chunk_index=_index(r["data/chunk_index"], "data/chunk_index", where),
                                       file_index=_index(r["data/file_index"], "data/file_index", where)), where, seen)
        videos = {}
        for k in video_keys:
            rel = _relative(info["video_path"], f"{where}: video_path", video_key=k,
                            chunk_index=_index(r[f"videos/{k}/chunk_index"], f"videos/{k}/chunk_index", where),
                            file_index=_index(r[f"videos/{k}/file_index"], f"videos/{k}/file_index", where))
            videos[k] = (_inside(root, rel, where, seen),
                         _seconds(r[f"videos/{k}/from_timestamp"], f"videos/{k}/from_timestamp", where))
        offset = next_row.get(data, 0)
        next_row[data] = offset + length
        out.append(Episode(_index(r["episode_index"], "episode_index", where), length, r["dataset_from_index"], data,
                           offset, videos, _task_strings(r.get("tasks"), where)))
    return out


def _episodes_v2(root: Path, info: dict) -> list[Episode]:
    path = root / "meta" / "episodes.jsonl"
    chunks = _index(info.get("chunks_size") or 1000, "chunks_size", str(root / "meta" / "info.json"), low=1)
    video_keys = [k for k, f in info["features"].items() if f.get("dtype") == "video"]
    out, start, seen = [], 0, {}
    lines = read_jsonl(path)
    if not all(isinstance(r, dict) for r in lines):
        raise ValueError(f"{path}: every line must be a JSON object")
    for n, r in enumerate(sorted(lines, key=lambda r: r.get("episode_index", -1)
                                 if isinstance(r.get("episode_index"), int) else -1)):
        where = f"{path}: episode line {n + 1}"
        e, length = _index(r.get("episode_index"), "episode_index", where), _index(r.get("length"), "length", where, 1)
        chunk = e // chunks
        data = _inside(root, _relative(info["data_path"], f"{where}: data_path", episode_chunk=chunk, episode_index=e),
                       where, seen)
        videos = {k: (_inside(root, _relative(info["video_path"], f"{where}: video_path", episode_chunk=chunk,
                                              video_key=k, episode_index=e), where, seen), 0.0)
                  for k in video_keys}
        out.append(Episode(e, length, start, data, 0, videos, _task_strings(r.get("tasks"), where)))
        start += length
    return out


def read_meta(root: str | Path) -> DatasetMeta:
    """Reads `meta/` of a LeRobot dataset (v3.0 or v2.x); errors are one line naming the file and field."""
    root = Path(root)
    info_file = root / "meta" / "info.json"
    if not (info_file.exists() or info_file.is_symlink()):
        raise FileNotFoundError(f"{root}: no meta/info.json; pass the LeRobot dataset folder (it holds meta/, data/)")
    info = _info(root)
    v3 = info["codebase_version"].startswith("v3")
    episodes = _episodes_v3(root, info) if v3 else _episodes_v2(root, info)
    if not episodes:
        raise ValueError(f"{root / 'meta'}: the dataset has no episodes")
    return DatasetMeta(root=root, version=info["codebase_version"], fps=float(info["fps"]),
                       features=info["features"], episodes=tuple(episodes), tasks=_tasks(root, v3), info=info)
