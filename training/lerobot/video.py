"""Video frames of LeRobot mp4 files, decoded with PyAV and matched to query times as LeRobot does.

A query time t (seconds inside the file: `from_timestamp + timestamp` in v3.0, `timestamp` in v2.x) returns
the decoded frame whose presentation time `pts * time_base` is nearest to t, as uint8 RGB [H, W, 3]
(`frame.to_ndarray(format="rgb24")`), provided |pts time - t| < `tolerance_s` (LeRobot's 1e-4 s); otherwise a
one-line ValueError naming the file and the time.

`VideoFrames.frames(path, times)` decodes each file segment once: it seeks to the key frame at or before the
earliest query, decodes forward to the latest, and keeps the frames within half a frame of the queried span.
Segments (keyed by file and span) are kept in a least-recently-used cache bounded by `cache_bytes` (0: off, so
every call decodes again and nothing is held after it returns). An episode's frames are one segment, so a
shuffled pass over a dataset decodes each episode about once per visit rather than once per frame; a
300k-frame dataset is never decoded as a whole.

Axes: Q queried times, H, W frame height and width.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path

import av
import numpy as np

TOLERANCE_S = 1e-4


class VideoFrames:
    """Decoded mp4 segments with a bounded cache (see the module docstring).

    Args:
      cache_bytes: bound on the decoded pixels kept (0: no cache).
      tolerance_s: largest accepted |frame time - query time|.
    """

    def __init__(self, cache_bytes: int = 512 << 20, tolerance_s: float = TOLERANCE_S):
        self.cache_bytes, self.tolerance_s = int(cache_bytes), float(tolerance_s)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cached_bytes = 0
        self.decoded_frames = 0  # frames decoded so far (a cache-effect counter for measurements)

    def _decode(self, path: Path, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
        """(times float64 [F], frames uint8 [F, H, W, 3]) of the frames with times in [lo, hi]."""
        try:
            container = av.open(str(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such video file (named by the episode table)") from None
        except av.error.FFmpegError as e:
            raise ValueError(f"{path}: not a readable video ({e})") from None
        times, frames = [], []
        with container:
            if not container.streams.video:
                raise ValueError(f"{path}: the file has no video stream")
            stream = container.streams.video[0]
            tb = float(stream.time_base)
            try:  # LeRobot's pyav path: seek to the key frame at or before the first query
                container.seek(max(int(round(lo / tb)) - 1, 0), backward=True, any_frame=False, stream=stream)
            except av.error.FFmpegError:
                container.seek(0)
            try:
                for frame in container.decode(stream):
                    self.decoded_frames += 1
                    if frame.pts is None:
                        continue
                    t = frame.pts * tb
                    if t > hi:
                        break
                    if t >= lo:
                        times.append(t)
                        frames.append(frame.to_ndarray(format="rgb24"))
            except av.error.FFmpegError as e:
                raise ValueError(f"{path}: decoding failed near t={lo:.4f} s ({e})") from None
        if not frames:
            return np.zeros([0]), np.zeros([0, 0, 0, 3], np.uint8)
        return np.asarray(times), np.stack(frames)

    def _segment(self, path: Path, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
        key = (str(path), round(lo, 6), round(hi, 6))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        seg = self._decode(path, lo, hi)
        if self.cache_bytes > 0:
            self._cache[key] = seg
            self._cached_bytes += seg[1].nbytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old[1].nbytes
        return seg

    def frames(self, path: Path, times: Sequence[float], span: tuple[float, float] | None = None,
               frame_s: float = 0.0) -> np.ndarray:
        """uint8 [Q, H, W, 3]: the frame nearest to each query time (see the module docstring).

        Args:
          path: the mp4 file.
          times: query times in seconds inside the file.
          span: (first, last) query time of the segment to decode and cache (default: the queries' own span);
            pass an episode's span so all its frames share one cached segment.
          frame_s: one frame period (1 / fps); frames within half of it outside the span are kept too.
        """
        times = [float(t) for t in times]
        first, last = span if span is not None else (min(times), max(times))
        pad = max(frame_s / 2, self.tolerance_s)
        seg_times, seg = self._segment(Path(path), first - pad, last + pad)
        out = []
        for t in times:
            if not seg_times.size:
                raise ValueError(f"{path}: no decoded frame near t={t:.6f} s (the file ends earlier?)")
            j = int(np.argmin(np.abs(seg_times - t)))
            if not abs(seg_times[j] - t) < self.tolerance_s:
                raise ValueError(f"{path}: no frame within {self.tolerance_s:g} s of t={t:.6f} s (nearest "
                                 f"{seg_times[j]:.6f} s); the timestamps or from_timestamp disagree with the video")
            out.append(seg[j])
        return np.stack(out)

    def clear(self) -> None:
        self._cache.clear()
        self._cached_bytes = 0
