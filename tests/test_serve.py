"""The policy server: openpi's protocol for unmodified clients, several robots batched on one engine,
language delivered to its owner exactly once, bad input answered without harm, a responsive event
loop, graceful shutdown and the exact command line.

Servers: one tiny real-engine server (buckets 1 and 4) in a thread, shared by most tests; model-free
`ScriptedEngine` servers for the timing-sensitive protocol tests; and one `python -m oxygen_jax.serve`
subprocess on two simulated CPU devices, started first so it compiles while the other tests run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import chex
import msgpack
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from helpers import REPO
from oxygen_jax.models.pi05.model import HEAD, as_vla
from oxygen_jax.models.pi05.params import abstract_params
from oxygen_jax.robots import transforms
from oxygen_jax.serving import wire
from oxygen_jax.serving.batcher import bucket_for, expected_streams, fire_delay
from oxygen_jax.serving.codec import frame_noise, make_codec
from oxygen_jax.serving.records import Frame, Stream
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.robots.config import robot_config
from oxygen_jax.runtime.engine import Engine, EngineConfig, FinishedRequest, StepResult
from oxygen_jax.runtime.request_limits import CheckedRequest, RequestLimits
from oxygen_jax.serve import _parser, main, serve_config
from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread
from oxygen_jax.robots.tokenizer import train_demo_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

ROBOT = robot_config("libero", max_token_len=32)
HA, AD = ROBOT.action_horizon, 32
SEED = 7
STEPS = 2  # denoising steps of the served π0.5
ENGINE_CONFIG = EngineConfig(num_slots=8, max_new_tokens=6, prompt_capacity=4, admissions_per_frame=4,
                             tokens_per_frame=2, action_horizon=HA)


def _openpi():
    try:
        from openpi_client import action_chunk_broker, websocket_client_policy
    except ImportError:
        pytest.skip("openpi-client not installed: pip install --no-deps -r requirements-test.txt")
    return websocket_client_policy, action_chunk_broker


def _sample(i: int, prompt: str | None = None) -> dict:
    return transforms.synthetic_sample(ROBOT, np.random.default_rng(100 + i), prompt=prompt or f"robot {i} task")


def _http(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = _http(port, "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _raw(port: int, **kw):
    """A plain websockets client (for frames openpi's client cannot send); returns (socket, metadata)."""
    ws = connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, **kw)
    return ws, wire.unpack(ws.recv())


def _reference(engine: Engine, tok, items, seed: int = SEED, rows: int = 1) -> list[np.ndarray]:
    """Robot actions of (sample, stream, frame) items from `Engine.step` with the served noise rule, `rows` per step."""
    out = []
    for i in range(0, len(items), rows):
        chunk = items[i:i + rows]
        samples = [s for s, _, _ in chunk] + [chunk[0][0]] * (rows - len(chunk))
        obs = transforms.make_observation(ROBOT, engine.vla.spec.backbone, tok, samples)
        noise = np.zeros((rows, HA, AD), np.float32)
        for j, (_, stream, frame) in enumerate(chunk):
            noise[j] = frame_noise(seed, stream, frame, HA, AD)
        actions = engine.step(obs, noise).actions
        out += [transforms.robot_outputs(ROBOT, actions[j], transforms.client_state(ROBOT, s)) for j, (s, _, _) in
                enumerate(chunk)]
    return out


class ScriptedEngine:
    """A model-free engine with `Engine`'s interface: actions echo the noise, and a step can be held.

    A language request finishes in the first step where its robot has a row, with `max_tokens` tokens
    of id 5 and its prompt reversed as text. Clear `gate` to hold steps; `entered` is set on entry;
    set `fail_next` to make the next step raise.
    """

    def __init__(self, step_s: float = 0.0, per_row_s: float = 0.0):
        self.config = EngineConfig(num_slots=4, max_new_tokens=8, prompt_capacity=8, action_horizon=HA)
        self.vla = as_vla(abstract_params(model_config("tiny")))  # shapes only: the codec reads the spec
        self.tokenizer = train_demo_tokenizer()  # the server tokenizes; the text comes back from the ids
        self.limits = RequestLimits(max_new_tokens=8, prompt_capacity=8, vocab_size=self.vla.vocab_size)
        self.step_s, self.per_row_s = step_s, per_row_s
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.fail_next = False
        self._live: dict[int, tuple] = {}
        self._next, self._frame = 0, 0

    def warmup(self, observation, states=None) -> float:
        return self.step_s

    def enqueue(self, request: CheckedRequest, *, owner) -> int:
        prompt = self.tokenizer.decode(list(request.prompt))
        self._live[self._next] = (prompt, request.max_tokens, request.row, owner, time.perf_counter())
        self._next += 1
        return self._next - 1

    def cancel(self, rid: int) -> bool:
        return self._live.pop(rid, None) is not None

    def requests_of(self, owner) -> list[int]:
        return [rid for rid, v in self._live.items() if v[3] is owner]

    @property
    def num_active(self) -> int:
        return len(self._live)

    num_queued = 0

    def step(self, observation, noise, *, rows, states=None) -> StepResult:
        self.entered.set()
        self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("scripted engine failure")
        time.sleep(self.step_s + self.per_row_s * sum(r >= 0 for r in rows))
        finished = []
        for rid, (prompt, m, row, owner, t) in list(self._live.items()):
            if row in rows:
                del self._live[rid]
                finished.append(FinishedRequest(
                    request_id=rid, tokens=[5] * m, text=prompt[::-1], arrival_frame=self._frame,
                    admit_frame=self._frame, finish_frame=self._frame, latency_frames=1,
                    latency_ms=(time.perf_counter() - t) * 1e3, row=row, owner=owner))
        self._frame += 1
        actions = np.asarray(noise[HEAD], np.float32)
        return StepResult(actions=actions, finished=finished, new_text={}, frame=self._frame - 1,
                          frame_ms=0.0, batch=len(finished), queued=0, head_actions={HEAD: actions})


# -------------------------------------------------------------------------------------------------
# Fixtures
# -------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    """`python -m oxygen_jax.serve --preset tiny --robot libero --port P` on 2 simulated CPU devices."""
    port, log_path = _free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"),
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "oxygen_jax.serve", "--preset", "tiny", "--robot", "libero", "--port", str(port),
           "--host", "127.0.0.1", "--batch-sizes", "2", "--steps", str(STEPS), "--prompt-len",
           str(ROBOT.max_token_len), "--compile-cache", "none", "--log-level", "WARNING"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    yield proc, port, log_path
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tok():
    return train_demo_tokenizer()


@pytest.fixture(scope="module")
def tiny(tiny_params, tok, cli_server):
    """The shared tiny real-engine server (requests `cli_server` so that subprocess compiles meanwhile)."""
    server = PolicyServer(Engine(as_vla(tiny_params, STEPS), ENGINE_CONFIG, tokenizer=tok), tok, ROBOT, ServeConfig(
        host="127.0.0.1", port=0, buckets=(1, 4), deadline_ms=1000, seed=SEED, max_message_bytes=1 << 20))
    handle = ServerThread(server).start()
    assert _http(handle.port, "/healthz")[0] in (200, 503)  # bound at once, healthy once compiled
    handle.wait_ready(timeout=600)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference(tiny_params, tok, tiny):
    """A second engine with the served config: its steps reuse the programs the server compiled."""
    return Engine(as_vla(tiny_params, STEPS), ENGINE_CONFIG, tokenizer=tok)


def _scripted_server(engine: ScriptedEngine, **config) -> ServerThread:
    handle = ServerThread(PolicyServer(engine, train_demo_tokenizer(), ROBOT, ServeConfig(
        host="127.0.0.1", port=0, buckets=(1, 2, 4), seed=SEED, **config))).start()
    handle.wait_ready(timeout=60)
    return handle


# -------------------------------------------------------------------------------------------------
# The batching policy (no server)
# -------------------------------------------------------------------------------------------------


def _frame(stream: Stream, arrival: float) -> Frame:
    return Frame(stream=stream, observation=None, state=None, language=[], arrival=arrival, future=None)


def test_a_frame_with_an_unchecked_request_is_its_own_one_line_error_and_queues_none_of_its_requests():
    from oxygen_jax.serving.engine_worker import EngineWorker
    from oxygen_jax.serving.records import LanguageRequest

    engine = ScriptedEngine()
    ok = LanguageRequest(prompt="", max_tokens=2, checked=engine.limits.check(prompt_tokens=[5], max_tokens=2))
    frame = Frame(stream=Stream(id=0, deadline_s=1.0), observation=None, state=None,
                  language=[ok, LanguageRequest(prompt="", max_tokens=2)], arrival=0.0, future=None)
    worker = EngineWorker(engine, None)
    try:
        (result,) = worker.call(worker.step, [frame], 1).results
    finally:
        worker.close()
    assert result.error == ("BadRequest: language_requests[1]: the request was not checked against the engine's "
                            "limits (serving.requests.check_requests)")
    assert engine._next == 0  # request 0 was never queued (no queue-then-cancel)


def test_fire_at_once_unless_an_expected_robot_can_still_make_the_tightest_deadline():
    a, b, c = (Stream(id=i, deadline_s=0.1, last_reply=0.0) for i in range(3))
    pending = [_frame(a, arrival=0.0)]
    assert fire_delay([], [b], 0.0, 0.03, 4) is None
    assert fire_delay(pending, [], 0.002, 0.03, 4) == 0.0  # nobody else is coming
    assert fire_delay(pending, [b], 0.002, 0.03, 4) == pytest.approx(0.068)  # wait for b until 0.1 - 0.03
    assert fire_delay(pending, [b], 0.08, 0.03, 4) == 0.0  # a's deadline would be missed: go now
    assert fire_delay(pending + [_frame(c, 0.0)], [b], 0.0, 0.03, 2) == 0.0  # the largest bucket is full
    c.deadline_s = 0.05
    assert fire_delay(pending + [_frame(c, 0.01)], [b], 0.01, 0.03, 4) == pytest.approx(0.02)  # c's is tighter
    a.deadline_s, b.deadline_s = 10.0, 0.05
    assert fire_delay(pending, [b], 0.002, 0.03, 4) == pytest.approx(0.048)  # until b stops being expected


def test_expected_robots_are_idle_and_were_answered_within_their_deadline():
    now = 10.0
    fresh, busy, stale, closed = (Stream(id=i, deadline_s=0.1, last_reply=now - 0.05) for i in range(4))
    busy.busy, stale.last_reply, closed.closed = True, now - 0.2, True
    assert expected_streams([fresh, busy, stale, closed, Stream(id=9, deadline_s=0.1)], now) == [fresh]
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="exceed the largest batch bucket 8"):
        bucket_for(9, (1, 2, 4, 8))


# -------------------------------------------------------------------------------------------------
# The tiny real-engine server
# -------------------------------------------------------------------------------------------------


def test_unmodified_openpi_client_gets_engine_step_actions_and_language_extras(tiny, reference, tok):
    client_mod, broker_mod = _openpi()
    client = client_mod.WebsocketClientPolicy(host="127.0.0.1", port=tiny.port)
    meta = client.get_server_metadata()
    assert (meta["action_horizon"], meta["action_dim"], meta["noise"]["seed"]) == (HA, 7, SEED)
    assert meta["language"]["adapters"] == ["base"]  # the engine's limits: its one list of adapter names
    assert meta["weights"] == {"quantized": None}  # float weights (a quantized model: its dtype and matmul modes)
    sample = _sample(0)
    reply = client.infer(sample)
    assert reply["actions"].shape == (HA, 7) and reply["stream"] == meta["stream"]
    assert {"infer_ms", "queue_ms", "batch"} <= set(reply["server_timing"]) and "infer_ms" in reply["policy_timing"]
    expected = _reference(reference, tok, [(sample, meta["stream"], reply["frame"])])[0]
    chex.assert_trees_all_close(reply["actions"], expected, atol=1e-5)

    # openpi's ActionChunkBroker slices every ndarray of a response per step: language extras are lists.
    broker = broker_mod.ActionChunkBroker(client, action_horizon=HA)
    sample["language_requests"] = [{"prompt": "Subtask: ", "max_tokens": 3, "id": "plan"}]
    steps = [broker.infer(sample) for _ in range(HA + 2)]  # two server calls
    assert all(s["actions"].shape == (7,) for s in steps)
    finished = {f["id"]: f for s in steps for f in s["language"]["finished"]}  # repeated per step: dedupe by id
    assert [f["tag"] for f in finished.values()] == ["plan", "plan"]
    assert all(len(f["tokens"]) == 3 and isinstance(f["text"], str) for f in finished.values())  # 1 + k tokens
    client._ws.close()


def test_four_robots_are_batched_without_cross_talk_beside_bad_and_dropped_connections(tiny, reference, tok):
    client_mod, _ = _openpi()
    frames_each, errors, robots = 30, [], {}
    valid = _sample(99)
    crafted = msgpack.packb({**{k: v for k, v in valid.items() if k != "observation/image"}, "observation/image": {
        b"__ndarray__": True, b"data": b"A" * 8, b"dtype": "|O", b"shape": [1]}}, use_bin_type=True,
        default=wire._encode)
    bad = [
        b"\x00garbage", "a text frame", wire.pack([1, 2, 3]), crafted,
        wire.pack({**valid, "observation/state": np.full(8, np.nan)}),
        wire.pack({**valid, "observation/image": np.zeros((10, 10), np.uint8)}),
        wire.pack({**valid, "observation/image": np.zeros((224, 224, 3), np.float32)}),
        wire.pack({k: v for k, v in valid.items() if k != "observation/wrist_image"}),
        wire.pack({**valid, "observation/state": np.zeros(5)}),
        wire.pack({**valid, "language_requests": [{"prompt": 5}]}),
        wire.pack({**valid, "language_requests": [{"prompt": "x", "max_tokens": 99}]}),  # refused by Engine.submit
        wire.pack({**valid, "deadline_ms": -1}),
    ]
    bad_replies = []

    def robot(r):
        try:
            client = client_mod.WebsocketClientPolicy(host="127.0.0.1", port=tiny.port)
            sample, got, accepted, finished = _sample(r), [], [], []
            f = 0
            while f < frames_each or (len(finished) < len(accepted) and f < frames_each + 20):
                obs = dict(sample)
                if f < frames_each and f % 5 == 0:
                    obs["language_requests"] = [{"prompt": "Subtask: ", "max_tokens": 6, "id": f"r{r}-f{f}"}]
                reply = client.infer(obs)
                got.append((reply["stream"], reply["frame"], reply["actions"]))
                accepted += reply["language"]["accepted"]
                finished += reply["language"]["finished"] + reply["language"]["failed"]
                f += 1
            robots[r] = (sample, got, accepted, finished)
            client._ws.close()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"robot {r}: {type(e).__name__}: {e}")

    def misbehaving():
        try:
            ws, _ = _raw(tiny.port)
            for i, message in enumerate(bad):
                ws.send(message)
                bad_replies.append(ws.recv())
                if i % 4 == 3:  # the same socket still serves valid frames
                    ws.send(wire.pack(valid))
                    assert isinstance(ws.recv(), bytes)
            ws.close()
        except Exception as e:  # noqa: BLE001
            errors.append(f"misbehaving client: {type(e).__name__}: {e}")

    def dropping():
        ws, _ = _raw(tiny.port)
        ws.send(wire.pack({**valid, "language_requests": [{"prompt": "", "max_tokens": 6, "stop_at_eos": False}]}))
        ws.close()  # mid-request: the reply and the running language request have no owner any more

    threads = [threading.Thread(target=robot, args=(r,)) for r in range(4)]
    threads += [threading.Thread(target=misbehaving)] + [threading.Thread(target=dropping) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors

    # Every malformed frame got a text reply naming the problem; the connection kept working.
    assert len(bad_replies) == len(bad)
    assert all(isinstance(m, str) and m.startswith("BadRequest: ") for m in bad_replies)
    assert "dtype '|O'" in bad_replies[3] and "NaN" in bad_replies[4] and "uint8" in bad_replies[6]
    assert "max_tokens" in bad_replies[10] and "deadline_ms" in bad_replies[11]

    # Every valid frame got its own robot's actions: equal to Engine.step on that robot's observation and noise.
    items, served = [], []
    for r, (sample, got, _, _) in sorted(robots.items()):
        assert [frame for _, frame, _ in got] == list(range(len(got)))  # frame index = the stream's count
        items += [(sample, stream, frame) for stream, frame, _ in got]
        served += [actions for _, _, actions in got]
    expected = _reference(reference, tok, items, rows=4)
    chex.assert_trees_all_close(served, expected, atol=1e-5)

    # Every accepted language request finished and reached its own robot exactly once.
    for r, (_, _, accepted, finished) in robots.items():
        assert len(accepted) == 6
        assert sorted(a["id"] for a in accepted) == sorted(f["id"] for f in finished)
        assert {f["tag"] for f in finished} == {f"r{r}-f{f}" for f in range(0, frames_each, 5)}
        assert all("error" not in f for f in finished)

    # Healthy, batched, nothing compiled after warm-up, dropped robots' requests cancelled.
    assert _http(tiny.port, "/healthz")[0] == 200
    for _ in range(100):
        m = _metrics(tiny.port)
        if m["oxygen_language_requests_total{event=cancelled}"] >= 3:
            break
        time.sleep(0.05)
    assert m["oxygen_language_requests_total{event=cancelled}"] == 3
    assert m["oxygen_compiles_after_warmup"] == 0
    assert m["oxygen_step_rows_sum"] / m["oxygen_step_rows_count"] > 1  # mean robots per step
    assert m["oxygen_frames_total{outcome=bad_request}"] >= len(bad)
    assert m["oxygen_connections"] == 0 and m["oxygen_queue_depth"] == 0


def test_crafted_array_headers_get_an_error_reply_and_the_server_lives(tiny):
    valid = _sample(1)
    ws, _ = _raw(tiny.port)
    for dtype, shape, data, match in [("|O", [1], b"A" * 8, "dtype"), ("|u1", [224, 224, 3], b"\0" * 10, "needs"),
                                      ("<f8", [2**40, 2**40, 2**40], b"\0" * 8, "at most")]:
        header = {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}
        ws.send(msgpack.packb({**{k: v for k, v in valid.items() if k != "observation/state"},
                               "observation/state": header}, use_bin_type=True, default=wire._encode))
        reply = ws.recv()
        assert isinstance(reply, str) and reply.startswith("BadRequest") and match in reply
    ws.send(wire.pack(valid))
    assert wire.unpack(ws.recv())["actions"].shape == (HA, 7)
    ws.close()
    assert _http(tiny.port, "/healthz")[0] == 200


def test_bucketed_multi_robot_step_equals_each_robots_own_step(tiny, reference, tok):
    from oxygen_jax.serving.engine_worker import EngineWorker

    codec = make_codec(reference, ROBOT, tok)
    worker = EngineWorker(reference, codec, seed=SEED)
    frames = []
    for i, stream_id in enumerate((3, 9, 12)):  # 3 robots padded to bucket 4
        sample = _sample(10 + i)
        frames.append(Frame(stream=Stream(id=stream_id, deadline_s=1.0), observation=codec.prepare(sample),
                            state=transforms.client_state(ROBOT, sample), language=[], arrival=time.perf_counter(),
                            future=None, index=5 + i))
    out = worker.call(worker.step, frames, 4)
    worker.close()
    assert (out.rows, out.bucket) == (3, 4)
    alone = _reference(reference, tok, [(_sample(10 + i), f.stream.id, f.index) for i, f in enumerate(frames)], rows=1)
    chex.assert_trees_all_close([r.actions for r in out.results], alone, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# Model-free servers: a responsive loop, size limits, graceful shutdown
# -------------------------------------------------------------------------------------------------


def test_healthz_and_keepalive_pings_are_answered_while_a_step_blocks():
    engine = ScriptedEngine()
    handle = _scripted_server(engine)
    try:
        engine.gate.clear()
        engine.entered.clear()
        replies = []

        def robot():  # pings every 1 s with a 1 s timeout: a loop blocked by the step would drop it (1011)
            ws, _ = _raw(handle.port, ping_interval=1, ping_timeout=1)
            ws.send(wire.pack(_sample(0)))
            replies.append(ws.recv(timeout=30))
            ws.close()

        t = threading.Thread(target=robot)
        t.start()
        assert engine.entered.wait(30)
        start = time.perf_counter()
        status = _http(handle.port, "/healthz")
        healthz_ms = (time.perf_counter() - start) * 1e3
        assert status[0] == 200 and not engine.gate.is_set()  # answered while the step is still running
        assert _metrics(handle.port)["oxygen_queue_depth"] == 0
        time.sleep(3.0)  # three missed-pong windows for the client
        engine.gate.set()
        t.join(30)
        assert len(replies) == 1 and isinstance(replies[0], bytes), f"healthz took {healthz_ms:.1f} ms"
        assert wire.unpack(replies[0])["actions"].shape == (HA, 7)
    finally:
        engine.gate.set()
        handle.stop()


def test_oversize_frame_closes_1009_and_other_robots_continue():
    handle = _scripted_server(ScriptedEngine(), max_message_bytes=400_000)  # a LIBERO frame is 301 KB
    try:
        big, (small, meta) = _raw(handle.port), _raw(handle.port)
        big[0].send(b"\0" * 500_000)
        with pytest.raises(ConnectionClosed) as closed:
            big[0].recv(timeout=10)
        assert closed.value.rcvd.code == 1009
        small.send(wire.pack(_sample(2)))
        reply = wire.unpack(small.recv(timeout=10))
        np.testing.assert_array_equal(reply["actions"], frame_noise(SEED, meta["stream"], 0, HA, AD)[:, :7])
        small.close()
    finally:
        handle.stop()


def test_a_robot_that_leaves_stops_being_waited_for():
    handle = _scripted_server(ScriptedEngine())
    try:
        (a, _), (b, _) = _raw(handle.port), _raw(handle.port)
        a.send(wire.pack(_sample(0)))
        assert isinstance(a.recv(timeout=10), bytes)  # a was just answered: expected back for a minute
        a.send(wire.pack({**_sample(0), "deadline_ms": 60_000}))
        a.recv(timeout=10)
        b.send(wire.pack({**_sample(1), "deadline_ms": 60_000}))  # b waits for a to batch with it ...
        a.close()  # ... until a leaves
        assert isinstance(b.recv(timeout=10), bytes)
        b.close()
    finally:
        handle.stop()


def test_a_full_queue_answers_busy_and_the_robot_can_retry():
    engine = ScriptedEngine()
    handle = _scripted_server(engine, max_pending=1)
    try:
        engine.gate.clear()
        engine.entered.clear()
        (a, _), (b, _), (c, _) = _raw(handle.port), _raw(handle.port), _raw(handle.port)
        a.send(wire.pack(_sample(0)))
        assert engine.entered.wait(30)  # a is in the step, b fills the queue
        b.send(wire.pack(_sample(1)))
        for _ in range(1000):
            if handle.server.batcher.queue_depth == 1:
                break
            time.sleep(0.01)
        c.send(wire.pack(_sample(2)))
        assert c.recv(timeout=10).startswith("busy: ")
        engine.gate.set()
        assert all(isinstance(ws.recv(timeout=10), bytes) for ws in (a, b))
        c.send(wire.pack(_sample(2)))  # retry on the same connection
        assert wire.unpack(c.recv(timeout=10))["actions"].shape == (HA, 7)
        assert _metrics(handle.port)["oxygen_frames_total{outcome=busy}"] == 1
        for ws in (a, b, c):
            ws.close()
    finally:
        engine.gate.set()
        handle.stop()


def test_an_engine_failure_logs_the_traceback_sends_its_id_and_closes_1011_and_the_server_carries_on(caplog):
    engine = ScriptedEngine()
    handle = _scripted_server(engine)
    try:
        (ws, _), (other, _) = _raw(handle.port), _raw(handle.port)
        engine.fail_next = True
        ws.send(wire.pack(_sample(0)))
        text = ws.recv(timeout=10)
        assert isinstance(text, str) and text.startswith("Internal server error (id ")
        assert "Traceback" not in text and "scripted engine failure" not in text  # no source paths to clients
        error_id = text.split("(id ", 1)[1].split(")", 1)[0]
        logged = [r for r in caplog.records if error_id in r.getMessage()]
        assert logged and "scripted engine failure" in str(logged[0].exc_info[1])
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 1011
        other.send(wire.pack(_sample(1)))
        assert wire.unpack(other.recv(timeout=10))["frame"] == 0
        assert _http(handle.port, "/healthz")[0] == 200
        assert _metrics(handle.port)["oxygen_frames_total{outcome=error}"] == 1
        other.close()
    finally:
        handle.stop()


def test_shutdown_answers_frames_already_received_then_closes_1001():
    engine = ScriptedEngine()
    handle = _scripted_server(engine)
    engine.gate.clear()
    engine.entered.clear()
    (a, meta_a), (b, meta_b), (c, _) = _raw(handle.port), _raw(handle.port), _raw(handle.port)
    a.send(wire.pack(_sample(0)))
    assert engine.entered.wait(30)  # a's frame is in a step
    b.send(wire.pack({**_sample(1), "language_requests": [{"prompt": "abc", "id": "late"}]}))
    for _ in range(1000):  # b's frame is queued behind it
        if handle.server.batcher.queue_depth == 1:
            break
        time.sleep(0.01)
    stopper = threading.Thread(target=handle.stop)
    stopper.start()  # what SIGTERM does in the CLI
    for _ in range(1000):
        if _http(handle.port, "/healthz")[0] == 503:
            break
        time.sleep(0.01)
    c.send(wire.pack(_sample(2)))
    assert c.recv(timeout=10).startswith("unavailable: ")  # new work is refused, politely
    engine.gate.set()
    ra, rb = wire.unpack(a.recv(timeout=10)), wire.unpack(b.recv(timeout=10))
    np.testing.assert_array_equal(ra["actions"], frame_noise(SEED, meta_a["stream"], 0, HA, AD)[:, :7])
    np.testing.assert_array_equal(rb["actions"], frame_noise(SEED, meta_b["stream"], 0, HA, AD)[:, :7])
    assert [f["text"] for f in rb["language"]["finished"]] == ["cba"]
    for ws in (a, b, c):
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 1001
    stopper.join(30)
    assert not stopper.is_alive()


def test_a_frame_still_being_decoded_at_shutdown_is_answered():
    handle = _scripted_server(ScriptedEngine())
    server, held, entered = handle.server, threading.Event(), threading.Event()
    prepare = server._prepare

    def slow_prepare(message):
        entered.set()
        held.wait(30)
        return prepare(message)

    server._prepare = slow_prepare
    ws, meta = _raw(handle.port)
    ws.send(wire.pack(_sample(3)))
    assert entered.wait(30)  # received, still being decoded
    stopper = threading.Thread(target=handle.stop)
    stopper.start()
    for _ in range(1000):
        if _http(handle.port, "/healthz")[0] == 503:
            break
        time.sleep(0.01)
    held.set()
    reply = wire.unpack(ws.recv(timeout=10))
    np.testing.assert_array_equal(reply["actions"], frame_noise(SEED, meta["stream"], 0, HA, AD)[:, :7])
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=10)
    assert closed.value.rcvd.code == 1001
    stopper.join(30)
    assert not stopper.is_alive()


# -------------------------------------------------------------------------------------------------
# The command line
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, name", [
    (["--preset", "tiny", "--bogus", "1"], "--bogus"), (["--port", "99999"], "--port"),
    (["--robot", "ur5"], "--robot"), (["--batch-sizes", "4,2"], "--batch-sizes"),
    (["--preset", "tiny", "--ckpt", "x"], "--ckpt"), (["--deadline-ms", "0"], "--deadline-ms"),
])
def test_bad_flags_are_rejected_by_name_in_one_line(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and name in err and len(err.strip().splitlines()) == 1


def test_every_server_limit_and_rtc_is_settable_from_the_command_line():
    default = serve_config(_parser().parse_args([]))
    assert default == ServeConfig(buckets=default.buckets)  # the CLI's defaults are the library's
    cfg = serve_config(_parser().parse_args(["--rtc", "--max-refusals-per-s", "5", "--send-buffer-kb", "16",
                                             "--max-connections-per-peer", "3", "--idle-timeout", "7"]))
    assert (cfg.rtc, cfg.max_refusals_per_s, cfg.send_buffer_bytes) == (True, 5.0, 16 << 10)
    assert (cfg.max_connections_per_peer, cfg.idle_timeout_s) == (3, 7.0)


def test_missing_or_damaged_checkpoints_are_one_line_errors(tmp_path, capsys):
    damaged = tmp_path / "params"
    damaged.mkdir()
    (damaged / "_METADATA").write_text("{not json")
    for ckpt in (tmp_path / "absent", damaged):
        assert main(["--ckpt", str(ckpt), "--compile-cache", "none", "--log-level", "ERROR"]) == 1
        err = capsys.readouterr().err
        assert f"cannot load checkpoint {ckpt}" in err and len(err.strip().splitlines()) == 1
        assert "Traceback" not in err


def test_cli_server_shards_robots_over_two_devices_and_exits_0_on_sigterm(cli_server, reference, tok):
    proc, port, log_path = cli_server
    bad = subprocess.run([sys.executable, "-m", "oxygen_jax.serve", "--preset", "tiny", "--bogus"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "python -m oxygen_jax.serve: error: unrecognized arguments: --bogus (see --help)"]
    for _ in range(1200):
        assert proc.poll() is None, log_path.read_text()
        if _http(port, "/healthz")[0] == 200:
            break
        time.sleep(0.25)
    sockets = [_raw(port) for _ in range(2)]
    assert all(meta["devices"] == 2 for _, meta in sockets)
    samples = [_sample(20), _sample(21)]
    for (ws, _), sample in zip(sockets, samples):  # both queued before the step: one batch of 2, one row per device
        ws.send(wire.pack(sample))
    replies = [wire.unpack(ws.recv(timeout=60)) for ws, _ in sockets]
    # The CLI's parameters are tiny_params (seed 0) with an unrolled layer loop; noise seed 0.
    expected = _reference(reference, tok, [(s, r["stream"], r["frame"]) for s, r in zip(samples, replies)], seed=0)
    chex.assert_trees_all_close([r["actions"] for r in replies], expected, atol=1e-5)
    assert _metrics(port)["oxygen_compiles_after_warmup"] == 0

    closes, stop = [], threading.Event()

    def traffic(ws, sample):
        try:
            while True:
                ws.send(wire.pack(sample))
                reply = ws.recv(timeout=60)
                assert isinstance(reply, bytes) or reply.startswith("unavailable: ")
                stop.set()
        except ConnectionClosed as e:
            closes.append(e.rcvd.code if e.rcvd else None)

    threads = [threading.Thread(target=traffic, args=(ws, s)) for (ws, _), s in zip(sockets, samples)]
    for t in threads:
        t.start()
    assert stop.wait(60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log_path.read_text()
    for t in threads:
        t.join(30)
    assert closes == [1001, 1001]
