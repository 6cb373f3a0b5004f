"""What real-time chunking costs per frame: guided / stop-gradient / trained frames against plain ones.

    python -m eval.results.rtc_cost.run --preset bench --robots 1 4 --reps 5 --out eval/results/rtc_cost

All frames run in one process on the same observations (LIBERO, the OxyGen benchmark's variant: 3 cameras,
100 prompt tokens, P = 868, Ha = 10, 10 denoising steps), with random weights. Each frame is
`Engine.step` (prefill, denoise, an empty language burst, one device-to-host transfer of the actions).
Per robot count B there are two compiled programs: plain (no `rtc`) and RTC. The RTC modes share the RTC
program because the mode is an array. Compile is each program's first call and is reported on its own.
After it, every repetition runs each variant once, in an order that rotates per repetition. The medians
and their ratios to the plain frame of the same B are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import numpy as np

from oxygen_jax.ckpts import load
from oxygen_jax.robots.config import oxygen_benchmark_robot
from oxygen_jax.robots import transforms
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from oxygen_jax.runtime import rtc
from oxygen_jax.runtime.engine import Engine, EngineConfig

VARIANTS = ("plain", "guided", "stop_gradient", "trained")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--robots", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="denoising steps")
    ap.add_argument("--delay", type=int, default=3, help="d of every RTC row")
    ap.add_argument("--horizon", type=int, default=5, help="s of every RTC row")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("eval/results/rtc_cost"))
    args = ap.parse_args(argv)
    robot = oxygen_benchmark_robot("libero")
    loaded = load.load_model(None, preset=args.preset, family="pi05", dtype=args.dtype)
    tok = train_demo_tokenizer()
    ha = robot.action_horizon
    engine = Engine(loaded.vla(args.steps), EngineConfig(num_slots=1, max_new_tokens=1, admissions_per_frame=1,
                                                         tokens_per_frame=1, action_horizon=ha), tokenizer=tok)
    rng = np.random.default_rng(0)
    setups, compile_s = {}, {}
    for b in args.robots:
        obs = jax.device_put(transforms.make_observation(robot, loaded.config, tok, [
            transforms.synthetic_sample(robot, rng, image_size=224) for _ in range(b)]))
        ad = loaded.config.action_dim
        noise = jax.device_put(rng.standard_normal((b, ha, ad)).astype(np.float32))
        prev = rng.standard_normal((b, ha, ad)).astype(np.float32)
        for v in VARIANTS:
            inputs = None if v == "plain" else rtc.make_inputs(prev, args.delay, args.horizon, mode=v)
            setups[b, v] = (obs, noise, inputs)
        for program in ("plain", "guided"):  # the two programs; the first call compiles
            obs_, noise_, inputs = setups[b, program]
            start = time.perf_counter()
            engine.step(obs_, noise_, rtc=inputs)
            compile_s[f"B={b} {program}"] = round(time.perf_counter() - start, 2)
            print(f"compiled B={b} {program} in {compile_s[f'B={b} {program}']} s", flush=True)
    times = {k: [] for k in setups}
    keys = list(setups)
    for r in range(args.reps):
        for i in range(len(keys)):
            key = keys[(i + r) % len(keys)]
            obs, noise, inputs = setups[key]
            start = time.perf_counter()
            engine.step(obs, noise, rtc=inputs)  # Engine.step waits for the actions on the host
            times[key].append((time.perf_counter() - start) * 1e3)
    rows = []
    for b in args.robots:
        plain = statistics.median(times[b, "plain"])
        for v in VARIANTS:
            med = statistics.median(times[b, v])
            rows.append(dict(robots=b, variant=v, frame_ms_median=round(med, 1), ratio_to_plain=round(med / plain, 3),
                             frame_ms=[round(t, 1) for t in times[b, v]]))
            print(f"B={b} {v:14s} {med:8.1f} ms  x{med / plain:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m eval.results.rtc_cost.run", *(sys.argv[1:] if argv is None else argv)])
    env = dict(command=command, backend=jax.default_backend(),
               devices=[str(d) for d in jax.devices()], machine=platform.machine(), jax=jax.__version__,
               load_average=list(os.getloadavg()), compile_s=compile_s, args=vars(args) | {"out": str(args.out)})
    (args.out / "summary.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = ["| robots | frame | median ms | × plain |", "|---|---|---|---|"]
    lines += [f"| {r['robots']} | {r['variant']} | {r['frame_ms_median']} | {r['ratio_to_plain']:.2f} |" for r in rows]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
