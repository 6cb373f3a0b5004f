"""Peak memory of restoring an openpi π0.5 checkpoint and converting it for the backend.

    python -m eval.restore_memory --preset bench --out eval/results/restore_memory_bench

Writes a random checkpoint of the preset in openpi's released layout (float32, orbax) to a temporary
directory, then, in a fresh process per dtype, measures the resident set size (VmRSS, sampled every
5 ms) above the process's own baseline: the peak while `load_openpi_params` runs and once it has
returned, and the peak while `for_backend(params, "cpu")` runs and once it has returned; each as a
multiple of the restored weights' bytes (the issue-18 target is <= 1.3x for load + conversion).

Output: DIR/summary.json and DIR/report.md.
"""

from __future__ import annotations

import argparse
import json
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


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakRss:
    """Context manager: the highest VmRSS (MiB) seen while the block ran (a thread samples every 5 ms)."""

    def __enter__(self):
        self.peak, self._stop = rss_mib(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib())


def write_checkpoint(preset: str, root: Path) -> int:
    """A random `preset` checkpoint in openpi's released layout under root/params; returns the float32 bytes."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from oxygen_jax.models.pi05.config import model_config
    from oxygen_jax.models.pi05.params import init_params, to_openpi_dict

    flat = {k: np.asarray(v, np.float32) for k, v in
            to_openpi_dict(init_params(model_config(preset), jax.random.key(0))).items()}
    tree: dict = {}
    for key, leaf in flat.items():
        node = tree
        *parents, name = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = leaf
    ocp.PyTreeCheckpointer().save((root / "params").resolve(), {"params": tree})
    return sum(v.nbytes for v in flat.values())


def measure(path: str, dtype: str) -> dict:
    """One dtype, in this (fresh) process."""
    import jax
    import jax.numpy as jnp

    from oxygen_jax.ckpts.openpi import load_openpi_params
    from oxygen_jax.models.pi05.params import for_backend

    jnp.zeros(4).block_until_ready()
    base = rss_mib()
    with PeakRss() as load:
        t0 = time.perf_counter()
        _, params = load_openpi_params(path, dtype=dtype)
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
    for k in ("load_peak", "after_load", "convert_peak", "after_convert"):
        rec[f"{k}_x"] = rec[f"{k}_mib"] / weights
    return rec


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m eval.restore_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench", choices=["tiny", "bench", "pi05"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--measure", nargs=2, metavar=("CKPT", "DTYPE"), help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure)), flush=True)
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    records = []
    with tempfile.TemporaryDirectory(prefix="oxygen-restore-") as tmp:
        stored = write_checkpoint(args.preset, Path(tmp))
        for dtype in args.dtypes:
            run = subprocess.run([sys.executable, "-m", "eval.restore_memory", "--measure", tmp, dtype], cwd=REPO,
                                 capture_output=True, text=True, check=True)
            records.append(json.loads(run.stdout.strip().splitlines()[-1]))
            r = records[-1]
            print(f"{dtype}: weights {r['weights_mib']:.0f} MiB; load peak {r['load_peak_x']:.2f}x, after "
                  f"{r['after_load_x']:.2f}x; for_backend(cpu) peak {r['convert_peak_x']:.2f}x, after "
                  f"{r['after_convert_x']:.2f}x", flush=True)
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
    (args.out / "report.md").write_text("\n".join([
        f"# Restore memory ({args.preset}, openpi released layout, float32 on disk)", "",
        f"Command: `{env['command']}`", "", f"Machine: {env['cpu_count']} CPUs, load average {env['load_average']}.",
        "", "RSS above the process baseline, as a multiple of the restored weights' bytes.", "", *rows, ""]))
    print(f"wrote {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
