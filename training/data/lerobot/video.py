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
least-recently-used cache bounded by `cache_bytes` (0: none), keyed by file and the frame's own presentation
time, so a query hits the cache only for the very frame decoding it would return (within the tolerance), for
frames read again (action chunks, epochs, several samplers); a 300k-frame dataset is never held whole.

What the file must agree with, checked when it is opened, before a frame is decoded: its video stream's frame
rate equals the dataset's fps (`info.json`; otherwise timestamps would address other frames), and its frame
size equals the camera's `(H, W)` from `info.json` (also checked on every decoded frame before it is
converted, so a stream that changes size mid-way is refused, not resized or accepted).

Axes: H, W frame height and width.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np

TOLERANCE_S = 1e-4
RATE_TOLERANCE = 1e-3  # relative |stream frame rate - fps| accepted


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
        self._reset()
        self.decoded_frames = 0  # frames decoded so far (for measurements)
        self.seeks = 0

    def _reset(self) -> None:
        self._cache: collections.OrderedDict[tuple[str, int], np.ndarray] = collections.OrderedDict()
        self._cached_bytes = 0
        self._cached_pts: dict[str, list[int]] = {}  # path -> sorted pts of its cached frames
        self._time_base: dict[str, float] = {}  # path -> seconds per pts unit (known once opened)
        self._cursors: collections.OrderedDict[str, _Cursor] = collections.OrderedDict()

    def __getstate__(self) -> dict:  # workers (grain, multiprocessing) get a copy without open files or cache
        state = dict(self.__dict__)
        copy = VideoFrames.__new__(VideoFrames)
        copy._reset()
        state.update({k: v for k, v in copy.__dict__.items()})
        return state

    def _open(self, path: str, t: float, fps: float, size: tuple[int, int] | None) -> _Cursor:
        old = self._cursors.pop(path, None)
        if old is not None:
            old.container.close()
        if not Path(path).is_file():
            what = "not a regular file" if Path(path).exists() else "no such video file"
            raise FileNotFoundError(f"{path}: {what} (named by the episode table)")
        try:
            container = av.open(path)
        except av.error.FFmpegError as e:
            raise ValueError(f"{path}: not a readable video ({e})") from None
        if not container.streams.video:
            container.close()
            raise ValueError(f"{path}: the file has no video stream")
        stream = container.streams.video[0]
        problem = _disagreement(stream, fps, size)
        if problem:
            container.close()
            raise ValueError(f"{path}: {problem}")
        self._time_base[path] = float(stream.time_base)
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

    def _decode(self, path: str, t: float, fps: float, size: tuple[int, int] | None) -> tuple[np.ndarray, int]:
        cursor = self._cursors.get(path)
        if cursor is None or not cursor.time < t - self.tolerance_s <= cursor.time + self.max_skip / fps:
            cursor = self._open(path, t, fps, size)
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
                    if size is not None and (frame.height, frame.width) != tuple(size):
                        raise ValueError(f"{path}: the frame at t={t:.4f} s is {frame.height} x {frame.width} px but "
                                         f"info.json says {size[0]} x {size[1]}")
                    return frame.to_ndarray(format="rgb24"), int(frame.pts)
        except (av.error.FFmpegError, ValueError) as e:
            self._cursors.pop(path).container.close()
            if isinstance(e, av.error.FFmpegError):
                raise ValueError(f"{path}: decoding failed near t={t:.4f} s ({e})") from None
            raise
        self._cursors.pop(path).container.close()
        raise ValueError(f"{path}: no frame within {self.tolerance_s:g} s of t={t:.6f} s (decoding reached "
                         f"{cursor.time:.6f} s); the timestamps or from_timestamp disagree with the video")

    def _cached(self, path: str, t: float) -> int | None:
        """The pts of a cached frame of `path` within the tolerance of `t`, else None."""
        tb, times = self._time_base.get(path), self._cached_pts.get(path)
        if not tb or not times:
            return None
        k = bisect.bisect_left(times, (t - self.tolerance_s) / tb)
        if k < len(times) and abs(times[k] * tb - t) < self.tolerance_s:
            return times[k]
        return None

    def frame(self, path: str | Path, t: float, fps: float, size: tuple[int, int] | None = None) -> np.ndarray:
        """uint8 [H, W, 3]: the frame of `path` at time `t` (seconds in the file), see the module docstring.
        `size` (H, W): the size info.json gives the camera (None: not checked)."""
        path, t = str(path), float(t)
        pts = self._cached(path, t)
        if pts is not None:
            self._cache.move_to_end((path, pts))
            return self._cache[path, pts]
        img, pts = self._decode(path, t, fps, size)
        if self.cache_bytes > 0 and (path, pts) not in self._cache:
            self._cache[path, pts] = img
            bisect.insort(self._cached_pts.setdefault(path, []), pts)
            self._cached_bytes += img.nbytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                (old_path, old_pts), old = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes
                times = self._cached_pts[old_path]
                del times[bisect.bisect_left(times, old_pts)]
        return img

    def close(self) -> None:
        """Closes the open files and drops the cache."""
        while self._cursors:
            self._cursors.popitem()[1].container.close()
        self._reset()


def _disagreement(stream, fps: float, size: tuple[int, int] | None) -> str | None:
    """Why a video stream disagrees with info.json's fps and camera size (None: it agrees)."""
    rates = [float(r) for r in (stream.average_rate, stream.base_rate, stream.guessed_rate) if r]
    if not rates:
        return "the video stream records no frame rate, so its frames cannot be matched to the dataset's timestamps"
    if not any(abs(r - fps) <= RATE_TOLERANCE * fps for r in rates):
        return (f"the video's frame rate is {rates[0]:g} fps but info.json says fps {fps:g}; timestamps would address "
                "other frames (fix info.json's fps or re-encode the video)")
    ctx = stream.codec_context
    if size is not None and ctx.height and ctx.width and (ctx.height, ctx.width) != tuple(size):
        return f"the video is {ctx.height} x {ctx.width} px but info.json says {size[0]} x {size[1]}"
    return None
