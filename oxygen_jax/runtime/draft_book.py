"""What a robot's language requests draft from under speculative decoding: its own earlier answers (host side).

Robot language repeats itself: a memory or subtask request opened every frame mostly answers what the same
robot answered last time. `DraftBook` remembers, per robot (stream), the last finished answer to each
(prompt, adapter) and the robot's most recent answers, and writes a request's draft reference at admission:

    [ previous answer to this prompt + adapter | -1 | recent answer | -1 | recent answer | -1 | prompt | -1 ]

an int32 row of R = `decode.draft_capacity(M, Q)` entries, -1 padded (`runtime.speculative` drafts from it
on the device). Segment 0 is empty (the row starts with -1) when the robot never answered this prompt.
"""

from __future__ import annotations

import collections

import numpy as np


class DraftBook:
    """Finished answers by robot, bounded: at most `max_keys` (robot, prompt, adapter) entries (oldest dropped)
    and `recent` answers per robot."""

    def __init__(self, width: int, *, recent: int = 2, max_keys: int = 4096):
        if width < 1:
            raise ValueError(f"DraftBook width must be >= 1 (decode.draft_capacity), got {width}")
        self.width, self.max_keys = width, max_keys
        self._answers: collections.OrderedDict[tuple, tuple[int, ...]] = collections.OrderedDict()
        self._recent: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=recent))

    @staticmethod
    def _key(row: int, prompt, adapter: int) -> tuple:
        return (int(row), tuple(int(t) for t in prompt), int(adapter))

    def record(self, row: int, prompt, adapter: int, tokens) -> None:
        """A finished answer of robot `row` to `prompt` on `adapter`."""
        answer = tuple(int(t) for t in tokens)
        key = self._key(row, prompt, adapter)
        self._answers.pop(key, None)
        self._answers[key] = answer
        while len(self._answers) > self.max_keys:
            self._answers.popitem(last=False)
        recent = self._recent[int(row)]
        if answer in recent:
            recent.remove(answer)
        recent.appendleft(answer)

    def reference(self, row: int, prompt, adapter: int) -> np.ndarray:
        """int32 [R]: the draft reference of a request (layout in the module docstring)."""
        previous = self._answers.get(self._key(row, prompt, adapter), ())
        others = [a for a in self._recent.get(int(row), ()) if a != previous]
        flat: list[int] = list(previous) + [-1]
        for segment in others + [tuple(int(t) for t in prompt)]:
            flat += list(segment) + [-1]
        out = np.full((self.width,), -1, np.int32)
        flat = flat[: self.width]
        out[: len(flat)] = flat
        return out
