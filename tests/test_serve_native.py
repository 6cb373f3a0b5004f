"""`python -m oxygen_jax.serve --ckpt DIR` serves a restored Xiaomi-Robotics-0 or StarVLA checkpoint.

The specification (../shared/fixtures/xr0_tiny and starvla_qwenpi_v3_tiny, made by the native code; each
test skips, naming the fixture, when ../shared is absent):

* the command line recognises an XR0 directory and serves it with its own head and a language decoder;
  an unmodified openpi client's `actions` are bit-identical to an `Engine` step of the same rows and
  noise (the served noise rule), and the metadata's horizon is the checkpoint's;
* the robot's action mask and horizon come from the checkpoint's config.json when it carries one;
* a StarVLA run with `dataset_statistics.json` is served un-normalised by StarVLA's own rule (clip, gripper
  threshold, q01 / q99) applied to the engine's chunk;
* with a `tokenizer.json` beside an XR0 checkpoint a client's observation becomes XR0's deploy prompt (the
  ids of the released prompt text, left-padded), and the engine steps those rows.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from helpers import fixture as _fixture

from oxygen_jax import serve
from oxygen_jax.ckpts import starvla
from oxygen_jax.ckpts.load import load_model
from oxygen_jax.robots.config import robot_config
from oxygen_jax.robots import transforms
from oxygen_jax.runtime.engine import Engine
from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

ROBOT = robot_config("libero")
SEED, IMAGE, PROMPT = 5, 64, 24  # 64 px -> 4 image tokens per camera with the fixtures' ViT (16 px patches, merge 2)


def _args(ckpt, *extra, prompt_len=PROMPT):
    return serve._parser().parse_args([
        "--ckpt", str(ckpt), "--image-size", str(IMAGE), *(["--prompt-len", str(prompt_len)] if prompt_len else []),
        "--robot", "libero",
        "--batch-sizes", "1", "--slots", "2", "--max-new-tokens", "4", "--tokens-per-frame", "2", "--seed", str(SEED),
        "--host", "127.0.0.1", "--port", "0", "--deadline-ms", "1000", *extra])


def _sample(i: int) -> dict:
    return transforms.synthetic_sample(ROBOT, np.random.default_rng(70 + i), prompt=f"open drawer {i}", image_size=IMAGE)


@pytest.fixture(scope="module")
def served():
    """The server exactly as `python -m oxygen_jax.serve --ckpt ../shared/fixtures/xr0_tiny ...` builds it."""
    engine, tok, robot, io, mesh, rows = serve.build(_args(_fixture("xr0_tiny")))
    assert rows == dict(image_size=IMAGE, prompt_len=PROMPT) and io.norm_stats is None and mesh is None
    server = PolicyServer(engine, tok, robot, ServeConfig(host="127.0.0.1", port=0, buckets=(1,), seed=SEED,
                                                          deadline_ms=1000), **rows)
    handle = ServerThread(server).start()
    handle.wait_ready(timeout=600)
    yield dict(handle=handle, engine=engine, tok=tok, server=server)
    handle.stop()


def test_an_openpi_client_gets_the_restored_xr0_chunk_bit_identical_to_an_engine_step(served):
    try:
        from openpi_client import websocket_client_policy
    except ImportError:
        pytest.skip("openpi-client not installed: pip install --no-deps -r requirements-test.txt")
    engine, server = served["engine"], served["server"]
    vla = engine.vla
    assert vla.heads == ("xr0",) and vla.has_language
    config = json.loads((_fixture("xr0_tiny") / "config.json").read_text())
    ha, ad = vla.action_shape("xr0")
    assert (ha, ad) == (config["action_length"], config["action_dim"])  # no mask in this config.json
    client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=served["handle"].port)
    meta = client.get_server_metadata()
    assert meta["action_horizon"] == ha
    reference = Engine(vla, engine.config, tokenizer=served["tok"])
    for f in range(2):
        sample = _sample(f)
        reply = client.infer(sample)
        assert reply["frame"] == f
        inputs, states = server.codec.batch([server.codec.prepare(sample)], 1)
        assert set(states) == {"xr0"}  # XR0's state token reads the client's state
        noise = server.codec.noise(SEED, [meta["stream"]], [f], 1)
        expected = reference.step(inputs, noise, states=states).head_actions["xr0"][0]
        want = transforms.robot_outputs(ROBOT, expected, transforms.client_state(ROBOT, sample))
        assert reply["actions"].shape == (ha, ROBOT.action_dim)
        np.testing.assert_array_equal(reply["actions"], want)
    client._ws.close()


def _linked_copy(src, dst, files):
    """`dst` holding symlinks to `src`'s files except those in `files` (name -> text), which are written."""
    dst.mkdir()
    for p in src.iterdir():
        if p.name not in files:
            os.symlink(p, dst / p.name)
    for name, text in files.items():
        (dst / name).write_text(text)
    return dst


def test_the_action_mask_and_horizon_come_from_the_checkpoints_config_json(tmp_path):
    src = _fixture("xr0_tiny")
    config = json.loads((src / "config.json").read_text())
    ad = config["action_dim"]
    mask = np.zeros((config["action_length"] - 2, ad), int)
    mask[:, : ad - 3] = 1
    d = _linked_copy(src, tmp_path / "xr0", {"config.json": json.dumps({**config, "action_mask": mask.tolist()})})
    head = load_model(d).config.heads[0]
    assert head.horizon == mask.shape[0] and np.array_equal(np.asarray(head.action_mask), mask)
    bad = _linked_copy(src, tmp_path / "bad", {"config.json": json.dumps({**config, "action_mask": [[1] * (ad + 1)]})})
    with pytest.raises(ValueError, match=rf"config.json action_mask must be \[Ha, action_dim = {ad}\]") as e:
        load_model(bad)
    assert "\n" not in str(e.value)


def test_an_action_mask_file_sets_the_xr0_robot_and_a_checkpoint_without_one_warns(tmp_path, caplog):
    src = _fixture("xr0_tiny")
    config = json.loads((src / "config.json").read_text())
    ad = config["action_dim"]
    mask = np.zeros((config["action_length"] - 3, ad), int)
    mask[:, : ad - 2] = 1
    for path in (tmp_path / "mask.npy", tmp_path / "mask.json"):
        np.save(path, mask) if path.suffix == ".npy" else path.write_text(json.dumps(mask.tolist()))
        args = _args(src, "--action-mask", str(path))
        head = load_model(src, action_mask=serve._action_mask(args)).config.heads[0]
        assert head.horizon == mask.shape[0] and np.array_equal(np.asarray(head.action_mask), mask)
    (tmp_path / "bad.json").write_text("[[0, 2]]")
    with pytest.raises(ValueError, match=r"--action-mask .*bad.json: expected a \[Ha, Ad\] array of 0 / 1"):
        serve._action_mask(_args(src, "--action-mask", str(tmp_path / "bad.json")))
    with pytest.raises(ValueError, match="action_mask= is the robot's mask of an XR0 checkpoint"):
        load_model(_fixture("starvla_gr00t_tiny"), action_mask=mask)
    caplog.set_level(logging.WARNING, logger="oxygen_jax.serve")
    serve.log_notes(load_model(src, action_mask=mask))
    assert not caplog.records  # a mask given: nothing to warn about
    serve.log_notes(load_model(src))  # the fixture's config.json has no mask
    assert any("XR0 checkpoint without an action mask" in r.getMessage() for r in caplog.records)


def test_a_starvla_run_with_dataset_statistics_is_served_unnormalised(tmp_path):
    src = _fixture("starvla_qwenpi_v3_tiny")
    ref = np.load(src / "reference.npz")
    ad = int(ref["actions"].shape[-1])
    q01, q99 = np.linspace(-3, -1, ad), np.linspace(1, 4, ad)
    stats = {"libero_goal": {"action": {"q01": q01.tolist(), "q99": q99.tolist(), "mask": [True] * (ad - 1) + [False]}}}
    d = _linked_copy(src, tmp_path / "run", {"dataset_statistics.json": json.dumps(stats)})
    engine, tok, robot, _, _, rows = serve.build(_args(d))
    assert engine.vla.heads == ("starvla_qwenpi_v3",) and set(rows) == {"image_size", "prompt_len", "outputs"}
    server = PolicyServer(engine, tok, robot, ServeConfig(buckets=(1,), seed=SEED), **rows)
    sample = _sample(3)
    inputs, states = server.codec.batch([server.codec.prepare(sample)], 1)
    assert states is None  # QwenPI_v3 has no state token
    out = engine.step(inputs, server.codec.noise(SEED, [0], [0], 1)).head_actions
    served_chunk, extra = server.codec.outputs(out, 0, transforms.client_state(ROBOT, sample))
    want = starvla.unnormalize_actions(out["starvla_qwenpi_v3"][0], starvla.action_stats(stats))
    np.testing.assert_array_equal(served_chunk, want)
    assert not np.array_equal(served_chunk, out["starvla_qwenpi_v3"][0])  # the un-normalisation did something
    with pytest.raises(ValueError, match="has no 'droid' entry"):
        serve.build(_args(d, "--dataset-key", "droid"))


def test_a_tokenizer_json_beside_an_xr0_checkpoint_gives_rows_of_its_deploy_prompt(tmp_path):
    pytest.importorskip("tokenizers")
    from test_native_prompts import byte_level_tokenizer_json

    from oxygen_jax.robots import native_prompts as npr

    src = _fixture("xr0_tiny")
    d = _linked_copy(src, tmp_path / "xr0", {})
    vlm = json.loads((src / "config.json").read_text())["vlm_config"]
    byte_level_tokenizer_json(d, {"image": vlm["image_token_id"], "vision_start": vlm["vision_start_token_id"],
                                  "vision_end": vlm["vision_end_token_id"], "im_start": 504, "im_end": 505})
    engine, tok, robot, _, _, rows = serve.build(_args(d, prompt_len=None))
    assert isinstance(tok, npr.QwenTokenizer) and engine.tokenizer is tok  # language is text in that tokenizer
    server = PolicyServer(engine, tok, robot, ServeConfig(buckets=(1,), seed=SEED), **rows)
    sample = _sample(4)
    row = server.codec.prepare(sample)
    n = (IMAGE // 32) ** 2
    image = "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>"
    text = ("<|im_start|>user\nThe following observations are captured from multiple views.\n"
            f"# Base View\n{image}\n# Left-Wrist View\n{image}\n"
            f"Generate robot actions for the task:\n{sample['prompt']} /no_cot<|im_end|>\n"
            "<|im_start|>assistant\n<cot></cot><|im_end|>\n")
    want = tok._tok.encode(text, add_special_tokens=False).ids
    assert row.ids.shape == (1, rows["prompt_len"]) and row.mask[0].sum() == len(want)
    assert row.ids[0][row.mask[0]].tolist() == want and not row.mask[0, 0]  # left-padded
    inputs, states = server.codec.batch([row], 1)
    out = engine.step(inputs, server.codec.noise(SEED, [0], [0], 1), states=states).head_actions["xr0"]
    assert out.shape == (1, *engine.vla.action_shape("xr0")) and np.isfinite(out).all()
