"""`python -m eval.bench`: measure the four execution settings side by side and write JSON results.

    python -m eval.bench --quick --out results/tiny          # tiny preset, a few minutes on 2 CPU cores
    python -m eval.bench --preset bench --out results/bench  # default grid (`figure`) on the bench preset
    python -m eval.bench --grid paper --preset pi05 --dtype bfloat16 --out results/paper   # the paper's sweep

A *group* is one (workload, S, N, arrival pattern) of the grid (`eval.bench.grid`). Within a group every
selected setting (and continuous batching once per k) runs the same frames, interleaved frame by frame, on
the same observations, noise and requests, under one protocol (`eval.bench.harness`):

    isolated    action program, then a text program with its own prefill (each waited for)
    shared_kv   one program: one prefill, actions, the frame's requests decoded to completion
    parallel    action and text programs dispatched concurrently from two host threads
    continuous  a frame program on a persistent decode pool: k tokens per active request per frame

The model family: π0.5 (`eval.bench.pi05`, a --preset or a --ckpt, ours or openpi's), or several action heads on one
Qwen3-VL prefix (`--heads xr0,starvla,gr00t`, with `--preset bench` or `tiny`: `eval.bench.heads`), which
also reports the fan-out ratio (shared-prefix frame / the sum of the single-head frames of the same run).

Output (`--out DIR`):

    DIR/summary.json        one record per (setting, grid point): see `harness.SUMMARY_KEYS`
    DIR/components.json     component times per workload
    DIR/environment.json    versions, backend, device, dtype, preset, commit, command line
    DIR/runs/<group>.json   environment, configuration, per-frame and per-request records, summaries
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from eval.bench import arrivals as arrivals_lib
from eval.bench import harness, heads, pi05
from eval.bench.grid import DEFAULT_SETTINGS, GRIDS, SETTINGS, WORKLOADS, Group, build_grid
from oxygen_jax.cli import float_in, int_at_least

PRESETS = ("tiny", "bench", "pi05", "qwen35_bench")


_positive_int = int_at_least(1, "a positive integer")
_nonnegative_int = int_at_least(0, "an integer >= 0")
_share = float_in(0.0, 1.0, low_open=True)


def _k_value(text: str) -> str:
    if text in ("div", "alldiv"):
        return text
    _positive_int(text)
    return text


def _arrival(text: str) -> str:
    try:
        return str(arrivals_lib.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _batches(text: str) -> list[int]:
    """'1-16' or '1,2,4,8' (or a mix: '1-4,8,16')."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)-(\d+)", part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo < 1 or hi < lo:
                raise argparse.ArgumentTypeError(f"bad batch range {part!r}")
            out.update(range(lo, hi + 1))
        else:
            out.add(_positive_int(part))
    return sorted(out)


def _parser() -> argparse.ArgumentParser:
    grids = "\n".join(
        f"  {name:9s} workloads={','.join(g['workloads'])} S={list(g['S'])} N={list(g['N'])} "
        f"arrivals={len(g['arrivals'])} frames={g['frames']}" for name, g in GRIDS.items()
    )
    p = argparse.ArgumentParser(
        prog="python -m eval.bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Measure the OxyGen execution settings (isolated, shared_kv, continuous, parallel) side by side.\n"
            "Default: the `figure` grid (LIBERO, S=10; k=5 over N in {5,10,15,20,30}; k in {1,2,3,5,10} at\n"
            "N=30) on the `bench` preset: about 1.5 h on 2 CPU cores (a bench frame takes seconds there).\n"
            "`--grid paper` runs the paper's full §5 sweep (S in {5,10,15,20}, N in {5,10,15,20,30}, k in\n"
            "{1,2,3,5,6,10,15,30} dividing N, all workloads, 50 frames): hours on a GPU with pi05, far too\n"
            "long for a CPU. `--quick` is the tiny-preset grid (about 1.5 min on 2 CPU cores).\n"
            "Use --dry-run to list the grid before running it."
        ),
        epilog=(
            "named grids (explicit --workloads/--S/--N/--k/--arrival replace the grid's lists):\n" + grids + "\n\n"
            "arrival patterns (one request = one language request decoded up to min(t_max, N) tokens):\n"
            "  uniform:R        R >= 1: one request every int(R) frames; R < 1: round(1/R) per frame\n"
            "  burst:4/8        4 requests every 8 frames      poisson:1.5   Poisson arrivals, seeded\n"
            "  variable_length:5,20   t_max cycles             random_length:5,20@0.3   P(t_max=20) = 0.3\n"
            "  options  :tmax=30  :seed=7  :rate=2 (the *_length kinds)        none   actions only\n\n"
            "examples:\n"
            "  python -m eval.bench --quick --out results/tiny && python -m eval.bench.report results/tiny\n"
            "  python -m eval.bench --preset bench --settings isolated continuous --N 30 --k 5 --frames 3 --warmup 1\n"
            "  python -m eval.bench --grid workload --preset pi05 --dtype bfloat16 --out results/workload\n"
            "  python -m eval.bench --ckpt ~/.cache/openpi/pi05_libero --workloads libero --N 30 --k 5 --dry-run"
        ),
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--grid", choices=sorted(GRIDS), default=None,
                   help="named grid (default: figure; quick with --quick)")
    g.add_argument("--quick", action="store_true", help="the quick grid on the tiny preset (unless --preset/--ckpt)")
    g.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(DEFAULT_SETTINGS), metavar="SETTING",
                   help=f"settings to measure (default: {', '.join(DEFAULT_SETTINGS)}; add actions_only for the "
                        "prefill + denoise reference frame without language)")
    g.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None, metavar="WORKLOAD",
                   help=f"robot workloads ({', '.join(WORKLOADS)}; Ha=10, 100 prompt tokens as in the paper)")
    g.add_argument("--S", nargs="+", type=_positive_int, default=None, metavar="S", dest="num_steps",
                   help="denoise steps")
    g.add_argument("--N", nargs="+", type=_positive_int, default=None, metavar="N", dest="decode_len",
                   help="decode length (tokens per request)")
    g.add_argument("--k", nargs="+", type=_k_value, default=None, metavar="K",
                   help="tokens per request per frame (continuous only): integers, 'div' (the paper's set "
                        "{1,2,3,5,6,10,15,30} dividing N) or 'alldiv' (every divisor of N). A k that does not "
                        "divide N runs and is recorded as k_divides_N=false")
    g.add_argument("--arrival", nargs="+", type=_arrival, default=None, metavar="SPEC",
                   help="arrival patterns (default uniform:1 = one request per frame); see below")
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, default=None,
                     help="random-weight model preset (default: bench; tiny with --quick)")
    src.add_argument("--ckpt", type=Path, default=None, help="a pi0.5 checkpoint instead of a preset: openpi's or one saved by oxygen_jax")
    m.add_argument("--heads", type=heads.parse_heads, default=None, metavar="NAMES",
                   help="several action heads + the language decoder on one Qwen3-VL prefix instead of pi0.5: "
                        "comma-separated from xr0, starvla, gr00t (e.g. xr0,starvla,gr00t; presets bench or tiny, or qwen35_bench with starvla,gr00t). "
                        "Reports the fan-out ratio: shared-prefix frame / sum of the single-head frames")
    m.add_argument("--image-size", type=_positive_int, default=224,
                   help="with --heads: square camera image side in pixels, a multiple of 32 ((size/32)^2 image "
                        "tokens per camera; default 224: 49 tokens)")
    m.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="parameters and activations (auto: float32 on CPU, bfloat16 on accelerators)")
    m.add_argument("--tokenizer", type=Path, default=None,
                   help="SentencePiece model for the prompts (default: the offline demo tokenizer; "
                        "latency is the same)")
    m.add_argument("--eos", action="store_true",
                   help="stop requests at EOS (default: fixed-length decode, the only fair mode with random weights)")
    t = p.add_argument_group("measurement")
    t.add_argument("--frames", type=_positive_int, default=None,
                   help="measured frames per group (default: the grid's, >= 30)")
    t.add_argument("--warmup", type=_nonnegative_int, default=2,
                   help="warm-up frames after compilation (continuous adds its ceil(N/k) ramp; default 2)")
    t.add_argument("--drain", action=argparse.BooleanOptionalAction, default=True,
                   help="after the measured frames, run continuous batching ceil(N/k) more frames (not measured) "
                        "so requests arriving while measuring finish and count in request latency (default: on)")
    t.add_argument("--slots", default="auto",
                   help="continuous-batching pool size: 'auto' (peak occupancy of the arrival pattern) or an integer")
    t.add_argument("--component-batches", type=_batches, default=None, metavar="LIST",
                   help="batch sizes B for the decode-step time t(B), e.g. '1-16' (default; quick: 1,2,4,8)")
    t.add_argument("--component-repeats", type=_positive_int, default=5, help="timed runs per component (median)")
    t.add_argument("--reuse-observation", action="store_true", help="one observation for every frame (saves memory)")
    t.add_argument("--adapter-rank", type=_nonnegative_int, default=0,
                   help="also measure language adapters: a random LoRA bank of this rank on the VLM expert; "
                        "decode steps are timed with every slot / half the slots on it, and continuous batching "
                        "runs a second time with --adapter-share of the requests on it (0: off)")
    t.add_argument("--adapter-share", type=_share, default=0.5,
                   help="fraction of requests on the adapter in that second continuous run (default 0.5)")
    t.add_argument("--prompt-bucket", type=_nonnegative_int, default=0,
                   help="trim prompt padding to a multiple of this many tokens (0: keep max_token_len, as the paper)")
    t.add_argument("--seed", type=_nonnegative_int, default=0, help="seed of weights, observations and noise")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None, help="result directory (default: results/<preset>-<UTC time>)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--dry-run", action="store_true", help="print the grid and exit")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.grid is None:
        args.grid = "quick" if args.quick else "figure"
    if args.preset is None and args.ckpt is None:
        args.preset = "tiny" if args.quick else "bench"
    if args.k is not None and any(k in ("div", "alldiv") for k in args.k) and len(args.k) > 1:
        parser.error("--k takes integers, or a single 'div' / 'alldiv'")
    if args.slots != "auto":
        try:
            args.slots = _positive_int(args.slots)
        except argparse.ArgumentTypeError as e:
            parser.error(f"--slots: {e}")
    if args.frames is None:
        args.frames = GRIDS[args.grid]["frames"]
    if args.component_batches is None:
        args.component_batches = [1, 2, 4, 8] if args.grid == "quick" else list(range(1, 17))
    if args.ckpt is not None and not args.ckpt.expanduser().exists():
        parser.error(f"--ckpt: {args.ckpt} does not exist")
    if args.tokenizer is not None and not args.tokenizer.expanduser().is_file():
        parser.error(f"--tokenizer: {args.tokenizer} is not a file")
    args.settings = [s for s in SETTINGS if s in args.settings]  # canonical order, no duplicates
    if args.heads is not None:
        if args.ckpt is not None or args.preset not in ("tiny", "bench", "qwen35_bench"):
            parser.error("--heads builds a random-weight mot model: use --preset bench, tiny or qwen35_bench (no --ckpt)")
        if args.num_steps is not None and len(args.num_steps) > 1:
            parser.error("--heads takes one --S (every head runs S steps) or none (each head its own steps)")
        if args.adapter_rank:
            parser.error("--adapter-rank is for pi0.5 language adapters; it does not combine with --heads")
        problem = heads.check_image_size(args.preset, args.image_size)
        if problem:
            parser.error(problem)
    elif args.preset == "qwen35_bench":
        parser.error("--preset qwen35_bench is a Qwen3.5 backbone with StarVLA heads: pass --heads starvla and/or gr00t")
    return args


def _describe(groups: Sequence[Group], args: argparse.Namespace) -> str:
    lines = [f"{len(groups)} group(s) x settings {', '.join(args.settings)}; {args.frames} measured frames each"]
    for g in groups:
        ks = f" k={list(g.ks)}" if g.ks else ""
        bad = [k for k in g.ks if g.decode_len % k]
        flag = f"  (k={bad} does not divide N: recorded as k_divides_N=false)" if bad else ""
        lines.append(f"  {g.name}{ks}{flag}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> Path | None:
    """Runs the benchmark; returns the output directory (None for --dry-run)."""
    args = parse_args(argv)
    groups = build_grid(args)
    print(_describe(groups, args), file=sys.stderr)
    for g in groups:
        for k in g.ks:
            if g.decode_len % k:
                print(f"warning: {g.name}: k={k} does not divide N={g.decode_len}; each request's last burst is short",
                      file=sys.stderr)
    if args.dry_run:
        return None
    return harness.run(args, heads if args.heads else pi05, groups)


if __name__ == "__main__":
    main()
