"""What hostile clients cost a policy server: start-up, memory under idle and non-reading clients, and a
well-behaved robot's round trip while two robots send frames that are costly to refuse.

    python -m eval.serving.serve_bench_hostile --preset tiny --out eval/results/serve_hostile

Three measurements, each against its own `python -m oxygen_jax.serve` process:

* start-up: seconds from process start to `/healthz` 200 with `--compile-cache none`, with an empty
  cache directory (compiles and fills it) and with that directory again (loads the programs);
* memory: the server's RSS (VmRSS) once it has served 8 robots at once, with `--clients` idle connections open
  (handshake only), after they have gone, with `--clients` clients that send LIBERO frames and never
  read (peak while they are held, then after the send timeout has dropped them), and at the end;
* round trip: a lock-step LIBERO robot's RTT alone and while two hostile robots (another process, so
  they do not share the robot's interpreter) send, as fast as they are answered, frames whose refusal
  used to be costly (a 65,000-character prompt, a 3.6 MB msgpack-bin prompt, language requests with
  65,000-character and token-heavy prompts); rounds alternate (alone, attacked, alone, ...) so both
  see the same machine load, and the ratio of the pooled p50s is reported.

Output: DIR/summary.json (environment, commands, records) and DIR/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eval.serving.serve_bench import REPO, _free_port, _version, libero_observation, percentile, start_server, stop_server
from oxygen_jax.cli import OneLineParser, int_at_least

_positive_int = int_at_least(1, "a positive integer")
# The clients here hold their connections across calls, as robots do.
warnings.filterwarnings("ignore", r"connect\(\) must be used as a context manager", DeprecationWarning)


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _connect(url: str, source: str = "127.0.0.1", rcvbuf: int | None = None, **kw):
    from websockets.sync.client import connect

    port = int(url.rsplit(":", 1)[1])
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return connect(url, sock=sock, compression=None, max_size=None, proxy=None, open_timeout=60, **kw)


def robot_rtts(url: str, frames: int, warmup: int = 2) -> list[float]:
    """A lock-step LIBERO robot: the round trips (ms) of `frames` measured frames."""
    from oxygen_jax.serving import wire

    out = []
    with _connect(url) as ws:
        ws.recv()
        msg = wire.pack(libero_observation(0))
        for i in range(warmup + frames):
            t0 = time.perf_counter()
            ws.send(msg)
            reply = ws.recv(60)
            if isinstance(reply, str):
                raise RuntimeError(f"the robot was refused: {reply[:200]}")
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e3)
    return out


def _robots(url: str, robots: int, frames: int) -> None:
    threads = [threading.Thread(target=robot_rtts, args=(url, frames)) for _ in range(robots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def hostile_frames() -> list[bytes]:
    """Frames cheap to send and (before issue 18) costly to refuse; each is refused now."""
    from oxygen_jax.serving import wire

    obs = libero_observation(7)
    many_tokens = " ".join("qzxj"[i % 4] for i in range(500))  # 999 characters, ~1,000 tokens
    return [wire.pack({**obs, "prompt": "pick " * 13_000}),
            wire.pack({**obs, "prompt": b"pick " * 720_000}),
            wire.pack({**obs, "language_requests": [{"prompt": "y" * 65_000}]}),
            wire.pack({**obs, "language_requests": [{"prompt": many_tokens}] * 8})]


def hostile_main(url: str, seconds: float, robots: int) -> int:
    """`--hostile URL`: `robots` lock-step hostile robots for `seconds`; prints frames sent and refused."""
    frames, counts, lock = hostile_frames(), [0, 0], threading.Lock()

    def one(r: int) -> None:
        with _connect(url, source=f"127.0.0.{2 + r}") as ws:
            ws.recv()
            end, i = time.perf_counter() + seconds, r
            while time.perf_counter() < end:
                ws.send(frames[i % len(frames)])
                reply = ws.recv(60)
                with lock:
                    counts[0] += 1
                    counts[1] += isinstance(reply, str) and reply.startswith("BadRequest")
                i += 1

    threads = [threading.Thread(target=one, args=(r,)) for r in range(robots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"sent": counts[0], "refused": counts[1]}), flush=True)
    return 0


# -------------------------------------------------------------------------------------------------
# The three measurements
# -------------------------------------------------------------------------------------------------


def server_command(args: argparse.Namespace, port: int, cache: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "oxygen_jax.serve", "--preset", args.preset, "--robot", "libero", "--host",
            "127.0.0.1", "--port", str(port), "--steps", str(args.steps), "--compile-cache", cache,
            "--log-level", "WARNING", *extra]


def measure_startup(args, out: Path, cache_dir: str) -> dict:
    result = {}
    for name, cache in (("no cache", "none"), ("empty cache", cache_dir), ("filled cache", cache_dir)):
        port = _free_port()
        proc, ready_s = start_server(server_command(args, port, cache), port, out / "server_startup.log", 1800)
        stop_server(proc)
        result[name] = round(ready_s, 2)
        print(f"start-up to healthy, {name}: {ready_s:.1f} s", flush=True)
    return result


def _metric(port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _non_readers(url: str, port: int, pid: int, n: int, frame: bytes, send_timeout: float, label: str) -> dict:
    """`n` clients that send `frame` and never read, until the server has dropped every one of them."""
    stop, peak, dropped = threading.Event(), 0.0, _metric(port, 'oxygen_connections_refused_total{reason="send_timeout"}')

    def never_read() -> None:
        try:
            ws = _connect(url, rcvbuf=4096, max_queue=1, ping_interval=None)
            while not stop.is_set():
                ws.send(frame)
        except Exception:  # noqa: BLE001 - the server drops this client: that is the point
            return

    threads = [threading.Thread(target=never_read, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 900 and any(t.is_alive() for t in threads):
        peak = max(peak, rss_mb(pid))
        time.sleep(0.2)
    stop.set()
    out = {f"{n} non-reading clients{label}, peak": peak,
           f"non-reading clients{label}: seconds until all were dropped": time.perf_counter() - t0,
           f"non-reading clients{label}: send timeouts": _metric(
               port, 'oxygen_connections_refused_total{reason="send_timeout"}') - dropped}
    time.sleep(2.0)
    out[f"non-reading clients{label} dropped"] = rss_mb(pid)
    return out


def measure_memory(args, out: Path, cache_dir: str) -> dict:
    """RSS (MiB) of one server through idle and non-reading clients."""
    from oxygen_jax.serving import wire

    n, port = args.clients, _free_port()
    cmd = server_command(args, port, cache_dir, "--max-connections", str(2 * n + 8), "--max-connections-per-peer",
                         str(2 * n + 8), "--max-robots", str(n + 4), "--send-timeout", str(args.send_timeout),
                         "--first-frame-timeout", "120")
    proc, _ = start_server(cmd, port, out / "server_memory.log", 1800)
    url, rss = f"ws://127.0.0.1:{port}", {}
    try:
        _robots(url, 8, 20)  # every batch size has run: its buffers are in the baseline
        time.sleep(1.0)
        rss["served 8 robots"] = rss_mb(proc.pid)
        idle = [_connect(url, ping_interval=None) for _ in range(n)]
        time.sleep(1.0)
        rss[f"{n} idle connections open"] = rss_mb(proc.pid)
        for ws in idle:
            ws.close()
        time.sleep(2.0)
        rss["idle connections closed"] = rss_mb(proc.pid)

        frame = wire.pack(libero_observation(3))
        for round_ in ("", ", second round"):  # a second round shows whether memory kept after the first is reused
            rss.update(_non_readers(url, port, proc.pid, n, frame, args.send_timeout, round_))
        _robots(url, 8, 20)
        rss["served 8 robots again"] = rss_mb(proc.pid)
    finally:
        stop_server(proc)
    for k, v in rss.items():
        print(f"memory: {k}: {v:.1f}", flush=True)
    return {k: round(v, 1) for k, v in rss.items()}


def measure_rtt(args, out: Path, cache_dir: str) -> dict:
    port = _free_port()
    proc, _ = start_server(server_command(args, port, cache_dir), port, out / "server_rtt.log", 1800)
    url, alone, attacked, hostile = f"ws://127.0.0.1:{port}", [], [], []
    try:
        robot_rtts(url, 10)
        for rep in range(args.repeats):
            alone += robot_rtts(url, args.frames)
            attacker = subprocess.Popen(
                [sys.executable, "-m", "eval.serving.serve_bench_hostile", "--hostile", url, "--seconds", "600"],
                cwd=REPO, stdout=subprocess.PIPE, text=True)
            time.sleep(args.attack_lead)  # the attackers are connected and sending
            attacked += robot_rtts(url, args.frames)
            attacker.terminate()
            attacker.wait(60)
            p50s = percentile(alone[-args.frames:], 50), percentile(attacked[-args.frames:], 50)
            print(f"  [{rep}] RTT p50 alone {p50s[0]:.1f} ms, attacked {p50s[1]:.1f} ms", flush=True)
        counter = subprocess.run(
            [sys.executable, "-m", "eval.serving.serve_bench_hostile", "--hostile", url, "--seconds", "5"], cwd=REPO,
            capture_output=True, text=True, timeout=120)
        hostile = json.loads(counter.stdout.strip().splitlines()[-1])
    finally:
        stop_server(proc)
    rec = {"frames_per_condition": len(alone), "alone_p50_ms": percentile(alone, 50),
           "alone_p90_ms": percentile(alone, 90), "attacked_p50_ms": percentile(attacked, 50),
           "attacked_p90_ms": percentile(attacked, 90), "hostile_frames_per_s": hostile["sent"] / 5,
           "hostile_refused_fraction": hostile["refused"] / max(hostile["sent"], 1)}
    rec["p50_ratio"] = rec["attacked_p50_ms"] / rec["alone_p50_ms"]
    print(f"RTT p50 alone {rec['alone_p50_ms']:.1f} ms, with 2 hostile robots {rec['attacked_p50_ms']:.1f} ms "
          f"({rec['p50_ratio']:.2f}x); hostile robots sent {rec['hostile_frames_per_s']:.0f} frames/s", flush=True)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}


# -------------------------------------------------------------------------------------------------
# Report and CLI
# -------------------------------------------------------------------------------------------------


def write_report(out: Path, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    env, r = summary["environment"], summary["rtt"]
    lines = [f"# Hostile clients ({env['preset']}, LIBERO observations)", "", f"Command: `{env['command']}`", "",
             f"Machine: {env['cpu_count']} CPUs, {env['platform']}; load average {env['load_before']} before, "
             f"{env['load_after']} after (the machine is shared).", "",
             "| start-up to healthy | s |", "|---|---|",
             *[f"| {k} | {v} |" for k, v in summary.get("startup", {}).items()], "",
             "| server memory (RSS) | MiB (seconds, counts) |", "|---|---|",
             *[f"| {k} | {v} |" for k, v in summary.get("memory", {}).items()], ""]
    if r:
        lines += ["| robot round trip | p50 ms | p90 ms |", "|---|---|---|",
                  f"| alone | {r['alone_p50_ms']:.1f} | {r['alone_p90_ms']:.1f} |",
                  f"| with 2 hostile robots | {r['attacked_p50_ms']:.1f} | {r['attacked_p90_ms']:.1f} |", "",
                  f"p50 ratio {r['p50_ratio']:.2f}x over {r['frames_per_condition']} frames per condition; the "
                  f"hostile robots sent {r['hostile_frames_per_s']:.0f} frames/s, "
                  f"{100 * r['hostile_refused_fraction']:.0f}% refused.", ""]
    (out / "report.md").write_text("\n".join(lines))


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m eval.serving.serve_bench_hostile", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
    ap.add_argument("--steps", type=_positive_int, default=10, help="denoising steps")
    ap.add_argument("--clients", type=_positive_int, default=64, help="idle and non-reading clients")
    ap.add_argument("--send-timeout", type=float, default=5.0, help="the memory server's --send-timeout")
    ap.add_argument("--frames", type=_positive_int, default=100, help="robot frames per round and condition")
    ap.add_argument("--repeats", type=_positive_int, default=3, help="alternating rounds (alone, attacked)")
    ap.add_argument("--attack-lead", type=float, default=1.0, help="seconds the attack runs before measuring")
    ap.add_argument("--only", nargs="+", choices=["startup", "memory", "rtt"], default=["startup", "memory", "rtt"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--hostile", metavar="URL", help=argparse.SUPPRESS)  # the attacker process
    ap.add_argument("--seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    import platform

    args = _parser().parse_args(argv)
    if args.hostile:
        return hostile_main(args.hostile, args.seconds, robots=2)
    if args.out is None:
        _parser().error("--out DIR is required")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"preset": args.preset, "steps": args.steps, "cpu_count": os.cpu_count(), "platform": platform.platform(),
           "jax": _version("jax"), "websockets": _version("websockets"),
           "command": " ".join(["python", "-m", "eval.serving.serve_bench_hostile", *sys.argv[1:]]),
           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_before": [round(x, 2) for x in os.getloadavg()]}
    summary = {"environment": env, "startup": {}, "memory": {}, "rtt": {}}
    with tempfile.TemporaryDirectory(prefix="oxygen-cache-") as cache_dir:
        if "startup" in args.only:
            summary["startup"] = measure_startup(args, args.out, cache_dir)
        else:
            port = _free_port()  # fill the cache once so the other servers start in seconds
            stop_server(start_server(server_command(args, port, cache_dir), port, args.out / "server_startup.log",
                                     1800)[0])
        if "memory" in args.only:
            summary["memory"] = measure_memory(args, args.out, cache_dir)
        if "rtt" in args.only:
            summary["rtt"] = measure_rtt(args, args.out, cache_dir)
    env["load_after"] = [round(x, 2) for x in os.getloadavg()]
    write_report(args.out, summary)
    print(f"wrote {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
