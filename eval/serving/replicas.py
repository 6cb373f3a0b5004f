"""Replicas behind HAProxy on loopback: two tiny policy servers, one balancer, unmodified openpi clients.

    python -m eval.serving.replicas                      # results in eval/results/replicas_<UTC date>/
    python -m eval.serving.replicas --out DIR --haproxy /usr/sbin/haproxy

Starts replica A (`--max-robots 2`) and replica B (`--max-robots 8`), renders
`eval/serving/haproxy_replicas.cfg.template` for them, checks it with `haproxy -c`, starts HAProxy, and drives
robots (`openpi_client.WebsocketClientPolicy` at `ws://127.0.0.1:<balancer>/?robot=<id>`) through it:

1. spread: four robots connect; leastconn places two on each replica; every reply is a finite action chunk.
2. full: A is full (/healthz 503), HAProxy marks it down; two new robots both go to B (leastconn alone
   would have put one on A) without a handshake being tried on A (A's refusals at the handshake are
   retried on another replica, so this is what tells the health check from the retry), and A's two
   robots keep being served on their connections.
3. sticky: one of A's robots leaves (A is up again with a free slot); a robot of B reconnects under its
   id and returns to B, though A has fewer connections.
4. killed: B is killed (SIGKILL); once HAProxy marks it down, a robot of B reconnecting under its id is
   served by A; when A is full again, the next robot is refused with HTTP 503 by the balancer.

Every robot's frames are counted per replica and compared with each replica's own frame counter
(`oxygen_frames_total{outcome="ok"}`; B's just before it is killed): each robot stayed on its replica. The replica a connection went to
is read from the upgrade response's `X-Oxygen-Replica` header (added by the configuration). The exit
code is 0 when every check passed; `result.json` and `result.md` say which did.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eval.serving.serve_bench import REPO, start_server, stop_server

TEMPLATE = Path(__file__).with_name("haproxy_replicas.cfg.template")
HA, ACTION_DIM = 10, 7  # the tiny preset's chunk for LIBERO


def render_haproxy(servers: Sequence[tuple[str, int]], *, bind_host: str = "127.0.0.1", bind_port: int = 8000,
                   stats_host: str = "127.0.0.1", stats_port: int = 8404, check_interval: str = "2s", fall: int = 2,
                   rise: int = 2, per_source: int = 64, stick_expire: str = "30m", maxconn: int = 4096) -> str:
    """The HAProxy configuration for replicas at `servers` ((host, port) each, named replica0, replica1, ...)."""
    if not servers:
        raise ValueError("render_haproxy needs at least one (host, port) replica")
    lines = "\n".join(f"    server replica{i} {host}:{port}" for i, (host, port) in enumerate(servers))
    return string.Template(TEMPLATE.read_text()).substitute(
        servers=lines, bind_host=bind_host, bind_port=bind_port, stats_host=stats_host, stats_port=stats_port,
        check_interval=check_interval, fall=fall, rise=rise, per_source=per_source, stick_expire=stick_expire,
        maxconn=maxconn)


# -------------------------------------------------------------------------------------------------
# Processes and probes
# -------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _counter(port: int, name: str, **labels: str) -> float:
    """One sample of a replica's metrics, e.g. `oxygen_frames_total{outcome="ok"}`; 0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(_get(f"http://127.0.0.1:{port}/metrics")[1]):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def _states(stats_port: int) -> dict[str, str]:
    """HAProxy's view of each replica: name -> "UP", "DOWN", ... (its CSV statistics)."""
    try:
        header, *rows = _get(f"http://127.0.0.1:{stats_port}/stats;csv")[1].lstrip("# ").splitlines()
    except OSError:  # not listening yet
        return {}
    cols = header.split(",")
    out = {}
    for row in rows:
        r = dict(zip(cols, row.split(",")))
        if r.get("pxname") == "replicas" and r.get("svname", "").startswith("replica"):
            out[r["svname"]] = r["status"]
    return out


def _wait_state(stats_port: int, name: str, prefix: str, timeout_s: float = 10.0) -> float | None:
    """Seconds until HAProxy reports `name` in a state starting with `prefix` ("UP", "DOWN"); None: not in time."""
    t0 = time.perf_counter()
    while not _states(stats_port).get(name, "").startswith(prefix):
        if time.perf_counter() - t0 > timeout_s:
            return None
        time.sleep(0.05)
    return time.perf_counter() - t0


def _waited(seconds: float | None) -> str:
    return "not within 10 s" if seconds is None else f"seen after waiting {seconds:.2f} s"


class Robot:
    """One unmodified openpi client through the balancer, under the robot id `rid`."""

    def __init__(self, rid: str, balancer_port: int):
        from openpi_client import websocket_client_policy
        from oxygen_jax.robots.config import robot_config
        from oxygen_jax.robots import transforms

        self.rid = rid
        self.client = websocket_client_policy.WebsocketClientPolicy(f"ws://127.0.0.1:{balancer_port}/?robot={rid}")
        self.replica = self.client._ws.response.headers["X-Oxygen-Replica"]  # the client keeps the handshake here
        self.sample = transforms.synthetic_sample(robot_config("libero"), np.random.default_rng(sum(rid.encode())),
                                                  prompt=f"{rid} picks up the bowl")
        self.frames = 0

    def act(self, n: int) -> bool:
        """`n` frames; True when every reply is a finite [HA, 7] chunk."""
        good = True
        for _ in range(n):
            actions = np.asarray(self.client.infer(self.sample)["actions"])
            good &= actions.shape == (HA, ACTION_DIM) and bool(np.isfinite(actions).all())
            self.frames += 1
        return good

    def close(self) -> None:
        self.client._ws.close()


# -------------------------------------------------------------------------------------------------
# The scenario
# -------------------------------------------------------------------------------------------------


class _Checks:
    def __init__(self):
        self.items: list[dict] = []

    def __call__(self, phase: str, what: str, ok: bool, detail=None) -> bool:
        self.items.append({"phase": phase, "check": what, "ok": bool(ok), "detail": detail})
        print(f"[{'ok' if ok else 'FAIL'}] {phase}: {what}" + (f" ({detail})" if detail is not None else ""), flush=True)
        return bool(ok)


def run(args, out: Path, tmp: Path) -> dict:
    check, frames = _Checks(), 4
    ports = {"A": _free_port(), "B": _free_port()}
    lb, stats = _free_port(), _free_port()
    common = [sys.executable, "-m", "oxygen_jax.serve", "--preset", "tiny", "--robot", "libero", "--host", "127.0.0.1",
              "--batch-sizes", "1,2,4", "--max-connections-per-peer", "256", "--log-level", "WARNING"]
    procs, ready_s = {}, {}
    try:
        for name, max_robots in (("A", 2), ("B", 8)):  # one after the other: B reads what A compiled from the cache
            cmd = common + ["--port", str(ports[name]), "--max-robots", str(max_robots)]
            procs[name], ready_s[name] = start_server(cmd, ports[name], tmp / f"replica_{name}.log", args.timeout)
        cfg = out / "haproxy.cfg"
        cfg.write_text(render_haproxy([("127.0.0.1", ports["A"]), ("127.0.0.1", ports["B"])], bind_port=lb,
                                      stats_port=stats, check_interval="250ms", fall=2, rise=2))
        checked = subprocess.run([args.haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
        check("config", "haproxy -c accepts the rendered configuration", checked.returncode == 0,
              (checked.stdout + checked.stderr).strip()[-300:])
        log = open(tmp / "haproxy.log", "w")
        procs["haproxy"] = subprocess.Popen([args.haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
        if _wait_state(stats, "replica0", "UP") is None or _wait_state(stats, "replica1", "UP") is None:
            raise RuntimeError(f"HAProxy does not see both replicas up: {_states(stats)}; see {tmp / 'haproxy.log'}")
        name_of = {"replica0": "A", "replica1": "B"}
        robots: dict[str, Robot] = {}  # connected now, by id
        history: list[Robot] = []  # every connection made

        def connect(rid: str) -> Robot:
            robots[rid] = r = Robot(rid, lb)
            history.append(r)
            return r

        def stayed(name: str, phase: str) -> None:  # every frame of a robot placed on `name` was answered there
            counted = _counter(ports[name], "oxygen_frames_total", outcome="ok")
            sent = sum(r.frames for r in history if name_of[r.replica] == name)
            check(phase, f"{name} answered exactly the frames of the robots placed on it", counted == sent,
                  {f"{name} counted": counted, f"robots on {name} sent": sent})

        # 1. spread
        for i in range(4):
            connect(f"r{i}").act(1)  # the first frame takes the robot slot
        placed = {rid: name_of[r.replica] for rid, r in robots.items()}
        check("spread", "four robots: two on each replica", sorted(placed.values()) == ["A", "A", "B", "B"], placed)
        check("spread", "every reply a finite [10, 7] chunk", all(r.act(frames) for r in robots.values()))
        on_a = [rid for rid, n in placed.items() if n == "A"]
        on_b = [rid for rid, n in placed.items() if n == "B"]

        # 2. full
        healthz = json.loads(_get(f"http://127.0.0.1:{ports['A']}/healthz")[1])
        check("full", "A's /healthz is 503 full with 0 robot slots free",
              healthz["status"] == "full" and healthz["robot_slots_free"] == 0, healthz)
        down_s = _wait_state(stats, "replica0", "DOWN")
        check("full", "HAProxy marks the full replica A down", down_s is not None, _waited(down_s))
        tried = _counter(ports["A"], "oxygen_connections_refused_total", reason="robots")
        new = [connect("r4"), connect("r5")]
        for r in new:
            r.act(1)
        check("full", "both new robots go to B", [name_of[r.replica] for r in new] == ["B", "B"],
              {r.rid: name_of[r.replica] for r in new})
        tried = _counter(ports["A"], "oxygen_connections_refused_total", reason="robots") - tried
        check("full", "HAProxy did not even try A (A refused no handshake)", tried == 0, f"{tried:.0f} refused")
        on_b += [r.rid for r in new]
        check("full", "A's robots keep being served while A is down", all(robots[rid].act(frames) for rid in on_a))

        # 3. sticky
        leaving = robots.pop(on_a.pop(0))
        leaving.close()
        up_s = _wait_state(stats, "replica0", "UP")
        check("sticky", "A is up again once a robot left", up_s is not None, _waited(up_s))
        back = on_b[-1]
        robots[back].close()
        again = connect(back)
        check("sticky", f"{back} reconnects under its id to B (A has fewer connections)",
              name_of[again.replica] == "B" and again.act(frames), name_of[again.replica])

        # 4. killed
        stayed("B", "stay")
        procs["B"].send_signal(signal.SIGKILL)
        procs["B"].wait()
        down_s = _wait_state(stats, "replica1", "DOWN")
        check("killed", "HAProxy marks the killed replica B down", down_s is not None, _waited(down_s))
        for rid in on_b:
            robots.pop(rid).close()
        moved = connect(on_b[0])
        check("killed", f"{moved.rid} (stuck to B) reconnects and is served by A",
              name_of[moved.replica] == "A" and moved.act(frames), name_of[moved.replica])
        refused = None
        try:
            connect(on_b[1])
        except Exception as e:  # noqa: BLE001 - websockets' InvalidStatus carries the balancer's response
            refused = getattr(getattr(e, "response", None), "status_code", repr(e))
        check("killed", "with A full and B dead the next robot is refused with HTTP 503", refused == 503, refused)
        check("killed", "A's robots are still served", all(robots[rid].act(1) for rid in robots))

        stayed("A", "stay")
        for r in robots.values():
            r.close()
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                if name == "haproxy":
                    p.terminate()
                    p.wait(10)
                else:
                    stop_server(p)
    return {"checks": check.items, "ready_s": {k: round(v, 1) for k, v in ready_s.items()},
            "haproxy": subprocess.run([args.haproxy, "-v"], capture_output=True, text=True).stdout.splitlines()[0]}


def _write(out: Path, result: dict) -> None:
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    passed = sum(c["ok"] for c in result["checks"])
    lines = [f"# Replicas behind HAProxy on loopback ({result['date']})", "",
             f"`python -m eval.serving.replicas`: two tiny replicas (A: --max-robots 2, B: --max-robots 8) behind "
             f"{result['haproxy']}, openpi clients through the balancer. Start-up to healthy: "
             f"A {result['ready_s'].get('A')} s, B {result['ready_s'].get('B')} s. "
             f"{passed} of {len(result['checks'])} checks passed. Configuration: [haproxy.cfg](haproxy.cfg).", "",
             "| phase | check | result | detail |", "|---|---|---|---|"]
    for c in result["checks"]:
        detail = "" if c["detail"] is None else str(c["detail"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {c['phase']} | {c['check']} | {'ok' if c['ok'] else 'FAIL'} | {detail} |")
    (out / "result.md").write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    p.add_argument("--out", type=Path, default=REPO / "eval" / "results" / f"replicas_{today}")
    p.add_argument("--haproxy", default=shutil.which("haproxy") or "/usr/sbin/haproxy")
    p.add_argument("--logs", type=Path, default=None, help="where the logs go (default: a new temporary folder)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a replica may take to become healthy")
    args = p.parse_args(argv)
    if not Path(args.haproxy).exists():
        print(f"haproxy not found at {args.haproxy}; install it (apt-get install haproxy) or pass --haproxy PATH")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="oxygen_replicas_")) if args.logs is None else args.logs
    logs.mkdir(parents=True, exist_ok=True)
    result = {"date": today, **run(args, args.out, logs)}
    _write(args.out, result)
    print(f"wrote {args.out}/result.md; the replicas' and HAProxy's logs are in {logs}")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
