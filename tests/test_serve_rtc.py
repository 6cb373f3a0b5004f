"""Real-time chunking through the policy server (serving.rtc_session): two robots with different delays and
execution horizons, batched in one engine, each get chunks that continue their own previous chunk (training-time
RTC reproduces the committed actions exactly), a third with exact guidance gets chunks nearer its previous chunk
than the plain ones; an unmodified openpi client on the same server is served as without RTC; fallbacks and bad
"rtc" fields are answered per frame; nothing compiles after warm-up."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.robots.config import robot_config
from oxygen_jax.robots import transforms
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from oxygen_jax.runtime.engine import Engine, EngineConfig
from oxygen_jax.serving import rtc_session
from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

ROBOT = robot_config("libero", max_token_len=16)
HA = ROBOT.action_horizon
SEED = 3
CFG = EngineConfig(num_slots=2, max_new_tokens=2, prompt_capacity=0, admissions_per_frame=1, tokens_per_frame=1,
                   action_horizon=HA)
FRAMES = 4
ROBOTS = {"a": dict(executed=3, delay=1), "b": dict(executed=2, delay=4)}  # (s, d) per robot, training-time RTC
GUIDED = dict(executed=4, delay=2)  # robot "c", exact guidance


def _client():
    try:
        from openpi_client import websocket_client_policy
    except ImportError:
        pytest.skip("openpi-client not installed: pip install --no-deps -r requirements-test.txt")
    return websocket_client_policy.WebsocketClientPolicy


def _sample(i: int) -> dict:
    return transforms.synthetic_sample(ROBOT, np.random.default_rng(50 + i), prompt=f"robot {i}")


@pytest.fixture(scope="module")
def served(tiny_params):
    client = _client()
    tok = train_demo_tokenizer()
    server = PolicyServer(Engine(as_vla(tiny_params, 3), CFG, tokenizer=tok), tok, ROBOT, ServeConfig(
        port=0, buckets=(2,), deadline_ms=500, seed=SEED, rtc=True))
    handle = ServerThread(server).start()
    handle.wait_ready(timeout=600)
    logs, errors = {}, []

    def robot(name: str, i: int) -> None:
        try:
            policy = client(host="127.0.0.1", port=handle.port)
            frames, last = [], None
            for f in range(FRAMES):
                obs = dict(_sample(i))
                if name in ROBOTS:
                    obs["rtc"] = {"mode": "trained"} if last is None else {"chunk": last, **ROBOTS[name]}
                elif name == "c":
                    obs["rtc"] = {"mode": "guided", "schedule": "ones", "max_guidance": 10.0} if last is None else {
                        "chunk": last, **GUIDED}
                out = policy.infer(obs)
                frames.append((obs, out))
                last = out.get("rtc", {}).get("chunk")
            logs[name] = dict(meta=policy.get_server_metadata(), frames=frames)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=robot, args=(n, i)) for i, n in enumerate(["a", "b", "c", "openpi"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    yield server, handle, logs
    handle.stop()


@pytest.mark.parametrize("name", sorted(ROBOTS))
def test_each_robot_gets_chunks_continuing_its_own_previous_chunk(served, name):
    """Frame k's actions [0, d) are frame k-1's actions [s, s + d) bit for bit (mode "trained"), with the robot's
    own s and d; the reply names the chunk it continued and where the new actions start."""
    _, _, logs = served
    frames = logs[name]["frames"]
    s, d = ROBOTS[name]["executed"], ROBOTS[name]["delay"]
    first = frames[0][1]["rtc"]
    assert first["new_from"] == 0 and first["fallback"] and first["mode"] == "off"
    for (_, before), (_, now) in zip(frames, frames[1:]):
        r = now["rtc"]
        assert r["previous"] == before["rtc"]["chunk"] and r["chunk"] == r["previous"] + 1
        assert (r["mode"], r["executed"], r["delay"], r["new_from"], r["fallback"]) == ("trained", s, d, d, None)
        np.testing.assert_array_equal(now["actions"][:d], before["actions"][s:s + d])
        assert np.max(np.abs(now["actions"][d:] - before["actions"][s + d:s + d + 1])) > 1e-4  # new actions after


def test_the_two_robots_were_batched_and_are_not_continuing_each_other(served):
    _, _, logs = served
    a, b = logs["a"]["frames"], logs["b"]["frames"]
    assert max(out["server_timing"]["batch"] for _, out in a + b) == 2
    assert np.max(np.abs(a[-1][1]["actions"][:1] - b[-2][1]["actions"][2:3])) > 1e-3


def _plain(server, obs: dict, stream: int, frame: int) -> np.ndarray:
    """The chunk `Engine.step` gives this observation with the served noise rule, without RTC (robot units)."""
    inputs, states = server.codec.batch([server.codec.prepare(obs)], 2)
    noise = server.codec.noise(SEED, [stream], [frame], 2)
    res = server.worker.call(lambda: server.engine.step(inputs, noise, rows=[-1, -1], states=states))
    return server.codec.outputs(res.head_actions, 0, transforms.client_state(ROBOT, obs))[0]


def test_a_guided_robot_gets_chunks_closer_to_its_previous_chunk_than_the_plain_chunk(served):
    """Exact guidance (schedule ones: the whole overlap Ha - s): the served chunk's overlap is nearer to the
    previous chunk's remaining actions than the plain chunk of the same observation and noise is."""
    server, _, logs = served
    frames, stream = logs["c"]["frames"], logs["c"]["meta"]["stream"]
    s = GUIDED["executed"]
    for (_, before), (obs, now) in zip(frames, frames[1:]):
        assert (now["rtc"]["mode"], now["rtc"]["new_from"], now["rtc"]["fallback"]) == ("guided", 2, None)
        target = before["actions"][s:]
        err = lambda a: float(np.sqrt(np.mean((a[:HA - s] - target) ** 2)))  # noqa: E731
        assert err(now["actions"]) < 0.8 * err(_plain(server, obs, stream, now["frame"]))


def test_an_unmodified_openpi_client_is_served_as_without_rtc(served):
    """No "rtc" key in its responses, and its actions are the plain `Engine.step` chunk of the served noise rule
    (to float32 rounding: its row may sit at another batch position, beside RTC rows)."""
    server, _, logs = served
    log = logs["openpi"]
    assert log["meta"]["rtc"]["field"] == "rtc"  # the metadata tells RTC clients; openpi's client ignores it
    stream = log["meta"]["stream"]
    for obs, out in log["frames"]:
        assert "rtc" not in out and out["actions"].shape == (HA, ROBOT.action_dim)
        np.testing.assert_allclose(out["actions"], _plain(server, obs, stream, out["frame"]), atol=1e-5, rtol=0)
    assert server.compiles_after_warmup == 0


def test_fallbacks_and_bad_rtc_fields_are_answered_per_frame(served):
    server, handle, _ = served
    policy = _client()(host="127.0.0.1", port=handle.port)
    obs = _sample(7)
    first = policy.infer({**obs, "rtc": {"mode": "guided", "delay": 2}})["rtc"]
    unknown = policy.infer({**obs, "rtc": {"chunk": first["chunk"] + 40, "executed": 1}})["rtc"]
    assert unknown["new_from"] == 0 and "not one of this connection's last" in unknown["fallback"]
    ended = policy.infer({**obs, "rtc": {"chunk": unknown["chunk"], "executed": HA}})["rtc"]
    assert ended["new_from"] == 0 and "executed to its end" in ended["fallback"]
    late = policy.infer({**obs, "rtc": {"chunk": ended["chunk"], "executed": HA - 1, "delay": 5}})["rtc"]
    assert (late["mode"], late["delay"], late["new_from"]) == ("guided", 1, 1)  # cut to what is left
    for bad, msg in [({"executed": 1}, "go together"), ({"mode": "fast"}, "rtc.mode must be one of"),
                     ({"chunk": 0, "executed": HA + 1}, r"rtc.executed must be an integer in \[0, 10\]"),
                     ({"max_guidance": -1}, "max_guidance"), ({"horizon": 3}, "unknown keys"), ([1], "must be a map")]:
        with pytest.raises(RuntimeError, match=msg):
            policy.infer({**obs, "rtc": bad})
    assert policy.infer(obs)["actions"].shape == (HA, ROBOT.action_dim)  # the connection stays usable
    with pytest.raises(ValueError, match="ALOHA"):
        rtc_session.RtcSessions.for_engine(server.engine, "aloha")
    with pytest.raises(ValueError, match="needs per-token flow time"):  # a head without it (joint_kv, cross)
        rtc_session.parse({"mode": "trained"}, HA, trained_ok=False)


def test_a_server_on_a_device_mesh_compiles_the_rtc_program_at_warm_up(tiny_params):
    """On a mesh, warm-up runs padding steps (no row asks for RTC); the RTC program must be among them, or the
    first RTC frame would compile while robots wait. A one-device mesh takes the same warm-up path."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    client = _client()
    mesh = Mesh(np.array(jax.devices()[:1]), ("robots",))
    params = jax.device_put(tiny_params, NamedSharding(mesh, PartitionSpec()))
    tok = train_demo_tokenizer()
    server = PolicyServer(Engine(as_vla(params, 3), CFG, tokenizer=tok), tok, ROBOT, ServeConfig(
        port=0, buckets=(1,), deadline_ms=500, seed=SEED, rtc=True), mesh=mesh)
    handle = ServerThread(server).start()
    try:
        handle.wait_ready(timeout=600)
        policy, last = client(host="127.0.0.1", port=handle.port), None
        for f in range(3):
            obs = dict(_sample(7))
            obs["rtc"] = {"mode": "trained"} if last is None else {"chunk": last, **ROBOTS["a"]}
            out = policy.infer(obs)
            assert "rtc" in out, out.keys()
            last = out["rtc"]["chunk"]
        assert server.compiles_after_warmup == 0
    finally:
        handle.stop()
