"""The benchmark protocol shared by every model family: runners, group inputs, timing, the group driver, JSON.

Within a group (`grid.Group`) every selected setting (and continuous batching once per k) runs the same
frames, interleaved frame by frame (the order rotates each frame), on the same observations, noise and
requests. A frame's time runs from its tick to actions and tokens on the host (`jax.device_get`, which
waits for the device).

Protocol (docs/benchmarks.md): each compiled program's first call (trace, compile, one execution) is timed
once per process and reported as `compile_s`, never mixed into frame times; warm-up frames (at least
ceil(N/k) ramp frames when continuous runs) and requests arriving in them are excluded; after the measured
frames continuous batching alone runs ceil(N/k) drain frames (not measured, arrivals continuing) so that
every request arriving while measuring finishes and has a latency; random weights decode a fixed number of
tokens (stop token disabled, recorded as `fixed_length_decode`); component times (prefill, S denoise steps,
one decode step at batch B) are measured alone, warm, median of several runs, and give each setting's
ideal frame time (`eval.bench.metrics.ideal_frame_ms`).

A *family* (`Family`: `eval.bench.pi05`, `eval.bench.heads`) is a module that loads its model, builds a
group's inputs (with the `models.vla.MultiHead` every setting runs) and measures its components; the runners,
one per setting, are the same for every family (`runners`: `ToCompletionRunner`, `ContinuousRunner`); `run`
drives any family through the same grid.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import jax
import jaxlib
import numpy as np
from tqdm import tqdm

from eval.bench import arrivals as arrivals_lib
from eval.bench import metrics
from eval.bench.grid import Group
from oxygen_jax.models.pi05.config import EOS_ID
from oxygen_jax.robots.config import oxygen_benchmark_robot
from oxygen_jax.runtime import decode
from oxygen_jax.runtime import frame as schedule
from oxygen_jax.runtime.scheduler import Scheduler, Ticket

SUMMARY_KEYS = (
    "setting", "workload", "preset", "dtype", "S", "N", "k", "arrival", "frame_ms_median", "action_hz",
    "tokens_per_s", "speedup_vs_isolated", "ideal_speedup", "compile_s",
)
"""Keys every `summary.json` record has (downstream scripts rely on them); records hold more.

`k` is null for isolated, shared_kv and parallel (they decode each frame's requests to completion);
`compile_s` sums the first-call times of the programs a setting uses (parallel runs the isolated
executables, so it reports theirs); `speedup_vs_isolated` is null when isolated was not measured.
"""


# --- environment ----------------------------------------------------------------------------------


def _git_commit() -> str:
    repo = Path(__file__).resolve().parents[2]
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


def _cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo on Linux, else `platform.processor()`), or "" when unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


_ENV_VARS = ("XLA_FLAGS", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_VISIBLE_DEVICES")


def environment(args: argparse.Namespace, dtype: str, preset: str, family_facts: dict) -> dict:
    """Software and hardware facts recorded with every result file (`family_facts` last)."""
    dev = jax.devices()[0]
    return {
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "backend": jax.default_backend(), "device_kind": dev.device_kind, "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(), "cpu_model": _cpu_model(), "dtype": dtype, "preset": preset,
        "ckpt": str(args.ckpt) if args.ckpt else None, "commit": _git_commit(),
        "command": " ".join([Path(sys.executable).name, "-m", "eval.bench", *sys.argv[1:]]),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
        # other processes share the machine: the report prints the load beside every figure (end: `run`)
        "loadavg_start": list(os.getloadavg()),
        **family_facts,
    }


# --- inputs ---------------------------------------------------------------------------------------


class RequestTable:
    """Every request of a group (ids 0..R-1 in arrival order) as numpy rows, sliced into `Requests` batches.

    Built before timing so that sampling keys are not derived inside a frame.
    """

    def __init__(self, budgets: Sequence[int], fixed_length: bool):
        r = len(budgets)
        # --eos: stop at π0.5's EOS id (the bench's random-weight models carry no tokenizer of their own)
        self._stop = () if fixed_length else (EOS_ID,)
        stops = [self._stop] * r
        # One extra default row (valid False, id -1) pads batches.
        table = decode.make_requests(r + 1, 0, list(range(r)), budgets=list(budgets), stop_ids=stops)
        self._fields = {f.name: getattr(table, f.name) for f in dataclasses.fields(table)}
        self._pad = r
        self.budgets = list(budgets)

    def tickets(self) -> list[Ticket]:
        """Fresh host tickets for every request (one set per continuous runner), keys derived here."""
        return [Ticket.make(rid, budget=b, stop_ids=self._stop) for rid, b in enumerate(self.budgets)]

    def batch(self, ids: Sequence[int], size: int):
        if len(ids) > size:
            raise ValueError(f"{len(ids)} requests do not fit a batch of {size}")
        idx = np.asarray(list(ids) + [self._pad] * (size - len(ids)), np.int64)
        return decode.Requests(**{name: jax.tree.map(lambda a: np.asarray(a)[idx], v) for name, v in self._fields.items()})


def group_requests(group: Group, num_frames: int, fixed_length: bool) -> tuple[list[list[int]], RequestTable, list]:
    """The group's requests: ids arriving per frame (0, 1, ... in arrival order), their table, and per frame
    the device `Requests` of exactly that frame's arrivals (None without arrivals).

    A request's budget is N, or its own t_max when the arrival pattern gives a smaller one.
    """
    budgets, ids, next_id = [], [], 0
    for frame_caps in arrivals_lib.parse(group.arrival).schedule(num_frames):
        ids.append(list(range(next_id, next_id + len(frame_caps))))
        budgets += [group.decode_len if cap is None else min(cap, group.decode_len) for cap in frame_caps]
        next_id += len(frame_caps)
    table = RequestTable(budgets, fixed_length)
    return ids, table, [jax.device_put(table.batch(i, len(i))) if i else None for i in ids]


@dataclasses.dataclass
class GroupInputs:
    """Everything a group's frames read, prepared (and on the device) before timing."""

    group: Group
    num_frames: int  # warm-up + measured + drain
    warmup: int
    measured_end: int  # frames warmup .. measured_end - 1 are measured; later ones drain
    vla: object  # the `models.vla.MultiHead` every setting runs (π0.5: `as_vla(params, S)` of the group's S)
    observations: list  # per frame (the same object repeated with --reuse-observation)
    noise: list  # per frame: (head name -> noise [1, Ha, Ad], head name -> state [1, Ds] for heads with one)
    arrivals: list[list[int]]  # request ids arriving in each frame
    table: RequestTable
    frame_requests: list  # per frame: device `Requests` of exactly that frame's arrivals, or None
    prefix_len: int
    action_horizon: int | None  # actions per frame in action_hz; None: several heads, action_hz counts chunks
    config: dict = dataclasses.field(default_factory=dict)  # the family's facts for the run record's config


def warmup_and_drain(args: argparse.Namespace, group: Group) -> tuple[int, int]:
    """Warm-up covers continuous batching's ramp (ceil(N/k) frames to a steady batch); drain frames after
    the measured ones (continuous only, arrivals continuing) let requests that arrived while measuring finish."""
    ramp = max((math.ceil(group.decode_len / k) for k in group.ks), default=0) if "continuous" in args.settings else 0
    return max(args.warmup, ramp), (ramp if args.drain else 0)


def peak_slots(budgets_per_frame: Sequence[Sequence[int]], k: int) -> int:
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


def pool_slots(args: argparse.Namespace, inputs: GroupInputs, k: int) -> int:
    """--slots, or with 'auto' the peak occupancy of the group's arrivals at tokens-per-frame k."""
    if args.slots != "auto":
        return args.slots
    return peak_slots([[inputs.table.budgets[i] for i in ids] for ids in inputs.arrivals], k)


# --- runners --------------------------------------------------------------------------------------


class Runner:
    """One setting of one group: compiles its programs, then runs frames and keeps the records."""

    label: str

    def __init__(self, setting: str, k: int | None = None):
        self.setting, self.k = setting, k
        self.label = setting if k is None else f"{setting}[k={k}]"
        self.frames: list[dict] = []
        self.requests: dict[int, dict] = {}
        self.program_keys: list[str] = []

    def compile(self, log: dict[str, float]) -> None:
        """First calls (`first_call`) of every program shape this runner will use; their keys into `program_keys`."""
        raise NotImplementedError

    def frame(self, f: int) -> None:
        """Runs and records frame f."""
        raise NotImplementedError

    def _record(self, x: GroupInputs, f: int, ms: float, tokens: int, batch: int, arrivals: int, steps: int):
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


def pool_slot_bytes(pool: decode.DecodePool | None) -> dict[str, int] | None:
    """One slot's bytes in the pool the runner allocated, by part (`decode.pool_slot_bytes`), or None."""
    return None if pool is None else decode.pool_slot_bytes(pool)


class ToCompletionRunner(Runner):
    """isolated, parallel, shared_kv and actions_only for any `MultiHead`: a frame's requests finish in it.

    isolated runs each head's own program, timed alone (`head_ms`: what the fan-out ratio divides by), then the
    text's own; frames without arrivals run the heads alone (isolated and parallel: the single-head programs;
    shared_kv and actions_only: one prefix pass and every head).
    """

    def __init__(self, setting: str, inputs: GroupInputs):
        super().__init__(setting)
        self.x = inputs

    def _call(self, f: int):
        """Runs frame f; returns (num_generated or None, {head: ms} of the single-head programs or None)."""
        x, vla, n = self.x, self.x.vla, self.x.group.decode_len
        inputs, (noises, states), req = x.observations[f], x.noise[f], x.frame_requests[f]
        if self.setting == "isolated":
            head_ms = {}
            for name in vla.heads:  # each head's own frame, timed alone (to the host)
                start = time.perf_counter()
                jax.device_get(schedule.head_program(vla, name, inputs, noises, states))
                head_ms[name] = (time.perf_counter() - start) * 1e3
            if req is None:
                return None, head_ms
            _, generated = jax.device_get(schedule.text_program(vla, inputs, req, max_new_tokens=n))
            return generated, head_ms
        if self.setting == "parallel":
            _, _, generated = jax.device_get(schedule.run_parallel(vla, inputs, noises, req, None, states,
                                                                   max_new_tokens=n))
            return generated, None
        if req is None or self.setting == "actions_only":
            jax.device_get(schedule.actions_program(vla, inputs, noises, states))
            return None, None
        _, _, generated = jax.device_get(schedule.shared_kv_program(vla, inputs, noises, req, None, states,
                                                                    max_new_tokens=n))
        return generated, None

    def compile(self, log: dict[str, float]) -> None:
        """First calls of every program shape this runner will use (arrival counts differ per frame)."""
        x, vla = self.x, self.x.vla
        n, wl, steps = x.group.decode_len, x.group.workload, x.group.num_steps
        sizes = sorted({len(a) for a in x.arrivals})
        inputs, (noises, states) = x.observations[0], x.noise[0]
        keys = []
        if self.setting in ("isolated", "parallel"):  # parallel runs the isolated executables
            for name in vla.heads:
                keys.append((f"head/{wl}/{name}/S={steps}", functools.partial(
                    schedule.head_program, vla, name, inputs, noises, states)))
            for j in (s for s in sizes if s > 0):
                req = x.table.batch([], j)  # shapes are all that matter here
                keys.append((f"text/{wl}/N={n}/J={j}", functools.partial(
                    schedule.text_program, vla, inputs, req, max_new_tokens=n)))
        else:
            if 0 in sizes or self.setting == "actions_only":
                keys.append((f"actions/{wl}/S={steps}",
                             functools.partial(schedule.actions_program, vla, inputs, noises, states)))
            for j in (s for s in sizes if s > 0 and self.setting == "shared_kv"):
                req = x.table.batch([], j)
                keys.append((f"shared_kv/{wl}/S={steps}/N={n}/J={j}", functools.partial(
                    schedule.shared_kv_program, vla, inputs, noises, req, None, states, max_new_tokens=n)))
        for key, thunk in keys:
            first_call(log, key, thunk)
            self.program_keys.append(key)
        if self.setting == "parallel":  # start the dispatch threads outside the timed frames
            j = next((s for s in sizes if s > 0), None)
            schedule.run_parallel(vla, inputs, noises, x.table.batch([], j) if j else None, None, states,
                                  max_new_tokens=n)

    def frame(self, f: int) -> None:
        start = time.perf_counter()
        generated, head_ms = self._call(f)
        self._record_to_completion(f, (time.perf_counter() - start) * 1e3, generated)
        if head_ms is not None:
            self.frames[-1]["head_ms"] = head_ms


class ContinuousRunner(Runner):
    """continuous batching with tokens-per-frame k: `schedule.frame_step` (the fan-out frame) on a persistent
    pool, queued by `scheduler.Scheduler` (the engine's own FIFO and output bookkeeping). With a language-adapter
    `bank`, `adapter_share` of the requests (spread evenly) run on adapter 1."""

    def __init__(self, k: int, inputs: GroupInputs, slots: int, bank=None, adapter_share: float = 0.0):
        super().__init__("continuous", k)
        self.x, self.slots = inputs, slots
        if bank is not None:
            self.label = f"continuous[k={k},adapter={adapter_share:g}]"
        self.bank, self.adapter_share = bank, adapter_share
        self.admissions = max(1, max(len(a) for a in inputs.arrivals))
        self.sched = Scheduler(slots, self.admissions, 0)
        self.tickets: list[Ticket] = []
        self.pool = None

    def _new_pool(self):
        return decode.init_pool(self.x.vla.language(), self.slots, self.x.prefix_len, self.x.group.decode_len, 0)

    def _step(self, pool, f: int, req, evict):
        """One frame program on `pool` with frame f's inputs (donates the pool)."""
        x = self.x
        noises, states = x.noise[f]
        return schedule.frame_step(x.vla, pool, x.observations[f], noises, req, evict, self.bank, states,
                                   tokens_per_frame=self.k)

    def compile(self, log: dict[str, float]) -> None:
        x, g = self.x, self.x.group
        key = (f"frame_step/{g.workload}/S={g.num_steps}/k={self.k}/N={g.decode_len}/slots={self.slots}"
               f"/J={self.admissions}") + ("/adapter_bank" if self.bank is not None else "")

        def thunk():  # a throwaway pool with one admitted request, so the compiled program also ran its decode path
            req = x.table.batch([0] if x.table.budgets else [], self.admissions)
            return jax.device_get(self._step(self._new_pool(), 0, req, np.zeros((self.slots,), bool))[1])

        first_call(log, key, thunk)
        self.program_keys.append(key)
        self.pool = self._new_pool()
        self.tickets = x.table.tickets()
        for t in self.tickets:  # exactly a share of the requests (spread evenly) use adapter 1
            t.adapter = int(int((t.request_id + 1) * self.adapter_share) > int(t.request_id * self.adapter_share))

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


def runners(ctx: RunContext, group: Group, inputs: GroupInputs, bank=None, adapter_share: float = 0.0) -> list[Runner]:
    """One runner per selected setting, in the order of `--settings`: continuous once per k, and again on the
    language-adapter `bank` (the same requests, `adapter_share` of them on adapter 1) when there is one."""
    out: list[Runner] = []
    for setting in ctx.args.settings:
        if setting != "continuous":
            out.append(ToCompletionRunner(setting, inputs))
            continue
        for k in group.ks:
            slots = pool_slots(ctx.args, inputs, k)
            out.append(ContinuousRunner(k, inputs, slots))
            if bank is not None:
                out.append(ContinuousRunner(k, inputs, slots, bank, adapter_share))
    return out


def first_call(log: dict[str, float], key: str, thunk: Callable) -> None:
    """Times a program's first call (trace + compile + one run, waited for) once per process."""
    if key in log:
        return
    start = time.perf_counter()
    jax.block_until_ready(thunk())
    log[key] = time.perf_counter() - start


# --- components -----------------------------------------------------------------------------------


def _compiled_programs() -> int:
    """How many executables the frame programs hold (all settings): must not grow after warm-up."""
    fns = (schedule.frame_step, schedule.head_program, schedule.actions_program, schedule.text_program,
           schedule.shared_kv_program)
    return sum(fn._cache_size() for fn in fns)


BURST = 4  # decode steps per timed burst (see `decode_step_ms`)


def median_ms(fn: Callable, repeats: int) -> float:
    """Median wall time of `fn()` (waited for) over `repeats` runs, after one untimed call (compile, warm)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def decode_step_ms(lm, cache, b: int, g: int, repeats: int, bank=None, adapters=None) -> float:
    """Median time of one decode step with b active slots, timed inside `BURST`-step bursts.

    Every setting runs its decode steps inside one compiled loop, so a per-call dispatch and host
    sync per token would overstate t(B); a burst's time is divided by `BURST`.
    """
    pool = decode.init_pool(lm, b, cache.length, g, 0)
    req = decode.make_requests(b, 0, list(range(b)), budgets=[g] * b, stop_ids=[-1] * b, adapters=adapters)
    pool, _, _ = decode.admit(lm, pool, cache, req, bank)
    pool, toks = decode.decode_burst(lm, pool, BURST, bank)  # compile
    jax.block_until_ready((pool, toks))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pool, toks = decode.decode_burst(lm, pool, BURST, bank)
        jax.block_until_ready((pool, toks))
        times.append((time.perf_counter() - start) * 1e3 / BURST)
    return float(np.median(times))


def decode_components(lm, prefix, batches: Sequence[int], max_new_tokens: int, repeats: int,
                      bank=None) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """t(B), one decode step with B active requests at each B (`decode_step_ms`) after `prefix`; with a
    language-adapter `bank`, also with every slot on adapter 1 and with half the slots on it, interleaved with the
    base measurement per B. Returns (base, all on adapter 1, half on it) ms by B ({} without a bank)."""
    g = max(max_new_tokens, (repeats + 2) * BURST + 2)  # room for the compile burst and every timed burst
    decode_ms, adapter_ms, mixed_ms = {}, {}, {}
    for b in sorted(set(batches)):
        decode_ms[b] = decode_step_ms(lm, prefix, b, g, repeats)
        if bank is not None:
            adapter_ms[b] = decode_step_ms(lm, prefix, b, g, repeats, bank, [1] * b)
            mixed_ms[b] = decode_step_ms(lm, prefix, b, g, repeats, bank, [i % 2 for i in range(b)])
    return decode_ms, adapter_ms, mixed_ms


# --- JSON -----------------------------------------------------------------------------------------


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


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


# --- one group ------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunContext:
    """Process-wide state of one bench invocation."""

    args: argparse.Namespace
    family: Family
    model: object  # the family's description of its model (what `Family.load_model` returned)
    params: object
    env: dict
    compile_log: dict[str, float]
    components: dict[str, metrics.Components]
    observations: dict[str, list]  # per workload: the family's frame stream, kept across the workload's groups
    fixed_length: bool
    preset: str
    dtype: str


class Family(Protocol):
    """A model family the harness measures: a module with these functions (`eval.bench.pi05`, `eval.bench.heads`)."""

    def load_model(self, args: argparse.Namespace, dtype: str) -> tuple[object, object, str]:
        """(model description, params for this backend, preset name for the records)."""

    def environment(self, args: argparse.Namespace) -> dict:
        """The family's facts for environment.json (besides versions, device, dtype, preset, commit, ...)."""

    def components(self, ctx: RunContext, robot, groups: Sequence[Group]) -> metrics.Components:
        """Component times of the model on `robot`'s workload (the grid points `groups`), each alone, warm."""

    def group_inputs(self, ctx: RunContext, group: Group, robot) -> GroupInputs:
        """The group's frames and requests, on the device."""

    def runners(self, ctx: RunContext, group: Group, inputs: GroupInputs) -> list[Runner]:
        """`runners(ctx, group, inputs, ...)`, with the family's language-adapter bank if it has one."""

    def summary_fields(self, ctx: RunContext, runner: Runner, iso_frames: list[dict] | None) -> dict:
        """Extra fields of `runner`'s summary record (iso_frames: the isolated runner's frames, or None)."""


def _virtual_isolated_frames(inputs: GroupInputs) -> list[dict]:
    """The isolated setting's per-frame work, from the schedule alone (for ideal speedups)."""
    out = []
    for f, ids in enumerate(inputs.arrivals):
        budgets = [inputs.table.budgets[i] for i in ids]
        out.append({"frame": f, "arrivals": len(ids), "batch": len(ids),
                    "decode_steps": max(budgets) - 1 if budgets else 0, "warmup": f < inputs.warmup})
    return out


def run_group(ctx: RunContext, group: Group, robot, progress=None) -> tuple[list[dict], dict]:
    """Compiles and runs every setting of `group` side by side; returns (summary records, run record)."""
    args = ctx.args
    inputs = ctx.family.group_inputs(ctx, group, robot)
    runners = ctx.family.runners(ctx, group, inputs)
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
    s_steps, n_len = group.num_steps, group.decode_len
    iso_ideal = metrics.ideal_mean_frame_ms("isolated", comp, _virtual_isolated_frames(inputs), num_steps=s_steps)
    iso_frames = next((r.frames for r in runners if r.setting == "isolated"), None)
    horizon = 1 if inputs.action_horizon is None else inputs.action_horizon
    summaries = []
    for r in runners:
        reqs = list(r.requests.values())
        share = getattr(r, "adapter_share", 0.0) if getattr(r, "bank", None) is not None else 0.0
        r_comp = comp
        if share:  # ideal times from the decode steps measured with the adapter bank
            r_comp = dataclasses.replace(comp, decode_step_ms=comp.adapter_step_ms if share >= 1 else comp.mixed_step_ms)
        s = metrics.summarize(r.frames, reqs, action_horizon=horizon, comp=r_comp, setting=r.setting,
                              num_steps=s_steps)
        steady = metrics.steady_state_ideal_ms(r.setting, r_comp, num_steps=s_steps, decode_len=n_len,
                                               tokens_per_frame=r.k or 1, arrivals_per_frame=pattern.arrivals_per_frame)
        speed = metrics.speedup(iso_frames, r.frames) if iso_frames is not None else math.nan
        ideal_speed = iso_ideal / s["ideal_frame_ms"] if s["ideal_frame_ms"] else math.nan
        summaries.append({
            "setting": r.setting, "workload": group.workload, "preset": ctx.preset, "dtype": ctx.dtype,
            "S": s_steps, "N": n_len, "k": r.k, "k_divides_N": (n_len % r.k == 0) if r.k else None,
            "arrival": group.arrival, "arrivals_per_frame": pattern.arrivals_per_frame,
            "action_horizon": inputs.action_horizon, "warmup_frames": inputs.warmup,
            "slots": getattr(r, "slots", None), "slot_bytes": pool_slot_bytes(getattr(r, "pool", None)),
            "fixed_length_decode": ctx.fixed_length,
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
            **ctx.family.summary_fields(ctx, r, iso_frames),
        })
    run = {
        "environment": ctx.env,
        "group": group.to_json(),
        "config": {
            "settings": [r.label for r in runners], "frames": args.frames, "warmup_frames": inputs.warmup,
            "drain_frames": inputs.num_frames - inputs.measured_end,
            "fixed_length_decode": ctx.fixed_length, "seed": args.seed, "reuse_observation": args.reuse_observation,
            "prompt_bucket": args.prompt_bucket,
            "prefix_len": inputs.prefix_len, "robot": dataclasses.asdict(robot),
            **inputs.config,
            "frame_order": "settings interleaved per frame, order rotated each frame",
        },
        "components": comp.to_json(),
        "compile_s": {key: ctx.compile_log[key] for r in runners for key in r.program_keys},
        "summary": summaries,
        "frames": [rec for r in runners for rec in r.frames],
        "requests": [rec for r in runners for rec in sorted(r.requests.values(), key=lambda q: q["id"])],
    }
    return summaries, run


# --- a whole run ----------------------------------------------------------------------------------


def run(args: argparse.Namespace, family: Family, groups: Sequence[Group]) -> Path:
    """Measures every group with `family`'s model; writes and returns the output directory."""
    dtype = args.dtype if args.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    model, params, preset = family.load_model(args, dtype)
    out = args.out or Path("results") / f"{preset}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args, dtype, preset, family.environment(args))
    env["fixed_length_decode"] = not args.eos
    env["parameters"] = int(sum(getattr(leaf, "size", 0) for leaf in jax.tree.leaves(params)))
    write_json(out / "environment.json", env)

    ctx = RunContext(args=args, family=family, model=model, params=params, env=env, compile_log={}, components={},
                     observations=collections.defaultdict(list), fixed_length=not args.eos, preset=preset, dtype=dtype)
    total = 0
    for g in groups:
        total += args.frames + sum(warmup_and_drain(args, g))
    summary: list[dict] = []
    with tqdm(total=total, unit="frame", disable=args.no_progress, dynamic_ncols=True, file=sys.stderr,
              mininterval=0.5) as bar:
        for workload in dict.fromkeys(g.workload for g in groups):
            robot = oxygen_benchmark_robot(workload)
            wgroups = [g for g in groups if g.workload == workload]
            bar.set_description(f"{workload}: components")
            ctx.components[workload] = family.components(ctx, robot, wgroups)
            write_json(out / "components.json", {w: c.to_json() for w, c in ctx.components.items()})
            for g in wgroups:
                bar.set_description(g.name)
                records, run_record = run_group(ctx, g, robot, bar)
                write_json(out / "runs" / f"{g.name}.json", run_record)
                summary += records
                write_json(out / "summary.json", summary)  # rewritten after each group: partial runs stay usable
                # Each group compiles its own programs (its shapes); dropping the finished group's executables
                # keeps a long grid under the kernel's memory-map limit (XLA CPU maps every executable).
                jax.clear_caches()
            ctx.observations[workload].clear()
    env["loadavg_end"] = list(os.getloadavg())  # the machine load seen over the run (other processes share it)
    write_json(out / "environment.json", env)
    print(f"wrote {len(summary)} records to {out / 'summary.json'}", file=sys.stderr)
    return out
