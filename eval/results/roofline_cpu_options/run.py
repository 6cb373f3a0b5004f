"""What XLA:CPU offers the few-row products of the batch-1 denoise and the decode step (issue 44, item 4).

    python -m eval.results.roofline_cpu_options.run --out eval/results/roofline_cpu_options

Three measurements, each a ratio inside one run (compile apart, `block_until_ready`, medians):

1. `products`: one float32 product x [M, K] @ w [K, N] at the π0.5 bench expert's MLP shapes for M = 1, 10, 60
   rows, over 24 distinct weights (96 MiB, three times the L3) so every call reads its weight from memory: time,
   the weight bytes per second, and process CPU / wall time (about 2 = both cores busy); the same product with
   the weight stored transposed, and with bfloat16 operands (float32 accumulation).
2. `configs`: the bench π0.5's one denoise step, S = 10 steps, a decode step at 1 and 6 slots
   (`eval.bench.roofline_measure`'s calls) in one child process per XLA option (`--xla_cpu_...`: XNNPACK and
   YNNPACK dot fusions, oneDNN, the thunk runtime off), the rounds alternating.
3. `tensor_parallel`: the same calls with the weights split over two host devices (`slot_mesh.place_model`, the
   `serve --tensor-parallel 2` layout) against one device, alternating in one process.

Writes `results.json` and `report.md` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {"default": "", "xnn_dot": "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
           "ynn_dot": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
           "onednn": "--xla_cpu_use_onednn=true", "no_thunks": "--xla_cpu_use_thunk_runtime=false"}
CALLS = ("step1:actions", "denoise:actions", "decode1", "decode")


def _median_s(call, n: int) -> float:
    import jax
    import numpy as np

    jax.block_until_ready(call())
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def products(reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng, rows = np.random.default_rng(0), []
    for k, n in ((512, 2048), (2048, 512)):
        ws = [jnp.asarray(rng.standard_normal((k, n), dtype=np.float32)) for _ in range(24)]
        forms = {"x @ w": (jax.jit(lambda x, w: x @ w), ws),
                 "x @ w, w stored [N, K]": (jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))),
                                            [w.T.copy() for w in ws]),
                 "bfloat16 x @ w -> float32": (jax.jit(lambda x, w: jnp.dot(x.astype(w.dtype), w,
                                                                            preferred_element_type=jnp.float32)),
                                               [w.astype(jnp.bfloat16) for w in ws])}
        for m in (1, 10, 60):
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            for name, (fn, weights) in forms.items():
                for w in weights:
                    fn(x, w).block_until_ready()
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for _ in range(reps):
                    for w in weights:
                        out = fn(x, w)
                    out.block_until_ready()
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                per = wall / reps / len(weights)
                nbytes = k * n * weights[0].dtype.itemsize
                rows.append({"form": name, "M": m, "K": k, "N": n, "ms": per * 1e3, "GB/s": nbytes / per / 1e9,
                             "GFLOP/s": 2 * m * k * n / per / 1e9, "cpu/wall": cpu / wall})
    return rows


def _bench_calls(tensor_parallel: int = 1, bursts: int = 8):
    import dataclasses

    import jax

    from eval.bench import roofline_measure as measure
    from oxygen_jax.ckpts import load
    from oxygen_jax.runtime import slot_mesh

    vla = load.load_model(preset="bench", dtype="float32", seed=0).vla(10)
    if tensor_parallel > 1:
        vla = slot_mesh.place_model(vla, slot_mesh.serving_mesh(jax.devices()[:tensor_parallel], tensor_parallel))
    plan = measure.Plan(cameras=2, prompt_tokens=100, image_size=224, horizon=10, steps=10, slots=6,
                        max_new_tokens=1, tokens_per_frame=5, gamma=0, repeats=bursts)
    plan = dataclasses.replace(plan, max_new_tokens=measure.needed_tokens(plan))  # every burst decodes every slot
    inputs, noises, states = measure.frame_inputs(vla, plan)
    factories, _ = measure.calls(vla, plan, inputs, noises, states)
    return {name: factories[name]() for name in CALLS}


def child(reps: int) -> dict:
    calls = _bench_calls(bursts=reps + 1)
    return {name: _median_s(call, reps) * 1e3 for name, call in calls.items()}


def tensor_parallel(rounds: int, reps: int) -> list[dict]:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    sets = {t: _bench_calls(t, rounds * (reps + 1)) for t in (1, 2)}
    out = []
    for r in range(rounds):
        for t in ((1, 2) if r % 2 == 0 else (2, 1)):
            out.append({"round": r, "devices": t, **{n: _median_s(c, reps) * 1e3 for n, c in sets[t].items()}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--part", choices=("all", "child", "tensor_parallel"), default="all", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part == "child":
        print(json.dumps(child(args.reps)))
        return 0
    if args.part == "tensor_parallel":
        print(json.dumps(tensor_parallel(args.rounds, args.reps)))
        return 0
    record = {"command": "python -m eval.results.roofline_cpu_options.run " + " ".join(argv or sys.argv[1:]),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "load_start": os.getloadavg()}
    record["products"] = products(args.reps)
    runs = []
    for r in range(args.rounds):
        for name in (list(CONFIGS) if r % 2 == 0 else list(CONFIGS)[::-1]):
            env = dict(os.environ, XLA_FLAGS=CONFIGS[name])
            done = subprocess.run([sys.executable, "-m", "eval.results.roofline_cpu_options.run", "--out", str(args.out),
                                   "--part", "child", "--reps", str(args.reps)], env=env, capture_output=True, text=True,
                                  check=True)
            runs.append({"round": r, "config": name, "flags": CONFIGS[name], "load": os.getloadavg()[0],
                         **json.loads(done.stdout.strip().splitlines()[-1])})
            print(runs[-1], flush=True)
    record["configs"] = runs
    done = subprocess.run([sys.executable, "-m", "eval.results.roofline_cpu_options.run", "--out", str(args.out),
                           "--part", "tensor_parallel", "--rounds", str(args.rounds), "--reps", str(args.reps)],
                          capture_output=True, text=True, check=True)
    record["tensor_parallel"] = json.loads(done.stdout.strip().splitlines()[-1])
    record["load_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "report.md").write_text(_report(record))
    print(_report(record))
    return 0


def _report(rec: dict) -> str:
    lines = [f"# XLA:CPU and the few-row products ({rec['commit']}, load {rec['load_start'][0]:.1f} -> "
             f"{rec['load_end'][0]:.1f})", "", "## One product, weights from memory", "",
             "| form | M x K x N | ms | weight GB/s | GFLOP/s | CPU / wall |", "|---|---|---|---|---|---|"]
    lines += [f"| {p['form']} | {p['M']} x {p['K']} x {p['N']} | {p['ms']:.3f} | {p['GB/s']:.1f} | "
              f"{p['GFLOP/s']:.0f} | {p['cpu/wall']:.2f} |" for p in rec["products"]]
    lines += ["", "## π0.5 bench components (ms, median of the rounds' medians) per XLA option", "",
              "| option | " + " | ".join(CALLS) + " | ratio to default (each) |", "|---" * (len(CALLS) + 2) + "|"]
    import numpy as np

    def med(rows, name):
        return float(np.median([r[name] for r in rows]))

    base = {c: med([r for r in rec["configs"] if r["config"] == "default"], c) for c in CALLS}
    for name in CONFIGS:
        rows = [r for r in rec["configs"] if r["config"] == name]
        vals = {c: med(rows, c) for c in CALLS}
        lines.append(f"| {name} | " + " | ".join(f"{vals[c]:.1f}" for c in CALLS) + " | "
                     + ", ".join(f"{vals[c] / base[c]:.2f}" for c in CALLS) + " |")
    lines += ["", "## Weights split over two host devices (ms)", "", "| devices | " + " | ".join(CALLS) + " |",
              "|---" * (len(CALLS) + 1) + "|"]
    for t in (1, 2):
        rows = [r for r in rec["tensor_parallel"] if r["devices"] == t]
        lines.append(f"| {t} | " + " | ".join(f"{med(rows, c):.1f}" for c in CALLS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
