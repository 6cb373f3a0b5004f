"""The asynchronous chunk client (oxygen_jax/client.py) against loopback servers: a model-free openpi-protocol
server whose replies the test releases (so every count is exact whatever the machine load), as oxygen_jax's
server and as any other openpi server, and oxygen_jax's real server with training-time RTC.

Chunk k of the scripted server is a[j] = (100 k + j, -(100 k + j)): every action names its chunk and index."""

from __future__ import annotations

import ast
import sys
import threading
import time

import numpy as np
import pytest

from helpers import REPO
from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.client import AsyncChunkClient

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

HA = 8


def _openpi():
    try:
        from openpi_client import msgpack_numpy, websocket_client_policy
    except ImportError:
        pytest.skip("openpi-client not installed: pip install --no-deps -r requirements-test.txt")
    return msgpack_numpy, websocket_client_policy


def _chunk(k: int) -> np.ndarray:
    v = 100.0 * k + np.arange(HA, dtype=np.float32)
    return np.stack([v, -v], axis=1)


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


class ScriptedServer:
    """openpi's protocol on 127.0.0.1; frame k is answered with `_chunk(k)` once the test releases `gate`."""

    def __init__(self, metadata: dict):
        from websockets.sync.server import serve

        self.msgpack, _ = _openpi()
        self.metadata, self.frames, self.gate = metadata, [], threading.Semaphore(0)
        self.oxygen = metadata.get("server") == "oxygen_jax"
        self._server = serve(self._handle, "127.0.0.1", 0, compression=None)
        self.port = self._server.socket.getsockname()[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _handle(self, ws) -> None:
        ws.send(self.msgpack.packb(self.metadata))
        for message in ws:
            k = len(self.frames)
            self.frames.append(self.msgpack.unpackb(message))
            self.gate.acquire()
            reply = {"actions": _chunk(k)}
            if self.oxygen:
                reply["rtc"] = {"chunk": 100 + k, "new_from": 0, "fallback": None}
            ws.send(self.msgpack.packb(reply))

    def close(self) -> None:
        self._server.shutdown()


def _client(server: ScriptedServer, **kw) -> AsyncChunkClient:
    _, wcp = _openpi()
    return AsyncChunkClient(wcp.WebsocketClientPolicy(host="127.0.0.1", port=server.port), **kw)


OXYGEN_META = {"server": "oxygen_jax", "rtc": {"field": "rtc"}}


@pytest.mark.parametrize("meta", [OXYGEN_META, {}], ids=["oxygen_jax", "any_openpi_server"])
def test_chunks_are_spliced_by_consumed_actions_and_a_late_reply_holds_the_last_action(meta):
    """s = 3: a request every 3 actions of a chunk; a reply after c consumed actions is continued at its index c;
    a reply later than the chunk lasts holds the chunk's last action, then continues at index c (clamped). RTC
    fields go only to oxygen_jax's server."""
    server = ScriptedServer(meta)
    obs = {"observation/state": np.zeros(8, np.float32)}
    server.gate.release()  # the first chunk
    with _client(server, execution_horizon=3, rtc={"mode": "guided"}, initial_delay=1) as robot:
        got = [robot.act(obs) for _ in range(4)]  # chunk 0 [0..3]; the 4th step sends request 1 (executed 3)
        _wait(lambda: len(server.frames) == 2, "request 1")
        got.append(robot.act(obs))  # chunk 0 [4]: c = 2 so far
        server.gate.release()
        _wait(robot.ready, "reply 1")
        got += [robot.act(obs) for _ in range(2)]  # chunk 1 [2], then [3] with request 2 sent (executed 3)
        _wait(lambda: len(server.frames) == 3, "request 2")
        got += [robot.act(obs) for _ in range(6)]  # chunk 1 [4..7], then its last action held twice
        server.gate.release()
        _wait(robot.ready, "reply 2")
        got.append(robot.act(obs))  # c = 7: chunk 2 [7], and request 3 sent at once (executed 7)
        _wait(lambda: len(server.frames) == 4, "request 3")
        want = [(0, j) for j in range(5)] + [(1, j) for j in (2, 3, 4, 5, 6, 7, 7, 7)] + [(2, 7)]
        np.testing.assert_array_equal(np.stack(got), np.stack([_chunk(k)[j] for k, j in want]))
        assert robot.stats.delays == [2, 7] and robot.stats.holds == 2 and robot.stats.requests == 4
        assert robot.stats.boundary_jumps == [98.0, 100.0]  # chunk 0 [4] -> chunk 1 [2]; chunk 1 [7] -> chunk 2 [7]
        server.gate.release()
    sent = [f.get("rtc") for f in server.frames]
    if meta:
        assert sent == [{"mode": "guided"},
                        {"mode": "guided", "chunk": 100, "executed": 3, "delay": 1},
                        {"mode": "guided", "chunk": 101, "executed": 3, "delay": 2},  # max of the measured so far
                        {"mode": "guided", "chunk": 102, "executed": 7, "delay": 1}]  # cut to what is left (8 - 7)
    else:
        assert sent == [None] * 4 and robot.rtc is None
    server.close()


def test_synchronous_execution_waits_for_every_chunk_and_starts_it_at_index_0():
    server = ScriptedServer({})
    server.gate.release(4)
    with _client(server, execution_horizon=3, asynchronous=False) as robot:
        got = np.stack([robot.act({}) for _ in range(8)])
    np.testing.assert_array_equal(got, np.stack([_chunk(k)[j] for k in range(3) for j in range(3)][:8]))
    assert robot.stats.delays == [0, 0] and robot.stats.holds == 0
    server.close()


def test_openpi_policy_interface_infer_returns_one_action_and_reset_starts_a_fresh_chunk():
    """`infer` is `act` in ActionChunkBroker's form; `reset` drops the chunk in flight and fetches a new one."""
    server = ScriptedServer({})
    server.gate.release(2)
    with _client(server, execution_horizon=2) as robot:
        got = [robot.infer({})["actions"] for _ in range(3)]  # chunk 0 [0, 1], then [2] with request 1 sent
        robot.reset()  # waits for reply 1 (released above) and drops it
        server.gate.release()
        got.append(robot.infer({})["actions"])  # a fresh chunk 2 from its start
    np.testing.assert_array_equal(np.stack(got), np.stack([_chunk(0)[0], _chunk(0)[1], _chunk(0)[2], _chunk(2)[0]]))
    assert len(server.frames) == 3
    server.close()


def test_a_server_error_reaches_the_control_loop_and_bad_arguments_are_one_line_errors():
    class Failing:
        def get_server_metadata(self):
            return {}

        def infer(self, obs):
            raise RuntimeError("Error in inference server:\nBadRequest: observation/state missing")

    with pytest.raises(RuntimeError, match="BadRequest"):
        with AsyncChunkClient(Failing(), execution_horizon=2) as robot:
            robot.act({})
    for kw, msg in [(dict(execution_horizon=0), "execution_horizon must be an integer >= 1"),
                    (dict(execution_horizon=2, initial_delay=-1), "initial_delay must be an integer >= 0")]:
        with pytest.raises(ValueError, match=msg):
            AsyncChunkClient(Failing(), **kw)


def test_the_client_module_imports_numpy_and_the_standard_library_only():
    tree = ast.parse((REPO / "oxygen_jax" / "client.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__", "numpy"} <= set(sys.stdlib_module_names), names


# -------------------------------------------------------------------------------------------------
# oxygen_jax's server


def test_against_oxygen_jax_server_each_chunk_continues_the_executed_actions(tiny_params):
    """Training-time RTC, s = 4, announced delay 2, replies taken after 2 consumed actions: every new chunk's
    first 2 actions are exactly the 2 actions the robot executed while it was computed, so the executed stream
    continues the old chunk through the splice; the server names no fallback after the first chunk."""
    from oxygen_jax.robots.config import robot_config
    from oxygen_jax.robots import transforms
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer
    from oxygen_jax.runtime.engine import Engine, EngineConfig
    from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread

    _, wcp = _openpi()
    robot_cfg = robot_config("libero", max_token_len=16)
    tok = train_demo_tokenizer()
    engine = Engine(as_vla(tiny_params, 2), EngineConfig(num_slots=1, max_new_tokens=1, admissions_per_frame=1, tokens_per_frame=1,
                                              action_horizon=robot_cfg.action_horizon), tokenizer=tok)
    handle = ServerThread(PolicyServer(engine, tok, robot_cfg, ServeConfig(port=0, buckets=(1,), rtc=True))).start()
    handle.wait_ready(timeout=600)
    replies = []

    class Recording:
        def __init__(self, policy):
            self.policy = policy

        def get_server_metadata(self):
            return self.policy.get_server_metadata()

        def infer(self, obs):
            replies.append(self.policy.infer(obs))
            return replies[-1]

    obs = transforms.synthetic_sample(robot_cfg, np.random.default_rng(0), prompt="pick")
    executed = []
    with AsyncChunkClient(Recording(wcp.WebsocketClientPolicy(host="127.0.0.1", port=handle.port)),
                          execution_horizon=4, rtc={"mode": "trained"}, initial_delay=2) as robot:
        while len(replies) < 4:
            sent = robot.stats.requests
            executed.append(robot.act(obs))
            if robot.stats.requests > sent and len(executed) > 1:  # a request left: 2 actions, then its reply
                executed.append(robot.act(obs))
                _wait(robot.ready, "a chunk")
        executed.append(robot.act(obs))  # takes the last reply
    handle.stop()
    assert [r["rtc"]["fallback"] is None for r in replies] == [False, True, True, True]
    for before, after in zip(replies, replies[1:]):
        r = after["rtc"]
        assert (r["mode"], r["executed"], r["delay"], r["previous"]) == ("trained", 4, 2, before["rtc"]["chunk"])
        np.testing.assert_array_equal(after["actions"][:2], before["actions"][4:6])
    assert robot.stats.delays == [2, 2, 2] and robot.stats.holds == 0
