"""The cost of quantized weights (`python -m oxygen_jax.quantize`): actions, text, bytes, memory, CPU time.

    python -m eval.quant cost --out eval/results/quant_cost
    python -m eval.quant memory --ckpt /tmp/full/ckpt --out eval/results/quant_memory_pi05

`cost`: for each source (the embedded demo with its held-out frames and memory adapter; each public openpi
fixture found in ../shared/fixtures, with random observations) and each setting (int8 / fp8, all layer
weights or the MLPs only), against the same source in float32, same observations and noise:

* actions: max and mean |Δ| over every action chunk (10 denoising steps), relative to the action scale,
  the RMS of the float32 actions;
* text: teacher-forced greedy tokens after every prompt position identical to float32's (fraction); for the
  demo also greedy answers through the slot pool (`Engine`): the memory adapter's answers (exact match
  against the true labels, and tokens identical to float32's with the first divergence) and the base
  model's "Scene: " answers (tokens identical, first divergence);
* weight bytes against float32 and bfloat16;
* for the demo, the CPU frame time of the README's loop (one frame with one memory request), the median of
  interleaved frames, as a ratio to float32 in the same run (compile time apart). XLA's CPU backend has no
  int8 or fp8 matmul: a quantized layer is dequantized and run in float32, so expect no speed-up here.

`memory`: the full-size π0.5 (the `pi05` preset's shapes, a random openpi-layout checkpoint written as
`eval.restore_memory` does, float32 on disk) quantized to int8 and fp8 (all layer weights), then in a fresh
process per (checkpoint, dtype): peak and settled resident memory while `load_model` restores it (the
`run` / `serve` path) and its weight bytes.

Writes OUT/summary.json, OUT/report.md and OUT/quant.png.
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

import numpy as np

from eval.restore_memory import REPO, PeakRss, rss_mib
from eval.restore_memory import _run_frames as run_frames  # the README's loop, as restore_memory measures it
from oxygen_jax.cli import OneLineParser

SETTINGS = (("int8", ("attn", "mlp")), ("int8", ("mlp",)), ("fp8", ("attn", "mlp")), ("fp8", ("mlp",)))
FIXTURES = ("openpi_tiny_pi05", "openpi_tiny_pi0")


def _name(weights: str, kinds) -> str:
    return f"{weights} {'+'.join(kinds)}"


def action_error(ref: np.ndarray, out: np.ndarray) -> dict:
    """max / mean |out - ref| relative to the action scale, the RMS of `ref` (float32 actions [..., Ha, Ad])."""
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    scale = float(np.sqrt(np.mean(ref ** 2)))
    err = np.abs(out - ref) / scale
    return {"action_scale": scale, "max_rel": float(err.max()), "mean_rel": float(err.mean())}


def token_agreement(ref: list[list[int]], out: list[list[int]]) -> dict:
    """Greedy answers against float32's: the share identical, and the first divergence of each that is not."""
    firsts = []
    for a, b in zip(ref, out):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        firsts.append(n if n is not None else (None if len(a) == len(b) else min(len(a), len(b))))
    return {"identical": sum(f is None for f in firsts) / len(firsts), "first_divergence": firsts}


# --------------------------------------------------------------------------------------------------
# cost


def _random_observation(config, batch: int, seed: int):
    import jax.numpy as jnp

    from oxygen_jax.models.observation import Observation

    rng = np.random.default_rng(seed)
    s, t = config.siglip.image_size, 16
    tokens = rng.integers(3, config.vocab_size, (batch, t)).astype(np.int32)
    tokens[:, 0] = 2
    tokens[:, t - 3:] = 0  # padding
    return Observation(images=jnp.asarray(rng.uniform(-1, 1, (batch, 2, s, s, 3)), jnp.float32),
                       image_masks=jnp.ones((batch, 2), bool), tokens=jnp.asarray(tokens),
                       token_mask=jnp.asarray(tokens > 0))


def _programs():
    import jax
    import jax.numpy as jnp

    from oxygen_jax.models.pi05 import model

    @jax.jit
    def run(params, obs, noise, state):
        out = model.prefix_forward(params, obs)
        tokens = jnp.argmax(model.lm_logits(params, model.final_norm(params, out["hidden"])), -1)
        state = state if params.config.variant == "pi0" else None
        return model.sample_actions(params, obs, noise, 10, state), tokens

    return run


def _compare(run, float_params, variants, obs, seed: int) -> dict:
    """Actions and teacher-forced tokens of each quantized variant against float32 (same inputs)."""
    import jax

    b = obs.tokens.shape[0]
    cfg = float_params.config
    noise = jax.random.normal(jax.random.key(seed), (b, 10, cfg.action_dim))
    state = jax.random.normal(jax.random.key(seed + 1), (b, cfg.action_dim))
    ref_a, ref_t = map(np.asarray, run(float_params, obs, noise, state))
    mask = np.asarray(obs.token_mask)
    out = {}
    for name, params in variants.items():
        a, t = map(np.asarray, run(params, obs, noise, state))
        out[name] = action_error(ref_a, a) | {
            "tokens_teacher_forced": float((t[:, -mask.shape[1]:] == ref_t[:, -mask.shape[1]:])[mask].mean())}
    return out


def _variants(params, settings=SETTINGS):
    from oxygen_jax.nn import quant

    return {_name(w, k): quant.quantize_tree(params, w, k) for w, k in settings}


def served_bytes(params, itemsize: int) -> int:
    """Weight bytes when served with float leaves and scales in `itemsize` bytes (4 float32, 2 bfloat16)."""
    import jax

    from oxygen_jax.nn import quant

    total = 0
    for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quant.QArray)):
        if isinstance(x, quant.QArray):
            total += int(np.prod(x.shape)) + int(np.prod(x.scale.shape)) * itemsize
        else:
            total += int(np.prod(x.shape)) * itemsize
    return total


def _bytes(float_params, variants) -> dict:
    out = {"float32": {"float32_bytes": served_bytes(float_params, 4), "bfloat16_bytes": served_bytes(float_params, 2)}}
    for name, p in variants.items():
        out[name] = {"float32_bytes": served_bytes(p, 4), "bfloat16_bytes": served_bytes(p, 2)}
    for rec in out.values():
        rec["vs_float32"] = rec["float32_bytes"] / out["float32"]["float32_bytes"]
        rec["vs_bfloat16"] = rec["bfloat16_bytes"] / out["float32"]["bfloat16_bytes"]
    return out


def _demo_text_and_time(demo, variants: dict, frames_timed: int) -> dict:
    """Greedy memory and scene answers through the Engine per frame, and interleaved frame times."""
    import jax

    from oxygen_jax.models.pi05.model import as_vla
    from oxygen_jax.models.pi05.params import for_backend
    from oxygen_jax.runtime.engine import Engine, EngineConfig
    from oxygen_jax.robots.transforms import make_observation

    samples = demo.samples()
    observations = [make_observation(demo.robot, demo.config, demo.tokenizer, [s]) for s in samples]
    cfg = EngineConfig(num_slots=2, max_new_tokens=demo.max_new_tokens, prompt_capacity=8, tokens_per_frame=4)
    engines = {name: Engine(as_vla(for_backend(p, "cpu")), cfg, tokenizer=demo.tokenizer, bank=demo.bank,
                            adapter_names=demo.adapter_names) for name, p in variants.items()}

    def answer(engine, obs, prompt, adapter):
        engine.submit(prompt=prompt, adapter=adapter, max_tokens=demo.max_new_tokens)
        for _ in range(40):
            done = engine.step(obs).finished
            if done:
                return done[0]
        raise RuntimeError("a demo request did not finish in 40 frames")

    out = {}
    for name, engine in engines.items():
        t0 = time.perf_counter()
        mem = [answer(engine, o, demo.prompt, demo.adapter_names[0]) for o in observations]
        scene = [answer(engine, o, "Scene: ", "base") for o in observations]
        out[name] = {"memory": [r.tokens for r in mem], "memory_text": [r.text for r in mem],
                     "scene": [r.tokens for r in scene], "answer_s": time.perf_counter() - t0}
    times = {name: [] for name in engines}
    names = list(engines)
    for i in range(frames_timed + 1):  # interleaved in rotating order, one memory request each; frame 0 is warm-up
        for name in names[i % len(names):] + names[:i % len(names)]:
            engine = engines[name]
            engine.submit(prompt=demo.prompt, adapter=demo.adapter_names[0], max_tokens=demo.max_new_tokens)
            t0 = time.perf_counter()
            jax.block_until_ready(engine.step(observations[i % len(observations)]).actions)
            if i:
                times[name].append(time.perf_counter() - t0)
    for name in engines:
        out[name]["frame_ms"] = 1e3 * float(np.median(times[name]))
    return out


def run_cost(frames_timed: int) -> dict:
    import jax

    from oxygen_jax.ckpts.load import load_model
    from oxygen_jax.demo import load_demo, normalize_answer
    from oxygen_jax.models.pi05.params import stack_layers
    from oxygen_jax.robots.transforms import make_observation

    run = _programs()
    sources = {}
    demo = load_demo()
    params = stack_layers(demo.params)
    variants = _variants(params)
    obs = make_observation(demo.robot, demo.config, demo.tokenizer, demo.samples())
    rec = {"what": "embedded demo (trained base, held-out frames)", "frames": len(demo.frames),
           "settings": _compare(run, params, variants, jax.tree.map(jax.numpy.asarray, obs), 0),
           "bytes": _bytes(params, variants)}
    text = _demo_text_and_time(demo, {"float32": params} | variants, frames_timed)
    labels = [normalize_answer(f["memory"]) for f in demo.frames]
    base = text["float32"]
    rec["float32"] = {"memory_exact_match": sum(normalize_answer(t or "") == y for t, y in zip(base["memory_text"], labels)),
                      "frame_ms": base["frame_ms"]}
    for name in variants:
        t = text[name]
        rec["settings"][name] |= {
            "memory_exact_match": sum(normalize_answer(a or "") == y for a, y in zip(t["memory_text"], labels)),
            "memory_tokens": token_agreement(base["memory"], t["memory"]),
            "scene_tokens": token_agreement(base["scene"], t["scene"]),
            "frame_ms": t["frame_ms"], "frame_ratio": t["frame_ms"] / base["frame_ms"]}
    sources["demo"] = rec
    shared = REPO.parent / "shared" / "fixtures"
    for fx in FIXTURES:
        path = shared / fx
        if not path.is_dir():
            sources[fx] = {"what": f"{fx}: not found ({shared} absent)"}
            continue
        model = load_model(path, family="pi05", dtype="float32", backend="gpu")  # stacked
        variants = _variants(model.params)
        obs = _random_observation(model.config, batch=4, seed=0)
        sources[fx] = {"what": f"{fx} (random observations, {model.config.variant})",
                       "settings": _compare(run, model.params, variants, obs, 0),
                       "bytes": _bytes(model.params, variants)}
    return sources


# --------------------------------------------------------------------------------------------------
# memory


def measure_load(path: str, dtype: str, frames: int = 0) -> dict:
    """In this (fresh) process: peak and settled RSS above the baseline while `load_model` restores `path`; then
    `frames` steps of the README's robot loop on it (`eval.restore_memory`'s: peak RSS, first and steady step)."""
    import jax
    import jax.numpy as jnp

    from oxygen_jax.ckpts.load import load_model
    from oxygen_jax.nn import quant

    jnp.zeros(4).block_until_ready()
    base = rss_mib()
    with PeakRss() as peak:
        t0 = time.perf_counter()
        model = load_model(path, family="pi05", dtype=dtype, backend="cpu")
        jax.block_until_ready(model.params)
        load_s = time.perf_counter() - t0
    rec = {"path": path, "dtype": dtype, "weights_mib": quant.weight_bytes(model.params) / 2**20, "load_s": load_s,
           "load_peak_mib": peak.peak - base, "after_load_mib": rss_mib() - base}
    if frames:
        rec |= run_frames(model.config, model.params, frames)
        rec["frames_peak_mib"] -= base
    return rec


def _child(args: list[str]) -> str:
    run = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    if run.returncode:
        tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(args[:4])} failed (exit {run.returncode}):\n{tail}")
    return run.stdout.strip().splitlines()[-1]


def run_memory(ckpt: Path, preset: str) -> list[dict]:
    if not (ckpt / "params").exists():
        _child(["-m", "eval.restore_memory", "--preset", preset, "--write", str(ckpt)])
    records = [json.loads(_child(["-m", "eval.quant", "--measure", str(ckpt), dtype])) for dtype in ("float32", "bfloat16")]
    for weights in ("int8", "fp8"):
        dest = ckpt.parent / f"{ckpt.name}_{weights}"
        if not dest.exists():
            t0 = time.perf_counter()
            _child(["-m", "oxygen_jax.quantize", "--ckpt", str(ckpt), "--out", str(dest), "--weights", weights])
            quantize_s = time.perf_counter() - t0
        else:
            quantize_s = None
        for dtype in ("float32", "bfloat16"):
            records.append(json.loads(_child(["-m", "eval.quant", "--measure", str(dest), dtype]))
                           | {"weights": weights, "quantize_s": quantize_s})
    return records


# --------------------------------------------------------------------------------------------------
# report


def _f(x, spec=".3f") -> str:
    return "–" if x is None else format(x, spec)


def report(summary: dict) -> str:
    env = summary["environment"]
    lines = ["# Quantized weights: measured cost", "", f"`{env['command']}`; {env['timestamp']} UTC, {env['platform']}, "
             f"{env['cpu_count']} CPUs, load average {env['load_average']}.", ""]
    for src, rec in summary.get("cost", {}).items():
        lines += [f"## {src}: {rec['what']}", ""]
        if "settings" not in rec:
            continue
        demo = "memory_exact_match" in next(iter(rec["settings"].values()))
        head = "| setting | actions max / scale | mean / scale | teacher-forced tokens | bytes, bf16 serving / bf16 |"
        if demo:
            head += " memory exact (of {n}) | memory tokens identical | scene tokens identical | frame ms | vs float32 |"
            head = head.format(n=rec["frames"])
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        if demo:
            f = rec["float32"]
            lines.append(f"| float32 | 0 | 0 | 1.000 | 1.00 | {f['memory_exact_match']} | 1.00 | 1.00 | {f['frame_ms']:.1f} | 1.00 |")
        for name, s in rec["settings"].items():
            row = (f"| {name} | {s['max_rel']:.4f} | {s['mean_rel']:.4f} | {s['tokens_teacher_forced']:.3f} | "
                   f"{rec['bytes'][name]['vs_bfloat16']:.2f} |")
            if demo:
                row += (f" {s['memory_exact_match']} | {s['memory_tokens']['identical']:.2f} | "
                        f"{s['scene_tokens']['identical']:.2f} | {s['frame_ms']:.1f} | {s['frame_ratio']:.2f} |")
            lines.append(row)
        lines.append("")
    mem = summary.get("memory")
    if mem:
        ref = {r["dtype"]: r for r in mem if "weights" not in r}
        lines += ["## Full size: restore memory (`load_model`, the run / serve path)", "",
                  "Peak resident memory above the process baseline while `load_model` restores the checkpoint in a fresh "
                  "process; ratios against the float source restored in the same dtype, and against it in bfloat16.", "",
                  "| checkpoint | dtype | weights MiB | load s | load peak MiB | after load MiB | peak / same dtype float | "
                  "peak / bfloat16 float | quantize s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mem:
            same, bf16 = ref.get(r["dtype"], {}).get("load_peak_mib"), ref.get("bfloat16", {}).get("load_peak_mib")
            lines.append(f"| {r.get('weights', 'float32 (source)')} | {r['dtype']} | {r['weights_mib']:.0f} | "
                         f"{r['load_s']:.1f} | {r['load_peak_mib']:.0f} | {r['after_load_mib']:.0f} | "
                         f"{_f(same and r['load_peak_mib'] / same, '.3f')} | {_f(bf16 and r['load_peak_mib'] / bf16, '.3f')} | "
                         f"{_f(r.get('quantize_s'), '.0f')} |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    """quant.png: per source, the actions' mean error and the teacher-forced token agreement per setting, and the
    weight bytes served in bfloat16 (cost); the full-size restore's peak and weights (memory)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost = {k: v for k, v in summary.get("cost", {}).items() if "settings" in v}
    mem = summary.get("memory") or []
    fig, axes = plt.subplots(1, 3 * bool(cost) + bool(mem), figsize=(5 * (3 * bool(cost) + bool(mem)), 4), squeeze=False)
    axes = list(axes[0])
    if cost:
        names = [_name(w, k) for w, k in SETTINGS]
        x = np.arange(len(names))
        width = 0.8 / len(cost)
        panels = (("mean_rel", "actions: mean |Δ| / action RMS (vs float32)"),
                  ("tokens_teacher_forced", "teacher-forced greedy tokens = float32's"),
                  ("bytes", "weight bytes served in bfloat16 / bfloat16"))
        for ax, (key, title) in zip(axes, panels):
            for i, (src, rec) in enumerate(cost.items()):
                vals = [rec["bytes"][n]["vs_bfloat16"] if key == "bytes" else rec["settings"][n][key] for n in names]
                ax.bar(x + i * width, vals, width, label=src)
            ax.set_title(title, fontsize=10)
            ax.set_xticks(x + width * (len(cost) - 1) / 2, names, rotation=15, fontsize=8)
            ax.legend(fontsize=7)
    if mem:
        ax = axes[-1]
        labels = [f"{r.get('weights', 'float')}\n{r['dtype']}" for r in mem]
        ax.bar(range(len(mem)), [r["load_peak_mib"] / 1024 for r in mem], label="load peak")
        ax.bar(range(len(mem)), [r["weights_mib"] / 1024 for r in mem], alpha=0.6, label="weights")
        ax.set_xticks(range(len(mem)), labels, fontsize=8)
        ax.set_title("full-size π0.5: GiB resident (load_model)", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m eval.quant", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=("cost", "memory"), default="cost")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--frames", type=int, default=8, help="cost: timed demo frames per setting (interleaved)")
    ap.add_argument("--ckpt", type=Path, default=None, help="memory: the random full-size checkpoint (written if "
                    "absent; its quantized copies go beside it as CKPT_int8, CKPT_fp8)")
    ap.add_argument("--preset", default="pi05", choices=("tiny", "bench", "pi05"), help="memory: the model size")
    ap.add_argument("--frames-after", type=int, default=0, help="with --measure: robot-loop steps after loading")
    ap.add_argument("--measure", nargs=2, metavar=("CKPT", "DTYPE"), help=argparse.SUPPRESS)  # the child processes
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_load(*args.measure, frames=args.frames_after)), flush=True)
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    summary = {"environment": {
        "command": " ".join(["python", "-m", "eval.quant", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}}
    if args.what == "cost":
        summary["cost"] = run_cost(args.frames)
    else:
        ckpt = args.ckpt or Path(tempfile.mkdtemp(prefix="oxygen-quant-")) / "ckpt"
        summary["memory"] = run_memory(ckpt, args.preset)
        summary["environment"]["preset"] = args.preset
    summary["environment"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "report.md").write_text(report(summary) + "\n")
    plot(summary, args.out / "quant.png")
    print(report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
