"""Hostile clients: each attack of issue 18's list (1-8) against a live server, while a well-behaved robot
keeps getting its own actions (equal to `Engine.step` on its observation and the served noise).

One tiny real-engine server per module (the engine config and batch sizes of `test_serve.py`, so one
process compiles them once) with small limits, so every timeout here fires within a second or two.
Attackers connect from 127.0.0.2 and up (all loopback on Linux), the good robot from 127.0.0.1, so the
per-address cap holds attackers without touching the robot. Connection caps that need many idle
connections at once use a model-free `ScriptedEngine` server with no first-frame timeout.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import chex
import msgpack
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax import serve
from oxygen_jax.robots import transforms
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from oxygen_jax.runtime.engine import Engine
from oxygen_jax.serving import wire
from oxygen_jax.serving.codec import frame_noise
from oxygen_jax.serving.requests import RefusalBudget
from oxygen_jax.serving.server import MAX_REPLY_CHARS, PolicyServer, ServeConfig, ServerThread
from test_serve import AD, ENGINE_CONFIG, HA, ROBOT, SEED, ScriptedEngine, _http

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

GOOD = "127.0.0.1"
LIMITS = ServeConfig(
    host="127.0.0.1", port=0, buckets=(1, 4), seed=SEED, deadline_ms=1000, max_deadline_ms=1000,
    max_robots=4, max_connections=16, max_connections_per_peer=8, first_frame_timeout_s=3.0, idle_timeout_s=20.0,
    send_timeout_s=1.0, write_limit=4096, send_buffer_bytes=8192, max_prompt_chars=200, max_message_bytes=1 << 20,
    max_refusals_per_s=1000.0)  # attackers are not throttled here (see test_2_refused_frames_are_read_at_...)


class SpyTokenizer:
    """The demo tokenizer, recording (thread name, text length) of every `encode`."""

    def __init__(self, tok):
        self._tok, self.calls, self._lock = tok, [], threading.Lock()

    def encode(self, text, **kw):
        with self._lock:
            self.calls.append((threading.current_thread().name, len(text)))
        return self._tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


# -------------------------------------------------------------------------------------------------
# Fixtures and clients
# -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return SpyTokenizer(train_demo_tokenizer())


@pytest.fixture(scope="module")
def server(tiny_params, tok):
    handle = ServerThread(PolicyServer(Engine(as_vla(tiny_params, 2), ENGINE_CONFIG, tokenizer=tok), tok, ROBOT, LIMITS)).start()
    handle.wait_ready(timeout=600)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference(tiny_params, tok, server):
    """An engine with the served config (its steps reuse the server's compiled programs)."""
    return Engine(as_vla(tiny_params, 2), ENGINE_CONFIG, tokenizer=tok._tok)


@pytest.fixture
def quiet(server):
    """The shared server with every earlier test's connection gone (robot slots free)."""
    for _ in range(1000):
        if not server.server._streams:
            break
        time.sleep(0.01)
    assert not server.server._streams, "connections of an earlier test are still open"
    return server


def _sample(i: int, prompt: str | None = None) -> dict:
    return transforms.synthetic_sample(ROBOT, np.random.default_rng(100 + i), prompt=prompt or f"robot {i} task")


def _ws(port: int, source: str = GOOD, **kw):
    """A websockets client from address `source`; returns (socket, metadata)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    ws = connect(f"ws://127.0.0.1:{port}", sock=sock, compression=None, max_size=None, proxy=None, **kw)
    return ws, wire.unpack(ws.recv(timeout=10))


def _metric(port: int, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = _http(port, "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            if (f"{s.name}{{{labels}}}" if labels else s.name) == name:
                return s.value
    return 0.0


def _good_robot(port: int, frames: int = 3, robot: int = 0) -> list[tuple]:
    """A lock-step robot from 127.0.0.1: [(sample, stream, frame, actions)] of `frames` replies."""
    ws, meta = _ws(port)
    sample, got = _sample(robot), []
    for _ in range(frames):
        ws.send(wire.pack(sample))
        reply = ws.recv(timeout=30)
        assert isinstance(reply, bytes), f"the good robot was refused: {reply}"
        reply = wire.unpack(reply)
        got.append((sample, meta["stream"], reply["frame"], reply["actions"]))
    ws.close()
    return got


def _assert_engine_actions(reference: Engine, tok, got: list[tuple]) -> None:
    """Each served chunk equals `Engine.step` on its observation with the served noise rule."""
    for sample, stream, frame, actions in got:
        obs = transforms.make_observation(ROBOT, reference.vla.spec.backbone, tok, [sample])
        chunk = reference.step(obs, frame_noise(SEED, stream, frame, HA, AD)[None]).actions[0]
        expected = transforms.robot_outputs(ROBOT, chunk, transforms.client_state(ROBOT, sample))
        chex.assert_trees_all_close(actions, expected, atol=1e-5)


def _served_during(attack, reference, tok, port: int, frames: int = 3) -> list:
    """Runs `attack(started)` in a thread; once it sets `started`, the good robot streams; returns the attack's
    result (it must finish within 60 s)."""
    started, result, errors = threading.Event(), [], []

    def run():
        try:
            result.append(attack(started))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(60)
    _assert_engine_actions(reference, tok, _good_robot(port, frames))
    t.join(60)
    assert not t.is_alive() and not errors, errors
    return result[0]


def _refusals(port: int, source: str, frames: list, started: threading.Event, rounds: int = 1) -> list[str]:
    """One connection sends `frames` (`rounds` times), reading each reply; then a valid frame must still work."""
    ws, _ = _ws(port, source)
    replies = []
    for r in range(rounds):
        for i, frame in enumerate(frames):
            ws.send(frame)
            replies.append(ws.recv(timeout=30))
            started.set()
    ws.send(wire.pack(_sample(50)))
    assert isinstance(ws.recv(timeout=30), bytes), "the attacker's own connection stopped serving valid frames"
    ws.close()
    return replies


def _assert_short_bad_requests(replies: list, frames: list) -> None:
    for reply, frame in zip(replies, frames):
        assert isinstance(reply, str) and reply.startswith("BadRequest: "), reply
        assert "\n" not in reply and "Traceback" not in reply and len(reply) <= MAX_REPLY_CHARS, reply[:200]


# -------------------------------------------------------------------------------------------------
# 1. Idle connections, one peer's connections, a full server
# -------------------------------------------------------------------------------------------------


def test_1_idle_handshakes_take_no_robot_slot_and_are_closed_1008(quiet, reference, tok):
    port, c = quiet.port, LIMITS
    idle = [_ws(port, "127.0.0.2")[0] for _ in range(c.max_robots + 2)]  # more handshakes than robot slots
    assert _http(port, "/healthz")[0] == 200
    _assert_engine_actions(reference, tok, _good_robot(port))
    for ws in idle:  # closed after first_frame_timeout_s without a frame
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10 + c.first_frame_timeout_s)
        assert closed.value.rcvd.code == 1008 and "no first frame" in closed.value.rcvd.reason
    assert _metric(port, "oxygen_connections_refused_total{reason=idle}") >= len(idle)


def test_1_one_address_cannot_take_every_connection_and_healthz_says_full():
    engine = ScriptedEngine()
    handle = ServerThread(PolicyServer(engine, train_demo_tokenizer(), ROBOT, ServeConfig(
        host="127.0.0.1", port=0, buckets=(1, 2), seed=SEED, max_connections=6, max_connections_per_peer=3,
        first_frame_timeout_s=None))).start()
    try:
        handle.wait_ready(timeout=60)
        port = handle.port
        robot, meta = _ws(port)
        held = [_ws(port, "127.0.0.2")[0] for _ in range(3)]
        with pytest.raises(InvalidStatus) as refused:  # the 4th from one address
            _ws(port, "127.0.0.2")
        assert refused.value.response.status_code == 503
        assert _http(port, "/healthz")[0] == 200
        held += [_ws(port, "127.0.0.3")[0] for _ in range(2)]  # 6 connections: nobody else can connect
        status, text = _http(port, "/healthz")
        assert status == 503 and json.loads(text)["status"] == "full"
        with pytest.raises(InvalidStatus):
            _ws(port, "127.0.0.4")
        for f in range(3):  # the robot already connected keeps being served
            robot.send(wire.pack(_sample(0)))
            reply = wire.unpack(robot.recv(timeout=10))
            np.testing.assert_array_equal(reply["actions"], frame_noise(SEED, meta["stream"], f, HA, AD)[:, :7])
        for ws in held + [robot]:
            ws.close()
    finally:
        handle.stop()


# -------------------------------------------------------------------------------------------------
# 2. Frames cheap to send and costly to refuse; tokenizing off the engine thread
# -------------------------------------------------------------------------------------------------


def test_2_costly_prompts_are_refused_before_tokenizing_while_others_are_served(quiet, reference, tok):
    c, valid = LIMITS, _sample(60)
    many_tokens = " ".join("qzxj"[i % 4] for i in range(c.max_prompt_chars // 2))  # short text, many tokens
    frames = [
        wire.pack({**valid, "prompt": "pick " * 13_000}),  # 65,000 characters (msgpack str)
        wire.pack({**valid, "prompt": b"pick " * 100_000}),  # 500 kB as msgpack bin
        wire.pack({**valid, "prompt": "x" * (c.max_prompt_chars + 1)}),
        wire.pack({**valid, "language_requests": [{"prompt": "y" * 65_000}]}),
        wire.pack({**valid, "language_requests": [{"prompt": many_tokens}]}),  # > prompt_capacity tokens
    ]
    before = len(tok.calls)

    def two_attackers(started):
        out = [None, None]
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _refusals(
            quiet.port, f"127.0.0.{2 + i}", frames, started, rounds=3))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    for replies in _served_during(two_attackers, reference, tok, quiet.port):
        _assert_short_bad_requests(replies, frames * 3)
        why = ("msgpack", "bytes", "characters", "msgpack", "prompt_capacity")  # the wire's str cap, prompt_of, ...
        assert all(why[i % 5] in r for i, r in enumerate(replies)), replies[:5]
    assert max(n for _, n in tok.calls[before:]) <= c.max_prompt_chars  # nothing longer was ever tokenized


def test_2_language_prompts_are_tokenized_on_prep_threads_never_on_the_engine_thread(quiet, tok):
    before = len(tok.calls)
    ws, _ = _ws(quiet.port)
    sample = {**_sample(1), "language_requests": [{"prompt": "Subtask: ", "max_tokens": 3, "id": "plan"}]}
    finished = []
    for _ in range(6):
        ws.send(wire.pack(sample))
        finished += wire.unpack(ws.recv(timeout=30))["language"]["finished"]
        sample = _sample(1)
        if finished:
            break
    ws.close()
    assert [f["tag"] for f in finished] == ["plan"] and len(finished[0]["tokens"]) == 3
    threads = {name for name, _ in tok.calls[before:]}
    assert any(name.startswith("oxygen-prep") for name in threads), threads
    assert not any(name.startswith("oxygen-engine") for name in threads), threads


def test_2_refused_frames_are_read_at_the_refusal_rate_after_a_burst():
    budget = RefusalBudget(rate=4.0)
    assert [budget.charge(0.0) for _ in range(4)] == [0.0] * 4  # a burst of `rate` refusals is free
    assert budget.charge(0.0) == pytest.approx(0.25)  # then one per 1/rate seconds
    assert budget.charge(0.25) == pytest.approx(0.25)
    assert budget.charge(10.0) == 0.0  # ten quiet seconds refill the burst, and no more than it
    assert [budget.charge(10.0) for _ in range(4)] == [0.0, 0.0, 0.0, pytest.approx(0.25)]
    with pytest.raises(ValueError, match="rate"):
        RefusalBudget(0.0)

    handle = ServerThread(PolicyServer(ScriptedEngine(), train_demo_tokenizer(), ROBOT, ServeConfig(
        host="127.0.0.1", port=0, buckets=(1,), seed=SEED, max_refusals_per_s=2.0))).start()
    try:
        handle.wait_ready(timeout=60)
        ws, meta = _ws(handle.port)
        for _ in range(5):  # refused frames: after a burst of two, each is read only after a wait
            ws.send("not an observation")
            assert ws.recv(timeout=10).startswith("BadRequest: ")
        assert _metric(handle.port, "oxygen_connections_refused_total{reason=throttled}") >= 1
        ws.send(wire.pack(_sample(0)))  # the same connection is served as soon as its frames are good
        reply = wire.unpack(ws.recv(timeout=10))
        np.testing.assert_array_equal(reply["actions"], frame_noise(SEED, meta["stream"], 0, HA, AD)[:, :7])
        ws.close()
    finally:
        handle.stop()


# -------------------------------------------------------------------------------------------------
# 3. A client that never reads
# -------------------------------------------------------------------------------------------------


def test_3_a_client_that_never_reads_is_dropped_after_the_send_timeout(quiet, reference, tok):
    port = quiet.port
    dropped = _metric(port, "oxygen_connections_refused_total{reason=send_timeout}")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes back up soon
    sock.bind(("127.0.0.2", 0))
    sock.connect(("127.0.0.1", port))
    ws = connect(f"ws://127.0.0.1:{port}", sock=sock, compression=None, max_size=None, max_queue=1, proxy=None)

    def never_read():
        start, sent = time.perf_counter(), 0
        try:
            while time.perf_counter() - start < 60:  # text frames: each answered with a refusal nobody reads
                ws.send("x")
                sent += 1
        except (ConnectionClosed, OSError):
            return sent
        return None  # still connected after a minute

    result = []
    attacker = threading.Thread(target=lambda: result.append(never_read()), daemon=True)
    attacker.start()
    _assert_engine_actions(reference, tok, _good_robot(port))  # served while the attacker's replies back up
    for _ in range(3000):
        if _metric(port, "oxygen_connections_refused_total{reason=send_timeout}") > dropped:
            break
        time.sleep(0.01)
    assert _metric(port, "oxygen_connections_refused_total{reason=send_timeout}") == dropped + 1
    attacker.join(60)
    assert result and result[0] is not None  # its sends failed once the server dropped it
    _assert_engine_actions(reference, tok, _good_robot(port))


def _raw_client(port: int, source: str, rcvbuf: int) -> socket.socket:
    """A websocket client on a bare socket with a small receive buffer: after the handshake it reads nothing, so
    whatever the server sent it stays in this socket's kernel buffer (FIONREAD) and nowhere else on its side."""
    import base64
    import os

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)  # byte by byte: nothing after the headers is taken out of the buffer
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _masked_binary_frame(payload: bytes) -> bytes:
    mask = np.frombuffer(b"\x11\x22\x33\x44", np.uint8)
    body = np.frombuffer(payload, np.uint8) ^ np.resize(mask, len(payload))
    return b"\x82\xff" + len(payload).to_bytes(8, "big") + mask.tobytes() + body.tobytes()


def _frames_started(data: bytes) -> int:
    """How many server frames begin in `data` (complete or cut off at its end)."""
    count, at = 0, 0
    while at + 2 <= len(data):
        n, at, count = data[at + 1] & 0x7F, at + 2, count + 1
        if n >= 126:
            size = 2 if n == 126 else 8
            n, at = int.from_bytes(data[at:at + size], "big"), at + size
        at += n
    return count


def test_3_a_client_that_takes_no_replies_is_answered_at_most_two_frames_ahead(quiet):
    """Frames answered for a client beyond the replies its TCP took (all in its own kernel buffer): at most 2."""
    import fcntl
    import termios

    port = quiet.port
    ok = _metric(port, "oxygen_frames_total{outcome=ok}")
    sock = _raw_client(port, "127.0.0.2", 4096)
    frame = _masked_binary_frame(wire.pack(_sample(70)))

    def flood():
        try:
            while True:
                sock.sendall(frame)
        except OSError:
            pass

    threading.Thread(target=flood, daemon=True).start()
    answered, waiting = -1, 0.0
    for _ in range(400):  # until the count of answered frames has stood still for 0.3 s (before the send timeout)
        time.sleep(0.02)
        now = _metric(port, "oxygen_frames_total{outcome=ok}") - ok
        waiting = waiting + 0.02 if now == answered else 0.0
        answered = now
        if waiting >= 0.3:
            break
    held = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    taken = _frames_started(sock.recv(held, socket.MSG_PEEK)) - 1  # less the metadata frame
    sock.close()
    assert answered >= 1 and answered <= taken + 2, (answered, taken)


# -------------------------------------------------------------------------------------------------
# 4. Refusals never echo large values; 5. deep nesting is a bad request, not an internal error
# -------------------------------------------------------------------------------------------------


def test_4_refusals_quote_at_most_a_few_dozen_characters_of_any_value(quiet, reference, tok):
    valid = _sample(61)

    def lang(**fields):
        return wire.pack({**valid, "language_requests": [{"prompt": "p", **fields}]})

    frames = [
        lang(max_tokens="9" * 800),  # the longest str the wire takes (4 x max_prompt_chars bytes)
        lang(max_tokens=b"9" * 500_000),
        lang(max_tokens=list(range(4000))),
        lang(temperature={f"k{i}": i for i in range(4000)}),
        lang(id="t" * 800),
        lang(adapter="a" * 128),  # refused by the request limits on the prep thread
        wire.pack({**valid, "language_requests": [{"prompt": "p", **{f"{'f' * 700}{i}": 1 for i in range(40)}}]}),
        wire.pack({**valid, "deadline_ms": [1.0] * 4000}),
        wire.pack({**valid, "observation/state": b"s" * 500_000}),
        wire.pack({**valid, "observation/image": "i" * 800}),
    ]
    replies = _served_during(lambda started: _refusals(quiet.port, "127.0.0.2", frames, started), reference, tok,
                             quiet.port)
    _assert_short_bad_requests(replies, frames)
    assert max(map(len, replies)) <= 400, max(replies, key=len)


def test_5_deep_nesting_is_a_one_line_bad_request_and_nothing_is_logged_as_an_error(quiet, reference, tok, caplog):
    valid = _sample(62)

    def nested(depth: int, kind=dict):
        value = 0
        for _ in range(depth):
            value = {"k": value} if kind is dict else [value]
        return value

    plain = {k: v for k, v in valid.items() if isinstance(v, str)}
    frames = [msgpack.packb({**plain, "x": nested(1000)}), msgpack.packb({**plain, "x": nested(1000, list)}),
              msgpack.packb({**plain, "x": nested(17)}), b"\x91" * 100_000 + b"\xc0",
              wire.pack({**valid, "observation/image": nested(20)})]  # deep where the image check recursed
    caplog.set_level(logging.INFO, logger="oxygen_jax.serve")
    replies = _served_during(lambda started: _refusals(quiet.port, "127.0.0.2", frames, started), reference, tok,
                             quiet.port)
    _assert_short_bad_requests(replies, frames)
    assert all("deep" in r or "nest" in r or "msgpack" in r for r in replies)
    # refused frames leave rate-limited WARNING lines (serving.refusal_log); nothing else, and no error
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert all(" frame refused: " in m and "\n" not in m for m in loud), loud
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], loud


# -------------------------------------------------------------------------------------------------
# 6. A robot that declares an hour and goes quiet
# -------------------------------------------------------------------------------------------------


def test_6_a_declared_hour_long_deadline_is_capped_and_a_quiet_robot_is_not_waited_for(quiet, reference, tok):
    port = quiet.port
    lazy, meta = _ws(port, "127.0.0.2")
    replies = []
    for _ in range(3):  # a quick robot at first: an observed period of a few milliseconds
        lazy.send(wire.pack({**_sample(3), "deadline_ms": 3_600_000}))
        replies.append(wire.unpack(lazy.recv(timeout=30)))
    # ... then it goes quiet (connection open): the good robot's frames fire without waiting for it.
    t0 = time.perf_counter()
    got = _good_robot(port, frames=4)
    per_frame = (time.perf_counter() - t0) / 4
    assert per_frame < LIMITS.max_deadline_ms / 2e3, f"the good robot waited {per_frame * 1e3:.0f} ms per frame"
    _assert_engine_actions(reference, tok, got)
    assert all(r["server_timing"]["deadline_ms"] == LIMITS.max_deadline_ms for r in replies)  # capped by the server
    stream = quiet.server._streams[meta["stream"]]
    assert stream.expect_s < LIMITS.max_deadline_ms / 1e3  # expected back for its period, not its deadline
    for bad in (float("nan"), float("inf"), 0, -5, 1e300, "100", True):  # refused, the connection kept
        lazy.send(wire.pack({**_sample(3), "deadline_ms": bad}))
        reply = lazy.recv(timeout=30)
        assert isinstance(reply, str) and reply.startswith("BadRequest: deadline_ms"), reply
    lazy.close()


# -------------------------------------------------------------------------------------------------
# 7. Operations: logging, bind before load, SIGTERM during warm-up, an unusable compile cache
# -------------------------------------------------------------------------------------------------


def test_7_bind_failures_are_one_line_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(serve, "build", lambda args: pytest.fail("the model was loaded before the port was bound"))
    monkeypatch.setattr(serve, "configure_logging", lambda level: None, raising=False)  # keep pytest's handlers
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        for argv, name in ([["--port", str(port)], "already in use"], [["--host", "no-such-host.invalid"], "--host"]):
            assert serve.main(["--preset", "tiny", "--compile-cache", "none", *argv]) == 2
            err = capsys.readouterr().err
            assert name in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_7_an_unusable_compile_cache_does_not_stop_the_server(monkeypatch, tmp_path, caplog):
    reached = []

    def build(args):
        reached.append(args.compile_cache)
        raise ValueError("stop here")

    monkeypatch.setattr(serve, "build", build)
    monkeypatch.setattr(serve, "configure_logging", lambda level: None, raising=False)  # keep pytest's handlers
    caplog.set_level(logging.WARNING, logger="oxygen_jax.serve")  # an earlier main(--log-level ERROR) may linger
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = str(blocker / "cache")  # a directory inside a file: cannot be created
    assert serve.main(["--preset", "tiny", "--port", "0", "--compile-cache", cache]) == 1
    assert reached == [cache]  # went on to load the model
    assert any("compilation cache" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_7_logging_is_configured_after_absl_with_levels_and_timestamps():
    import absl.logging  # noqa: F401 - what orbax imports: it installs its own root handler first

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        serve.configure_logging("INFO")
        mine = [h for h in root.handlers if type(h) is logging.StreamHandler]
        assert root.level == logging.INFO and len(mine) == 1
        record = logging.LogRecord("oxygen_jax.serve", logging.INFO, __file__, 1, "ready", None, None)
        line = mine[0].format(record)
        assert line.endswith("INFO oxygen_jax.serve: ready") and line[:4].isdigit()  # a timestamp first
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_7_sigterm_during_warm_up_is_answered_after_the_compile_in_progress():
    class SlowWarmup(ScriptedEngine):
        def __init__(self):
            super().__init__()
            self.calls, self.release = 0, threading.Event()

        def warmup(self, observation, states=None):
            self.calls += 1
            self.entered.set()
            self.release.wait(30)
            return 0.0

    engine = SlowWarmup()
    handle = ServerThread(PolicyServer(engine, train_demo_tokenizer(), ROBOT, ServeConfig(
        host="127.0.0.1", port=0, buckets=(1, 2, 4, 8)))).start()
    assert engine.entered.wait(30) and _http(handle.port, "/healthz")[0] == 503
    stopper = threading.Thread(target=handle.stop)
    stopper.start()
    for _ in range(1000):
        if handle.server._draining:
            break
        time.sleep(0.01)
    engine.release.set()  # the compile in progress finishes; no further batch size is compiled
    stopper.join(30)
    assert not stopper.is_alive() and engine.calls <= 2  # of the 8 warm-up calls of 4 batch sizes


# -------------------------------------------------------------------------------------------------
# 8. Values that pass float64 checks and break in float32; over-long prompts' warnings
# -------------------------------------------------------------------------------------------------


# The tokenizer warns per distinct over-long length; the server filters that warning out at start-up, and
# pytest restores the filters around every test, so the test re-installs the same filter.
@pytest.mark.filterwarnings(r"ignore:prompt has \d+ tokens, more than max_len:UserWarning")
def test_8_float32_breaking_values_are_refused_and_long_prompts_warn_once(quiet, reference, tok, caplog):
    valid = _sample(63)
    frames = [
        wire.pack({**valid, "language_requests": [{"prompt": "p", "top_p": 1e-300}]}),
        wire.pack({**valid, "language_requests": [{"prompt": "p", "temperature": 1e300}]}),
        wire.pack({**valid, "observation/state": np.full(8, 1e300)}),
    ]
    replies = _served_during(lambda started: _refusals(quiet.port, "127.0.0.2", frames, started), reference, tok,
                             quiet.port)
    _assert_short_bad_requests(replies, frames)
    assert "top_p" in replies[0] and "temperature" in replies[1] and "state" in replies[2]

    caplog.set_level(logging.WARNING, logger="oxygen_jax.serve")
    ws, _ = _ws(quiet.port, "127.0.0.2")
    for n in range(40, 50):  # ten distinct over-long prompt lengths (longer than the 32 prompt tokens)
        ws.send(wire.pack({**valid, "prompt": " ".join("ab"[i % 2] for i in range(n))}))
        assert isinstance(ws.recv(timeout=30), bytes)  # cut to fit and served
    ws.close()
    warned = [r for r in caplog.records if "filled all" in r.getMessage()]
    assert len(warned) <= 1 and (warned or quiet.server._truncation_quiet >= 10)  # one line for all ten at most
