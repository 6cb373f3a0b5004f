"""π0-FAST action streams in the shared decode pool (issue 40's acceptance): each robot stops on its own, its tokens
are what it decodes alone, an undecodable chunk or a deadline fails only that robot, language decodes beside.

A tiny random π0-FAST (its VLM scaled so greedy tokens vary, `diverse_text_params`) with a stand-in chunk reader:
random weights never write "Action: ", so the stop ids are picked from each robot's own greedy tokens (robot 0 stops
after 3 tokens, robot 1 after 7, robot 2 after 5) and robot 2's stop id is the one the reader refuses.
"""

from __future__ import annotations

import dataclasses
import logging
import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from websockets.sync.client import connect

from oxygen_jax.ckpts.load import load_model
from oxygen_jax.models.decoded_actions import ActionStream, ChunkError
from oxygen_jax.models.pi05 import pi0_fast, pi0_fast_decode
from oxygen_jax.models.pi05.config import fast_config
from oxygen_jax.models.pi05.params import init_params
from oxygen_jax.runtime.action_streams import StreamConfig
from oxygen_jax.runtime.engine import Engine, EngineConfig
from oxygen_jax.robots import transforms
from oxygen_jax.robots.config import robot_config
from oxygen_jax.robots.tokenizer import Tokenizer, train_demo_tokenizer
from oxygen_jax.serving import wire
from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread
from tests.helpers import diverse_text_params, fixture, make_obs

FAST = "openpi_tiny_pi0_fast"

ENDS = (2, 6, 4)  # the step at which each robot's stream writes its stop id
HA, AD, MAX_TOKENS = 2, 3, 12


@pytest.fixture(scope="module")
def world():
    config = fast_config("pi0_fast_tiny")
    params = diverse_text_params(init_params(config, seed=3))
    obs = make_obs(config, batch=3, cameras=2, prompt_len=12, lengths=[10, 6, 8], seed=4)
    alone = jax.jit(lambda p, o: pi0_fast_decode.sample_tokens(p, o, MAX_TOKENS, window="valid"))
    solo = np.concatenate([np.asarray(alone(params, jax.tree.map(lambda x: x[i:i + 1], obs))) for i in range(3)])
    stops = tuple(int(solo[i, e]) for i, e in enumerate(ENDS))
    for i, e in enumerate(ENDS):  # each robot meets a stop id first at its own step
        assert not set(solo[i, :e].tolist()) & set(stops), "pick other ENDS: a stop id occurs earlier"
    undecodable = stops[2]

    def read(tokens):  # the stand-in reader: a chunk of the token count, robot 2's stop id refused
        if tokens[-1] == undecodable:
            raise ValueError("the action text holds a token that is no FAST id")
        return np.full((HA, AD), len(tokens), np.float32)

    stream = ActionStream(horizon=HA, action_dim=AD, stop_ids=tuple(sorted(stops)), max_tokens=MAX_TOKENS, decode=read)
    return pi0_fast.as_vla(params, stream), obs, solo


def _engine(vla, **streams):
    return Engine(vla, EngineConfig(num_slots=4, max_new_tokens=MAX_TOKENS, tokens_per_frame=2),
                  streams=StreamConfig(slots=3, **streams))


def test_each_robot_stops_on_its_own_equals_its_decode_alone_and_fails_alone(world):
    vla, obs, solo = world
    engine = _engine(vla)
    rid = engine.submit(prompt_tokens=[], max_tokens=5, stop_ids=(), row=1)  # language beside, greedy from robot 1's prefix
    res = engine.step(obs)
    # Robot 0 ended at step 2 (EOS-like) while robot 1 went on to step 6; both chunks are what they decode alone.
    np.testing.assert_array_equal(res.actions[0], np.full((HA, AD), ENDS[0] + 1))
    np.testing.assert_array_equal(res.actions[1], np.full((HA, AD), ENDS[1] + 1))
    assert sorted(res.row_errors) == [2] and "failed to decode" in res.row_errors[2] and "FAST" in res.row_errors[2]
    assert not res.actions[2].any() and res.steps == 6  # bursts of 2 until robot 1's stop; none for the others
    # The language request continued robot 1's prefix in the same bursts: robot 1's own greedy tokens.
    (done,) = res.finished
    assert done.request_id == rid and done.tokens == solo[1, :5].tolist()
    # Every slot is free again; the next frame decodes the same chunks (nothing leaks between frames).
    assert engine.num_active == 0
    again = engine.step(obs, rows=[7, 8, 9])
    np.testing.assert_array_equal(again.actions, res.actions)
    assert sorted(again.row_errors) == [2]


def test_a_deadline_or_a_missing_slot_fails_only_that_robot_and_zeros_need_the_option(world):
    vla, obs, _ = world
    res = _engine(vla, deadline_steps=4).step(obs)  # robot 1 needs 6 steps
    np.testing.assert_array_equal(res.actions[0], np.full((HA, AD), ENDS[0] + 1))
    assert "deadline (4 decode steps" in res.row_errors[1] and res.steps == 4
    zeros = _engine(vla, deadline_steps=4, on_failure="zeros").step(obs)
    assert not zeros.row_errors and sorted(zeros.fallbacks) == [1, 2] and not zeros.actions[1:].any()
    one_slot = Engine(vla, EngineConfig(num_slots=1, max_new_tokens=MAX_TOKENS, tokens_per_frame=2),
                      streams=StreamConfig(slots=1)).step(obs, rows=[0, 5, -1])
    np.testing.assert_array_equal(one_slot.actions[0], np.full((HA, AD), ENDS[0] + 1))
    assert "no free decode slot" in one_slot.row_errors[1] and 2 not in one_slot.row_errors


def test_stream_settings_are_checked(world):
    vla = world[0]
    with pytest.raises(ValueError, match="max_new_tokens"):
        Engine(vla, EngineConfig(num_slots=4, max_new_tokens=4), streams=StreamConfig(max_tokens=8))
    with pytest.raises(ValueError, match="exceeds the pool"):
        Engine(vla, EngineConfig(num_slots=2, max_new_tokens=MAX_TOKENS), streams=StreamConfig(slots=3))
    with pytest.raises(ValueError, match="on_failure"):
        StreamConfig(on_failure="silent")


@pytest.mark.parametrize("command", ["serve", "run"])
def test_chunk_flags_show_their_defaults_configure_the_streams_and_a_model_with_heads_refuses_them(world, command):
    import importlib

    from oxygen_jax.cli import CHUNK_UNSET, DefaultsHelpFormatter, pool_tokens, stream_config

    ap = importlib.import_module(f"oxygen_jax.{command}")._parser()  # both commands: one definition (`cli`)
    slots = ap.parse_args([]).slots
    shown = {a.dest: DefaultsHelpFormatter(command)._get_help_string(a) for a in ap._actions if a.dest.startswith("chunk_")}
    assert set(shown) == set(CHUNK_UNSET) and all("(default: " in text for text in shown.values())
    args = ap.parse_args(["--chunk-slots", "2", "--chunk-max-tokens", "64", "--chunk-deadline-steps", "8",
                          "--chunk-deadline-ms", "40", "--chunk-on-failure", "zeros"])
    assert stream_config(args, world[0]) == StreamConfig(slots=2, max_tokens=64, deadline_steps=8,
                                                         deadline_ms=40.0, on_failure="zeros")
    assert pool_tokens(world[0], 32, args.chunk_max_tokens) == 64 and pool_tokens(world[0], 8) == MAX_TOKENS
    assert stream_config(ap.parse_args([]), world[0]) == StreamConfig()
    heads, language = SimpleNamespace(action_stream=None, heads=("actions",)), SimpleNamespace(action_stream=None, heads=())
    assert stream_config(ap.parse_args([]), heads) is None
    with pytest.raises(ValueError, match="argument --chunk-deadline-ms: .* this model's actions come from its action heads: drop"):
        stream_config(ap.parse_args(["--chunk-deadline-ms", "40"]), heads)
    with pytest.raises(ValueError, match="argument --chunk-on-failure: .* this model has no actions"):
        stream_config(ap.parse_args(["--chunk-on-failure", "zeros"]), language)
    with pytest.raises(ValueError, match=f"--chunk-slots: {slots + 1} is more than the pool's --slots {slots}"):
        stream_config(ap.parse_args(["--chunk-slots", str(slots + 1)]), world[0])


def test_load_model_serves_an_openpi_pi0_fast_checkpoint_with_its_codec_prompt_and_stops():
    """The fixture (openpi's own π0-FAST): load_model wires its FAST codec, quantile statistics, its prompt and a
    stream that stops at EOS / "|" and reads openpi's working chunk exactly, an unreadable one as that chunk's error."""
    root = fixture(FAST)
    ref, config = dict(np.load(root / "reference.npz")), json.loads((root / "config.json").read_text())
    tok = Tokenizer.from_file(root / "paligemma_tokenizer.model")
    model = load_model(root)
    assert model.family == "pi0_fast" and model.io.action_codec is not None and model.io.tokenizer_hint
    assert model.io.action_horizon == ref["actions"].shape[1]
    droid, aloha = robot_config("droid"), robot_config("aloha")  # openpi's π0-FAST camera inputs, chosen by the loader
    assert model.io.camera_layout(droid).slots == ("base_0_rgb", "zeros", "left_wrist_0_rgb")
    assert model.io.camera_layout(aloha) is None and load_model(fixture("openpi_tiny_pi05")).io.camera_layout(droid) is None
    # openpi's universal FAST processor names no chunk shape: the robot's openpi π0-FAST config gives it.
    unshaped = dataclasses.replace(model, io=dataclasses.replace(model.io, action_codec=dataclasses.replace(
        model.io.action_codec, horizon=None, action_dim=None), action_horizon=None))
    assert unshaped.io.robot(droid).action_horizon == 10 and unshaped.io.robot(droid).max_token_len == 250
    assert unshaped.vla(tokenizer=tok, robot=droid).action_stream.shape == (10, 8)
    assert unshaped.vla(tokenizer=tok, robot=robot_config("libero")).action_stream.shape == (10, 7)
    with pytest.raises(ChunkError, match="names no chunk shape and no robot was given"):
        unshaped.vla(tokenizer=tok).action_stream.chunk([1])
    with pytest.raises(ValueError, match="no π0-FAST config for robot 'aloha' .*add time_horizon and action_dim"):
        unshaped.vla(tokenizer=tok, robot=aloha)
    with pytest.raises(ValueError, match="needs a pi05 model"):
        load_model(root, family="pi05")
    ids, mask = model.io.rows.prompt(tok, config["strings"]["prompts"][0], ref["state"][0], ref["tok/infer/tokens"].shape[1],
                                     None)
    np.testing.assert_array_equal(ids, ref["tok/infer/tokens"][0])
    np.testing.assert_array_equal(mask, ref["tok/infer/mask"][0])
    vla = model.vla(tokenizer=tok)
    stream = vla.action_stream
    assert vla.heads == () and stream.shape == ref["actions"].shape[1:]
    assert stream.stop_ids == tuple(sorted({tok.eos_id, *tok.encode("|")})) and stream.max_tokens == 256
    for name, case, want in zip(config["strings"]["extract_cases/names"], ref["extract_cases/tokens"],
                                ref["extract_cases/actions"]):
        ids = [int(t) for t in case]
        if name.startswith("works"):
            np.testing.assert_allclose(stream.chunk(ids), want, atol=1e-5)
        else:
            with pytest.raises(ChunkError):
                stream.chunk(ids)


def test_served_over_openpis_protocol_the_reply_is_the_decoded_chunk_with_language_beside(world, caplog):
    """Served: openpi's reply shape [Ha, Da] from the decoded chunk (openpi's zero fallback asked for explicitly: a
    random model writes no stop, and the server's log says why), the language request answered in the same reply."""
    caplog.set_level(logging.WARNING, logger="oxygen_jax.serve")  # whatever level an earlier serve command set
    vla = world[0]
    stream = ActionStream(horizon=4, action_dim=7, stop_ids=(1,), max_tokens=6, decode=vla.stream.decode)
    tok, robot = train_demo_tokenizer(), robot_config("libero", max_token_len=16)
    engine = Engine(dataclasses.replace(vla, stream=stream),
                    EngineConfig(num_slots=2, max_new_tokens=6, request_max_tokens=4, prompt_capacity=2,
                                 tokens_per_frame=3), tokenizer=tok,
                    streams=StreamConfig(slots=1, on_failure="zeros"))
    server = PolicyServer(engine, tok, robot, ServeConfig(host="127.0.0.1", port=0, buckets=(1,), seed=0))
    with ServerThread(server) as handle:
        handle.wait_ready(timeout=300)
        with connect(f"ws://127.0.0.1:{handle.port}", compression=None, max_size=None) as ws:
            meta = wire.unpack(ws.recv())
            assert meta["action_horizon"] == 4 and "decoded tokens" in meta["noise"]["rule"]
            assert meta["language"]["max_tokens"] == 4  # a request's cap, not the chunk-sized slots' 6
            sample = transforms.synthetic_sample(robot, np.random.default_rng(0), prompt="pick up the cube")
            ws.send(wire.pack({**sample, "language_requests": [{"prompt": "ab", "max_tokens": 3, "stop_at_eos": False}]}))
            reply = wire.unpack(ws.recv())
            # Without the option the same chunk (no stop in 6 tokens) is that robot's BadRequest, naming why and the
            # flag of openpi's zeros, not the state field (a host setting: nothing compiles).
            engine.streams.config = dataclasses.replace(engine.streams.config, on_failure="error")
            ws.send(wire.pack(sample))
            refused = ws.recv()
        assert server.compiles_after_warmup == 0
    assert refused.startswith("BadRequest: its action chunk reached 6 tokens without a stop id (1,)")
    assert refused.endswith("serve --chunk-on-failure zeros") and "observation/state" not in refused
    assert reply["actions"].shape == (4, robot.action_dim) and np.isfinite(reply["actions"]).all()
    assert any("all-zero chunk" in r.getMessage() and "without a stop id" in r.getMessage() for r in caplog.records)
    (done,) = reply["language"]["finished"]
    assert len(done["tokens"]) == 3
