"""Reading speed and peak memory of `training.data.lerobot` on a LeRobot v3.0 video dataset, with the decode cache on
and off.

    python -m eval.results.lerobot_read.run [--episodes 8 --length 50 --size 224 --out DIR]

Writes a synthetic v3.0 dataset (`training.data.lerobot.synthetic`: two AV1 cameras of SIZE x SIZE, LeRobot's encoder
settings, 4 episodes per file so the files roll over), then in a fresh Python process per configuration reads
every frame once, in dataset order and in a shuffled order (training's access pattern), through
`LeRobotSource` with the video cache off and on (512 MB, more than the data; 16 MB, less), and each
configuration twice (the second pass shows frames read again: epochs). Reports frames/s, frames decoded per frame read, and
the process's peak resident memory (VmHWM of /proc/self/status; ru_maxrss would include the parent's peak
before exec) next to that of a process that only imported the reader and
opened the dataset. Prints a markdown table and writes it, with the machine and load, to OUT/lerobot_read.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, sys, time
import numpy as np
from training.data.lerobot import LeRobotSource
root, order, cache_mb, read = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
src = LeRobotSource(root, video_cache_mb=cache_mb)
idx = np.arange(len(src)) if order == "sequential" else np.random.default_rng(0).permutation(len(src))
times = []
for _ in range(2 if read else 0):
    t0 = time.perf_counter()
    for i in idx:
        src[int(i)]
    times.append(time.perf_counter() - t0)
print(json.dumps({"frames": len(idx) if read else 0, "seconds": times,
                  "decoded": src.dataset.video.decoded_frames,
                  "peak_rss_mb": next(int(l.split()[1]) for l in open("/proc/self/status")
                                      if l.startswith("VmHWM:")) / 1024}))
"""


def _child(root: Path, order: str, cache_mb: float, read: bool = True) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(root), order, str(cache_mb), "1" if read else "0"],
                         check=True, capture_output=True, text=True, env={**os.environ, "SVT_LOG": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.results.lerobot_read.run", description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--length", type=int, default=50, help="frames per episode")
    ap.add_argument("--size", type=int, default=224, help="camera side in pixels")
    ap.add_argument("--out", type=Path, default=None, help="folder for lerobot_read.md (default: print only)")
    args = ap.parse_args(argv)
    from training.data.lerobot.synthetic import write_dataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        t0 = time.perf_counter()
        write_dataset(root, version="v3.0", lengths=[args.length] * args.episodes, fps=10, episodes_per_file=4,
                      cameras={"image": ("video", args.size, args.size), "wrist_image": ("video", args.size, args.size)})
        written = time.perf_counter() - t0
        base = _child(root, "sequential", 512, read=False)
        rows = []
        for order in ("sequential", "shuffled"):
            for cache_mb, what in ((512, "on, 512 MB (default; more than the data)"),
                                   (16, "on, 16 MB (less than the data)"), (0, "off")):
                rows.append((order, what, _child(root, order, cache_mb)))
    n = args.episodes * args.length
    load = os.getloadavg()
    lines = [f"Command: python -m eval.results.lerobot_read.run {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
             f"LeRobot v3.0 dataset: {args.episodes} episodes x {args.length} frames = {n} frames, 2 AV1 cameras "
             f"{args.size}x{args.size} (written in {written:.1f} s), 4 episodes per file.",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
             f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end.",
             f"Process that only opened the dataset: peak RSS {base['peak_rss_mb']:.0f} MB.", "",
             "| order | video cache | frames/s, first pass | frames/s, second pass | video frames decoded per camera "
             "image read (both passes) | peak RSS (MB) |", "|---|---|---|---|---|---|"]
    for order, cache, r in rows:
        first, second = (r["frames"] / s for s in r["seconds"])
        lines.append(f"| {order} | {cache} | {first:.0f} | {second:.0f} | {r['decoded'] / (4 * r['frames']):.2f} "
                     f"| {r['peak_rss_mb']:.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lerobot_read.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
