"""Benchmark the four execution settings side by side and write JSON results.

    python -m eval.bench --quick --out results/tiny          # tiny preset, a few minutes on 2 CPU cores
    python -m eval.bench --preset bench --out results/bench  # default grid (`figure`) on the bench preset
    python -m eval.bench --grid paper --preset pi05 --dtype bfloat16 --out results/paper   # the §5 sweep

A *group* is one (workload, S, N, arrival pattern). Within a group every selected setting (and
continuous batching once per k) runs the same frames, interleaved frame by frame (the order rotates
each frame), on the same observations, noise and requests:

    isolated    action program, then a text program with its own prefill (each waited for)
    shared_kv   one program: one prefill, actions, the frame's requests decoded to completion
    parallel    action and text programs dispatched concurrently from two host threads
    continuous  `schedule.frame_step` on a persistent decode pool: k tokens per active request per frame

Frames without arrivals run the action program alone in the non-batched settings. A frame's time runs
from its tick to actions and tokens on the host (`jax.device_get`, which waits for the device).

Protocol (method_and_benchmark.md §5, §9.22-27): each compiled program's first call (trace, compile,
one execution) is timed once per process and reported as `compile_s`, never mixed into frame times;
warm-up frames (at least ceil(N/k) ramp frames when continuous runs) and requests arriving in them
are excluded; after the measured frames continuous batching alone runs ceil(N/k) drain frames (not
measured, arrivals continuing) so that every request arriving while measuring finishes and has a
latency; random weights decode a fixed number of tokens (stop token disabled, recorded as
`fixed_length_decode`); component times (prefill, S denoise steps, one decode step at batch B) are
measured alone, warm, median of several runs, and give each setting's ideal frame time (§8.4).

Several action heads on one Qwen3-VL prefix (`--heads xr0,starvla,gr00t`, with `--preset bench` or `tiny`):
the same settings, grid and protocol for `mot` models with a language decoder, and the fan-out ratio
(shared-prefix frame / the sum of the single-head frames of the same run); see `eval.bench_heads`.

Output (`--out DIR`):

    DIR/summary.json        one record per (setting, grid point): see `SUMMARY_KEYS`
    DIR/components.json     component times per workload
    DIR/environment.json    versions, backend, device, dtype, preset, commit, command line
    DIR/runs/<group>.json   environment, configuration, per-frame and per-request records, summaries
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from tqdm import tqdm

from eval import arrivals as arrivals_lib
from eval import metrics
from oxygen_jax.runtime import decode
from oxygen_jax.models import mot
from oxygen_jax.runtime import frame as schedule
from oxygen_jax.cli import float_in, int_at_least
from oxygen_jax.models.pi05.config import EOS_ID, model_config, oxygen_benchmark_robot
from oxygen_jax.models.pi05.model import denoise, prefill, prefix_length
from oxygen_jax.models.pi05.params import for_backend, init_params
from oxygen_jax.runtime.scheduler import Scheduler, Ticket
from oxygen_jax.robots.tokenizer import Tokenizer, train_demo_tokenizer
from oxygen_jax.models.pi05.observation import trim_prompt_padding
from oxygen_jax.robots.transforms import make_observation, synthetic_sample

SETTINGS = schedule.BENCH_SETTINGS
DEFAULT_SETTINGS = schedule.SETTINGS  # actions_only (prefill + denoise, no text) is an opt-in reference
WORKLOADS = ("libero", "droid", "aloha")
PRESETS = ("tiny", "bench", "pi05")
PAPER_K = (1, 2, 3, 5, 6, 10, 15, 30)

SUMMARY_KEYS = (
    "setting", "workload", "preset", "dtype", "S", "N", "k", "arrival", "frame_ms_median", "action_hz",
    "tokens_per_s", "speedup_vs_isolated", "ideal_speedup", "compile_s",
)
"""Keys every `summary.json` record has (downstream scripts rely on them); records hold more.

`k` is null for isolated, shared_kv and parallel (they decode each frame's requests to completion);
`compile_s` sums the first-call times of the programs a setting uses (parallel runs the isolated
executables, so it reports theirs); `speedup_vs_isolated` is null when isolated was not measured.
"""


# --- grids ----------------------------------------------------------------------------------------


def _paper_ks(n: int) -> list[int]:
    return [k for k in PAPER_K if n % k == 0]


def _all_divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _figure_ks(n: int) -> list[int]:
    return [1, 2, 3, 5, 10] if n == 30 else [5]


_WORKLOAD_SWEEP = (
    [f"uniform:{r:g}:tmax=30" for r in (0.25, 0.5, 1, 2, 4)]
    + [f"poisson:{lam:g}:tmax=30" for lam in (0.5, 1, 1.5, 2)]
    + [f"random_length:5,20@{p:g}" for p in (0.1, 0.3, 0.5, 0.7, 0.9)]
)

GRIDS: dict[str, dict] = {
    # §5 default sweep: all workloads, S x N, k in the paper's set dividing N.
    "paper": dict(workloads=WORKLOADS, S=(5, 10, 15, 20), N=(5, 10, 15, 20, 30), k=_paper_ks,
                  arrivals=("uniform:1",), frames=50),
    # The paper's figures: S = 10, k = 5 over N, and k in {1,2,3,5,10} at N = 30 (LIBERO).
    "figure": dict(workloads=("libero",), S=(10,), N=(5, 10, 15, 20, 30), k=_figure_ks,
                   arrivals=("uniform:1",), frames=30),
    # §5 workload sweep: LIBERO, S = 10, N = 30, k = 5 under different arrival patterns.
    "workload": dict(workloads=("libero",), S=(10,), N=(30,), k=lambda n: [5], arrivals=tuple(_WORKLOAD_SWEEP),
                     frames=50),
    # Small grid for the tiny preset: enough points for every table and plot.
    "quick": dict(workloads=("libero",), S=(10,), N=(10, 20, 30), k=lambda n: [1, 5, 10],
                  arrivals=("uniform:1",), frames=30),
}


@dataclasses.dataclass(frozen=True)
class Group:
    """One grid point shared by all settings: continuous batching runs once per k in `ks`."""

    workload: str
    S: int
    N: int
    arrival: str
    ks: tuple[int, ...]

    @property
    def name(self) -> str:
        arrival = re.sub(r"[^A-Za-z0-9.]+", "-", self.arrival).strip("-")
        return f"{self.workload}_S{self.S}_N{self.N}_{arrival}"


def build_grid(args: argparse.Namespace) -> list[Group]:
    """Groups from the named grid, with any explicit --workloads/--S/--N/--k/--arrival replacing its lists."""
    grid = GRIDS[args.grid]
    workloads = args.workloads or grid["workloads"]
    steps = args.S or ((0,) if getattr(args, "heads", None) else grid["S"])  # 0: each head's own steps
    lengths = args.N or grid["N"]
    specs = args.arrival or grid["arrivals"]
    if args.k is None:
        k_of = grid["k"]
    elif args.k == ["div"]:
        k_of = _paper_ks
    elif args.k == ["alldiv"]:
        k_of = _all_divisors
    else:
        fixed = [int(k) for k in args.k]
        k_of = lambda n: fixed  # noqa: E731
    groups = []
    for w in workloads:
        for s in steps:
            for n in lengths:
                ks = tuple(sorted(set(k_of(n)))) if "continuous" in args.settings else ()
                if "continuous" in args.settings and not ks:
                    raise SystemExit(f"error: no tokens-per-frame k for N = {n}; pass --k explicitly")
                for spec in specs:
                    groups.append(Group(workload=w, S=s, N=n, arrival=str(arrivals_lib.parse(spec)), ks=ks))
    return groups


# --- command line ---------------------------------------------------------------------------------


_positive_int = int_at_least(1, "a positive integer")
_nonnegative_int = int_at_least(0, "an integer >= 0")


_share = float_in(0.0, 1.0, low_open=True)


def _heads(text: str) -> tuple[str, ...]:
    from eval import bench_heads

    return bench_heads.parse_heads(text)


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
            "  python -m eval.bench --quick --out results/tiny && python -m eval.report results/tiny\n"
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
    g.add_argument("--S", nargs="+", type=_positive_int, default=None, metavar="S", help="denoise steps")
    g.add_argument("--N", nargs="+", type=_positive_int, default=None, metavar="N",
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
    src.add_argument("--ckpt", type=Path, default=None, help="restore an openpi pi0.5 checkpoint instead of a preset")
    m.add_argument("--heads", type=_heads, default=None, metavar="NAMES",
                   help="several action heads + the language decoder on one Qwen3-VL prefix instead of pi0.5: "
                        "comma-separated from xr0, starvla, gr00t (e.g. xr0,starvla,gr00t; presets bench or tiny). "
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
        if args.ckpt is not None or args.preset not in ("tiny", "bench"):
            parser.error("--heads builds a random-weight mot model: use --preset bench or tiny (no --ckpt)")
        if args.S is not None and len(args.S) > 1:
            parser.error("--heads takes one --S (every head runs S steps) or none (each head its own steps)")
        if args.adapter_rank:
            parser.error("--adapter-rank is for pi0.5 language adapters; it does not combine with --heads")
        from eval import bench_heads

        problem = bench_heads.check_image_size(args.preset, args.image_size)
        if problem:
            parser.error(problem)
    return args


# --- environment ----------------------------------------------------------------------------------


def _git_commit() -> str:
    repo = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        commit = out.stdout.strip() if out.returncode == 0 else ""
        if not commit:
            return "unknown"
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, timeout=10)
        return commit + ("-dirty" if status.returncode == 0 and status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


_ENV_VARS = ("XLA_FLAGS", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_VISIBLE_DEVICES")


def environment(args: argparse.Namespace, dtype: str, preset: str) -> dict:
    """Software and hardware facts recorded with every result file."""
    dev = jax.devices()[0]
    return {
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "backend": jax.default_backend(), "device_kind": dev.device_kind, "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(), "dtype": dtype, "preset": preset,
        "ckpt": str(args.ckpt) if args.ckpt else None, "commit": _git_commit(),
        "command": " ".join([Path(sys.executable).name, "-m", "eval.bench", *sys.argv[1:]]),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
        **({"heads": list(args.heads), "image_size": args.image_size, "loadavg_start": list(os.getloadavg())}
           if getattr(args, "heads", None) else {}),
    }


# --- inputs ---------------------------------------------------------------------------------------


class _RequestTable:
    """Every request of a group (ids 0..R-1 in arrival order) as numpy rows, sliced into `Requests` batches.

    Built before timing so that sampling keys are not derived inside a frame.
    """

    def __init__(self, budgets: Sequence[int], fixed_length: bool):
        r = len(budgets)
        stops = [-1] * r if fixed_length else None
        # One extra default row (valid False, id -1) pads batches.
        table = decode.make_requests(r + 1, 0, list(range(r)), budgets=list(budgets), stop_tokens=stops)
        self._fields = {f.name: getattr(table, f.name) for f in dataclasses.fields(table)}
        self._pad = r
        self.budgets = list(budgets)

    def tickets(self) -> list[Ticket]:
        """Fresh host tickets for every request (one set per continuous runner), keys derived here."""
        stop = None if self._fields["sampling"].stop_token[0] == -1 else EOS_ID
        return [Ticket.make(rid, budget=b, stop_token=stop) for rid, b in enumerate(self.budgets)]

    def batch(self, ids: Sequence[int], size: int):
        if len(ids) > size:
            raise ValueError(f"{len(ids)} requests do not fit a batch of {size}")
        idx = np.asarray(list(ids) + [self._pad] * (size - len(ids)), np.int64)
        return decode.Requests(**{name: jax.tree.map(lambda a: np.asarray(a)[idx], v) for name, v in self._fields.items()})


@dataclasses.dataclass
class _GroupInputs:
    """Everything a group's frames read, prepared (and on the device) before timing."""

    group: Group
    num_frames: int  # warm-up + measured + drain
    warmup: int
    measured_end: int  # frames warmup .. measured_end - 1 are measured; later ones drain
    observations: list  # per frame (the same object repeated with --reuse-observation)
    noise: list
    arrivals: list[list[int]]  # request ids arriving in each frame
    table: _RequestTable
    frame_requests: list  # per frame: device `Requests` of exactly that frame's arrivals, or None
    prefix_len: int


def _observation_stream(robot, model_cfg, tokenizer, count: int, seed: int, reuse: bool, prompt_bucket: int = 0) -> list:
    """`count` synthetic client samples (seeded) converted to device observations.

    `prompt_bucket` > 0 trims prompt padding to that bucket (`trim_prompt_padding`); 0 keeps the
    workload's full max_token_len as the paper does.
    """
    rng = np.random.default_rng([seed, 1 + WORKLOADS.index(robot.name)])
    out = []
    for _ in range(1 if reuse else count):
        sample = synthetic_sample(robot, rng, image_size=224)
        obs = make_observation(robot, model_cfg, tokenizer, [sample])
        if prompt_bucket:
            obs = trim_prompt_padding(obs, prompt_bucket)
        out.append(jax.device_put(obs))
    return out * count if reuse else out


def _peak_slots(budgets_per_frame: Sequence[Sequence[int]], k: int) -> int:
    """Peak concurrent requests in continuous batching without queueing (one admission per arrival frame).

    A request of T tokens admitted in frame a emits 1 + k tokens there and k per later frame, so it
    holds a slot in frames a .. a + max(ceil((T − 1)/k), 1) − 1.
    """
    live: list[int] = []
    peak = 0
    for f, budgets in enumerate(budgets_per_frame):
        live = [end for end in live if end >= f]
        live += [f + max(math.ceil((t - 1) / k), 1) - 1 for t in budgets]
        peak = max(peak, len(live))
    return max(peak, 1)


# --- runners --------------------------------------------------------------------------------------


class _Runner:
    """One setting of one group: compiles its programs, then runs frames and keeps the records."""

    label: str

    def __init__(self, setting: str, k: int | None = None):
        self.setting, self.k = setting, k
        self.label = setting if k is None else f"{setting}[k={k}]"
        self.frames: list[dict] = []
        self.requests: dict[int, dict] = {}
        self.program_keys: list[str] = []

    def _record(self, x: "_GroupInputs", f: int, ms: float, tokens: int, batch: int, arrivals: int, steps: int):
        self.frames.append({
            "frame": f, "setting": self.setting, "label": self.label, "k": self.k, "frame_ms": ms, "tokens": int(tokens),
            "batch": int(batch), "arrivals": int(arrivals), "decode_steps": int(steps),
            "warmup": f < x.warmup, "drain": f >= x.measured_end,
        })

    def _record_to_completion(self, f: int, ms: float, generated) -> None:
        """Frame f of a setting whose requests all finish in their arrival frame (generated: counts [J] or None)."""
        x = self.x
        ids = x.arrivals[f]
        n = [] if generated is None else [int(v) for v in np.asarray(generated)[: len(ids)]]
        for rid, count in zip(ids, n):
            self.requests[rid] = {"id": rid, "setting": self.setting, "arrival_frame": f, "admit_frame": f,
                                  "finish_frame": f, "tokens": count, "budget": x.table.budgets[rid]}
        self._record(x, f, ms, sum(n), len(ids) if generated is not None else 0, len(ids), max(n) - 1 if n else 0)


class _ToCompletionRunner(_Runner):
    """isolated, shared_kv and parallel: each frame decodes its own arrivals to completion."""

    def __init__(self, setting: str, params, inputs: _GroupInputs):
        super().__init__(setting)
        self.params, self.x = params, inputs

    def _call(self, f: int):
        g, x, params = self.x.group, self.x, self.params
        obs, noise, req = x.observations[f], x.noise[f], x.frame_requests[f]
        if req is None or self.setting == "actions_only":
            return jax.device_get(schedule.action_program(params, obs, noise, num_steps=g.S)), None
        if self.setting == "isolated":
            # The action task finishes (on the host) before the text task starts.
            actions = jax.device_get(schedule.action_program(params, obs, noise, num_steps=g.S))
            _, n = jax.device_get(schedule.text_program(params, obs, req, max_new_tokens=g.N))
            return actions, n
        run = schedule.shared_kv_program if self.setting == "shared_kv" else schedule.run_parallel
        actions, _, n = jax.device_get(run(params, obs, noise, req, num_steps=g.S, max_new_tokens=g.N))
        return actions, n

    def compile(self, log: dict[str, float]) -> None:
        """First calls of every program shape this runner will use (arrival counts differ per frame)."""
        g, x, params = self.x.group, self.x, self.params
        sizes = sorted({len(a) for a in x.arrivals})
        wl = g.workload
        keys: list[tuple[str, Callable]] = []
        obs, noise = x.observations[0], x.noise[0]
        if 0 in sizes or self.setting in ("isolated", "parallel", "actions_only"):
            keys.append((f"action/{wl}/S={g.S}",
                         lambda: schedule.action_program(params, obs, noise, num_steps=g.S)))
        for j in (s for s in sizes if s > 0 and self.setting != "actions_only"):
            req = x.table.batch([], j)  # shapes are all that matter here
            if self.setting == "shared_kv":
                keys.append((f"shared_kv/{wl}/S={g.S}/N={g.N}/J={j}", lambda req=req: schedule.shared_kv_program(
                    params, obs, noise, req, num_steps=g.S, max_new_tokens=g.N)))
            else:  # isolated and parallel run the same action and text executables
                keys.append((f"text/{wl}/N={g.N}/J={j}",
                             lambda req=req: schedule.text_program(params, obs, req, max_new_tokens=g.N)))
        for key, thunk in keys:
            _first_call(log, key, thunk)
            self.program_keys.append(key)
        if self.setting == "parallel":  # start the dispatch threads outside the timed frames
            j = next((s for s in sizes if s > 0), None)
            if j is not None:
                schedule.run_parallel(params, obs, noise, x.table.batch([], j), num_steps=g.S, max_new_tokens=g.N)

    def frame(self, f: int) -> None:
        start = time.perf_counter()
        _, generated = self._call(f)
        self._record_to_completion(f, (time.perf_counter() - start) * 1e3, generated)


class _ContinuousRunner(_Runner):
    """continuous batching with tokens-per-frame k on a persistent pool, queued by `scheduler.Scheduler`
    (the engine's own FIFO and output bookkeeping)."""

    def __init__(self, k: int, params, inputs: _GroupInputs, slots: int, bank=None, adapter_share: float = 0.0):
        super().__init__("continuous", k)
        if bank is not None:
            self.label = f"continuous[k={k},adapter={adapter_share:g}]"
        self.params, self.x, self.slots = params, inputs, slots
        self.bank, self.adapter_share = bank, adapter_share
        self.admissions = max(1, max(len(a) for a in inputs.arrivals))
        self.sched = Scheduler(slots, self.admissions, 0)
        self.tickets: list[Ticket] = []
        self.pool = None

    def _new_pool(self):
        return decode.init_pool(self.params, self.slots, self.x.prefix_len, self.x.group.N, 0)

    def compile(self, log: dict[str, float]) -> None:
        g, x = self.x.group, self.x
        key = f"frame_step/{g.workload}/S={g.S}/k={self.k}/N={g.N}/slots={self.slots}/J={self.admissions}"
        if self.bank is not None:
            key += "/adapter_bank"

        def thunk():
            # A throwaway pool with one admitted request, so the compiled program also ran its decode path.
            req = x.table.batch([0] if x.table.budgets else [], self.admissions)
            _, out = schedule.frame_step(self.params, self._new_pool(), x.observations[0], x.noise[0], req,
                                         np.zeros((self.slots,), bool), self.bank, num_steps=g.S,
                                         tokens_per_frame=self.k)
            return jax.device_get(out)

        _first_call(log, key, thunk)
        self.program_keys.append(key)
        self.pool = self._new_pool()
        self.tickets = x.table.tickets()
        for t in self.tickets:  # exactly a share of the requests (spread evenly) use adapter 1
            t.adapter = int(int((t.request_id + 1) * self.adapter_share) > int(t.request_id * self.adapter_share))

    def _step(self, pool, f: int, req, evict):
        """One frame program on `pool` with frame f's inputs (donates the pool)."""
        x = self.x
        return schedule.frame_step(self.params, pool, x.observations[f], x.noise[f], req, evict, self.bank,
                                   num_steps=x.group.S, tokens_per_frame=self.k)

    def frame(self, f: int) -> None:
        x = self.x
        for rid in x.arrivals[f]:
            self.sched.enqueue(self.tickets[rid])
            self.requests[rid] = {"id": rid, "setting": "continuous", "label": self.label, "arrival_frame": f,
                                  "admit_frame": None, "finish_frame": None, "tokens": 0,
                                  "budget": x.table.budgets[rid], "adapter": self.tickets[rid].adapter}
        start = time.perf_counter()
        req, evict = self.sched.offer(1)
        self.pool, out = self._step(self.pool, f, req, evict)
        out = jax.device_get(out)  # the frame's single host sync: actions, tokens, flags
        ms = (time.perf_counter() - start) * 1e3
        ev = self.sched.absorb(out, f)
        for t in ev.admitted:
            self.requests[t.request_id]["admit_frame"] = f
        for rid, toks in ev.emitted.items():
            self.requests[rid]["tokens"] += len(toks)
        for t in ev.finished:
            self.requests[t.request_id]["finish_frame"] = f
        tokens = sum(len(toks) for toks in ev.emitted.values())
        self._record(x, f, ms, tokens, ev.batch, len(x.arrivals[f]), ev.steps)


def _first_call(log: dict[str, float], key: str, thunk: Callable) -> None:
    """Times a program's first call (trace + compile + one run, waited for) once per process."""
    if key in log:
        return
    start = time.perf_counter()
    jax.block_until_ready(thunk())
    log[key] = time.perf_counter() - start


# --- components -----------------------------------------------------------------------------------


def _compiled_programs() -> int:
    """How many executables the frame programs hold (all settings): must not grow after warm-up."""
    fns = (schedule.frame_step, schedule.action_program, schedule.text_program, schedule.shared_kv_program,
           schedule.mot_frame_step, schedule.mot_text_program, schedule.mot_shared_kv_program, mot.sample_all)
    return sum(fn._cache_size() for fn in fns)


_BURST = 4  # decode steps per timed burst (see measure_components)


def _median_ms(fn: Callable, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile / warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def _decode_step_ms(params, cache, b: int, g: int, repeats: int, bank=None, adapters=None) -> float:
    """Median time of one decode step with b active slots, timed inside `_BURST`-step bursts."""
    pool = decode.init_pool(params, b, cache.length, g, 0)
    req = decode.make_requests(b, 0, list(range(b)), budgets=[g] * b, stop_tokens=[-1] * b, adapters=adapters)
    pool, _, _ = decode.admit(params, pool, cache, req, bank)
    pool, toks = decode.decode_burst(params, pool, _BURST, bank)  # compile
    jax.block_until_ready((pool, toks))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pool, toks = decode.decode_burst(params, pool, _BURST, bank)
        jax.block_until_ready((pool, toks))
        times.append((time.perf_counter() - start) * 1e3 / _BURST)
    return float(np.median(times))


def measure_components(params, obs, noise, *, steps: Sequence[int], batches: Sequence[int], max_new_tokens: int,
                       repeats: int, bank=None) -> metrics.Components:
    """Warm medians of prefill, S denoise steps (each S) and one decode step with B active requests (each B).

    A decode step is timed inside a burst of `_BURST` steps and divided by `_BURST`: every setting
    runs its decode steps inside one compiled loop, so a per-call dispatch and host sync per token
    would overstate t(B). With a language-adapter `bank`, the decode step is also timed with every
    slot on adapter 1 and with half the slots on it, interleaved with the base measurement per B.
    """
    prefill_ms = _median_ms(lambda: prefill(params, obs), repeats)
    cache = prefill(params, obs)
    denoise_ms = {s: _median_ms(lambda s=s: denoise(params, cache, noise, s), repeats) for s in sorted(set(steps))}
    g = max(max_new_tokens, (repeats + 2) * _BURST + 2)  # room for the compile burst and every timed burst
    decode_ms, adapter_ms, mixed_ms = {}, {}, {}
    for b in sorted(set(batches)):
        decode_ms[b] = _decode_step_ms(params, cache, b, g, repeats)
        if bank is not None:
            adapter_ms[b] = _decode_step_ms(params, cache, b, g, repeats, bank, [1] * b)
            mixed_ms[b] = _decode_step_ms(params, cache, b, g, repeats, bank, [i % 2 for i in range(b)])
    return metrics.Components(prefill_ms=prefill_ms, denoise_ms=denoise_ms, decode_step_ms=decode_ms,
                              adapter_step_ms=adapter_ms, mixed_step_ms=mixed_ms)


# --- one group ------------------------------------------------------------------------------------


def _clean(obj):
    """JSON-safe copy: NaN/inf -> None, numpy scalars -> Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


def _virtual_isolated_frames(inputs: _GroupInputs) -> list[dict]:
    """The isolated setting's per-frame work, from the schedule alone (for ideal speedups)."""
    out = []
    for f, ids in enumerate(inputs.arrivals):
        budgets = [inputs.table.budgets[i] for i in ids]
        out.append({"frame": f, "arrivals": len(ids), "batch": len(ids),
                    "decode_steps": max(budgets) - 1 if budgets else 0, "warmup": f < inputs.warmup})
    return out


@dataclasses.dataclass
class RunContext:
    """Process-wide state of one bench invocation."""

    args: argparse.Namespace
    params: object
    model_cfg: object
    tokenizer: object
    env: dict
    compile_log: dict[str, float]
    components: dict[str, metrics.Components]
    observations: dict[str, list]
    fixed_length: bool
    preset: str
    dtype: str
    bank: object = None  # language-adapter bank (--adapter-rank), or None
    spec: object = None  # mot.ModelSpec with --heads (params are then mot.ModelParams), else None


def _warmup_and_drain(args: argparse.Namespace, group: Group) -> tuple[int, int]:
    """Warm-up covers continuous batching's ramp (ceil(N/k) frames to a steady batch); drain frames after
    the measured ones (continuous only, arrivals continuing) let requests that arrived while measuring finish."""
    ramp = max((math.ceil(group.N / k) for k in group.ks), default=0) if "continuous" in args.settings else 0
    return max(args.warmup, ramp), (ramp if args.drain else 0)


def _group_inputs(ctx: RunContext, group: Group, robot) -> _GroupInputs:
    args = ctx.args
    warmup, drain = _warmup_and_drain(args, group)
    total = warmup + args.frames + drain
    stream = ctx.observations[group.workload]
    if len(stream) < total:
        stream[:] = _observation_stream(robot, ctx.model_cfg, ctx.tokenizer, total, args.seed, args.reuse_observation,
                                        args.prompt_bucket)
    pattern = arrivals_lib.parse(group.arrival)
    caps = pattern.schedule(total)
    budgets, ids, next_id = [], [], 0
    for frame_caps in caps:
        frame_ids = []
        for cap in frame_caps:
            budgets.append(group.N if cap is None else min(cap, group.N))
            frame_ids.append(next_id)
            next_id += 1
        ids.append(frame_ids)
    table = _RequestTable(budgets, ctx.fixed_length)
    frame_requests = [jax.device_put(table.batch(i, len(i))) if i else None for i in ids]
    base = jax.random.key(args.seed)
    shape = (1, robot.action_horizon, ctx.model_cfg.action_dim)
    noise = [jax.random.normal(jax.random.fold_in(base, f), shape) for f in range(total)]
    prefix_len = prefix_length(ctx.params, stream[0])  # from the cache itself (prompt buckets included)
    return _GroupInputs(group=group, num_frames=total, warmup=warmup, measured_end=warmup + args.frames,
                        observations=stream[:total], noise=noise,
                        arrivals=ids, table=table, frame_requests=frame_requests, prefix_len=prefix_len)


def _runners(ctx: RunContext, group: Group, inputs: _GroupInputs) -> list[_Runner]:
    args = ctx.args
    runners: list[_Runner] = []
    for setting in args.settings:
        if setting == "continuous":
            for k in group.ks:
                budgets = [[inputs.table.budgets[i] for i in ids] for ids in inputs.arrivals]
                slots = _peak_slots(budgets, k) if args.slots == "auto" else args.slots
                runners.append(_ContinuousRunner(k, ctx.params, inputs, slots))
                if ctx.bank is not None:  # the same requests, a share of them on the language adapter
                    runners.append(_ContinuousRunner(k, ctx.params, inputs, slots, ctx.bank, args.adapter_share))
        else:
            runners.append(_ToCompletionRunner(setting, ctx.params, inputs))
    return runners


def run_group(ctx: RunContext, group: Group, robot, progress=None) -> tuple[list[dict], dict]:
    """Compiles and runs every setting of `group` side by side; returns (summary records, run record)."""
    args = ctx.args
    if ctx.spec is not None:  # several heads + language on one prefix
        from eval import bench_heads

        inputs = bench_heads.group_inputs(ctx, group, robot)
        runners = bench_heads.runners(ctx, group, inputs)
    else:
        inputs = _group_inputs(ctx, group, robot)
        runners = _runners(ctx, group, inputs)
    for r in runners:
        if progress is not None:
            progress.set_postfix_str(f"compiling {r.label}")
        r.compile(ctx.compile_log)
    compiled_after_warmup = None
    for f in range(inputs.num_frames):
        if f == inputs.warmup:
            compiled_after_warmup = _compiled_programs()
        active = runners if f < inputs.measured_end else [r for r in runners if r.setting == "continuous"]
        shift = f % len(active)  # rotate the order so no setting always runs right after another
        for r in active[shift:] + active[:shift]:
            r.frame(f)
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(" ".join(f"{r.label}={r.frames[-1]['frame_ms']:.1f}ms" for r in active[:4]),
                                     refresh=False)

    recompiles = _compiled_programs() - compiled_after_warmup if compiled_after_warmup is not None else 0
    if recompiles:
        print(f"warning: {recompiles} program(s) compiled after warm-up in {group.name}", file=sys.stderr)
    comp = ctx.components[group.workload]
    pattern = arrivals_lib.parse(group.arrival)
    iso_ideal = metrics.ideal_mean_frame_ms("isolated", comp, _virtual_isolated_frames(inputs), num_steps=group.S)
    iso_frames = next((r.frames for r in runners if r.setting == "isolated"), None)
    summaries = []
    for r in runners:
        reqs = list(r.requests.values())
        share = getattr(r, "adapter_share", 0.0) if getattr(r, "bank", None) is not None else 0.0
        r_comp = comp
        if share:  # ideal times from the decode steps measured with the adapter bank
            r_comp = dataclasses.replace(comp, decode_step_ms=comp.adapter_step_ms if share >= 1 else comp.mixed_step_ms)
        horizon = 1 if ctx.spec is not None else robot.action_horizon  # several heads: action_hz = chunks/s
        s = metrics.summarize(r.frames, reqs, action_horizon=horizon, comp=r_comp, setting=r.setting,
                              num_steps=group.S)
        steady = metrics.steady_state_ideal_ms(r.setting, r_comp, num_steps=group.S, decode_len=group.N,
                                               tokens_per_frame=r.k or 1, arrivals_per_frame=pattern.arrivals_per_frame)
        speed = metrics.speedup(iso_frames, r.frames) if iso_frames is not None else math.nan
        ideal_speed = iso_ideal / s["ideal_frame_ms"] if s["ideal_frame_ms"] else math.nan
        summaries.append({
            "setting": r.setting, "workload": group.workload, "preset": ctx.preset, "dtype": ctx.dtype,
            "S": group.S, "N": group.N, "k": r.k, "k_divides_N": (group.N % r.k == 0) if r.k else None,
            "arrival": group.arrival, "arrivals_per_frame": pattern.arrivals_per_frame,
            "action_horizon": robot.action_horizon, "warmup_frames": inputs.warmup,
            "slots": getattr(r, "slots", None), "fixed_length_decode": ctx.fixed_length,
            "adapter_share": share, "adapter_rank": ctx.args.adapter_rank if share else None,
            **s,
            "ideal_frame_ms_steady": steady,
            "ideal_isolated_ms": iso_ideal,
            "speedup_vs_isolated": speed,
            "ideal_speedup": ideal_speed,
            "speedup_fraction": speed / ideal_speed if ideal_speed and not math.isnan(speed) else math.nan,
            "compile_s": sum(ctx.compile_log[key] for key in r.program_keys),
            "recompiles_after_warmup": recompiles,
            "programs": r.program_keys,
            "run_file": f"runs/{group.name}.json",
        })
        if ctx.spec is not None:
            from eval import bench_heads

            summaries[-1].update(bench_heads.fanout_fields(ctx.spec, r, iso_frames), action_horizon=None,
                                 image_size=ctx.args.image_size)
    run = {
        "environment": ctx.env,
        "group": dataclasses.asdict(group) | {"name": group.name},
        "config": {
            "settings": [r.label for r in runners], "frames": args.frames, "warmup_frames": inputs.warmup,
            "drain_frames": inputs.num_frames - inputs.measured_end,
            "fixed_length_decode": ctx.fixed_length, "seed": args.seed, "reuse_observation": args.reuse_observation,
            "prompt_bucket": args.prompt_bucket,
            "prefix_len": inputs.prefix_len, "robot": dataclasses.asdict(robot),
            **({"heads": list(ctx.spec.names), "image_size": args.image_size} if ctx.spec is not None else {}),
            "frame_order": "settings interleaved per frame, order rotated each frame",
        },
        "components": comp.to_json(),
        "compile_s": {key: ctx.compile_log[key] for r in runners for key in r.program_keys},
        "summary": summaries,
        "frames": [rec for r in runners for rec in r.frames],
        "requests": [rec for r in runners for rec in sorted(r.requests.values(), key=lambda q: q["id"])],
    }
    return summaries, run


# --- main -----------------------------------------------------------------------------------------


def _load_model(args: argparse.Namespace, dtype: str):
    if args.ckpt is not None:
        from oxygen_jax.ckpts.checkpoint import load_openpi_params

        cfg, params = load_openpi_params(args.ckpt.expanduser(), dtype=dtype)
        return cfg, for_backend(params), "ckpt"
    cfg = model_config(args.preset, dtype=dtype)
    # Layer loop per backend (scan on accelerators, unrolled on CPU): the same for every setting.
    return cfg, for_backend(init_params(cfg, args.seed)), args.preset


def _adapter_bank(args: argparse.Namespace, model_cfg):
    """One random language adapter of --adapter-rank (B drawn like a trained adapter's), or None."""
    if not args.adapter_rank:
        return None
    from oxygen_jax.models import lora

    bank = lora.init_bank(model_cfg, 1, rank=args.adapter_rank, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    # init_bank sets B = 0 (an exact identity); a served adapter has non-zero B, so draw it.
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype)
        if getattr(path[-1], "name", None) == "b" else x, bank)


def _tokenizer(args: argparse.Namespace):
    return Tokenizer.from_file(args.tokenizer.expanduser()) if args.tokenizer else train_demo_tokenizer()


def _describe(groups: Sequence[Group], args: argparse.Namespace) -> str:
    lines = [f"{len(groups)} group(s) x settings {', '.join(args.settings)}; {args.frames} measured frames each"]
    for g in groups:
        ks = f" k={list(g.ks)}" if g.ks else ""
        bad = [k for k in g.ks if g.N % k]
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
            if g.N % k:
                print(f"warning: {g.name}: k={k} does not divide N={g.N}; each request's last burst is short",
                      file=sys.stderr)
    if args.dry_run:
        return None



    dtype = args.dtype if args.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    spec = None
    if args.heads:
        from eval import bench_heads

        spec, params, preset = bench_heads.load_model(args, dtype)
        model_cfg = None
    else:
        model_cfg, params, preset = _load_model(args, dtype)
    out = args.out or Path("results") / f"{preset}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args, dtype, preset)
    env["fixed_length_decode"] = not args.eos
    tokenizer = _tokenizer(args) if spec is None else None  # --heads prompts are random token ids

    _write_json(out / "environment.json", env)

    ctx = RunContext(args=args, params=params, model_cfg=model_cfg, tokenizer=tokenizer, env=env,
                     compile_log={}, components={}, observations=collections.defaultdict(list),
                     fixed_length=not args.eos, preset=preset, dtype=dtype, bank=_adapter_bank(args, model_cfg),
                     spec=spec)
    total = 0
    for g in groups:
        total += args.frames + sum(_warmup_and_drain(args, g))
    summary: list[dict] = []
    with tqdm(total=total, unit="frame", disable=args.no_progress, dynamic_ncols=True, file=sys.stderr,
              mininterval=0.5) as bar:
        for workload in dict.fromkeys(g.workload for g in groups):
            robot = oxygen_benchmark_robot(workload)
            wgroups = [g for g in groups if g.workload == workload]
            bar.set_description(f"{workload}: components")
            if spec is not None:
                from eval import bench_heads

                ctx.components[workload] = bench_heads.components(ctx, robot, max(g.N for g in wgroups))
            else:
                obs = _observation_stream(robot, model_cfg, tokenizer, 1, args.seed, True)[0]
                noise = jax.random.normal(jax.random.key(args.seed), (1, robot.action_horizon, model_cfg.action_dim))
                ctx.components[workload] = measure_components(
                    params, obs, noise, steps=sorted({g.S for g in wgroups}), batches=args.component_batches,
                    max_new_tokens=max(g.N for g in wgroups), repeats=args.component_repeats, bank=ctx.bank)
            _write_json(out / "components.json", {w: c.to_json() for w, c in ctx.components.items()})
            for g in wgroups:
                bar.set_description(g.name)
                records, run = run_group(ctx, g, robot, bar)
                _write_json(out / "runs" / f"{g.name}.json", run)
                summary += records
                _write_json(out / "summary.json", summary)  # rewritten after each group: partial runs stay usable
                # Each group compiles its own programs (its shapes); dropping the finished group's executables
                # keeps a long grid under the kernel's memory-map limit (XLA CPU maps every executable).
                jax.clear_caches()
            ctx.observations[workload].clear()
    if spec is not None:  # the machine load seen over the run (other processes share the CPU)
        env["loadavg_end"] = list(os.getloadavg())
        _write_json(out / "environment.json", env)
    print(f"wrote {len(summary)} records to {out / 'summary.json'}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
