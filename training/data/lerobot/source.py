"""A LeRobot dataset as a random-access source of the project's frame dicts (`training.data.frames`'s layout),
with the key map applied:

    src = LeRobotSource("path/to/dataset", episodes=range(0, 40), action_horizon=10)
    src[i] = {"image": uint8 [H, W, 3], "wrist_image": uint8 [H, W, 3], "state": float32 [Ds],
              "actions": float32 [H, Da], "actions_is_pad": bool [H],          (Da only without action_horizon)
              "language_instruction": task, "task": task, "memory" / "subtask" / "plan" / "interjection" /
              "speech": str ('' when none is active), "init_index": -1, "episode_index", "frame_index", "index",
              "task_index": int, "timestamp": float, plus every other camera / column under its own name}
    src.texts(i)  # the same without cameras: no image bytes read, no video decoded

It follows the tfds / grain data-source protocol (`len`, `__getitem__` with any int in range, deterministic);
`training.data.lerobot.sampling` gives shuffled, per-host views. Nothing is read at construction but `meta/`, so a
300k-frame dataset costs its episode table; frames are decoded on access (video segments cached, bounded).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from training.data.lerobot import language
from training.data.lerobot.dataset import LANGUAGE_TEXT_KEYS, LeRobotDataset
from training.data.lerobot.keys import KeyMap
from training.data.lerobot.meta import read_meta

_META_KEYS = ("episode_index", "frame_index", "index", "task_index", "timestamp")


def _python(value):
    return value.item() if isinstance(value, np.generic) else value


class LeRobotSource(Sequence):
    """Frame dicts of a LeRobot dataset (see the module docstring).

    Args:
      root: the dataset folder.
      episodes: episode indices to read (e.g. a held-out list), default all.
      key_map: which features feed image / wrist_image / state / actions (`training.data.lerobot.keys`).
      action_horizon: H > 0 samples `actions` as openpi does (offsets 0 .. H-1 frames, padded at the episode
        end, `actions_is_pad`); None keeps the row's own action vector.
      video_cache_mb, row_cache_mb: cache bounds (`LeRobotDataset`); 0 switches a cache off.
    """

    def __init__(self, root: str | Path, *, episodes: Sequence[int] | None = None, key_map: KeyMap = KeyMap(),
                 action_horizon: int | None = None, video_cache_mb: float = 512, row_cache_mb: float = 256):
        meta = read_meta(root)
        self.keys = key_map.resolve(meta.features)
        if "image" not in self.keys:
            raise ValueError(f"{meta.root / 'meta/info.json'}: no feature matches the key map's image candidates "
                             f"{key_map.image} (cameras: {list(meta.camera_keys)}); pass "
                             "KeyMap(image=('<camera feature>',)) or --key-map image=<camera feature>")
        delta = None
        if action_horizon is not None:
            if action_horizon < 1 or "actions" not in self.keys:
                raise ValueError(f"action_horizon={action_horizon} needs H >= 1 and an action feature (the key map "
                                 f"found {self.keys.get('actions')!r} among {sorted(meta.features)})")
            delta = {self.keys["actions"]: [k / meta.fps for k in range(action_horizon)]}
        used = tuple(self.keys[f] for f in ("state", "actions") if f in self.keys)  # a NaN there would spread
        self.dataset = LeRobotDataset(root, episodes=episodes, delta_timestamps=delta, video_cache_mb=video_cache_mb,
                                      row_cache_mb=row_cache_mb, finite=used)
        self.meta = self.dataset.meta
        self.action_horizon = action_horizon
        self._rename = {v: k for k, v in self.keys.items()}
        self._skip = {language.PERSISTENT, language.EVENTS, "task"}

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def episodes(self) -> tuple[int, ...]:
        """The episode indices read, in dataset order."""
        return tuple(e.index for e in self.dataset.episodes)

    def _frame(self, item: dict) -> dict:
        frame = {}
        for key, value in item.items():
            if key in self._skip or key in LANGUAGE_TEXT_KEYS:
                continue
            if key.endswith("_is_pad") and key[:-7] in self._rename:
                frame[f"{self._rename[key[:-7]]}_is_pad"] = value
            else:
                frame[self._rename.get(key, key)] = _python(value)
        frame["language_instruction"] = frame["task"] = item["task"]
        for key in LANGUAGE_TEXT_KEYS:
            frame[key] = str(item.get(key) or "")
        frame["init_index"] = -1
        for key in _META_KEYS:
            frame[key] = _python(item[key])
        return frame

    def __getitem__(self, i: int) -> dict:
        return self._frame(self.dataset.item(i))

    def texts(self, i: int) -> dict:
        """Frame `i` without cameras (no image decoding): its text, numbers and metadata."""
        return self._frame(self.dataset.texts(i))

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self[i]
