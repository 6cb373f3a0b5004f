"""Small LeRobot datasets written from scratch with pyarrow and PyAV, in the v3.0 or v2.1 layout, for tests and
measurements (any camera count, sizes, fps, key names, several episodes per file with roll-over).

    truth = write_dataset(root, version="v3.0", lengths=[8, 6, 10], fps=15,
                          cameras={"observation.images.front": ("video", 48, 80), "wrist": ("image", 32, 32)},
                          episodes_per_file=2, language=True)

Layout as LeRobot writes it (docs/lerobot.md): v3.0 puts `episodes_per_file` consecutive episodes in one data
parquet (one row group per episode) and `video_episodes_per_file` (default: the same) in one mp4 per camera
(frames concatenated, so pts continue and each episode's `from_timestamp` is the duration before it); v2.1
writes one parquet and one mp4 per episode with `meta/episodes.jsonl`, `tasks.jsonl` and `episodes_stats.jsonl`. Videos are AV1 (libsvtav1, yuv420p, a key
frame every 2 frames: LeRobot's defaults; `vcodec="libx264"`: H.264 with B-frames and a key frame every 6
frames, as older recorders wrote), image cameras PNG bytes in the parquet.

Pixels identify their frame: every channel of global frame g is a ramp plus 37 * g (mod 256) in the blue channel,
and a bright square moves 3 px per frame, so a neighbouring frame differs by far more than codec noise.
`language=True` adds LeRobot's language columns: per episode a subtask span at every third frame, a memory row
from the second span on, a plan at t = 0, and an interjection plus a `say` speech event on the frame where the
second span starts. Returns the truth: {"frames": {camera: uint8 [N, H, W, 3]}, "state", "actions", "tasks",
"subtask", "memory", "plan", "interjection", "speech": per frame} in dataset order.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

os.environ.setdefault("SVT_LOG", "1")  # libsvtav1: errors only (its default prints its whole configuration)

_TASKS = ("put the bowl on the plate", "open the drawer", "stack the blocks")


def _pixels(g: int, h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), np.full_like(x, (37 * g) % 256)], -1)
    s, p = max(4, min(h, w) // 5), (3 * g) % max(1, min(h, w) - max(4, min(h, w) // 5))
    img[p:p + s, p:p + s] = 255
    return img.astype(np.uint8)


def _png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _encode(path: Path, frames: Sequence[np.ndarray], fps: int, vcodec: str = "libsvtav1") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as out:
        stream = out.add_stream(vcodec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"g": "2", "crf": "30", "preset": "12"} if vcodec == "libsvtav1" else {"crf": "20", "g": "6"}
        for k, img in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = k
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _language(length: int, fps: int, task: str):
    """(persistent rows, events per frame, per-frame truth) of one episode."""
    ts = [float(np.float32(k / fps)) for k in range(length)]
    starts = list(range(0, length, 3))
    persistent = [{"role": "assistant", "content": f"plan for {task}", "style": "plan", "timestamp": ts[0]}]
    for n, k in enumerate(starts):
        persistent.append({"role": "assistant", "content": f"step {n} of {task}", "style": "subtask", "timestamp": ts[k]})
        if n:
            persistent.append({"role": "assistant", "content": f"I did step {n - 1}.", "style": "memory",
                               "timestamp": ts[k]})
    persistent.sort(key=lambda r: (r["timestamp"], r["style"], r["role"]))
    events = [[] for _ in range(length)]
    if len(starts) > 1:
        k = starts[1]
        events[k] = [{"role": "user", "content": "now the next step", "style": "interjection", "camera": None,
                      "tool_calls": None},
                     {"role": "assistant", "content": None, "style": None, "camera": None,
                      "tool_calls": [{"type": "function", "function": {"name": "say", "arguments": {"text": "OK."}}}]}]
    span = np.searchsorted(starts, np.arange(length), side="right") - 1
    truth = {"subtask": [f"step {n} of {task}" for n in span],
             "memory": [f"I did step {n - 1}." if n else "" for n in span],
             "plan": [f"plan for {task}"] * length,
             "interjection": ["now the next step" if events[k] else "" for k in range(length)],
             "speech": ["OK." if events[k] else "" for k in range(length)]}
    return persistent, events, truth


def _stats(values: np.ndarray) -> dict:
    return {"min": values.min(0).tolist(), "max": values.max(0).tolist(), "mean": values.mean(0).tolist(),
            "std": values.std(0).tolist(), "count": [len(values)]}


def write_dataset(root: str | Path, *, version: str = "v3.0", lengths: Sequence[int] = (8, 6, 10), fps: int = 10,
                  cameras: Mapping[str, tuple[str, int, int]] = {"image": ("video", 32, 48),
                                                                   "wrist_image": ("image", 32, 32)},
                  state_key: str = "state", action_key: str = "actions", state_dim: int = 8, action_dim: int = 7,
                  episodes_per_file: int = 1000, video_episodes_per_file: int | None = None, language: bool = False,
                  vcodec: str = "libsvtav1", seed: int = 0) -> dict:
    """Writes a dataset under `root` (see the module docstring) and returns its truth arrays."""
    if version not in ("v3.0", "v2.1"):
        raise ValueError(f"version must be 'v3.0' or 'v2.1', got {version!r}")
    root = Path(root)
    rng = np.random.default_rng(seed)
    n = int(sum(lengths))
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    state = rng.standard_normal((n, state_dim)).astype(np.float32)
    actions = rng.standard_normal((n, action_dim)).astype(np.float32)
    ep_task = [_TASKS[e % len(_TASKS)] for e in range(len(lengths))]
    task_index = {t: i for i, t in enumerate(dict.fromkeys(ep_task))}
    frames = {k: np.stack([_pixels(g + 11 * c, h, w) for g in range(n)])
              for c, (k, (_, h, w)) in enumerate(cameras.items())}
    truth = {"frames": frames, "state": state, "actions": actions, "tasks": [], "subtask": [], "memory": [], "plan": [],
             "interjection": [], "speech": []}
    features = {}
    for k, (kind, h, w) in cameras.items():
        features[k] = {"dtype": kind, "shape": [h, w, 3], "names": ["height", "width", "channel"]}
    features[state_key] = {"dtype": "float32", "shape": [state_dim], "names": None}
    features[action_key] = {"dtype": "float32", "shape": [action_dim], "names": None}
    for k, dt in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"), ("index", "int64"),
                  ("task_index", "int64")):
        features[k] = {"dtype": dt, "shape": [1], "names": None}
    if language:
        features["language_persistent"] = features["language_events"] = {"dtype": "language", "shape": [1],
                                                                         "names": None}
    tables = []
    for e, length in enumerate(lengths):
        rows = slice(starts[e], starts[e + 1])
        cols = {k: [{"bytes": _png(img), "path": None} for img in frames[k][rows]]
                for k, (kind, _, _) in cameras.items() if kind == "image"}
        cols[state_key] = pa.FixedSizeListArray.from_arrays(pa.array(state[rows].ravel()), state_dim)
        cols[action_key] = pa.FixedSizeListArray.from_arrays(pa.array(actions[rows].ravel()), action_dim)
        cols["timestamp"] = pa.array((np.arange(length) / fps).astype(np.float32))
        cols["frame_index"] = pa.array(np.arange(length, dtype=np.int64))
        cols["episode_index"] = pa.array(np.full(length, e, np.int64))
        cols["index"] = pa.array(np.arange(starts[e], starts[e + 1], dtype=np.int64))
        cols["task_index"] = pa.array(np.full(length, task_index[ep_task[e]], np.int64))
        truth["tasks"] += [ep_task[e]] * length
        if language:
            persistent, events, lang = _language(length, fps, ep_task[e])
            cols["language_persistent"] = [persistent] * length
            cols["language_events"] = events
            for k, v in lang.items():
                truth[k] += v
        else:
            for k in ("subtask", "memory", "plan", "interjection", "speech"):
                truth[k] += [""] * length
        tables.append(pa.table(cols))
    unified = pa.concat_tables(tables, promote_options="permissive")  # one schema for every file
    tables = [unified.slice(int(starts[e]), int(length)) for e, length in enumerate(lengths)]
    video_keys = [k for k, (kind, _, _) in cameras.items() if kind == "video"]
    info = {"codebase_version": version, "robot_type": "synthetic", "fps": fps, "features": features,
            "total_episodes": len(lengths), "total_frames": n, "total_tasks": len(task_index), "chunks_size": 1000,
            "splits": {"train": f"0:{len(lengths)}"}}
    (root / "meta").mkdir(parents=True, exist_ok=True)
    if version == "v3.0":
        _write_v3(root, info, tables, lengths, starts, frames, video_keys, fps, episodes_per_file,
                  video_episodes_per_file or episodes_per_file, ep_task, task_index,
                  state_key, action_key, state, actions, vcodec)
    else:
        _write_v2(root, info, tables, lengths, frames, video_keys, fps, ep_task, task_index, state_key, action_key,
                  state, actions, starts, vcodec)
    return truth


def _groups(n: int, per_file: int) -> list[list[int]]:
    return [list(range(s, min(s + per_file, n))) for s in range(0, n, per_file)]


def _write_v3(root, info, tables, lengths, starts, frames, video_keys, fps, per_file, video_per_file, ep_task,
              task_index, state_key, action_key, state, actions, vcodec):
    info.update(data_path="data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
                video_path="videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4" if video_keys else None,
                data_files_size_in_mb=100, video_files_size_in_mb=200)
    n = len(lengths)
    episodes = {"episode_index": list(range(n)), "tasks": [[t] for t in ep_task], "length": list(lengths),
                "data/chunk_index": [0] * n, "data/file_index": [0] * n,
                "dataset_from_index": [int(s) for s in starts[:-1]], "dataset_to_index": [int(s) for s in starts[1:]]}
    for file_index, group in enumerate(_groups(n, per_file)):
        path = root / info["data_path"].format(chunk_index=0, file_index=file_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        with pq.ParquetWriter(path, tables[group[0]].schema) as writer:
            for e in group:  # one row group per episode, as LeRobot writes
                writer.write_table(tables[e])
                episodes["data/file_index"][e] = file_index
    for k in video_keys:  # videos roll over on their own schedule (LeRobot: 200 MB vs 100 MB for data)
        cols = {f: [0.0] * n for f in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")}
        for file_index, group in enumerate(_groups(n, video_per_file)):
            before = 0
            for e in group:
                cols["chunk_index"][e], cols["file_index"][e] = 0, file_index
                cols["from_timestamp"][e], cols["to_timestamp"][e] = before / fps, (before + lengths[e]) / fps
                before += lengths[e]
            rows = slice(starts[group[0]], starts[group[-1] + 1])
            _encode(root / info["video_path"].format(video_key=k, chunk_index=0, file_index=file_index),
                    frames[k][rows], fps, vcodec)
        for f, values in cols.items():
            episodes[f"videos/{k}/{f}"] = [int(v) for v in values] if f.endswith("index") else values
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(episodes), root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    pq.write_table(pa.table({"task_index": list(task_index.values()), "task": list(task_index)}),
                   root / "meta" / "tasks.parquet")
    (root / "meta" / "stats.json").write_text(json.dumps({state_key: _stats(state), action_key: _stats(actions)}))
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=1))


def _write_v2(root, info, tables, lengths, frames, video_keys, fps, ep_task, task_index, state_key, action_key, state,
              actions, starts, vcodec):
    info.update(data_path="data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
                video_path="videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
                if video_keys else None, total_chunks=1, total_videos=len(video_keys) * len(lengths))
    lines, stat_lines = [], []
    for e, table in enumerate(tables):
        path = root / info["data_path"].format(episode_chunk=0, episode_index=e)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        rows = slice(starts[e], starts[e + 1])
        for k in video_keys:
            _encode(root / info["video_path"].format(episode_chunk=0, video_key=k, episode_index=e), frames[k][rows],
                    fps, vcodec)
        lines.append(json.dumps({"episode_index": e, "tasks": [ep_task[e]], "length": lengths[e]}))
        stat_lines.append(json.dumps({"episode_index": e, "stats": {state_key: _stats(state[rows]),
                                                                     action_key: _stats(actions[rows])}}))
    (root / "meta" / "episodes.jsonl").write_text("\n".join(lines) + "\n")
    (root / "meta" / "episodes_stats.jsonl").write_text("\n".join(stat_lines) + "\n")
    (root / "meta" / "tasks.jsonl").write_text(
        "".join(json.dumps({"task_index": i, "task": t}) + "\n" for t, i in task_index.items()))
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=1))
