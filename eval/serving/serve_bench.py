"""Serving benchmark: R robots on one policy server, batched versus one robot at a time.

    python -m eval.serving.serve_bench --preset tiny --robots 1 2 4 8 --out eval/results/serve_tiny
    python -m eval.serving.serve_bench --preset bench --robots 1 2 4 --frames 6 --warmup-frames 2 --repeats 1 \
        --out eval/results/serve_bench

Each mode gets its own `python -m oxygen_jax.serve` process (same model, same flags, a shared persistent
compilation cache), all started before measuring; then `--repeats` rounds alternate between the modes
for every R (so both see the same machine-load drift; rounds are pooled), each running R robot clients
(threads speaking openpi's protocol) in lock step: send a LIBERO observation, wait for the chunk, send
the next (no think time: the most a server can deliver); rates are taken between each robot's first
and last measured reply. Every measured frame carries one language
request ("Subtask: ", fixed length) while the robot has fewer than `--max-live` of its own in flight.

    batched   --batch-sizes 1,2,4,8   waiting robots share one prefill + denoise (and the decode pool)
    serial    --batch-sizes 1         one robot per step: openpi's one-at-a-time serving

Reported per (mode, R): per-robot and aggregate action rate (actions/s = chunks/s x Ha), round-trip
p50/p99 at the client, serving overhead (round trip minus the server's Engine.step time, per frame),
tokens/s of finished requests, mean robots per step; and the ideal aggregate rate that the same run's
component times allow (batched: R chunks per measured step of bucket(R); serial: one chunk per batch-1
step) with the achieved fraction of it.

Output: DIR/summary.json (records, environment, commands), DIR/report.md, DIR/serve_bench.png.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from oxygen_jax.cli import OneLineParser, float_in, int_at_least

REPO = Path(__file__).resolve().parents[2]
MODES = {"batched": None, "serial": "1"}  # --batch-sizes per mode (None: powers of two up to max R)
SUMMARY_KEYS = (
    "mode", "robots", "frames", "wall_s", "action_rate_per_robot", "action_rate_total", "rtt_p50_ms", "rtt_p99_ms",
    "step_p50_ms", "queue_p50_ms", "overhead_p50_ms", "overhead_p99_ms", "mean_batch", "tokens_per_s",
    "requests_finished",
    "ideal_action_rate_total", "fraction_of_ideal", "speedup_vs_serial",
)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if len(values) else math.nan


# -------------------------------------------------------------------------------------------------
# Robot clients
# -------------------------------------------------------------------------------------------------


def libero_observation(robot: int, image_size: int = 224) -> dict:
    """A LIBERO client observation (openpi format) with robot-specific random pixels and state."""
    rng = np.random.default_rng(1000 + robot)
    return {
        "observation/image": rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8),
        "observation/state": rng.standard_normal(8),
        "prompt": f"pick up the black bowl and place it on plate {robot}",
    }


def run_robots(url: str, robots: int, frames: int, *, warmup_frames: int = 2, max_tokens: int = 8,
               max_live: int = 2, deadline_ms: float = 10_000.0, timeout_s: float = 600.0) -> dict:
    """Runs `robots` lock-step clients against a server; returns every measured frame.

    Each robot sends `warmup_frames` unmeasured frames, then `frames` measured frames, each with one
    fixed-length language request while it has fewer than `max_live` in flight. Robots never wait for
    each other: a robot blocked outside the protocol (say, at a barrier) would look like a late robot
    to the batcher.

    Returns:
      {"frames": [{"robot", "rtt_ms", "step_ms", "queue_ms", "batch", "bucket", "t_recv"}], "finished":
       [{"robot", "tokens", "t_recv"}], "action_horizon", "errors": [str]}.
    """
    from websockets.sync.client import connect

    from oxygen_jax.serving import wire

    lock = threading.Lock()
    records, finished, errors, horizon = [], [], [], [0]

    def robot(r: int) -> None:
        try:
            with connect(url, compression=None, max_size=None, open_timeout=60) as ws:
                meta = wire.unpack(ws.recv())
                horizon[0] = meta["action_horizon"]
                obs = {**libero_observation(r), "deadline_ms": deadline_ms}
                live = set()
                for i in range(warmup_frames + frames):
                    measured = i >= warmup_frames
                    msg = dict(obs)
                    if measured and len(live) < max_live:
                        msg["language_requests"] = [
                            {"prompt": "Subtask: ", "max_tokens": max_tokens, "stop_at_eos": False}]
                    t0 = time.perf_counter()
                    ws.send(wire.pack(msg))
                    raw = ws.recv(timeout_s)
                    t1 = time.perf_counter()
                    if isinstance(raw, str):
                        raise RuntimeError(f"server refused a frame: {raw.splitlines()[0]}")
                    reply = wire.unpack(raw)
                    lang = reply["language"]
                    live |= {a["id"] for a in lang["accepted"]}
                    live -= {f["id"] for f in lang["finished"] + lang["failed"]}
                    if not measured:
                        continue
                    timing = reply["server_timing"]
                    with lock:
                        records.append({"robot": r, "rtt_ms": (t1 - t0) * 1e3, "step_ms": timing["infer_ms"],
                                        "queue_ms": timing["queue_ms"], "batch": timing["batch"],
                                        "bucket": timing["bucket"], "t_recv": t1})
                        finished.extend({"robot": r, "tokens": len(f["tokens"]), "t_recv": t1}
                                        for f in lang["finished"])
        except Exception as e:  # noqa: BLE001 - reported with the results
            errors.append(f"robot {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=robot, args=(r,), daemon=True) for r in range(robots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return {"frames": records, "finished": finished, "action_horizon": horizon[0], "errors": errors}


def summarize(mode: str, robots: int, runs: Sequence[dict]) -> dict:
    """One summary record (see `SUMMARY_KEYS`) from the `run_robots` results of one (mode, R), pooled.

    A robot's rate is the chunks it received after its first measured reply divided by the time from
    that reply to its last (steady state, no start-up edge); the aggregate is the sum over robots.
    Tokens/s counts requests finished inside those spans. Ideal and speedup are filled by `compare`.
    """
    ha = runs[0]["action_horizon"]
    chunks, spans, tokens = np.zeros(robots), np.zeros(robots), 0
    for run in runs:
        for r in range(robots):
            recv = sorted(f["t_recv"] for f in run["frames"] if f["robot"] == r)
            if len(recv) < 2:
                raise ValueError(f"robot {r} has {len(recv)} measured frames; at least 2 are needed for a rate")
            chunks[r] += len(recv) - 1
            spans[r] += recv[-1] - recv[0]
            tokens += sum(f["tokens"] for f in run["finished"] if f["robot"] == r and recv[0] < f["t_recv"] <= recv[-1])
    frames = [f for run in runs for f in run["frames"]]
    rtt = [f["rtt_ms"] for f in frames]
    overhead = [f["rtt_ms"] - f["step_ms"] for f in frames]
    per_robot = chunks * ha / spans
    # Each step is seen by every robot in it: weight frames by 1/batch to average over steps.
    steps = sum(1.0 / f["batch"] for f in frames)
    return {
        "mode": mode, "robots": robots, "frames": len(frames), "wall_s": float(spans.mean()), "action_horizon": ha,
        "action_rate_per_robot": float(per_robot.mean()), "action_rate_total": float(per_robot.sum()),
        "rtt_p50_ms": percentile(rtt, 50), "rtt_p99_ms": percentile(rtt, 99),
        "step_p50_ms": percentile([f["step_ms"] for f in frames], 50),
        "queue_p50_ms": percentile([f["queue_ms"] for f in frames], 50),
        "overhead_p50_ms": percentile(overhead, 50), "overhead_p99_ms": percentile(overhead, 99),
        "mean_batch": len(frames) / steps if steps else math.nan,
        "tokens_per_s": tokens / float(spans.mean()), "requests_finished": sum(len(run["finished"]) for run in runs),
        "ideal_action_rate_total": math.nan, "fraction_of_ideal": math.nan, "speedup_vs_serial": math.nan,
        # Mean (not median) step time per bucket: the ideal is a rate, compared with chunks / time.
        "step_ms_by_bucket": {str(b): float(np.mean([f["step_ms"] for f in frames if f["bucket"] == b]))
                              for b in sorted({f["bucket"] for f in frames})},
        "errors": [e for run in runs for e in run["errors"]],
    }


def compare(records: list[dict]) -> list[dict]:
    """Adds each run's ideal aggregate rate from its own step times, and the batched speedup over serial.

    Ideal: batched, R chunks per mean step of the smallest measured bucket holding R robots; serial, one
    chunk per mean batch-1 step. Serving overhead, batching waits and steps split into smaller buckets
    show up as a fraction below 1.
    """
    serial = {r["robots"]: r for r in records if r["mode"] == "serial"}
    for rec in records:
        steps = {int(b): ms for b, ms in rec["step_ms_by_bucket"].items()}
        usable = [b for b in steps if b >= rec["robots"]] if rec["mode"] == "batched" else [b for b in steps if b == 1]
        if usable:
            chunks_per_step = rec["robots"] if rec["mode"] == "batched" else 1
            rec["ideal_action_rate_total"] = chunks_per_step * rec["action_horizon"] / (steps[min(usable)] / 1e3)
            rec["fraction_of_ideal"] = rec["action_rate_total"] / rec["ideal_action_rate_total"]
        if rec["mode"] == "batched" and rec["robots"] in serial:
            rec["speedup_vs_serial"] = rec["action_rate_total"] / serial[rec["robots"]]["action_rate_total"]
    return records


# -------------------------------------------------------------------------------------------------
# Servers
# -------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(args: argparse.Namespace, mode: str, port: int) -> list[str]:
    """The `python -m oxygen_jax.serve` command line of one mode."""
    sizes = MODES[mode] or ",".join(str(b) for b in (1, 2, 4, 8, 16) if b < 2 * max(args.robots))
    # Random weights saved as a checkpoint carry no tokenizer: the demo one, asked for by name, gives stand-in ids.
    model = ["--ckpt", args.ckpt, "--tokenizer", args.tokenizer or "demo"] if args.ckpt else ["--preset", args.preset]
    return [sys.executable, "-m", "oxygen_jax.serve", *model, "--robot", "libero", "--host", "127.0.0.1",
            "--port", str(port), "--batch-sizes", sizes, "--steps", str(args.steps), "--slots", str(args.slots),
            "--max-new-tokens", str(args.max_tokens), "--tokens-per-frame", str(args.tokens_per_frame),
            "--prompt-len", str(args.prompt_len), "--dtype", args.dtype,
            *(["--compile-cache", args.compile_cache] if args.compile_cache else []), "--log-level", "WARNING"]


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def start_server(cmd: list[str], port: int, log_path: Path, timeout_s: float) -> tuple[subprocess.Popen, float]:
    """Starts a server process and waits until /healthz is 200; returns (process, seconds to ready)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    while _healthz(port) != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}:\n{log_path.read_text()[-2000:]}")
        if time.perf_counter() - t0 > timeout_s:
            proc.kill()
            raise TimeoutError(f"server not ready after {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.2)
    return proc, time.perf_counter() - t0


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# -------------------------------------------------------------------------------------------------
# Report
# -------------------------------------------------------------------------------------------------


def _fmt(x, digits=1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def write_report(out: Path, records: list[dict], meta: dict) -> None:
    """Writes summary.json, report.md and serve_bench.png into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"environment": meta, "records": records}, indent=1, default=float))
    rows = ["| mode | robots | action rate / robot | aggregate | ideal (components) | achieved | vs serial "
            "| RTT p50 | RTT p99 | step p50 | queue p50 | overhead p50 / p99 | mean batch | tokens/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["robots"], r["mode"])):
        rows.append(
            f"| {r['mode']} | {r['robots']} | {_fmt(r['action_rate_per_robot'])} | {_fmt(r['action_rate_total'])} "
            f"| {_fmt(r['ideal_action_rate_total'])} | {_fmt(100 * r['fraction_of_ideal'], 0)}% "
            f"| {_fmt(r['speedup_vs_serial'], 2)}{'x' if r['mode'] == 'batched' else ''} | {_fmt(r['rtt_p50_ms'])} ms "
            f"| {_fmt(r['rtt_p99_ms'])} ms | {_fmt(r['step_p50_ms'])} ms | {_fmt(r['queue_p50_ms'])} ms "
            f"| {_fmt(r['overhead_p50_ms'])} / {_fmt(r['overhead_p99_ms'])} ms "
            f"| {_fmt(r['mean_batch'], 2)} | {_fmt(r['tokens_per_s'])} |")
    text = [f"# Serving benchmark ({meta.get('preset') or meta.get('ckpt')}, LIBERO observations)", "",
            f"Command: `{meta['command']}`", "",
            f"Server commands: {', '.join(f'`{c}`' for c in meta['server_commands'].values())}",
            "", "Action rates are actions/s (chunks x Ha). Overhead = client round trip minus the server's "
            "Engine.step time of that frame; with several robots it includes the queue (waiting for other "
            "robots' frames or, serially, their steps), reported apart as the server-side queue time. "
            "Ideal = the rate the same run's measured step times allow: batched, "
            "R chunks per step of the bucket holding R robots; serial, one chunk per batch-1 step.", "", *rows, "",
            f"Server start-up to healthy (compile or cache load): {meta.get('startup_s')}", "",
            "![serve_bench](serve_bench.png)", ""]
    (out / "report.md").write_text("\n".join(text))
    _plot(out / "serve_bench.png", records, meta)


def _plot(path: Path, records: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("batched", "o-"), ("serial", "s--")):
        recs = sorted((r for r in records if r["mode"] == mode), key=lambda r: r["robots"])
        if not recs:
            continue
        xs = [r["robots"] for r in recs]
        ax1.plot(xs, [r["action_rate_total"] for r in recs], style, label=f"{mode}: aggregate")
        ax1.plot(xs, [r["action_rate_per_robot"] for r in recs], style, alpha=0.5, label=f"{mode}: per robot")
        ax2.plot(xs, [r["rtt_p50_ms"] for r in recs], style, label=f"{mode}: p50")
        ax2.plot(xs, [r["rtt_p99_ms"] for r in recs], style, alpha=0.5, label=f"{mode}: p99")
        if mode == "batched":
            ideal = [(r["robots"], r["ideal_action_rate_total"]) for r in recs
                     if not math.isnan(r["ideal_action_rate_total"])]
            if ideal:
                ax1.plot(*zip(*ideal), "k:", label="batched ideal (components)")
    ax1.set(xlabel="robots", ylabel="actions / s", title="action rate")
    ax2.set(xlabel="robots", ylabel="ms", title="round trip")
    robots = sorted({r["robots"] for r in records})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(robots, [str(r) for r in robots])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"policy server, {meta.get('preset') or meta.get('ckpt')}: batched vs one robot at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(args: argparse.Namespace) -> dict:
    return {
        "preset": None if args.ckpt else args.preset, "ckpt": args.ckpt, "dtype": args.dtype,
        "jax": _version("jax"), "websockets": _version("websockets"), "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "command": " ".join(["python", "-m", "eval.serving.serve_bench", *sys.argv[1:]]),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "frames": args.frames, "warmup_frames": args.warmup_frames, "repeats": args.repeats, "steps": args.steps,
        "tokens_per_frame": args.tokens_per_frame, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
    }


# -------------------------------------------------------------------------------------------------
# CLI
# -------------------------------------------------------------------------------------------------


_positive_int = int_at_least(1, "a positive integer")


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m eval.serving.serve_bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--preset", default="tiny", choices=["tiny", "bench", "pi05"])
    model.add_argument("--ckpt", help="a π checkpoint instead of a random preset")
    ap.add_argument("--tokenizer", help="with --ckpt: its tokenizer (default 'demo', the offline stand-in: random weights "
                                        "saved as a checkpoint carry none)")
    ap.add_argument("--robots", type=_positive_int, nargs="+", default=[1, 2, 4, 8], help="robot counts R")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--frames", type=int_at_least(2), default=40, help="measured frames per robot")
    ap.add_argument("--warmup-frames", type=int_at_least(0), default=3, help="unmeasured frames per robot before timing")
    ap.add_argument("--repeats", type=_positive_int, default=3, help="interleaved repeats of every (mode, R), pooled")
    ap.add_argument("--steps", type=_positive_int, default=10, help="denoising steps")
    ap.add_argument("--tokens-per-frame", type=_positive_int, default=4, help="k")
    ap.add_argument("--max-tokens", type=_positive_int, default=8, help="tokens per language request (fixed length)")
    ap.add_argument("--max-live", type=_positive_int, default=2, help="language requests in flight per robot")
    ap.add_argument("--deadline-ms", type=float_in(0.0, low_open=True), default=10_000.0,
                    help="deadline each robot declares (how long the batcher may wait for the others)")
    ap.add_argument("--slots", type=_positive_int, default=32, help="decode slots")
    ap.add_argument("--prompt-len", type=_positive_int, default=48, help="prompt tokens in the prefix")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compile-cache", default=None,
                    help="the servers' compilation cache (default: serve's, the directory run uses; 'none' disables)")
    ap.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for a server to compile")
    ap.add_argument("--out", type=Path, required=True)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = environment(args)
    meta["server_commands"], meta["startup_s"], meta["server_exit_codes"] = {}, {}, {}
    servers = {}
    try:
        for mode in args.modes:  # all servers up at once (idle ones cost nothing); runs alternate between them
            port = _free_port()
            cmd = server_command(args, mode, port)
            meta["server_commands"][mode] = " ".join(["python", *cmd[1:]])
            proc, ready_s = start_server(cmd, port, args.out / f"server_{mode}.log", args.startup_timeout)
            servers[mode] = (proc, port)
            meta["startup_s"][mode] = round(ready_s, 1)
            print(f"{mode}: server ready in {ready_s:.1f} s", flush=True)
        runs = {(mode, r): [] for mode in args.modes for r in args.robots}
        for rep in range(args.repeats):
            for r in args.robots:
                for mode in args.modes if rep % 2 == 0 else args.modes[::-1]:  # the same load drift for both
                    run = run_robots(f"ws://127.0.0.1:{servers[mode][1]}", r, args.frames,
                                     warmup_frames=args.warmup_frames, max_tokens=args.max_tokens,
                                     max_live=args.max_live, deadline_ms=args.deadline_ms)
                    if run["errors"]:
                        raise RuntimeError("; ".join(run["errors"]))
                    runs[(mode, r)].append(run)
                    rec = summarize(mode, r, [run])
                    print(f"  [{rep}] {mode} R={r}: {rec['action_rate_total']:.1f} actions/s total, "
                          f"{rec['action_rate_per_robot']:.1f} per robot, RTT p50 {rec['rtt_p50_ms']:.1f} ms, "
                          f"overhead p50 {rec['overhead_p50_ms']:.2f} ms, mean batch {rec['mean_batch']:.2f}, "
                          f"{rec['tokens_per_s']:.0f} tokens/s", flush=True)
    finally:
        for mode, (proc, _) in servers.items():
            meta["server_exit_codes"][mode] = stop_server(proc)
    records = compare([summarize(mode, r, rs) for (mode, r), rs in runs.items()])
    write_report(args.out, records, meta)
    print(f"wrote {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
