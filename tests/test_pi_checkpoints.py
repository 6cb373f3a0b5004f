"""Every π checkpoint a user holds runs with its own robot I/O, and nothing is silently substituted.

The specification (fixtures from ../shared; each test skips, naming the fixture, when it is absent):

* π0 (openpi's `Pi0Config(pi05=False)`): the cached path (prefill once, then the action expert reading the prefix
  K/V with the state token and the time MLP) equals a plain joint forward over [prefix ‖ state ‖ actions] at other
  dims than any fixture (2 KV heads, other widths); openpi's π0 fixture passes `eval.parity`; a π0 head without
  a state, or π0.5 given one, is a one-line error.
* A π checkpoint whose tokenizer is not found (openpi's never ship it) is refused by `run` and `serve` in one line
  naming the file to fetch and `--tokenizer`; with `--tokenizer` they run; a tokenizer of another size than the
  model's vocabulary is refused.
* `serve --ckpt` on each π fixture answers an unmodified openpi client with actions in the robot's shape and a
  language answer decoded from the same prefix.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import fixture, make_obs
from reference_mot import joint_forward

from oxygen_jax import run, serve
from oxygen_jax.models.heads import time_mlp
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import init_params
from oxygen_jax.nn.layers import dense
from oxygen_jax.robots import transforms
from oxygen_jax.robots.config import robot_config

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

ROBOT = robot_config("libero")


def _model_flags(name: str) -> list[str]:
    """A LeRobot fixture's SigLIP is not So400m, and no tensor stores its heads: the generator's record names them."""
    if not name.startswith("lerobot"):
        return []
    spec = json.loads((fixture(name) / "generation_config.json").read_text())["spec"]
    return ["--vision-heads", str(spec["vision"]["num_attention_heads"])]


def _tokenizer_of(name: str):
    """The 1024-piece PaliGemma-layout SentencePiece model the LeRobot fixtures ship (it fits every tiny π fixture's
    1024-row vocabulary; openpi's fixtures ship none, like openpi's checkpoints)."""
    return fixture("lerobot_tiny_pi05") / "tokenizer" / "tokenizer.model"


@pytest.fixture(scope="module")
def pi0_params():
    # Other dims than the fixture's: 2 KV heads, widths 64 / 32, SigLIP 56 px.
    return init_params(model_config("tiny", variant="pi0"), 7)


def test_pi0_cached_velocity_equals_a_plain_joint_forward(pi0_params):
    params = pi0_params
    obs = make_obs(params.config, batch=2, cameras=2, image_masks=[[True, True], [True, False]])
    ha, ad = 3, params.config.action_dim
    x_t = jax.random.normal(jax.random.key(0), (2, ha, ad))
    state = jax.random.uniform(jax.random.key(1), (2, ad), minval=-1, maxval=1)
    t = jnp.array([0.7, 0.2])
    fast = np.asarray(model.velocity(params, model.prefill(params, obs), x_t, t, state))
    tokens, input_mask, ar = model.embed_prefix(params, obs)
    head = model.head_params(params)
    suffix = jnp.concatenate([dense(params.state_proj, state)[:, None], time_mlp.action_tokens(head, x_t, t)], 1)
    for b in range(2):
        full_mask = np.concatenate([np.asarray(input_mask[b]), np.ones(1 + ha, bool)])
        full_ar = np.concatenate([np.asarray(ar), [True, True] + [False] * (ha - 1)])  # openpi's π0 suffix
        _, out = joint_forward(params, [tokens[b], suffix[b]], full_mask, full_ar)
        ref = out[1:] @ np.asarray(params.action_out.kernel) + np.asarray(params.action_out.bias)
        np.testing.assert_allclose(fast[b], ref, rtol=2e-4, atol=2e-4)
    other = np.asarray(model.velocity(params, model.prefill(params, obs), x_t, t, -state))
    assert not np.allclose(other, fast)  # the state token is read


def test_pi0_needs_its_state_and_pi05_refuses_one(pi0_params, tiny_params):
    obs = make_obs(pi0_params.config, batch=1, cameras=1)
    noise = jnp.zeros((1, 2, pi0_params.config.action_dim))
    with pytest.raises(ValueError, match=r"reads the robot state as a token: pass state \[B, Ds\] = \(1, 32\)"):
        model.denoise(pi0_params, model.prefill(pi0_params, obs), noise, 1)
    with pytest.raises(ValueError, match="π0.5 reads the robot state as prompt tokens: pass state=None"):
        model.velocity(tiny_params, model.prefill(tiny_params, obs), noise, jnp.ones(1), jnp.zeros((1, 32)))


def test_openpi_pi0_fixture_matches_openpis_prefix_velocity_and_actions():
    """The core of `python -m eval.parity` on openpi's π0 fixture (which checks 71 quantities in both layouts)."""
    from eval.parity.openpi import observation_of
    from oxygen_jax.ckpts.openpi import load_openpi_params

    root = fixture("openpi_tiny_pi0")
    ref = dict(np.load(root / "reference.npz"))
    cfg, params = load_openpi_params(root / "params")
    assert cfg.variant == "pi0" and params.state_proj is not None
    obs, noise = observation_of(ref), jnp.asarray(ref["noise"])
    cache = model.prefill(params, obs)
    valid = np.asarray(ref["prefix/input_mask"])
    k = np.asarray(cache.k)[:, valid]  # [L, B, P, K, H] at the valid positions
    np.testing.assert_allclose(k, np.asarray(ref["prefix/kv_cache_k"])[:, valid], atol=5e-4, rtol=1e-4)
    ones = jnp.ones((noise.shape[0],))
    v = jax.jit(model.velocity)(params, cache, noise, ones, jnp.asarray(ref["state"]))
    np.testing.assert_allclose(v, ref["step1/velocity_t1"], atol=2e-4, rtol=1e-4)
    for state, key in (("state", "actions/num_steps_10"), ("state_alt/state", "state_alt/actions/num_steps_10")):
        actions = model.denoise(params, cache, noise, 10, jnp.asarray(ref[state]))
        np.testing.assert_allclose(actions, ref[key], atol=2e-4, rtol=1e-4)


def _copy_without(src, dst, *names):
    """`dst` holding symlinks to `src`'s entries except `names` (a checkpoint "downloaded" without them)."""
    dst.mkdir()
    for p in src.iterdir():
        if p.name not in names:
            os.symlink(p, dst / p.name)
    return dst


def test_a_pi_checkpoint_without_its_tokenizer_is_refused_in_one_line_and_runs_with_one(tmp_path, capsys):
    ckpt = _copy_without(fixture("openpi_tiny_pi05"), tmp_path / "pi05_libero", "tokenizer.model")
    argv = ["--ckpt", str(ckpt), "--frames", "1", "--steps", "1", "--slots", "1", "--max-new-tokens", "1",
            "--prompt-len", "16", "--no-cache"]
    assert run.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no tokenizer in or beside it" in err and "tokenizer.model" in err
    assert "--tokenizer" in err and "Traceback" not in err
    assert serve.main(["--ckpt", str(ckpt), "--port", "0", "--batch-sizes", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "has no tokenizer in or beside it" in err[-1] and "--tokenizer" in err[-1]
    assert run.main(argv + ["--tokenizer", str(_tokenizer_of("openpi_tiny_pi05"))]) == 0
    assert re.search(r"^\s+0\s+\d+\.\d+\s+\d+\s+\d+\s+\[", capsys.readouterr().out, re.M)
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer

    small, demo = tmp_path / "small.model", train_demo_tokenizer()
    small.write_bytes(demo.to_bytes())  # fewer pieces than the 1024-row vocabulary: prompts would be other ids
    assert run.main(argv + ["--tokenizer", str(small)]) == 2
    assert f"has {demo.vocab_size} ids but the model's vocabulary is 1024" in capsys.readouterr().err


SERVED = ("openpi_tiny_pi0", "lerobot_tiny_pi05", "lerobot_tiny_pi0")


@pytest.mark.parametrize("name", SERVED)
def test_serve_answers_an_openpi_client_with_actions_and_a_language_answer(name):
    try:
        from openpi_client import websocket_client_policy
    except ImportError:
        pytest.skip("openpi-client not installed: pip install --no-deps -r requirements-test.txt")
    from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread

    args = serve._parser().parse_args([
        "--ckpt", str(fixture(name)), "--tokenizer", str(_tokenizer_of(name)), *_model_flags(name), "--robot", "libero",
        "--batch-sizes", "1", "--slots", "1", "--max-new-tokens", "2", "--tokens-per-frame", "2", "--steps", "2",
        "--port", "0", *([] if name.startswith("lerobot") else ["--prompt-len", "16"])])
    engine, tok, robot, io, _, rows = serve.build(args)
    server = PolicyServer(engine, tok, robot, ServeConfig(host="127.0.0.1", port=0, buckets=(1,), seed=1,
                                                          deadline_ms=1000), io=io, **rows)
    handle = ServerThread(server).start()
    try:
        handle.wait_ready(timeout=600)
        client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=handle.port)
        ha = client.get_server_metadata()["action_horizon"]
        sample = transforms.synthetic_sample(robot, np.random.default_rng(3), prompt="pick up the bowl")
        reply = client.infer({**sample, "language_requests": [{"prompt": "", "max_tokens": 2, "id": "say"}]})
        finished = reply["language"]["finished"] + client.infer(sample)["language"]["finished"]
        assert reply["actions"].shape == (ha, robot.action_dim) and np.isfinite(reply["actions"]).all()
        assert [f["tag"] for f in finished] == ["say"] and len(finished[0]["tokens"]) == 2
        client._ws.close()
    finally:
        handle.stop()


@pytest.mark.parametrize("name, drop, says", [
    ("xr0_tiny", "config.json", "a Xiaomi-Robotics-0 checkpoint missing config.json"),
    ("starvla_gr00t_tiny", "config.yaml", "a StarVLA checkpoint missing config.yaml"),
    ("lerobot_tiny_pi0/pretrained_model", "config.json", "a LeRobot π checkpoint missing config.json"),
])
def test_a_folder_of_one_family_missing_its_identifying_file_says_so(tmp_path, name, drop, says):
    from oxygen_jax.ckpts.load import load_model

    d = _copy_without(fixture(name), tmp_path / "ckpt", drop)
    with pytest.raises(ValueError, match=says) as e:
        load_model(d)
    assert "\n" not in str(e.value)


def test_our_checkpoint_without_config_and_an_openpi_pi0_fast_checkpoint_are_named(tmp_path):
    from oxygen_jax.ckpts.load import load_model
    from oxygen_jax.demo import DEMO_DIR

    d = _copy_without(DEMO_DIR / "base", tmp_path / "base", "config")
    with pytest.raises(ValueError, match="an oxygen_jax checkpoint missing its config/ item"):
        load_model(d)
    assert load_model(fixture("openpi_tiny_pi0_fast")).family == "pi0_fast"  # read by ckpts.openpi_fast, not refused


def test_training_memory_takes_a_lerobot_pi0_base_with_its_own_robot_io(tmp_path):
    """The adapter trains on the base's own prefix (LeRobot's resize, prompt and normaliser; π0's state token input
    beside the batch), is evaluated by the served frame (whose action expert reads that state token) and is tied to
    the base's model.safetensors."""
    from training.memory.__main__ import main as train_main

    data, out = fixture("lerobot_libero_tiny", "dataset"), tmp_path / "run"
    rc = train_main(["--data", str(data), "--out", str(out), "--base", str(fixture("lerobot_tiny_pi0")),
                     *_model_flags("lerobot_tiny_pi0"), "--target", "memory", "--heldout-episodes", "1",
                     "--key-map", "wrist_image=wrist_image", "--steps", "1", "--batch-size", "2", "--rank", "2",
                     "--prompt-len", "24", "--devices", "1", "--no-progress", "--eval-every", "0", "--eval-frames", "1"])
    assert rc == 0 and (out / "adapter").is_dir()
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(e["event"] == "eval" for e in events), events
    run = json.loads((out / "run.json").read_text())
    assert "LeRobot π0 checkpoint" in run["base"]
