"""Peak memory of restoring an openpi π0.5 checkpoint and converting it for the backend.

    python -m eval.restore_memory --preset bench --out eval/results/restore_memory_bench
    python -m eval.restore_memory --preset pi05 --ckpt /tmp/full/ckpt --frames 3 --out eval/results/restore_memory_pi05

Writes a random checkpoint of the preset in openpi's released layout (float32; `write_checkpoint`,
leaf by leaf, as orbax lays it out) to a temporary directory or `--ckpt DIR`, then, in a fresh process
per dtype, measures the resident set size (VmRSS, sampled every 5 ms) above the process's own
baseline: the peak while `load_openpi_params` runs and once it has returned, and the peak while
`for_backend(params, "cpu")` runs and once it has returned; each as a multiple of the restored
weights' bytes (the issue-18 target is <= 1.3x for load + conversion). `--frames N` then runs the
README's robot loop (an `Engine`, one LIBERO observation, one language request) for N steps on those
weights: its peak RSS and the first (compiling) and steady step times. The full-size checkpoint is
13.4 GB on disk and takes about 2 minutes to write here.

Output: DIR/summary.json and DIR/report.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from oxygen_jax.cli import OneLineParser

REPO = Path(__file__).resolve().parents[1]


def status_mib(fields=("VmRSS",)) -> dict[str, float]:
    """{field: MiB} of /proc/self/status memory fields (VmRSS: resident; RssAnon: the anonymous part, without the
    file pages of memory-mapped files, which the kernel may drop)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name = line.split(":", 1)[0]
        if name in fields:
            out[name] = int(line.split()[1]) / 1024
    missing = set(fields) - set(out)
    if missing:
        raise RuntimeError(f"no {sorted(missing)} in /proc/self/status")
    return out


def rss_mib() -> float:
    return status_mib()["VmRSS"]


class PeakRss:
    """Context manager: the highest VmRSS (MiB) seen while the block ran (`peak`; a thread samples every 5 ms), and
    of each other /proc/self/status field in `fields` (`peaks`, e.g. {"VmRSS": ..., "RssAnon": ...})."""

    def __init__(self, fields=()):
        self.fields = tuple(dict.fromkeys(("VmRSS", *fields)))

    @property
    def peak(self) -> float:
        return self.peaks["VmRSS"]

    def _update(self):
        now = status_mib(self.fields)
        self.peaks = {k: max(self.peaks.get(k, 0.0), v) for k, v in now.items()}

    def __enter__(self):
        self.peaks, self._stop = {}, threading.Event()
        self._update()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._update()

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._update()


def write_checkpoint(preset, root: Path, rss_limit_gib: float | None = 20.0) -> int:
    """A random checkpoint of `preset` (a preset name or a `ModelConfig`) in openpi's released layout under
    root/params (`ckpts.random_openpi.write_random_openpi`, leaf by leaf); returns the float32 bytes.

    A watchdog stops the process if its RSS passes `rss_limit_gib` (None: no watchdog) instead of letting the
    kernel pick a victim.
    """
    from oxygen_jax.ckpts.random_openpi import write_random_openpi
    from oxygen_jax.models.pi05.config import model_config

    def watchdog():
        while True:
            if rss_mib() > rss_limit_gib * 1024:
                print(f"write_checkpoint: RSS above {rss_limit_gib} GiB, stopping", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.05)

    if rss_limit_gib is not None:
        threading.Thread(target=watchdog, daemon=True).start()
    return write_random_openpi(model_config(preset) if isinstance(preset, str) else preset, root)


def measure(path: str, dtype: str, frames: int = 0) -> dict:
    """One dtype, in this (fresh) process; then `frames` engine steps on the weights (0: none)."""
    import jax
    import jax.numpy as jnp

    from oxygen_jax.ckpts.openpi import load_openpi_params
    from oxygen_jax.models.pi05.params import for_backend

    jnp.zeros(4).block_until_ready()
    base = rss_mib()
    with PeakRss() as load:
        t0 = time.perf_counter()
        config, params = load_openpi_params(path, dtype=dtype)
        jax.block_until_ready(params)
        load_s = time.perf_counter() - t0
    weights = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
    after_load = rss_mib() - base
    with PeakRss() as convert:
        t0 = time.perf_counter()
        params = jax.block_until_ready(for_backend(params, "cpu"))
        convert_s = time.perf_counter() - t0
    after = rss_mib() - base
    rec = {"dtype": dtype, "weights_mib": weights, "load_s": load_s, "load_peak_mib": load.peak - base,
           "after_load_mib": after_load, "convert_s": convert_s, "convert_peak_mib": convert.peak - base,
           "after_convert_mib": after}
    keys = ["load_peak", "after_load", "convert_peak", "after_convert"]
    if frames:
        rec.update(_run_frames(config, params, frames))
        rec["frames_peak_mib"] -= base
        keys.append("frames_peak")
    for k in keys:
        rec[f"{k}_x"] = rec[f"{k}_mib"] / weights
    return rec


def _run_frames(config, params, frames: int) -> dict:
    """The README's robot loop on the restored weights: a LIBERO observation (synthetic cameras), one
    language request, `frames` engine steps (the first compiles). Peak RSS and the steady frame time."""
    import jax
    import numpy as np

    from oxygen_jax import Engine, EngineConfig, as_vla, robot_config
    from oxygen_jax.robots import transforms
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer

    tokenizer = train_demo_tokenizer()  # ids below any π0.5 vocabulary; the PaliGemma model is not shipped
    robot = robot_config("libero")
    sample = transforms.synthetic_sample(robot, np.random.default_rng(0), image_size=224)
    engine = Engine(as_vla(params), EngineConfig(num_slots=4, max_new_tokens=20, prompt_capacity=8,
                                         action_horizon=robot.action_horizon), tokenizer=tokenizer)
    observation = transforms.make_observation(robot, config, tokenizer, [sample])
    engine.submit(prompt="Subtask: ", max_tokens=20)
    times = []
    with PeakRss() as peak:
        for _ in range(frames):
            t0 = time.perf_counter()
            result = engine.step(observation)
            jax.block_until_ready(result.actions)
            times.append(time.perf_counter() - t0)
    if not np.isfinite(np.asarray(result.actions, np.float32)).all():
        raise RuntimeError("the full-size frame gave non-finite actions")
    return {"frames": frames, "first_frame_s": times[0], "frame_s": float(np.median(times[1:])) if frames > 1 else None,
            "frames_peak_mib": peak.peak}


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _stored_bytes(ckpt: Path) -> int:
    import numpy as np
    from flax.traverse_util import flatten_dict

    from oxygen_jax.ckpts.orbax_io import read_tree_metadata, resolve_params_item

    meta = flatten_dict(dict(read_tree_metadata(resolve_params_item(ckpt))["params"])).values()
    return sum(math.prod(m.shape) * np.dtype(m.dtype).itemsize for m in meta)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m eval.restore_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench", choices=["tiny", "bench", "pi05"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ckpt", type=Path, help="reuse (or write, if absent) the random checkpoint in this directory "
                    "instead of a temporary one (the full-size one takes minutes to write)")
    ap.add_argument("--frames", type=int, default=0, help="after loading, run the README's robot loop for this many "
                    "engine steps (the first compiles) and report its peak RSS and frame time (default 0: none)")
    ap.add_argument("--measure", nargs=2, metavar=("CKPT", "DTYPE"), help=argparse.SUPPRESS)  # the child processes
    ap.add_argument("--write", metavar="CKPT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure, frames=args.frames)), flush=True)
        return 0
    if args.write:
        print(write_checkpoint(args.preset, Path(args.write)), flush=True)
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    records = []
    with contextlib.ExitStack() as stack:
        tmp = str(args.ckpt or stack.enter_context(tempfile.TemporaryDirectory(prefix="oxygen-restore-")))
        if not (Path(tmp) / "params").exists():  # written in its own process, so its memory is gone before measuring
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "eval.restore_memory", "--preset", args.preset, "--write", tmp],
                           cwd=REPO, check=True)
            print(f"wrote the random {args.preset} checkpoint in {time.perf_counter() - t0:.0f} s", flush=True)
        stored = _stored_bytes(Path(tmp))
        for dtype in args.dtypes:
            run = subprocess.run([sys.executable, "-m", "eval.restore_memory", "--measure", tmp, dtype,
                                  "--frames", str(args.frames)], cwd=REPO,
                                 capture_output=True, text=True)
            if run.returncode:  # e.g. killed for memory (-9): say which dtype and show the child's last words
                tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-5:])
                ap.exit(1, f"restore_memory: measuring {dtype} failed (exit {run.returncode}):\n{tail}\n")
            records.append(json.loads(run.stdout.strip().splitlines()[-1]))
            r = records[-1]
            print(f"{dtype}: weights {r['weights_mib']:.0f} MiB; load peak {r['load_peak_x']:.2f}x, after "
                  f"{r['after_load_x']:.2f}x; for_backend(cpu) peak {r['convert_peak_x']:.2f}x, after "
                  f"{r['after_convert_x']:.2f}x" + (f"; {args.frames} engine steps peak {r['frames_peak_x']:.2f}x, first "
                  f"{r['first_frame_s']:.1f} s, then {_seconds(r['frame_s'])} s" if args.frames else ""), flush=True)
    env = {"preset": args.preset, "stored_float32_bytes": stored, "cpu_count": os.cpu_count(),
           "platform": platform.platform(), "load_average": [round(x, 2) for x in os.getloadavg()],
           "command": " ".join(["python", "-m", "eval.restore_memory", *(argv or sys.argv[1:])]),
           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"environment": env, "records": records}, indent=1))
    rows = ["| dtype | weights MiB | load s | load peak | after load | for_backend peak | after for_backend |",
            "|---|---|---|---|---|---|---|"]
    rows += [f"| {r['dtype']} | {r['weights_mib']:.0f} | {r['load_s']:.1f} | {r['load_peak_x']:.2f}x "
             f"| {r['after_load_x']:.2f}x | {r['convert_peak_x']:.2f}x | {r['after_convert_x']:.2f}x |" for r in records]
    if args.frames:
        rows += ["", f"The README's robot loop on the same weights ({args.frames} engine steps, LIBERO, one language "
                 "request): peak RSS above the baseline while it ran, first step (compiles) and the median of the rest.",
                 "", "| dtype | peak | peak MiB | first step s | step s |", "|---|---|---|---|---|"]
        rows += [f"| {r['dtype']} | {r['frames_peak_x']:.2f}x | {r['frames_peak_mib']:.0f} | {r['first_frame_s']:.1f} "
                 f"| {_seconds(r['frame_s'])} |" for r in records]
    (args.out / "report.md").write_text("\n".join([
        f"# Restore memory ({args.preset}, openpi released layout, float32 on disk)", "",
        f"Command: `{env['command']}`", "", f"Machine: {env['cpu_count']} CPUs, load average {env['load_average']}.",
        "", "RSS above the process baseline, as a multiple of the restored weights' bytes.", "", *rows, ""]))
    print(f"wrote {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
