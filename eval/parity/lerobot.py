"""LeRobot dataset parity: `training.data.lerobot` against what LeRobot itself returned for every frame.

    python -m eval.parity FIXTURE_DIR      # FIXTURE_DIR holds dataset/ (a LeRobot dataset) and reference.npz

Every quantity is compared exactly (integers, float32 values, strings and uint8 pixels: number of mismatches):

* per frame: index, episode_index, frame_index, task_index, timestamp, task, the state and action vectors;
* every camera `camK` (video cameras: the decoded frame nearest to the row's video time; image cameras: PNG);
  where LeRobot's two video backends disagreed (`camK_pyav` stored), each frame must equal one of them;
* `action_chunk` / `action_chunk_is_pad` sampled with the fixture's delta timestamps (reference.json
  `action_chunk_delta_timestamps`; default k / fps for the chunk length in reference.npz);
* subtask, plan, memory (active at t), interjection, speech (emitted at t), and the raw language lists as
  `json.dumps(rows, sort_keys=True)` when the reference has them.

Plus one sanity row per camera against the pixels the recorder was given (`camK_truth`): image cameras exactly,
video cameras by mean |difference| (codec noise is a few levels; a swapped or mis-timed frame is far more).
Camera order and the state / action keys come from reference.json (`camera_npz_prefix`, `state_key`,
`action_key`); without it, cameras in info.json order and the key map's state / action features.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from eval.parity.checks import Checker, Row, report
from training.data.lerobot.dataset import LANGUAGE_TEXT_KEYS, LeRobotDataset
from training.data.lerobot.keys import KeyMap
from training.data.lerobot.language import EVENTS, PERSISTENT

TRUTH_MEAN_ABS = 16.0  # mean |decoded - recorded| allowed for a video camera (codec noise is ~3 levels)


def is_lerobot_fixture(path: Path) -> bool:
    """A directory with `dataset/meta/info.json` and `reference.npz`."""
    path = Path(path)
    return (path / "dataset" / "meta" / "info.json").is_file() and (path / "reference.npz").is_file()


def _reference_meta(path: Path) -> dict:
    f = path / "reference.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def run_fixture(path: Path) -> list[Row]:
    """One row per compared quantity (see the module docstring)."""
    path = Path(path)
    meta = _reference_meta(path)
    with np.load(path / "reference.npz", allow_pickle=False) as z:
        ref = {k: z[k] for k in z.files}
    plain = LeRobotDataset(path / "dataset")
    features = plain.meta.features
    keys = KeyMap().resolve(features)
    state_key = meta.get("state_key", keys.get("state"))
    action_key = meta.get("action_key", keys.get("actions"))
    prefixes = meta.get("camera_npz_prefix") or {k: f"cam{n}" for n, k in enumerate(plain.meta.camera_keys)}
    items = [plain.item(i) for i in range(len(plain))]
    c = Checker(lambda q, f: (0.0, None))
    for key in ("index", "episode_index", "frame_index", "task_index", "timestamp", "task"):
        c.exact(key, np.asarray([it[key] for it in items]), ref[key])
    for name, key in (("state", state_key), ("actions", action_key)):
        if name in ref and key is not None:
            c.exact(f"{name} ({key})", np.stack([it[key] for it in items]), ref[name])
    for key, prefix in prefixes.items():
        ours = np.stack([it[key] for it in items])
        other = ref.get(f"{prefix}_pyav")  # stored only where LeRobot's two video backends disagreed
        if other is not None and other.shape == ref[prefix].shape == ours.shape:
            per_frame = [np.array_equal(o, a) or np.array_equal(o, b) for o, a, b in zip(ours, ref[prefix], other)]
            bad = len(per_frame) - sum(per_frame)
            c.add(f"{prefix} ({key}, {features[key]['dtype']}; torchcodec or pyav)", bad, bad / len(per_frame),
                  "exact per frame (mismatches)", bad == 0)
        else:
            c.exact(f"{prefix} ({key}, {features[key]['dtype']})", ours, ref[prefix])
        truth = ref.get(f"{prefix}_truth")
        if truth is None:
            continue
        if features[key]["dtype"] == "image":
            c.exact(f"{prefix}_truth ({key}, lossless)", ours, truth)
        elif ours.shape == truth.shape:
            d = float(np.mean(np.abs(ours.astype(np.float64) - truth)))
            c.add(f"{prefix}_truth ({key}, mean abs)", d, d / 255, f"mean abs <= {TRUTH_MEAN_ABS:g}", d <= TRUTH_MEAN_ABS)
    if "action_chunk" in ref and action_key is not None:
        fps = plain.meta.fps
        deltas = meta.get("action_chunk_delta_timestamps") or [k / fps for k in range(ref["action_chunk"].shape[1])]
        chunked = LeRobotDataset(path / "dataset", delta_timestamps={action_key: deltas})
        texts = [chunked.texts(i) for i in range(len(chunked))]
        c.exact("action_chunk", np.stack([t[action_key] for t in texts]), ref["action_chunk"])
        c.exact("action_chunk_is_pad", np.stack([t[f"{action_key}_is_pad"] for t in texts]),
                ref["action_chunk_is_pad"])
    for key in LANGUAGE_TEXT_KEYS:
        if key in ref:
            c.exact(key, np.asarray([it[key] for it in items], dtype=str), ref[key].astype(str))
    for key in (PERSISTENT, EVENTS):
        if f"{key}_json" in ref:
            ours = [json.dumps(it.get(key) or [], sort_keys=True) for it in items]
            c.exact(f"{key}_json", np.asarray(ours, dtype=str), ref[f"{key}_json"].astype(str))
    return c.rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not is_lerobot_fixture(Path(argv[0])):
        print("usage: python -m eval.parity FIXTURE_DIR (with dataset/meta/info.json and reference.npz)",
              file=sys.stderr)
        return 2
    print(f"LeRobot dataset {Path(argv[0]) / 'dataset'}")
    return report(run_fixture(Path(argv[0])))
