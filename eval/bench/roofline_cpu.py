"""`python -m eval.bench.roofline_cpu`: XLA:CPU options against the bandwidth-bound components, values checked.

    python -m eval.bench.roofline_cpu --preset bench --out eval/results/roofline_cpu_flags
    python -m eval.bench.roofline_cpu --preset bench --layouts --out eval/results/roofline_cpu_layouts

Each configuration (`CONFIGS`: a set of XLA flags) runs in its own process (XLA reads its flags once, at
start), in rounds so that every configuration sees the machine's load drift alike. A process builds the model
(random weights, --seed), times the components that read their weights once per call (batch-1 denoise, decode
steps at Ns = 1 and 6) and the prefix pass (`eval.bench.roofline_measure`, warm medians), and hashes what they
compute: the prefix's K/V, the S-step actions and the decode step's logits. A configuration whose hashes differ
from the default's changes computed values and is reported as such (the runtime adopts none of those).

Output: flags.json (per configuration and round: component ms, hashes, machine load) and report.md (medians
over rounds, each as a ratio to the default's, the fraction of the bandwidth limit, and whether values are
bit-identical). `--layouts` instead times each projection of π0.5's layers as the model computes it against
the same product on weights stored in another layout (`layouts`), values compared bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

CONFIGS: dict[str, str] = {
    "default": "",
    "xnn_dot": "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "ynn_dot": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "onednn": "--xla_cpu_use_onednn=true",
    "eigen_one_thread": "--xla_cpu_multi_thread_eigen=false",
    "prefer_512": "--xla_cpu_prefer_vector_width=512",
}
"""Name -> XLA_FLAGS appended to the environment's (the XLA:CPU options of jaxlib 0.10.2 that pick a GEMM or GEMV
kernel, or its threading)."""

COMPONENTS = ("prefix", "step1:actions", "denoise:actions", "decode1", "decode6")
COPIES = ("copies:denoise step", "copies:decode step")


def _digest(*arrays) -> str:
    import numpy as np

    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    return h.hexdigest()[:16]


def child(args: argparse.Namespace) -> dict:
    """One configuration's measurement, in this process (XLA_FLAGS already set)."""
    import dataclasses

    import jax

    from eval.bench import roofline_cost as rc
    from eval.bench import roofline_measure as measure
    from eval.bench import roofline_peaks
    from oxygen_jax.ckpts import load
    from oxygen_jax.models import heads as hd
    from oxygen_jax.robots.config import oxygen_benchmark_robot
    from oxygen_jax.runtime import decode

    robot = oxygen_benchmark_robot("libero")
    vla = load.load_model(preset=args.preset, dtype="float32", seed=args.seed).vla(10)
    m, prec = rc.from_params(vla.spec, vla.params, args.preset), rc.Precision.of("float32")
    out = {"loadavg_start": list(os.getloadavg()), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    peaks = roofline_peaks.measure()
    digests, times, limits = {}, {}, {}
    for slots in (1, 6):
        plan = measure.Plan(cameras=robot.num_cameras, prompt_tokens=robot.max_token_len, image_size=rc.default_image_size(m),
                            horizon=robot.action_horizon, steps=10, slots=slots, max_new_tokens=40, tokens_per_frame=5,
                            gamma=0, repeats=args.repeats, seed=args.seed)
        plan = dataclasses.replace(plan, max_new_tokens=measure.needed_tokens(plan))
        inputs, noises, _ = measure.frame_inputs(vla, plan)
        factories, _ = measure.calls(vla, plan, inputs, noises, None)
        wanted = {"decode": f"decode{slots}"} if slots == 6 else {n: n for n in COMPONENTS[:3]} | {"decode": "decode1"}
        ms, _ = measure.measure({k: factories[k] for k in wanted}, plan.repeats)
        times |= {wanted[k]: v for k, v in ms.items()}
        p = measure.prefix_len(vla, inputs)
        cost = measure.costs(m, plan, p, prec)
        limits |= {wanted[k]: 1e3 * cost[k].limit_s(peaks.matmul_flops, peaks.bandwidth) for k in wanted}
        limits |= {f"{wanted[k]} bytes": cost[k].bytes for k in wanted}
        prefix = jax.jit(vla.prefix)(inputs)
        lm = vla.language()
        pool = measure.busy_pool(lm, prefix, slots, plan.max_new_tokens)
        _, _, logits = decode.decode_step(lm, pool)
        digests[f"decode{slots}_logits"] = _digest(logits)
        if slots == 1:
            h = vla.spec.heads[0]
            digests["prefix_kv"] = _digest(prefix.k, prefix.v)
            digests["actions"] = _digest(hd.sample(vla.params.heads[h.name], h, prefix, noises[h.name]))
    times |= _copy_times(vla, args.repeats)
    out |= {"ms": times, "limit_ms": limits, "peaks": peaks.to_json(), "digests": digests,
            "loadavg_end": list(os.getloadavg())}
    return out


TRANSPOSES = {"q": (1, 0, 2), "kv": (0, 1, 3, 2), "out": (1, 0, 2)}
"""What XLA:CPU (jaxlib 0.10.2) did to π0.5's attention weights on every call of a decode step or a denoise step
while the products were plain einsums (their compiled HLO before `nn.layers.project_heads` / `merge_heads`): it
copied q [N, D, H] to [D, N, H], k|v [2, K, D, H] to [2, K, H, D] and out [N, H, D] to [H, N, D] before the
products, inside the step loop. `_copy_times` still times those copies alone."""


def _copy_times(vla, repeats: int) -> dict[str, float]:
    """ms of exactly those copies of one step, alone: the action expert's (a denoise step) and the VLM expert's
    (a decode step)."""
    import jax
    import jax.numpy as jnp

    from eval.bench import roofline_measure as measure
    from oxygen_jax.nn.layers import Unstacked

    def leaves(layers):
        per_layer = layers.layers if isinstance(layers, Unstacked) else [layers]
        return [(getattr(lp, f), perm) for lp in per_layer for f, perm in TRANSPOSES.items()]

    out = {}
    for name, layers in (("copies:denoise step", vla.params.heads[vla.spec.heads[0].name].layers),
                         ("copies:decode step", vla.params.decoder.layers)):
        ws = leaves(layers)
        fn = jax.jit(lambda arrays, perms=tuple(p for _, p in ws): [jnp.transpose(a, p) + 0 for a, p in zip(arrays, perms)])
        arrays = [a for a, _ in ws]
        ms, _ = measure.measure({name: lambda: lambda: fn(arrays)}, repeats)
        out |= ms
    return out


def _projections(d: int, n: int, k: int, h: int, f: int) -> list[tuple[str, str, tuple, str, tuple, Callable | None]]:
    """(name, the product as one einsum, weight shape, the same product with the weight stored contraction-dim-minor,
    the permutation to that storage, the model's form on the stored weight when it is not that einsum) of a Gemma /
    Qwen decoder layer (`models.backbone._block`, `_mlp`; q, k|v and out through `nn.layers.project_heads` /
    `merge_heads` since issue 44 item 4, each returning the einsum's layout here)."""
    import jax.numpy as jnp

    from oxygen_jax.nn.layers import merge_heads, project_heads

    return [("q", "YD,NDH->YNH", (n, d, h), "YD,DNH->YNH", (1, 0, 2), project_heads),
            ("kv", "YD,2KDH->2YKH", (2, k, d, h), "YD,2KHD->2YKH", (0, 1, 3, 2),
             lambda x, w: jnp.moveaxis(project_heads(x, w), -3, 0)),
            ("out", "YNH,NHD->YD", (n, h, d), "YNH,HND->YD", (1, 0, 2), merge_heads),
            ("gating", "2YD,2DF->2YF", (2, d, f), "2YD,2FD->2YF", (0, 2, 1), None),
            ("linear", "YF,FD->YD", (f, d), "YF,DF->YD", (1, 0), None)]


def layouts(args: argparse.Namespace) -> list[dict]:
    """Each projection of the VLM expert's layers (decode rows 1 and 6) and the action expert's (denoise rows Ha =
    10) as the model computes it against the same product on weights stored in the layout XLA:CPU transposes
    them to (`TRANSPOSES`) or contraction-dim-minor: GB/s of weights over `depth` layers (random weights of the
    preset's shapes, so the set is larger than the caches), and whether the outputs are bit-identical."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eval.bench import roofline_measure as measure
    from oxygen_jax.models.pi05 import model as pi05_model
    from oxygen_jax.models.pi05.config import model_config

    spec = pi05_model.model_spec(model_config(args.preset))
    b, e = spec.backbone, spec.heads[0]
    rng = np.random.default_rng(args.seed)
    out = []
    for stack, dims, rows in (("VLM expert", (b.width, b.num_heads, b.num_kv_heads, b.head_dim, b.mlp_dim), (1, 6)),
                              ("action expert", (e.width, e.num_heads, e.num_kv_heads, e.head_dim, e.mlp_dim), (10,))):
        size = dict(zip("DNKHF", dims), **{"2": 2})
        for name, eq, shape, alt, perm, model_form in _projections(*dims):
            ws = [jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(b.depth)]
            alts = [jnp.transpose(w, perm).copy() for w in ws]
            for y in rows:
                x = jnp.asarray(rng.standard_normal(tuple(y if c == "Y" else size[c] for c in eq.split(",")[0]), np.float32))
                now = jax.jit(lambda x, ws, eq=eq: [jnp.einsum(eq, x, w) for w in ws])
                new = jax.jit(lambda x, ws, alt=alt: [jnp.einsum(alt, x, w) for w in ws])
                calls = {"now": lambda: (lambda: now(x, ws)), "alt": lambda: (lambda: new(x, alts))}
                if model_form is not None:
                    model = jax.jit(lambda x, ws, fn=model_form: [fn(x, w) for w in ws])
                    calls["model"] = lambda: (lambda: model(x, ws))
                ms, _ = measure.measure(calls, args.repeats)
                ref = np.stack([np.asarray(p) for p in now(x, ws)])
                same = np.array_equal(ref, np.stack([np.asarray(q) for q in new(x, alts)]))
                mb = 4 * np.prod(shape) * len(ws) / 1e6
                row = {"stack": stack, "projection": name, "rows": y, "einsum": eq, "stored": alt,
                       "gbs_now": mb / ms["now"], "gbs_stored": mb / ms["alt"], "bit_identical": same,
                       "loadavg": list(os.getloadavg())}
                if model_form is not None:
                    diff = np.abs(np.stack([np.asarray(q) for q in model(x, ws)]) - ref)
                    row |= {"gbs_model": mb / ms["model"], "model_max_rel": float(diff.max() / np.abs(ref).max())}
                out.append(row)
    return out


def _layouts_report(rows: list[dict]) -> str:
    lines = ["# Weight layouts: each projection as one einsum, as the model computes it, and on re-stored weights", "",
             "GB/s of weights (several layers, more than the caches), the three timed in the same rounds; the model's "
             "form (`project_heads` / `merge_heads` on the stored weight; – where the model's form is the einsum): its "
             "largest difference from the einsum relative to the largest output; values: the einsum and the re-stored "
             "product compared bit for bit.", "",
             "| stack | projection | rows | einsum | weight stored as | GB/s einsum | GB/s model | GB/s stored | "
             "model / einsum | stored / einsum | model's max rel. diff | values (stored) | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        model = r.get("gbs_model")
        cells = (f"{model:.1f} | ", f"{model / r['gbs_now']:.2f} | ", f"{r['model_max_rel']:.1e}") if model else ("– | ", "– | ", "–")
        lines.append(f"| {r['stack']} | {r['projection']} | {r['rows']} | `{r['einsum']}` | `{r['stored']}` | "
                     f"{r['gbs_now']:.1f} | {cells[0]}{r['gbs_stored']:.1f} | {cells[1]}{r['gbs_stored'] / r['gbs_now']:.2f} | "
                     f"{cells[2]} | {'bit-identical' if r['bit_identical'] else 'differ'} | {r['loadavg'][0]:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.bench.roofline_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench", choices=("tiny", "bench"))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=2, help="passes over the configurations (order reversed each pass)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per component in a process (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layouts", action="store_true", help="the weight-layout study instead (in this process)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.layouts:
        rows = layouts(args)
        (args.out / "layouts.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "report.md").write_text(_layouts_report(rows))
        print(_layouts_report(rows))
        return 0
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    base_flags = os.environ.get("XLA_FLAGS", "")
    for r in range(args.rounds):
        for name in (args.configs if r % 2 == 0 else args.configs[::-1]):
            env = dict(os.environ, XLA_FLAGS=f"{base_flags} {CONFIGS[name]}".strip())
            cmd = [sys.executable, "-m", "eval.bench.roofline_cpu", "--child", name, "--preset", args.preset,
                   "--repeats", str(args.repeats), "--seed", str(args.seed), "--out", str(args.out)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                errors = [ln for ln in (proc.stderr or proc.stdout).splitlines() if "Error" in ln.split(":")[0]]
                runs[name].append({"error": errors[-1:] or [f"exit code {proc.returncode}"]})
            else:
                runs[name].append(json.loads(line[len("RESULT "):]))
            print(f"round {r} {name}: {runs[name][-1].get('ms', runs[name][-1].get('error'))}", file=sys.stderr)
    (args.out / "flags.json").write_text(json.dumps({"preset": args.preset, "runs": runs}, indent=1) + "\n")
    (args.out / "report.md").write_text(_report(args, runs))
    return 0


def _report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> str:
    import numpy as np

    ok = {n: [r for r in rs if "ms" in r] for n, rs in runs.items()}
    base = ok.get("default") or []
    ref = base[0]["digests"] if base else {}
    med = {n: {c: float(np.median([r["ms"][c] for r in rs])) for c in COMPONENTS} for n, rs in ok.items() if rs}
    frac = {n: {c: float(np.median([r["limit_ms"][c] / r["ms"][c] for r in rs])) for c in COMPONENTS}
            for n, rs in ok.items() if rs}
    gbs = {n: {c: float(np.median([r["limit_ms"][f"{c} bytes"] / r["ms"][c] / 1e6 for r in rs])) for c in COMPONENTS}
           for n, rs in ok.items() if rs}
    lines = [f"# XLA:CPU options, {args.preset} preset, float32", "",
             f"{args.rounds} rounds over the configurations, {args.repeats} timed calls per component in each process; "
             "medians over rounds: ms, the ratio to the default's, the fraction of the roofline limit reached "
             "(limit / ms, from the peaks each process measured under its own flags) and the bytes streamed per "
             "second (GB/s).", "",
             "| configuration | XLA flags | " + " | ".join(COMPONENTS) + " | values | load (start of each run) | "
             "peaks: GFLOP/s, GB/s |", "|---|---|" + "---|" * len(COMPONENTS) + "---|---|---|"]
    for name, m in med.items():
        same = all(r["digests"] == ref for r in ok[name])
        loads = ", ".join(f"{r['loadavg_start'][0]:.1f}" for r in ok[name])
        ratio = lambda c: f" x{m[c] / med['default'][c]:.2f}" if "default" in med else ""  # noqa: E731
        cells = " | ".join(f"{m[c]:.1f}{ratio(c)}, {frac[name][c]:.2f}, {gbs[name][c]:.1f}" for c in COMPONENTS)
        pk = "; ".join(f"{r['peaks']['matmul_flops'] / 1e9:.0f}, {r['peaks']['bandwidth'] / 1e9:.1f}" for r in ok[name])
        lines.append(f"| {name} | `{CONFIGS[name] or '(none)'}` | {cells} | {'bit-identical' if same else 'DIFFER'} | "
                     f"{loads} | {pk} |")
    if base and all(c in base[0]["ms"] for c in COPIES):
        lines += ["", "The per-call weight copies XLA inserts (`TRANSPOSES`), timed alone (ms, median over the default's "
                  "rounds), against the step they belong to:", ""]
        for copy, step in zip(COPIES, ("step1:actions", "decode1")):
            c = float(np.median([r["ms"][copy] for r in base]))
            lines.append(f"- {copy}: {c:.1f} ms, {c / med['default'][step]:.0%} of `{step}` ({med['default'][step]:.1f} ms)")
    failed = {n: [r["error"] for r in rs if "error" in r] for n, rs in runs.items()}
    lines += [""] + [f"- {n} failed: {e}" for n, e in failed.items() if e]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
