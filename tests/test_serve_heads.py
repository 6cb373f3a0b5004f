"""The policy server serves any model an `Engine` runs: a tiny Qwen3-VL with XR0-, StarVLA- and GR00T-style heads
and a language decoder, to an unmodified openpi client.

The specification: the metadata names every head and the primary one; each response carries the primary head's
chunk as "actions" and every head's chunk under "heads", each equal to an `Engine.step` of the same rows and
noise (the served noise rule); language requests finish and are delivered; a malformed frame is a BadRequest
and the connection keeps serving.
"""

from __future__ import annotations

import numpy as np
import pytest

from oxygen_jax import serve
from oxygen_jax.robots.config import robot_config
from oxygen_jax.robots import transforms
from oxygen_jax.runtime.engine import Engine
from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

ROBOT = robot_config("libero")
SEED, IMAGE, PROMPT = 3, 64, 24  # 64 px -> 4 image tokens per camera with the tiny ViT (16 px patches, merge 2)


def _openpi():
    try:
        from openpi_client import websocket_client_policy
    except ImportError:
        pytest.skip("openpi-client not installed: pip install --no-deps -r requirements-test.txt")
    return websocket_client_policy


@pytest.fixture(scope="module")
def served():
    """The server exactly as `python -m oxygen_jax.serve --heads tiny ...` builds it (in a thread)."""
    args = serve._parser().parse_args([
        "--heads", "tiny", "--image-size", str(IMAGE), "--prompt-len", str(PROMPT), "--robot", "libero",
        "--batch-sizes", "1", "--slots", "2", "--max-new-tokens", "4", "--tokens-per-frame", "2", "--seed", str(SEED),
        "--host", "127.0.0.1", "--port", "0", "--deadline-ms", "1000"])
    engine, tok, robot, io, mesh, rows = serve.build(args)
    assert rows == dict(image_size=IMAGE, prompt_len=PROMPT) and mesh is None and robot == ROBOT
    server = PolicyServer(engine, tok, robot, ServeConfig(host="127.0.0.1", port=0, buckets=(1,), seed=SEED,
                                                          deadline_ms=1000), io=io, **rows)
    handle = ServerThread(server).start()
    handle.wait_ready(timeout=600)
    yield dict(handle=handle, vla=engine.vla, tok=tok, server=server, config=engine.config)
    handle.stop()


def _sample(i: int) -> dict:
    return transforms.synthetic_sample(ROBOT, np.random.default_rng(40 + i), prompt=f"put bowl {i} away")


def test_an_unmodified_openpi_client_gets_every_heads_chunk_equal_to_an_engine_step(served):
    client_mod = _openpi()
    vla, server = served["vla"], served["server"]
    client = client_mod.WebsocketClientPolicy(host="127.0.0.1", port=served["handle"].port)
    meta = client.get_server_metadata()
    assert meta["primary_head"] == vla.primary and list(meta["heads"]) == list(vla.heads)
    assert meta["action_horizon"] == vla.action_shape(vla.primary)[0]

    reference = Engine(vla, served["config"], tokenizer=served["tok"])
    for f in range(2):
        sample = _sample(f)
        reply = client.infer(sample)
        assert reply["frame"] == f
        assert set(reply["heads"]) == set(vla.heads)
        np.testing.assert_array_equal(reply["actions"], reply["heads"][vla.primary])
        inputs, states = server.codec.batch([server.codec.prepare(sample)], 1)
        noise = server.codec.noise(SEED, [meta["stream"]], [f], 1)
        expected = reference.step(inputs, noise, states=states)
        state = transforms.client_state(ROBOT, sample)
        for name in vla.heads:
            ha, ad = vla.action_shape(name)
            assert reply["heads"][name].shape == (ha, min(ad, ROBOT.action_dim) if ad >= ROBOT.action_dim else ad)
            want = transforms.robot_outputs(ROBOT, expected.head_actions[name][0], state) \
                if ad >= ROBOT.action_dim else expected.head_actions[name][0]
            np.testing.assert_allclose(reply["heads"][name], want, atol=1e-5, err_msg=name)
    client._ws.close()


def test_language_requests_finish_and_a_bad_frame_leaves_the_connection_serving(served):
    client_mod = _openpi()
    client = client_mod.WebsocketClientPolicy(host="127.0.0.1", port=served["handle"].port)
    sample = {**_sample(5), "language_requests": [{"prompt": "", "max_tokens": 3, "id": "narrate"}]}
    first = client.infer(sample)["language"]
    accepted, finished = first["accepted"], first["finished"]
    for _ in range(2):  # delivered exactly once
        finished += client.infer(_sample(5))["language"]["finished"]
    assert [a["tag"] for a in accepted] == ["narrate"]
    assert [f["tag"] for f in finished] == ["narrate"] and len(finished[0]["tokens"]) == 3
    with pytest.raises(RuntimeError, match="BadRequest"):
        client.infer({k: v for k, v in _sample(5).items() if k != "observation/wrist_image"})
    assert client.infer(_sample(6))["actions"].shape == (served["vla"].action_shape(served["vla"].primary)[0], 7)
    client._ws.close()


def test_the_command_line_refuses_heads_with_the_demo_or_a_preset_in_one_line():
    for argv, message in ((["--heads", "tiny", "--demo"], "--heads cannot be combined with --demo"),
                          (["--heads", "tiny", "--preset", "tiny"], "give --heads or --preset, not both"),
                          (["--heads", "tiny", "--image-size", "48"], "image_size must be a multiple of 32")):
        with pytest.raises(ValueError, match=message):
            serve.build(serve._parser().parse_args(argv))
