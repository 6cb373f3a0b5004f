"""`python -m eval.roofline`: how far each component of a frame is from the device's limit, and what a frame
would take on other devices.

    python -m eval.roofline --preset bench --out results/roofline_bench           # π0.5 at bench scale
    python -m eval.roofline --mot-preset bench --out results/roofline_heads       # Qwen3-VL + XR0, StarVLA, GR00T
    python -m eval.roofline --ckpt DIR --dtype bfloat16 --out results/roofline    # any checkpoint load_model reads
    python -m eval.roofline --preset pi05 --no-measure                            # the cost model and predictions only
    python -m eval.roofline --ckpt DIR --no-measure                               # a checkpoint's predictions

In one process: the device's peaks are measured (`eval.bench.roofline_peaks`: a matmul rate and streaming
bandwidths as JAX programs), then each component of a frame is timed alone (`eval.bench.roofline_measure`),
then set against its limit max(FLOPs / peak, bytes / bandwidth) from the analytic cost model
(`eval.bench.roofline_cost`). The report (`eval.bench.roofline_report`) gives per component the measured time,
the limit, the fraction reached and the bound, a chart (roofline.png), and roofline predictions of the paper's
workload (LIBERO, S = 10, N = 30, k = 5, one request per frame) at full size in bfloat16 for RTX 4090, H100,
H200, Jetson AGX Thor and Orin from datasheet peaks: lower bounds on frame time, stated as predictions.

Output (--out DIR): roofline.json (everything), report.md, roofline.png; the component table is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
from pathlib import Path

import jax

from eval.bench import harness
from eval.bench import heads as bench_heads
from eval.bench import roofline_cost as rc
from eval.bench import roofline_measure as measure
from eval.bench import roofline_peaks as peaks_lib
from eval.bench import roofline_report as report
from oxygen_jax.cli import int_at_least
from oxygen_jax.models import mot
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.robots.config import oxygen_benchmark_robot
from oxygen_jax.runtime import slot_mesh

_positive = int_at_least(1, "a positive integer")
_nonnegative = int_at_least(0, "an integer >= 0")
PREDICTED = {"π0.5 (full size)": lambda: rc.pi05(model_config("pi05"), 10, dtype="bfloat16"),
             "Qwen3-VL-4B + XR0, QwenPI_v3, GR00T (full size)": lambda: rc.multihead(mot.preset("full"), "bfloat16",
                                                                                   "qwen3_vl_4b")}
"""The models predicted for the datasheet devices (each head at its own steps; π0.5 at S = 10)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.roofline", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=("tiny", "bench", "pi05"), help="π0.5 with random weights (default bench)")
    src.add_argument("--mot-preset", help="a mot.preset model with random weights: tiny, bench, qwen35_tiny, qwen35_bench, "
                                          "full, xr0, starvla_qwenpi_v3, gr00t")
    src.add_argument("--ckpt", type=Path, help="a checkpoint directory (any kind `ckpts.load.load_model` reads)")
    p.add_argument("--heads", type=bench_heads.parse_heads, default=(),
                   help="random heads on a bare Hugging Face --ckpt (xr0,starvla,gr00t)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: float32 on CPUs, bfloat16 elsewhere")
    p.add_argument("--weight-bytes", type=float, help="bytes per weight in the cost model (default: the stored dtypes, "
                                                      "quantized leaves included; e.g. 1 to ask what int8 would give)")
    p.add_argument("--workload", choices=("libero", "droid", "aloha"), default="libero",
                   help="cameras, prompt tokens (100) and Ha (10) of OxyGen's benchmark robot")
    p.add_argument("--image-size", type=_positive, default=224, help="camera pixels per side (Qwen ViTs)")
    p.add_argument("--S", type=_positive, help="Euler steps of every head (default: each head's own; π0.5 10)")
    p.add_argument("--N", type=_positive, default=30, help="tokens per request (slot length C = P + N)")
    p.add_argument("--k", type=_positive, default=5, help="decode steps per frame")
    p.add_argument("--slots", type=_positive, help="Ns (default ceil((N - 1) / k): one request per frame, steady)")
    p.add_argument("--gamma", type=_nonnegative, default=4, help="draft tokens of the verify block (0: no verify)")
    p.add_argument("--repeats", type=_positive, default=5, help="timed rounds per component (median)")
    p.add_argument("--tensor-parallel", type=_positive, default=1, metavar="T",
                   help="split the model's weights over T devices as `serve --tensor-parallel` does (on a CPU, T host "
                        "devices share its cores: XLA:CPU runs a few-row product on one core, a split one on T)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-measure", action="store_true", help="the cost model and the predictions only (no timing)")
    p.add_argument("--out", type=Path, help="write roofline.json, report.md and roofline.png here")
    return p


def _load(args: argparse.Namespace, dtype: str, steps: int):
    """(the model the runtime drives, its name) for --preset / --mot-preset / --ckpt."""
    from oxygen_jax.ckpts import load

    if args.ckpt is not None:
        loaded = load.load_model(args.ckpt, dtype=dtype, seed=args.seed, heads=_hf_heads(args) if args.heads else ())
        return loaded.vla(steps), f"checkpoint {args.ckpt}"
    if args.mot_preset:
        spec = mot.preset(args.mot_preset)
        return load.load_model(preset=spec, dtype=dtype, seed=args.seed).vla(steps), f"mot.preset('{args.mot_preset}')"
    name = args.preset or "bench"
    return load.load_model(preset=name, dtype=dtype, seed=args.seed).vla(steps), f"π0.5 preset '{name}'"


def _hf_heads(args: argparse.Namespace):
    """Random bench-scale heads sized to the checkpoint's backbone (as `eval.bench --heads` on a checkpoint)."""
    from oxygen_jax.ckpts import hf
    from oxygen_jax.models.heads.presets import for_backbone

    config = json.loads((args.ckpt / "config.json").read_text())
    backbone = hf.spec_from_config(config)
    kinds = {v: k for k, v in bench_heads.HEADS.items()}
    return [for_backbone(kinds[h], backbone, "bench") for h in args.heads]


def _slots(args: argparse.Namespace) -> int:
    return args.slots or max(1, math.ceil((args.N - 1) / args.k))


def _measured(args: argparse.Namespace, dtype: str, prec: rc.Precision, robot) -> tuple[dict, list[str]]:
    """Load the model, time every component and the peak probes in the same rounds, set them against the cost
    model: (record fields, report lines)."""
    vla, what = _load(args, dtype, args.S or 10)
    m = rc.from_params(vla.spec, vla.params, what)
    if args.tensor_parallel > 1:
        vla = slot_mesh.place_model(vla, slot_mesh.serving_mesh(jax.devices()[:args.tensor_parallel],
                                                                args.tensor_parallel))
        what += f", tensor parallel over {args.tensor_parallel} devices"
    image_size = rc.default_image_size(m) if vla.spec.input_kind == "observation" else args.image_size
    plan = measure.Plan(cameras=robot.num_cameras, prompt_tokens=robot.max_token_len, image_size=image_size,
                        horizon=robot.action_horizon, steps=args.S, slots=_slots(args), max_new_tokens=args.N,
                        tokens_per_frame=args.k, gamma=args.gamma, repeats=args.repeats, seed=args.seed)
    plan = dataclasses.replace(plan, max_new_tokens=measure.needed_tokens(plan))
    inputs, noises, states = measure.frame_inputs(vla, plan)
    p = measure.prefix_len(vla, inputs)
    factories, prefix_s = measure.calls(vla, plan, inputs, noises, states)
    # The peak probes run in the same rounds as the components, so both see the machine's load alike.
    probe_dtype, probe_bytes, probes = peaks_lib.probes(dtype)
    load = measure.load()
    times, compile_s = measure.measure(factories | {f"peak:{n}": pr.factory for n, pr in probes.items()}, plan.repeats)
    compile_s["prefix"] = prefix_s
    peaks = peaks_lib.from_times(probe_dtype, probe_bytes, probes, {n: times[f"peak:{n}"] for n in probes}, load)
    table = report.rows(measure.costs(m, plan, p, prec), times, compile_s, peaks)
    fields = {"model": what, "parameters": rc.count(m.tree), "prefix_len": p, "plan": vars(plan),
              "slot_length": p + plan.max_new_tokens, "peaks": peaks.to_json(),
              "components": [r.to_json() for r in table], "loadavg_end": list(measure.load())}
    lines = [f"- {dtype} ({rc.count(m.tree):,} parameters), {args.workload}: {plan.cameras} cameras, "
             f"{plan.prompt_tokens} prompt tokens, P = {p}, Ha = {plan.horizon}; Ns = {plan.slots}, slot length "
             f"C = {p + plan.max_new_tokens}, k = {plan.tokens_per_frame}, γ = {plan.gamma}; {plan.repeats} rounds",
             "", "## Peaks, measured in the same rounds as the components", ""]
    lines += report.peaks_lines(peaks) + ["", "## Components", ""] + report.component_table(table) + [""]
    print("\n".join(report.component_table(table)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report.plot(table, peaks, args.out / "roofline.png", f"{what}, {dtype}, {jax.devices()[0].device_kind}")
        lines += ["![roofline](roofline.png)", ""]
    return fields, lines


def _named_model(args: argparse.Namespace) -> rc.Model | None:
    """The model --preset / --mot-preset / --ckpt names, in bfloat16, for --no-measure: π0.5 checkpoints (ours and
    openpi's) from their metadata alone, other checkpoints through `load_model`; None without a model flag."""
    from oxygen_jax.ckpts import load, openpi, own

    steps = args.S or 10
    if args.ckpt is not None:
        kind = load.source_kind(args.ckpt)
        if kind in ("checkpoint", "openpi"):
            config = own.stored_config(args.ckpt) if kind == "checkpoint" else openpi.read_openpi_config(args.ckpt)
            return rc.pi05(config, steps, f"checkpoint {args.ckpt}", "bfloat16")
        vla, what = _load(args, "bfloat16", steps)
        return rc.from_params(vla.spec, vla.params, what)
    if args.mot_preset:
        return rc.multihead(mot.preset(args.mot_preset), "bfloat16", f"mot.preset('{args.mot_preset}')")
    return rc.pi05(model_config(args.preset), steps, f"π0.5 preset '{args.preset}'", "bfloat16") if args.preset else None


def _predictions(args: argparse.Namespace, robot) -> tuple[dict, list[str]]:
    """Roofline predictions of `PREDICTED` (and with --no-measure of the named model) on the datasheet devices:
    (record field, report lines)."""
    lines = ["## Predictions (roofline lower bounds, not measurements)", "",
             f"The workload in bfloat16 ({robot.name}: {robot.num_cameras} cameras, {robot.max_token_len} "
             f"prompt tokens; S = 10 for π0.5, each head's own otherwise; N = {args.N}, k = {args.k}, one request per "
             f"frame, Ns = {_slots(args)}): each part of a frame at max(FLOPs / peak, bytes / bandwidth) of the "
             "datasheet peaks, the parts summed.", ""]
    out = {}
    bf16 = rc.Precision.of("bfloat16", args.weight_bytes)
    named = _named_model(args) if args.no_measure else None
    models = {**({named.name: lambda: named} if named is not None else {}), **PREDICTED}
    for label, build in models.items():
        pm = build()
        size = rc.default_image_size(pm) if pm.spec.input_kind == "observation" else args.image_size
        w = report.Workload(prefix_len=rc.prefix_length(pm, robot.num_cameras, robot.max_token_len, size),
                            images=robot.num_cameras, horizon=robot.action_horizon, steps=None, decode_len=args.N,
                            tokens_per_frame=args.k, slots=_slots(args), image_size=size)
        preds = report.predictions(pm, w, bf16)
        out[label] = {"workload": vars(w), "devices": preds}
        lines += [f"### {label}: P = {w.prefix_len}", ""] + report.prediction_table(preds) + [""]
    return out, lines + ["## Datasheet peaks", ""] + report.datasheet_lines() + [""]


def main(argv=None) -> int:
    try:
        return _main(argv)
    except (ValueError, FileNotFoundError) as e:  # a model or checkpoint that cannot be read: one line
        raise SystemExit(f"python -m eval.roofline: {e}".splitlines()[0]) from None


def _main(argv) -> int:
    args = _parser().parse_args(argv)
    if args.tensor_parallel > 1:
        try:
            jax.config.update("jax_num_cpu_devices", args.tensor_parallel)
        except RuntimeError:  # jax already started (a caller in the same process): its devices are what there is
            pass
        if len(jax.devices()) < args.tensor_parallel:
            raise SystemExit(f"--tensor-parallel {args.tensor_parallel}: only {len(jax.devices())} "
                             f"{jax.default_backend()} devices here")
    if args.heads and args.ckpt is None:
        raise SystemExit("--heads puts random heads on a bare Hugging Face --ckpt; --mot-preset names its own heads")
    dtype = args.dtype if args.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    robot = oxygen_benchmark_robot(args.workload)
    record: dict = {"command": " ".join(["python -m eval.roofline", *(argv if argv is not None else sys.argv[1:])]),
                    "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "commit": harness._git_commit(), "backend": jax.default_backend(),
                    "device_kind": jax.devices()[0].device_kind, "cpu_model": harness._cpu_model(), "dtype": dtype,
                    "loadavg_start": list(measure.load())}
    lines: list[str] = []
    if not args.no_measure:
        fields, lines = _measured(args, dtype, rc.Precision.of(dtype, args.weight_bytes), robot)
        record |= fields
        lines = [f"# Roofline: {fields['model']}", "",
                 f"- {record['timestamp']} (UTC), commit `{record['commit']}`, {record['backend']} "
                 f"({record['device_kind']}; {record['cpu_model']}); `{record['command']}`",
                 f"- machine load (1 / 5 / 15 min): {', '.join(f'{x:.2f}' for x in record['loadavg_start'])} at the "
                 f"start, {', '.join(f'{x:.2f}' for x in record['loadavg_end'])} at the end"] + lines
    if args.no_measure:
        lines = ["# Roofline predictions", "", f"- {record['timestamp']} (UTC), commit `{record['commit']}`; "
                 f"`{record['command']}`", ""]
    record["predictions"], more = _predictions(args, robot)
    text = "\n".join(lines + more) + "\n"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)
        harness.write_json(args.out / "roofline.json", record)
        print(f"wrote {args.out / 'report.md'}", file=sys.stderr)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
