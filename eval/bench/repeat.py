"""`python -m eval.bench.repeat`: the `repeat` workload, speculative decoding beside plain continuous batching.

    python -m eval.bench.repeat --preset tiny --p 0 0.9 --frames 10 --out /tmp/repeat     # a smoke run
    python -m eval.bench.repeat --preset bench --p 0 0.5 0.9 --out eval/results/cpu_bench_repeat

Each robot (a batch row of one LIBERO observation) opens a memory request every frame. With probability p
the request repeats the robot's usual prompt, whose greedy answer on the same observation is the answer it
gave last time (the robot's "The soup is in the basket."); otherwise it asks a prompt never seen before
(a fresh token), whose answer the robot has not given. Requests decode exactly N tokens (no stop id: random
weights), greedy. Random π0.5 weights answer a prompt token by repeating it (a tied head reads back the input
embedding), which any n-gram drafter predicts at every p; the VLM expert's attention and MLP outputs are
therefore scaled (`--text-scale`, as the tests' `diverse_text_params`) so that answers vary with the prompt and
the observation and do not repeat one token. Actions use the same scaled weights in both settings.

Two `Engine`s serve the same frames, interleaved frame by frame (order alternating) on the same observation,
noise and requests: continuous batching with k decode steps per frame, and the same with speculation
(`EngineConfig.speculate` = γ: k verify steps per frame, drafts from the robot's earlier answers). Both emit
the same tokens (checked). Per p and setting: frame time (median, p90), action Hz (Ha / median frame), tokens
per second, request latency in frames (arrival to last token, requests arriving in measured frames), tokens
per (slot, step), and the components: one decode step and one verify step at γ (all slots active) measured
alone, warm, with the ideal frame time the plain and speculative settings would take from them.
Compiles are timed apart (first frames of each engine); warm-up frames cover the plain ramp.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from oxygen_jax.cli import int_at_least
from oxygen_jax.models.pi05.config import oxygen_benchmark_robot
from oxygen_jax.models.pi05.model import as_vla, language_model, prefill
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from oxygen_jax.robots.transforms import make_observation, synthetic_sample
from oxygen_jax.runtime import decode, speculative
from oxygen_jax.runtime.engine import Engine, EngineConfig

_USUAL, _FRESH0 = 5, 10  # the usual prompt token; fresh prompts count up from here (never reused in a run)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval.bench.repeat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("tiny", "bench", "pi05"), default="tiny")
    ap.add_argument("--p", nargs="+", type=float, default=[0.0, 0.5, 0.9], help="repeat probabilities")
    ap.add_argument("--N", type=int_at_least(2), default=20, dest="decode_len", help="tokens per request")
    ap.add_argument("--k", type=int_at_least(1), default=5, help="decode (verify) steps per frame")
    ap.add_argument("--gamma", type=int_at_least(1), default=4, help="draft tokens per verify step")
    ap.add_argument("--S", type=int_at_least(1), default=10, dest="num_steps", help="denoise steps")
    ap.add_argument("--robots", type=int_at_least(1), default=1, help="batch rows; each opens a request per frame")
    ap.add_argument("--slots", type=int_at_least(1), default=None, help="decode slots (default: enough for plain)")
    ap.add_argument("--frames", type=int_at_least(1), default=20, help="measured frames per p")
    ap.add_argument("--warmup", type=int_at_least(0), default=None, help="warm-up frames (default: ceil(N/k) + 1)")
    ap.add_argument("--text-scale", type=float, default=20.0,
                    help="scale of the VLM expert's MLP output (attention out: half, q and k: 3); 0 = the random weights")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write repeat.json there")
    return ap


def _varied_text(params, scale: float):
    """Stacked π0.5 `Params` whose random VLM expert does not just echo its input token (see the docstring)."""
    layers = params.vlm.layers
    layers = dataclasses.replace(layers, q=layers.q * 3, kv=layers.kv.at[:, 0].multiply(3), linear=layers.linear * scale,
                                 out=layers.out * (scale / 2))
    return dataclasses.replace(params, vlm=dataclasses.replace(params.vlm, layers=layers))


def _components(params, obs, slots: int, m: int, gamma: int, repeats: int = 5) -> dict:
    """Warm medians of one decode step and one verify step at γ with every slot active, every slot drafting γ tokens."""
    lm, cache = language_model(params), prefill(params, obs)
    out = {}
    for name, speculate in (("decode_step_ms", 0), ("verify_step_ms", gamma)):
        times = []
        for _ in range(repeats + 1):
            pool = decode.init_pool(lm, slots, cache.length, m, 0, speculate=speculate)
            req = decode.make_requests(slots, 0, list(range(slots)), budgets=[m] * slots, stop_ids=[-1] * slots)
            pool, _, _ = decode.admit(lm, pool, cache, req)
            if speculate:  # every slot drafts γ tokens ("7 7 ..." after its token 0): the full [Ns, γ + 1] block
                ref = pool.draft_ref.at[:, 1:].set(7).at[:, 0].set(pool.tokens[:, 0])
                pool = dataclasses.replace(pool, draft_ref=ref)
            jax.block_until_ready(pool)
            start = time.perf_counter()
            burst = speculative.verify_burst if speculate else decode.decode_burst
            jax.block_until_ready(burst(lm, pool, 1))
            times.append((time.perf_counter() - start) * 1e3)
        out[name] = statistics.median(times[1:])
    return out


def _run_p(p: float, engines: dict[str, Engine], obs, args, rng, horizon: int, fresh) -> dict:
    warm = args.warmup if args.warmup is not None else math.ceil(args.decode_len / args.k) + 1
    total, drain = warm + args.frames, math.ceil(args.decode_len / args.k) + 1
    arrivals = [[[_USUAL] if rng.random() < p else [next(fresh)] for _ in range(args.robots)] for _ in range(total)]
    rows = list(range(args.robots))
    rec: dict[str, dict] = {name: {"frames": [], "requests": {}} for name in engines}
    for f in range(total + drain):
        order = list(engines) if f % 2 == 0 else list(reversed(engines))
        for name in order:
            eng, r = engines[name], rec[name]
            if f < total:
                for row, prompt in enumerate(arrivals[f]):
                    rid = eng.submit(prompt_tokens=prompt, max_tokens=args.decode_len, stop_ids=(), row=row)
                    r["requests"][rid] = {"arrival": f, "repeat": prompt == [_USUAL]}
            res = eng.step(obs, rows=rows)
            for done in res.finished:
                r["requests"][done.request_id].update(finish=res.frame, latency=done.latency_frames, tokens=done.tokens)
            if warm <= f < total:
                r["frames"].append({"ms": res.frame_ms, "tokens": sum(map(len, res.new_tokens.values())), "steps": res.steps,
                                    "tokens_per_step": res.tokens_per_step, "batch": res.batch})
    out = {}
    for name, r in rec.items():
        measured = [q for q in r["requests"].values() if warm <= q["arrival"] < total]
        done = [q for q in measured if "latency" in q]
        ms = [fr["ms"] for fr in r["frames"]]
        emitted = sum(fr["tokens"] for fr in r["frames"])
        tps = [fr["tokens_per_step"] for fr in r["frames"] if fr["steps"]]
        out[name] = {
            "frame_ms_median": statistics.median(ms), "frame_ms_p90": float(np.percentile(ms, 90)),
            "action_hz": horizon * 1e3 / statistics.median(ms),
            "tokens_per_s": emitted / (sum(ms) / 1e3), "requests": len(measured), "finished": len(done),
            "latency_frames_mean": statistics.mean(q["latency"] for q in done) if done else math.nan,
            "latency_frames_p90": float(np.percentile([q["latency"] for q in done], 90)) if done else math.nan,
            "tokens_per_step": statistics.mean(tps) if tps else math.nan,
            "repeat_share": statistics.mean(q["repeat"] for q in measured) if measured else math.nan,
        }
    same = all(rec["plain"]["requests"][i].get("tokens") == rec["speculative"]["requests"][i].get("tokens")
               for i in rec["plain"]["requests"])
    return {"p": p, "same_tokens": same, **out}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from oxygen_jax.ckpts import load

    from oxygen_jax.models.pi05.params import for_backend

    loaded = load.load_model(None, preset=args.preset, family="pi05", dtype=args.dtype, seed=args.seed, backend="gpu")
    params = for_backend(_varied_text(loaded.params, args.text_scale) if args.text_scale else loaded.params)
    robot = oxygen_benchmark_robot("libero")
    rng = np.random.default_rng(args.seed)
    samples = [synthetic_sample(robot, rng, image_size=224) for _ in range(args.robots)]
    obs = jax.device_put(make_observation(robot, loaded.config, train_demo_tokenizer(), samples))
    slots = args.slots or args.robots * (math.ceil((args.decode_len - 1) / args.k) + 1)
    vla = as_vla(params, args.num_steps)
    cfg = EngineConfig(num_slots=slots, max_new_tokens=args.decode_len, prompt_capacity=1,
                       admissions_per_frame=args.robots, tokens_per_frame=args.k, action_horizon=robot.action_horizon)
    engines = {"plain": Engine(vla, cfg), "speculative": Engine(vla, dataclasses.replace(cfg, speculate=args.gamma))}
    compile_s = {name: eng.warmup(obs) for name, eng in engines.items()}
    fresh = iter(range(_FRESH0, vla.vocab_size))  # the engines remember answers across p: a fresh prompt is new
    comp = _components(params, obs, slots, args.decode_len, args.gamma)
    results = []
    for p in args.p:
        res = _run_p(p, engines, obs, args, np.random.default_rng([args.seed, int(p * 1000)]), robot.action_horizon,
                     fresh)
        results.append(res)
        pl, sp = res["plain"], res["speculative"]
        print(f"p={p:g}: frame {pl['frame_ms_median']:.1f} / {sp['frame_ms_median']:.1f} ms, action Hz "
              f"{pl['action_hz']:.1f} / {sp['action_hz']:.1f}, tokens/s {pl['tokens_per_s']:.1f} / "
              f"{sp['tokens_per_s']:.1f}, latency {pl['latency_frames_mean']:.2f} / {sp['latency_frames_mean']:.2f} "
              f"frames, tokens per step {pl['tokens_per_step']:.2f} / {sp['tokens_per_step']:.2f} (plain / speculative)"
              f"{'' if res['same_tokens'] else '  TOKENS DIFFER'}", file=sys.stderr)
    record = {"preset": args.preset, "dtype": args.dtype, "text_scale": args.text_scale, "N": args.decode_len, "k": args.k, "gamma": args.gamma,
              "S": args.num_steps, "robots": args.robots, "slots": slots, "frames": args.frames,
              "backend": jax.default_backend(), "compile_s": compile_s, "components": comp,
              "loadavg": list(os.getloadavg()), "results": results}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "repeat.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"components": comp, "compile_s": compile_s}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
