"""`python -m eval.bench.repeat`: the `repeat` workload, speculative decoding beside plain continuous batching.

    python -m eval.bench.repeat --preset tiny --p 0 0.9 --frames 10 --out /tmp/repeat     # a smoke run
    python -m eval.bench.repeat --preset bench --p 0 0.5 0.9 --out eval/results/cpu_bench_repeat
    python -m eval.bench.repeat --preset bench --spec 4 4:5:1.66 9:5:2.5 --out DIR   # several budgets, one run

Each robot (a batch row of one LIBERO observation) opens a memory request every frame. With probability p
the request repeats the robot's usual prompt, whose greedy answer on the same observation is the answer it
gave last time (the robot's "The soup is in the basket."); otherwise it asks a prompt never seen before
(a fresh token), whose answer the robot has not given. Requests decode exactly N tokens (no stop id: random
weights), greedy. Random π0.5 weights answer a prompt token by repeating it (a tied head reads back the input
embedding), which any n-gram drafter predicts at every p; the VLM expert's attention and MLP outputs are
therefore scaled (`--text-scale`, as the tests' `diverse_text_params`) so that answers vary with the prompt and
the observation and do not repeat one token. Actions use the same scaled weights in both settings.

Several `Engine`s serve the same frames, interleaved frame by frame (order rotating) on the same observation,
noise and requests: continuous batching with k decode steps per frame, and one speculative engine per `--spec
γ[:k[:c]]` (`EngineConfig.speculate` = γ, a language budget of k decode-step equivalents per frame of which a
verify step with drafts costs c = `verify_cost`: c = 1 is k verify steps, c = 2.5 at k = 5 two verify steps or
five decode steps; drafts from the robot's earlier answers). All emit the same tokens (checked). Per p and
setting: frame time (median, p90), action Hz (Ha · frames / Σ frame time), tokens per second, request latency
in frames (arrival to last token, requests arriving in measured frames; repeated and fresh apart), tokens per
(slot, step), and the ideal frame from the components: the actions-only frame (prefix and denoise), one decode
step and one verify step per γ (every slot active and drafting γ tokens), measured alone, warm, interleaved
(median); a frame's verify steps are counted as min(steps, floor(k / c)) when some slot took more than one
token per step, else none (a verify step whose drafts were all rejected counts as a decode step).
Compiles are timed apart (first frames of each engine); warm-up frames cover the plain ramp.
`python -m eval.bench.repeat_report DIR` draws the plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
from oxygen_jax.robots.config import oxygen_benchmark_robot
from oxygen_jax.models.pi05.model import as_vla, language_model, prefill
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from oxygen_jax.robots.transforms import make_observation, synthetic_sample
from oxygen_jax.runtime import decode, frame, speculative
from oxygen_jax.runtime.engine import Engine, EngineConfig

_USUAL, _FRESH0 = 5, 10  # the usual prompt token; fresh prompts count up from here (never reused in a run)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval.bench.repeat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("tiny", "bench", "pi05"), default="tiny")
    ap.add_argument("--ckpt", type=Path, default=None, help="a π0.5 checkpoint folder instead of the preset's random weights")
    ap.add_argument("--p", nargs="+", type=float, default=[0.0, 0.5, 0.9], help="repeat probabilities")
    ap.add_argument("--N", type=int_at_least(2), default=20, dest="decode_len", help="tokens per request")
    ap.add_argument("--k", type=int_at_least(1), default=5, help="decode (verify) steps per frame")
    ap.add_argument("--spec", nargs="+", type=_spec, default=None, metavar="G[:K[:C[:NS]]]",
                    help="speculative settings: γ draft tokens, budget K (default --k), verify cost C (default 1), "
                         "slots NS (default: the plain engine's)")
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


@dataclasses.dataclass(frozen=True)
class _Spec:
    gamma: int  # draft tokens per verify step
    k: int | None  # the frame's language budget in decode steps (None: --k)
    cost: float  # decode steps a verify step with drafts is charged
    slots: int | None = None  # decode slots (None: --slots or the plain engine's)

    def name(self, k: int) -> str:
        return f"spec g{self.gamma} k{self.k or k} c{self.cost:g}" + (f" s{self.slots}" if self.slots else "")

    def component(self, slots: int) -> str:
        return f"verify_step_ms_g{self.gamma}" + (f"_s{self.slots}" if self.slots and self.slots != slots else "")


def _spec(text: str) -> _Spec:
    """'4', '4:5', '4:5:1.66' or '4:5:1.25:3' -> _Spec (γ >= 1, k >= 1, c >= 1, slots >= 1)."""
    parts = text.split(":")
    try:
        gamma, k, cost = int(parts[0]), int(parts[1]) if len(parts) > 1 else None, float(parts[2]) if len(parts) > 2 else 1.0
        slots = int(parts[3]) if len(parts) > 3 else None
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"--spec wants G[:K[:C[:NS]]] (e.g. 4 or 9:5:2.5), got {text!r}") from None
    if len(parts) > 4 or gamma < 1 or (k is not None and k < 1) or cost < 1 or (slots is not None and slots < 1):
        raise argparse.ArgumentTypeError(f"--spec wants γ >= 1, K >= 1, C >= 1, NS >= 1 in G[:K[:C[:NS]]], got {text!r}")
    return _Spec(gamma, k, cost, slots)


def _varied_text(params, scale: float):
    """Stacked π0.5 `Params` whose random VLM expert does not just echo its input token (see the docstring)."""
    layers = params.vlm.layers
    layers = dataclasses.replace(layers, q=layers.q * 3, kv=layers.kv.at[:, 0].multiply(3), linear=layers.linear * scale,
                                 out=layers.out * (scale / 2))
    return dataclasses.replace(params, vlm=dataclasses.replace(params.vlm, layers=layers))


def _components(vla, params, obs, slots: int, m: int, specs, horizon: int, repeats: int = 5) -> dict:
    """Warm medians (ms), measured interleaved: the actions-only frame (prefix and denoise), one decode step, and
    one verify step per γ with every slot active and drafting γ tokens (the full [Ns, γ + 1] block)."""
    lm, cache = language_model(params), prefill(params, obs)
    noise = {n: jax.random.normal(jax.random.key(0), (1, *vla.action_shape(n, horizon))) for n in vla.heads}

    def pool_for(speculate, ns=slots):
        pool = decode.init_pool(lm, ns, cache.length, m, 0, speculate=speculate)
        req = decode.make_requests(ns, 0, list(range(ns)), budgets=[m] * ns, stop_ids=[-1] * ns)
        pool, _, _ = decode.admit(lm, pool, cache, req)
        if speculate:  # every slot drafts γ tokens ("7 7 ..." after its token 0)
            pool = dataclasses.replace(pool, draft_ref=pool.draft_ref.at[:, 1:].set(7).at[:, 0].set(pool.tokens[:, 0]))
        return jax.block_until_ready(pool)

    calls = {"actions_frame_ms": lambda: (lambda: frame.actions_program(vla, obs, noise)),
             "decode_step_ms": lambda: functools.partial(decode.decode_burst, lm, pool_for(0), 1)}
    for s in specs:
        calls[s.component(slots)] = lambda s=s: functools.partial(speculative.verify_burst, lm,
                                                                  pool_for(s.gamma, s.slots or slots), 1)
    times = {name: [] for name in calls}
    for r in range(repeats + 1):  # round 0 compiles
        for name in (list(calls) if r % 2 else list(reversed(calls))):
            call = calls[name]()
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts[1:]) for name, ts in times.items()}


def _ideal_ms(frames: list[dict], comp: dict, spec: _Spec | None, k: int, slots: int) -> float:
    """Mean ideal frame (ms) from the components and each frame's steps (see the module docstring)."""
    total = 0.0
    for fr in frames:
        verify = 0
        if spec is not None and fr["steps"] and fr["tokens_per_step"] > 1:
            verify = min(fr["steps"], int((spec.k or k) / spec.cost + 1e-4))
        step_ms = comp[spec.component(slots)] if spec is not None else 0.0
        total += comp["actions_frame_ms"] + verify * step_ms + (fr["steps"] - verify) * comp["decode_step_ms"]
    return total / len(frames)


def _run_p(p: float, engines: dict[str, Engine], specs: dict[str, _Spec], comp: dict, obs, args, rng, horizon: int,
           fresh) -> dict:
    warm = args.warmup if args.warmup is not None else math.ceil(args.decode_len / args.k) + 1
    total, drain = warm + args.frames, math.ceil(args.decode_len / args.k) + 1
    arrivals = [[[_USUAL] if rng.random() < p else [next(fresh)] for _ in range(args.robots)] for _ in range(total)]
    rows = list(range(args.robots))
    rec: dict[str, dict] = {name: {"frames": [], "requests": {}} for name in engines}
    names = list(engines)
    for f in range(total + drain):
        order = names[f % len(names):] + names[:f % len(names)]
        order = order if f % 2 == 0 else order[::-1]
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
    mean = lambda xs: statistics.mean(xs) if xs else math.nan  # noqa: E731
    for name, r in rec.items():
        measured = [q for q in r["requests"].values() if warm <= q["arrival"] < total]
        done = [q for q in measured if "latency" in q]
        ms = [fr["ms"] for fr in r["frames"]]
        emitted = sum(fr["tokens"] for fr in r["frames"])
        stepped = [fr for fr in r["frames"] if fr["steps"]]
        out[name] = {
            "frame_ms_median": statistics.median(ms), "frame_ms_p90": float(np.percentile(ms, 90)),
            "frame_ms_mean": statistics.mean(ms), "action_hz": horizon * len(ms) * 1e3 / sum(ms),
            "tokens_per_s": emitted / (sum(ms) / 1e3), "requests": len(measured), "finished": len(done),
            "latency_frames_mean": mean([q["latency"] for q in done]),
            "latency_frames_p90": float(np.percentile([q["latency"] for q in done], 90)) if done else math.nan,
            "latency_repeat_mean": mean([q["latency"] for q in done if q["repeat"]]),
            "latency_fresh_mean": mean([q["latency"] for q in done if not q["repeat"]]),
            "tokens_per_step": mean([fr["tokens_per_step"] for fr in stepped]),
            "steps_per_frame": mean([fr["steps"] for fr in r["frames"]]),
            "ideal_frame_ms": _ideal_ms(r["frames"], comp, specs.get(name), args.k, engines["plain"].config.num_slots),
            "repeat_share": mean([q["repeat"] for q in measured]),
        }
    plain = rec["plain"]["requests"]  # requests left unfinished (a queue behind fewer slots) are not compared
    both = [(i, n) for n in rec for i in plain if "tokens" in plain[i] and "tokens" in rec[n]["requests"][i]]
    same = all(plain[i]["tokens"] == rec[n]["requests"][i]["tokens"] for i, n in both)
    unfinished = {n: sum("tokens" not in q for q in r["requests"].values()) for n, r in rec.items()}
    return {"p": p, "same_tokens": same, "compared": len(both), "unfinished": unfinished, **out}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from oxygen_jax.ckpts import load

    from oxygen_jax.models.pi05.params import for_backend

    loaded = load.load_model(args.ckpt, preset=None if args.ckpt else args.preset, family="pi05", dtype=args.dtype, seed=args.seed, backend="gpu")
    params = for_backend(_varied_text(loaded.params, args.text_scale) if args.text_scale else loaded.params)
    robot = oxygen_benchmark_robot("libero")
    rng = np.random.default_rng(args.seed)
    samples = [synthetic_sample(robot, rng, image_size=224) for _ in range(args.robots)]
    obs = jax.device_put(make_observation(robot, loaded.config, train_demo_tokenizer(), samples))
    slots = args.slots or args.robots * (math.ceil((args.decode_len - 1) / args.k) + 1)
    vla = as_vla(params, args.num_steps)
    cfg = EngineConfig(num_slots=slots, max_new_tokens=args.decode_len, prompt_capacity=1,
                       admissions_per_frame=args.robots, tokens_per_frame=args.k, action_horizon=robot.action_horizon)
    specs = {s.name(args.k): s for s in (args.spec or [_Spec(4, None, 1.0)])}
    engines = {"plain": Engine(vla, cfg)}
    for name, s in specs.items():
        engines[name] = Engine(vla, dataclasses.replace(cfg, speculate=s.gamma, tokens_per_frame=s.k or args.k,
                                                        verify_cost=s.cost, num_slots=s.slots or slots))
    load_start = list(os.getloadavg())
    compile_s = {name: eng.warmup(obs) for name, eng in engines.items()}
    fresh = iter(range(_FRESH0, vla.vocab_size))  # the engines remember answers across p: a fresh prompt is new
    unique = {s.component(slots): s for s in specs.values()}  # one verify component per (γ, slots)
    comp = _components(vla, params, obs, slots, args.decode_len, list(unique.values()),
                       robot.action_horizon)
    print(f"components (ms): {json.dumps({k: round(v, 1) for k, v in comp.items()})}", file=sys.stderr)
    results = []
    for p in args.p:
        res = _run_p(p, engines, specs, comp, obs, args, np.random.default_rng([args.seed, int(p * 1000)]),
                     robot.action_horizon, fresh)
        res["loadavg"] = list(os.getloadavg())
        results.append(res)
        for name in engines:
            r = res[name]
            print(f"p={p:g} {name:>16}: frame {r['frame_ms_median']:.0f} ms (ideal {r['ideal_frame_ms']:.0f}), action Hz "
                  f"{r['action_hz']:.2f}, tokens/s {r['tokens_per_s']:.1f}, latency {r['latency_frames_mean']:.2f} frames, "
                  f"tokens per step {r['tokens_per_step']:.2f}", file=sys.stderr)
        print(f"p={p:g}: {'same tokens' if res['same_tokens'] else 'TOKENS DIFFER'}, load {res['loadavg'][0]:.1f}",
              file=sys.stderr)
    record = {"preset": args.preset, "dtype": args.dtype, "text_scale": args.text_scale, "N": args.decode_len, "k": args.k,
              "specs": {name: dataclasses.asdict(s) for name, s in specs.items()},
              "S": args.num_steps, "robots": args.robots, "slots": slots, "frames": args.frames,
              "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "compile_s": compile_s,
              "components": comp, "loadavg_start": load_start, "loadavg": list(os.getloadavg()),
              "command": "python -m eval.bench.repeat " + " ".join(sys.argv[1:] if argv is None else argv),
              "results": results}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "repeat.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"components": comp, "compile_s": compile_s, "same_tokens": all(r["same_tokens"] for r in results)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
