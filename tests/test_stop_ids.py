"""A Qwen-vocabulary model stops where its checkpoint says, never at π0.5's EOS id, and takes text prompts.

The specification:

* `ckpts.stop_ids.read_stop_ids` reads `generation_config.json` `eos_token_id` (an int or a list) first, then
  `config.json` (top level, `text_config`, an XR0 `vlm_config`), then `tokenizer_config.json` `eos_token`
  through the tokenizer; malformed or out-of-vocabulary ids are one-line errors; none gives ();
* `load_model` puts them in `ModelSpec.stop_ids` and finds the checkpoint's `tokenizer.json`;
* an XR0 checkpoint with a `tokenizer.json` whose weights are edited so the model always says `"` answers a
  text request with `"` up to its budget through `Engine` with default arguments, and through the server to an
  unmodified openpi client (`"` is id 1 in Qwen vocabularies, π0.5's EOS); made to say its end id instead, it
  stops after that one token;
* the wire protocol takes token ids ("prompt_tokens") and an explicit "stop" list, and an engine without a
  tokenizer refuses a text prompt in one line naming "prompt_tokens".
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import fixture
from test_native_prompts import byte_level_tokenizer_json

from oxygen_jax import serve
from oxygen_jax.ckpts.load import load_model
from oxygen_jax.ckpts.stop_ids import read_stop_ids
from oxygen_jax.models.vla import MultiHead
from oxygen_jax.robots import transforms
from oxygen_jax.robots.text_tokenizers import QwenTextTokenizer
from oxygen_jax.runtime.engine import Engine, EngineConfig
from oxygen_jax.runtime.request_limits import RequestLimits
from oxygen_jax.serving.requests import BadRequest, check_requests, parse_language_requests
from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

IMAGE, END = 64, 505  # 64 px: 4 image tokens per camera; END: the checkpoint's <|im_end|>, its stop id here


def _write(path, value):
    path.write_text(json.dumps(value))


# -------------------------------------------------------------------------------------------------
# Reading the stop ids


def test_stop_ids_come_from_generation_config_then_config_then_tokenizer_config(tmp_path):
    d = tmp_path
    assert read_stop_ids([d], 600) == ()
    _write(d / "tokenizer_config.json", {"eos_token": {"content": "<|im_end|>"}})
    byte_level_tokenizer_json(d, {"image": 500, "vision_start": 502, "vision_end": 503, "im_start": 504, "im_end": END})
    assert read_stop_ids([d], 600, QwenTextTokenizer(d / "tokenizer.json")) == (END,)
    _write(d / "config.json", {"vlm_config": {"text_config": {"eos_token_id": 7}}})  # XR0 nests its Qwen3-VL config
    assert read_stop_ids([d], 600) == (7,)
    _write(d / "config.json", {"text_config": {"eos_token_id": [9, 8]}})
    assert read_stop_ids([d], 600) == (8, 9)
    _write(d / "generation_config.json", {"eos_token_id": [END, 3, END]})
    assert read_stop_ids([tmp_path / "missing", d], 600) == (3, END)
    _write(d / "generation_config.json", {"eos_token_id": 600})
    with pytest.raises(ValueError, match=r"generation_config.json eos_token_id holds 600, outside the model's vocabulary"):
        read_stop_ids([d], 600)
    _write(d / "generation_config.json", {"eos_token_id": "</s>"})
    with pytest.raises(ValueError, match="must be a token id or a list of them"):
        read_stop_ids([d], 600)
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json: not valid JSON"):
        read_stop_ids([d], 600)


# -------------------------------------------------------------------------------------------------
# An XR0 checkpoint that always says '"'


@pytest.fixture(scope="module")
def xr0_dir(tmp_path_factory):
    """The XR0 fixture (symlinks) with a byte-level tokenizer.json and a generation_config.json naming END."""
    src, d = fixture("xr0_tiny"), tmp_path_factory.mktemp("xr0")
    for p in src.iterdir():
        os.symlink(p, d / p.name)
    vlm = json.loads((src / "config.json").read_text())["vlm_config"]
    byte_level_tokenizer_json(d, {"image": vlm["image_token_id"], "vision_start": vlm["vision_start_token_id"],
                                  "vision_end": vlm["vision_end_token_id"], "im_start": 504, "im_end": END})
    _write(d / "generation_config.json", {"eos_token_id": [END]})
    return d


def _always_says(vla: MultiHead, token: int) -> MultiHead:
    """The model with its text path edited to emit `token` at every position: feature 0 of every embedding is
    large and positive (it dominates the residual stream), the final norm keeps only feature 0, and only
    `token`'s (tied) head row reads it at twice the others' weight."""
    spec, dec = vla.spec.backbone, vla.params.decoder
    big = 1e3
    emb = dec.embedding.at[:, 0].set(big).at[token, 0].set(2 * big)
    keep = jnp.zeros_like(dec.final_norm.scale).at[0].set(1.0)
    scale = keep - 1.0 if spec.norm_plus_one else keep
    head = None if dec.lm_head is None else dec.lm_head.at[:, 0].set(big).at[token, 0].set(2 * big)
    edited = dataclasses.replace(dec, embedding=emb, final_norm=dataclasses.replace(dec.final_norm, scale=scale),
                                 lm_head=head)
    return MultiHead(dataclasses.replace(vla.params, decoder=edited), vla.spec)


def _rows(args):
    engine, tok, robot, norm_stats, _, rows = serve.build(args)
    return engine, tok, robot, rows


def _args(d, *extra):
    return serve._parser().parse_args(["--ckpt", str(d), "--image-size", str(IMAGE), "--robot", "libero", "--slots", "2",
                                       "--max-new-tokens", "5", "--tokens-per-frame", "5", "--prompt-capacity", "8",
                                       "--batch-sizes", "1", "--host", "127.0.0.1", "--port", "0", "--seed", "3",
                                       "--deadline-ms", "1000", *extra])


def test_load_model_reads_the_tokenizer_json_and_the_stop_ids_of_an_xr0_checkpoint(xr0_dir):
    model = load_model(xr0_dir)
    assert model.tokenizer == xr0_dir / "tokenizer.json" and model.stop_ids == (END,)
    assert model.vla().stop_ids == (END,) and isinstance(model.text_tokenizer(), QwenTextTokenizer)


def test_a_qwen_vocabulary_engine_with_default_arguments_does_not_stop_at_a_quote_mark(xr0_dir):
    engine, tok, robot, rows = _rows(_args(xr0_dir))
    quote = tok.encode('"')
    assert len(quote) == 1 and quote[0] not in engine.vla.stop_ids
    eng = Engine(_always_says(engine.vla, quote[0]), engine.config, tokenizer=engine.tokenizer)
    sample = transforms.synthetic_sample(robot, np.random.default_rng(0), image_size=IMAGE)
    inputs, states = _codec_row(engine, tok, robot, rows, sample)
    eng.submit(prompt="Memory: ", max_tokens=5)  # every default: the model's stop ids
    done = []
    for _ in range(2):
        done += eng.step(inputs, states=states).finished
    assert [d.text for d in done] == ['"' * 5] and done[0].tokens == quote * 5
    ends = Engine(_always_says(engine.vla, END), engine.config, tokenizer=engine.tokenizer)
    ends.submit(prompt="Memory: ", max_tokens=5)
    (stopped,) = ends.step(inputs, states=states).finished
    assert stopped.tokens == [END] and stopped.text == ""  # the end token ends it and is not text


def _codec_row(engine, tok, robot, rows, sample):
    from oxygen_jax.serving.codec import make_codec

    codec = make_codec(engine, robot, tok, **rows)
    return codec.batch([codec.prepare(sample)], 1)  # (inputs, states): XR0's state token reads the row's state


def test_an_openpi_client_gets_a_text_answer_with_quote_marks_from_a_served_qwen_vocabulary_model(xr0_dir):
    pytest.importorskip("openpi_client")
    from openpi_client import websocket_client_policy

    engine, tok, robot, rows = _rows(_args(xr0_dir))
    quote = tok.encode('"')[0]
    edited = Engine(_always_says(engine.vla, quote), engine.config, tokenizer=engine.tokenizer)
    server = PolicyServer(edited, tok, robot, ServeConfig(host="127.0.0.1", port=0, buckets=(1,), seed=3,
                                                         deadline_ms=1000), **rows)
    handle = ServerThread(server).start()
    try:
        client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=handle.port)
        meta = client.get_server_metadata()
        assert meta["language"]["stop_ids"] == [END] and meta["language"]["text_prompts"] is True
        sample = transforms.synthetic_sample(robot, np.random.default_rng(1), image_size=IMAGE)
        out = client.infer({**sample, "language_requests": [{"prompt": "Memory: ", "max_tokens": 5, "id": "m"}]})
        texts = list(out["language"]["finished"])
        for _ in range(3):
            if texts:
                break
            texts = list(client.infer(sample)["language"]["finished"])
        assert [(t["tag"], t["text"], t["tokens"]) for t in texts] == [("m", '"' * 5, [quote] * 5)]
        ids = client.infer({**sample, "language_requests": [{"prompt_tokens": tok.encode("Memory: "), "max_tokens": 5,
                                                              "stop": [quote], "id": "ids"}]})
        got = list(ids["language"]["finished"]) or list(client.infer(sample)["language"]["finished"])
        assert [(t["tag"], t["tokens"]) for t in got] == [("ids", [quote])]  # the client's own stop id ends it
    finally:
        handle.stop()


def test_language_requests_take_token_ids_and_stop_lists_and_need_a_tokenizer_for_text():
    (req,) = parse_language_requests([{"prompt_tokens": [5, 6], "stop": [7, 8], "stop_at_eos": False}], max_requests=2,
                                     default_max_tokens=3)
    assert req.tokens == (5, 6) and req.stop_ids == (7, 8) and not req.stop_at_eos
    (as_list,) = parse_language_requests([{"prompt": [5, 6]}], max_requests=2, default_max_tokens=3)
    assert as_list.tokens == (5, 6)
    limits = RequestLimits(max_new_tokens=3, prompt_capacity=4, vocab_size=16)
    assert check_requests([req], None, limits=limits)[0].tokens == (5, 6)
    with pytest.raises(BadRequest, match="prompt has 2 tokens; the engine's prompt_capacity is 1"):
        check_requests([req], None, limits=dataclasses.replace(limits, prompt_capacity=1))
    with pytest.raises(BadRequest, match="stop has 9 entries; at most 8"):
        check_requests(parse_language_requests([{"prompt": "", "stop": list(range(9))}], max_requests=2,
                                               default_max_tokens=3), None, limits=limits)
    for bad, field in (({"prompt": "a", "prompt_tokens": [1]}, "not both"), ({"prompt_tokens": [-1]}, "prompt_tokens"),
                       ({"prompt": "a", "stop": "x"}, "stop")):
        with pytest.raises(BadRequest, match=field):
            check_requests(parse_language_requests([bad], max_requests=2, default_max_tokens=3), None, limits=limits)


def test_an_id_array_far_over_its_cap_is_refused_by_its_count_before_its_values_are_read():
    """A 4 MiB array (the largest message) as stop or prompt_tokens: refused by length, never walked value by value."""
    huge = np.zeros(4 << 20, np.uint8)
    for req, field in (({"prompt": "a", "stop": huge}, "stop"), ({"prompt_tokens": huge}, "prompt_tokens")):
        with pytest.raises(BadRequest, match=rf"{field} has {huge.size} entries; at most \d+$"):
            parse_language_requests([req], max_requests=1, default_max_tokens=3, max_prompt_chars=64)
