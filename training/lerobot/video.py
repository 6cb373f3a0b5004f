"""Video frames of LeRobot mp4 files, decoded with PyAV and matched to query times as LeRobot does.

A query time t (seconds inside the file: `from_timestamp + timestamp` in v3.0, `timestamp` in v2.x) returns
the decoded frame whose presentation time `pts * time_base` is within `tolerance_s` (LeRobot's 1e-4 s) of t,
as uint8 RGB [H, W, 3] (`frame.to_ndarray(format="rgb24")`); none there is a one-line ValueError naming the
file and the time. Frames are at least 1 / fps apart, so at most one frame qualifies: it is the nearest one.

`VideoFrames.frame(path, t)` keeps an open decoder per file (a *cursor*, at most `max_open` files): a query a
little ahead of the cursor (at most `max_skip` frames) decodes forward from where it stopped, any other query seeks
to the key frame at or before t and decodes forward from there (LeRobot's pyav path). Only frames within the
tolerance are converted to RGB. So reading in time order decodes each frame once, and a random access decodes
from the previous key frame (LeRobot encodes a key frame every 2 frames). Decoded frames are kept in a
least-recently-used cache bounded by `cache_bytes` (0: none), keyed by file and frame number round(t * fps),
for frames read again (action chunks, epochs, several samplers); a 300k-frame dataset is never held whole.

Axes: H, W frame height and width.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np

TOLERANCE_S = 1e-4


@dataclasses.dataclass
class _Cursor:
    """An open file positioned after the frame at `time` (seconds); `frames` continues decoding from there."""

    container: av.container.InputContainer
    stream: av.video.stream.VideoStream
    frames: Iterator
    time: float


class VideoFrames:
    """Decoded mp4 frames with open-file cursors and a bounded frame cache (see the module docstring).

    Args:
      cache_bytes: bound on the decoded pixels kept (0: no cache).
      tolerance_s: largest accepted |frame time - query time|.
      max_open: files kept open with their decoder position.
      max_skip: how many frames ahead of a cursor a query may be and still decode forward instead of seeking
        (a seek decodes at most a key-frame interval: 2 frames in LeRobot's files).
    """

    def __init__(self, cache_bytes: int = 512 << 20, tolerance_s: float = TOLERANCE_S, max_open: int = 8,
                 max_skip: int = 3):
        self.cache_bytes, self.tolerance_s = int(cache_bytes), float(tolerance_s)
        self.max_open, self.max_skip = int(max_open), int(max_skip)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cached_bytes = 0
        self._cursors: collections.OrderedDict[str, _Cursor] = collections.OrderedDict()
        self.decoded_frames = 0  # frames decoded so far (for measurements)
        self.seeks = 0

    def __getstate__(self) -> dict:  # workers (grain, multiprocessing) get a copy without open files or cache
        return {**self.__dict__, "_cursors": collections.OrderedDict(), "_cache": collections.OrderedDict(),
                "_cached_bytes": 0}

    def _open(self, path: str, t: float) -> _Cursor:
        old = self._cursors.pop(path, None)
        if old is not None:
            old.container.close()
        try:
            container = av.open(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such video file (named by the episode table)") from None
        except av.error.FFmpegError as e:
            raise ValueError(f"{path}: not a readable video ({e})") from None
        if not container.streams.video:
            container.close()
            raise ValueError(f"{path}: the file has no video stream")
        stream = container.streams.video[0]
        target = int(round(t / float(stream.time_base)))  # the frame's own pts when |its time - t| < time_base / 2
        try:  # the key frame at or before it (LeRobot's pyav backend seeks one pts earlier: a key frame sooner)
            container.seek(max(target, 0), backward=True, any_frame=False, stream=stream)
        except av.error.FFmpegError:
            container.seek(0)
        self.seeks += 1
        cursor = _Cursor(container, stream, container.decode(stream), -np.inf)
        self._cursors[path] = cursor
        while len(self._cursors) > self.max_open:
            self._cursors.popitem(last=False)[1].container.close()
        return cursor

    def _decode(self, path: str, t: float, fps: float) -> np.ndarray:
        cursor = self._cursors.get(path)
        if cursor is None or not cursor.time < t - self.tolerance_s <= cursor.time + self.max_skip / fps:
            cursor = self._open(path, t)
        self._cursors.move_to_end(path)
        tb = float(cursor.stream.time_base)
        try:
            for frame in cursor.frames:
                self.decoded_frames += 1
                if frame.pts is None:
                    continue
                cursor.time = frame.pts * tb
                if cursor.time > t + self.tolerance_s:
                    break
                if abs(cursor.time - t) < self.tolerance_s:
                    return frame.to_ndarray(format="rgb24")
        except av.error.FFmpegError as e:
            self._cursors.pop(path).container.close()
            raise ValueError(f"{path}: decoding failed near t={t:.4f} s ({e})") from None
        self._cursors.pop(path).container.close()
        raise ValueError(f"{path}: no frame within {self.tolerance_s:g} s of t={t:.6f} s (decoding reached "
                         f"{cursor.time:.6f} s); the timestamps or from_timestamp disagree with the video")

    def frame(self, path: str | Path, t: float, fps: float) -> np.ndarray:
        """uint8 [H, W, 3]: the frame of `path` at time `t` (seconds in the file), see the module docstring."""
        path, t = str(path), float(t)
        key = (path, int(round(t * fps)))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        img = self._decode(path, t, fps)
        if self.cache_bytes > 0:
            self._cache[key] = img
            self._cached_bytes += img.nbytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                self._cached_bytes -= self._cache.popitem(last=False)[1].nbytes
        return img

    def close(self) -> None:
        """Closes the open files and drops the cache."""
        while self._cursors:
            self._cursors.popitem()[1].container.close()
        self._cache.clear()
        self._cached_bytes = 0
