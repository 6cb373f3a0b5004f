"""LeRobot datasets as training / held-out splits of labelled frames for the text trainer and evaluator
(`python -m training.memory --data DIR --target memory`, `python -m eval.memory_eval --data DIR`).

Splits are episode lists, never frame lists, so no episode is seen in both:

    "train"                 every episode not held out
    "heldout"               the held-out episodes (`heldout=` / --heldout-episodes "3,7,10-12")
    "all"                   every episode
    a key of info.json `splits` (LeRobot writes {"train": "0:E"}: episode ranges "a:b", end exclusive), used
                            when no held-out list is given

The target (`target=`) is the frame field to predict: `memory`, `subtask`, `plan` (active at the frame's
time in `language_persistent`), `interjection`, `speech` (emitted on the frame), or any string column of the
dataset by name (e.g. a `subtask` column some exports carry instead of language columns).

Frames without an active label. LeRobot's annotator writes no memory before the first subtask boundary, so the
first subtask's frames have `memory == ''`; training "Memory: " -> EOS on them would teach the adapter to
answer nothing. The choice here, as LeRobot's recipes make it (a sample whose required binding is missing is
dropped): such frames are left out of both splits (`empty_label=None`, the default). `empty_label="..."`
keeps them with that text as their label instead (e.g. "nothing yet"). Either way every frame of the split
has a non-empty label, and `texts(i)` answers from a table built once per split (no parquet read per frame).

Every label is a string of at most `MAX_TEXT_CHARS` characters and every frame's `task_index` names a task,
checked when the table is built; `LabelledFrames.check_cameras()` decodes one labelled frame of every episode
(every camera), so a missing or damaged video, an image of the wrong size or a wrong fps is found before
training starts. Each error is one line naming the file, the episode, the frame and the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from training.data.lerobot import language
from training.data.lerobot.dataset import LeRobotDataset
from training.data.lerobot.keys import KeyMap
from training.data.lerobot.meta import MAX_TEXT_CHARS, read_meta
from training.data.lerobot.source import LeRobotSource

_ACTIVE = ("subtask", "plan", "memory")


def parse_episodes(text: str) -> list[int]:
    """'3,7,10-12' -> [3, 7, 10, 11, 12] (ranges inclusive); a one-line ValueError on anything else."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise ValueError(f"episode list {text!r}: {part!r} is not an episode index or a range a-b") from None
    return out


def split_episodes(root: str | Path, split: str, heldout: Sequence[int] | None = None) -> list[int]:
    """The episode indices of `split` (see the module docstring)."""
    meta = read_meta(root)
    every = [e.index for e in meta.episodes]
    if heldout is not None:
        unknown = sorted(set(heldout) - set(every))
        if unknown:
            raise ValueError(f"--heldout-episodes: episode {unknown[0]} is not in {meta.root} (episodes "
                             f"{min(every)}..{max(every)})")
        if split in ("train", "heldout"):
            keep = set(heldout)
            return [e for e in every if (e in keep) == (split == "heldout")]
    if split == "all":
        return every
    ranges = meta.info.get("splits") or {}
    if isinstance(ranges, dict) and split in ranges:
        lo, sep, hi = str(ranges[split]).partition(":")
        if not (sep and lo.strip().isdigit() and hi.strip().isdigit()):
            raise ValueError(f"{meta.root / 'meta/info.json'}: splits.{split} is {str(ranges[split])[:40]!r}, expected "
                             "an episode range 'a:b'")
        return [e for e in every if int(lo) <= e < int(hi)]
    if not isinstance(ranges, dict):
        raise ValueError(f"{meta.root / 'meta/info.json'}: splits must be an object of episode ranges")
    raise ValueError(f"split {split!r} of {meta.root}: give the held-out episodes (--heldout-episodes 3,7,10-12) "
                     f"for 'train' / 'heldout', or use 'all' or one of info.json's splits {sorted(ranges)}")


def _labels(ds: LeRobotDataset, target: str) -> tuple[list[str], np.ndarray]:
    """(label per frame, task_index int64 [N]) of the selected episodes, one parquet read per episode."""
    feats = ds.meta.features
    if target in feats:
        if feats[target].get("dtype") != "string":
            raise ValueError(f"{ds.root / 'meta/info.json'}: features.{target} has dtype "
                             f"{feats[target].get('dtype')!r}; a text target must be a string column")
        cols = [target]
    elif target in _ACTIVE or target in ("interjection", "speech"):
        cols = [c for c in (language.PERSISTENT, language.EVENTS) if c in feats]
    else:
        raise ValueError(f"--target {target!r}: not memory / subtask / plan / interjection / speech nor a string "
                         f"column of {ds.root} (features: {sorted(feats)})")
    labels, tasks = [], []
    for ep in ds.episodes:
        where = f"{ds.root / ep.data_file}: episode {ep.index}"
        try:
            block = ds.rows.read(ep.data_file, ep.row_offset, ep.row_offset + ep.length,
                                 ["timestamp", "task_index", *cols])
        except ValueError as e:
            raise ValueError(f"episode {ep.index}: {e}") from None
        task_index = np.asarray(block["task_index"], np.int64)
        unknown = [int(i) for i in task_index if int(i) not in ds.meta.tasks]
        if unknown:
            frame = int(np.flatnonzero(task_index == unknown[0])[0])
            raise ValueError(f"{where} frame {frame}: field 'task_index' {unknown[0]} has no task in meta/tasks")
        tasks.append(task_index)
        times = np.asarray(block["timestamp"], np.float64)
        if not np.isfinite(times).all():
            raise ValueError(f"{where} frame {int(np.flatnonzero(~np.isfinite(times))[0])}: field 'timestamp' is not "
                             "finite")
        for r in range(ep.length):
            if target in feats:
                text = block[target][r]
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"{where} frame {r}: field {target!r} holds {type(text).__name__}, expected a "
                                     "string")
                text = text or ""
            else:
                text = language.frame_texts(block.get(language.PERSISTENT, [None] * ep.length)[r],
                                            block.get(language.EVENTS, [None] * ep.length)[r], float(times[r]),
                                            f"{where} frame {r}")[target]
            if len(text) > MAX_TEXT_CHARS:
                raise ValueError(f"{where} frame {r}: the {target!r} label has {len(text)} characters, above the cap "
                                 f"{MAX_TEXT_CHARS}; shorten it or leave the episode out (--heldout-episodes)")
            labels.append(text)
    return labels, np.concatenate(tasks) if tasks else np.zeros([0], np.int64)


class LabelledFrames(Sequence):
    """The frames of a `LeRobotSource` that have a label for `target` (see the module docstring)."""

    def __init__(self, source: LeRobotSource, target: str, empty_label: str | None = None):
        self.source, self.target, self.empty_label = source, target, empty_label
        labels, task_index = _labels(source.dataset, target)
        if empty_label is not None:
            labels = [x or empty_label for x in labels]
        self.indices = np.asarray([i for i, x in enumerate(labels) if x], np.int64)
        self._labels = [labels[i] for i in self.indices]
        self._tasks = [source.meta.tasks[int(task_index[i])] for i in self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> dict:
        frame = self.source[int(self.indices[k])]
        frame[self.target] = self._labels[k]
        return frame

    def texts(self, k: int) -> dict:
        """The label and the instruction of frame k from the split's table (nothing is read)."""
        return {"language_instruction": self._tasks[k], "task": self._tasks[k], self.target: self._labels[k]}

    def first_of_each_episode(self) -> list[int]:
        """k of the first labelled frame of every episode that has one, in order."""
        episodes = self.source.dataset.episode_of(self.indices)
        return [int(k) for k in np.flatnonzero(np.diff(episodes, prepend=-1))]

    def check_cameras(self) -> int:
        """Decodes one labelled frame of every episode, every camera (see the module docstring); returns how many."""
        firsts = self.first_of_each_episode()
        for k in firsts:
            self[k]
        return len(firsts)

    def digest_parts(self) -> dict:
        """What identifies the split's data: its episodes, labelled frames, labels and tasks."""
        return {"episodes": list(self.source.episodes), "frames": self.indices.tolist(), "labels": self._labels,
                "tasks": self._tasks}


def open_lerobot_split(root: str | Path, split: str, *, target: str = "memory", heldout: Sequence[int] | None = None,
                       empty_label: str | None = None, key_map: KeyMap = KeyMap()) -> LabelledFrames:
    """Frames of one split with a label for `target` (see the module docstring)."""
    episodes = split_episodes(root, split, heldout)
    if not episodes:
        raise ValueError(f"split {split!r} of {root} has no episodes")
    return LabelledFrames(LeRobotSource(root, episodes=episodes, key_map=key_map), target, empty_label)
