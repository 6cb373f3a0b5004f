"""Time of each matmul mode of quantized weights (`--quant-matmul`), side by side in one run.

    python -m eval.quant_matmul --preset bench --out eval/results/quant_cost/matmul_cpu
    python -m eval.quant_matmul --ckpt QDIR --dtype bfloat16 --batches 1 6 64 --out DIR     # a GPU (device_check.sh)

The π0.5 of `--preset` (random weights, quantized here to int8 and to fp8, attention + MLP + adaptive norms) or
of `--ckpt` (a quantized checkpoint, `python -m oxygen_jax.quantize`), run through the model the runtime drives
(`as_vla`): float (the same weights dequantized, or the preset's own), each weight dtype's weight-only and
dynamic-range modes (`nn.quant.with_matmul`; a mode the device lacks, `nn.quant.native_dots`, is left out
unless `--all-modes`). Three programs per variant and batch size B: the prefix pass, the action chunk (10
denoising steps) on that prefix, and one decode step (one token per row through the language decoder and the
LM head). Each is compiled first (compile time apart), then the variants run in rotating order, `--repeats`
rounds, `block_until_ready`; medians and ratios to float in the same run.

Output: DIR/summary.json and DIR/report.md.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from oxygen_jax.cli import OneLineParser, int_at_least

_PROGRAMS = ("prefix", "actions", "decode")


def _variants(args) -> tuple[dict, str]:
    """{name: π0.5 params}, and what the weights are."""
    import jax

    from oxygen_jax.ckpts.load import load_model
    from oxygen_jax.models.pi05.config import model_config
    from oxygen_jax.models.pi05.params import for_backend, init_params, stack_layers
    from oxygen_jax.nn import quant

    dev = quant.device_info(jax.devices()[0])
    dots = quant.native_dots(dev)
    if args.ckpt is not None:
        params = stack_layers(load_model(args.ckpt, family="pi05", dtype=args.dtype, backend="gpu").params)
        weights = quant.quantized_weights(params)
        if weights is None:
            raise ValueError(f"--ckpt {args.ckpt} holds no quantized weights (python -m oxygen_jax.quantize makes them)")
        floats, quantized, what = quant.dequantize_tree(params), {weights: params}, f"checkpoint {args.ckpt}"
    else:
        floats = init_params(model_config(args.preset, dtype=args.dtype), 0)
        quantized = {w: quant.quantize_tree(floats, w) for w in ("int8", "fp8")}
        what = f"random '{args.preset}' weights"
    out = {"float": floats}
    for w, q in quantized.items():
        out[f"{w} weight_only"] = q
        if w in dots and (dots[w] == "native" or args.all_modes):
            out[f"{w} {w}"] = quant.with_matmul(q, w)
    return {n: for_backend(p) for n, p in out.items()}, what


def _programs():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def prefix(vla, obs):
        return vla.prefix(obs)

    @jax.jit
    def actions(vla, pre, noises):
        return vla.actions(pre, noises, {})

    @jax.jit
    def decode(vla, pre, token):
        lm = vla.language()
        b = token.shape[0]
        _, _, hidden = lm.suffix_forward(pre, jnp.arange(b), token)
        return jnp.argmax(lm.logits_vocab_major(lm.final_norm(hidden.reshape(b, -1))), 0)

    return {"prefix": prefix, "actions": actions, "decode": decode}


def run(args) -> dict:
    import jax

    from eval.quant import _vla_inputs
    from oxygen_jax.models.pi05.model import as_vla

    params, what = _variants(args)
    programs, rng = _programs(), np.random.default_rng(0)
    vlas = {n: as_vla(p, 10) for n, p in params.items()}
    first = next(iter(vlas.values()))
    results = {n: {} for n in vlas}
    for b in args.batches:
        obs = _vla_inputs(first, b, rng)
        noises = {h: rng.standard_normal((b, *first.action_shape(h, 10))).astype(np.float32) for h in first.heads}
        token = jax.numpy.asarray(rng.integers(3, 100, (b, 1)), jax.numpy.int32)
        calls = {}
        for n, vla in vlas.items():
            pre = jax.block_until_ready(programs["prefix"](vla, obs))  # compiles the prefix pass
            calls[n] = {"prefix": lambda vla=vla: programs["prefix"](vla, obs),
                        "actions": lambda vla=vla, pre=pre: programs["actions"](vla, pre, noises),
                        "decode": lambda vla=vla, pre=pre: programs["decode"](vla, pre, token)}
            for p in ("actions", "decode"):
                t0 = time.perf_counter()
                jax.block_until_ready(calls[n][p]())
                results[n].setdefault(f"compile_{p}_s", {})[str(b)] = time.perf_counter() - t0
        times = {n: {p: [] for p in _PROGRAMS} for n in vlas}
        names = list(vlas)
        for r in range(args.repeats):  # rotating order: no variant always runs first or last
            for n in names[r % len(names):] + names[:r % len(names)]:
                for p in _PROGRAMS:
                    t0 = time.perf_counter()
                    jax.block_until_ready(calls[n][p]())
                    times[n][p].append(time.perf_counter() - t0)
        for n in vlas:
            for p in _PROGRAMS:
                results[n].setdefault(f"{p}_ms", {})[str(b)] = 1e3 * float(np.median(times[n][p]))
    for n in vlas:
        for p in _PROGRAMS:
            results[n][f"{p}_ratio"] = {b: results[n][f"{p}_ms"][b] / results["float"][f"{p}_ms"][b]
                                        for b in results[n][f"{p}_ms"]}
    dev = jax.devices()[0]
    return {"what": what, "dtype": args.dtype, "batches": list(args.batches), "repeats": args.repeats,
            "device": {"platform": dev.platform, "kind": dev.device_kind}, "environment": {
                "python": platform.python_version(), "jax": jax.__version__, "machine": platform.machine(),
                "cpus": os.cpu_count(), "load_avg_start": args.load_start, "load_avg_end": os.getloadavg()},
            "results": results}


def report(summary: dict) -> str:
    env = summary["environment"]
    lines = [f"# Matmul modes of quantized weights: {summary['what']}, {summary['dtype']}", "",
             f"Device {summary['device']['kind']} ({summary['device']['platform']}); jax {env['jax']}, "
             f"{env['cpus']} CPUs, load average {env['load_avg_start'][0]:.1f} at the start, "
             f"{env['load_avg_end'][0]:.1f} at the end. Medians of {summary['repeats']} rounds in rotating order; "
             "ratio: to float in the same run (compile apart).", "",
             "| variant | B | prefix pass ms | ratio | action chunk ms | ratio | decode step ms | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for n, r in summary["results"].items():
        for b in map(str, summary["batches"]):
            cells = [f"{r[f'{p}_ms'][b]:.2f} | {r[f'{p}_ratio'][b]:.2f}" for p in _PROGRAMS]
            lines.append(f"| {n} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m eval.quant_matmul", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default="bench", choices=("tiny", "bench", "pi05"), help="random π0.5 weights")
    src.add_argument("--ckpt", type=Path, default=None, help="a quantized π0.5 / π0 checkpoint instead")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batches", type=int_at_least(1), nargs="+", default=[1], help="rows per call (default 1)")
    ap.add_argument("--repeats", type=int_at_least(1), default=10, help="timed rounds (default 10)")
    ap.add_argument("--all-modes", action="store_true", help="also the modes the device only emulates (fp8 on a CPU)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.load_start = os.getloadavg()
    try:
        summary = run(args)
    except ValueError as e:
        print(f"python -m eval.quant_matmul: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "report.md").write_text(report(summary))
    print(report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
