"""Every model a checkpoint directory holds runs from the command line: `serve --ckpt` and `run --ckpt`.

The specification (../shared/fixtures; each test skips, naming the fixture, when ../shared is absent):

* `serve.build` takes every fixture directory that holds a model: π0.5 serves its action expert, XR0 / StarVLA
  their own head, a bare Qwen3 / Qwen3-VL / Qwen3.5 backbone language only (no head; empty chunks, metadata
  action_horizon 0) or the `--heads` kinds sized to that backbone;
* `run --ckpt` prints every head's first action per frame and each finished request (text with a tokenizer,
  token ids without one);
* a Qwen3.5 backbone takes hidden-state heads only (xr0 is refused naming starvla, gr00t); flags the model
  cannot take are one line naming the flag.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from helpers import fixture

from oxygen_jax import run, serve
from oxygen_jax.models import backbone as bb
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.models.heads import presets
from oxygen_jax.serving.codec import make_codec

IMAGE = 32  # 1 image token per camera with the fixtures' ViTs (16 px patches, merge 2): the cheapest rows
HEADS = {"openpi_tiny_pi05": ("actions",), "openpi_tiny_pi05_lora": ("actions",), "openpi_tiny_pi0": ("actions",),
         "xr0_tiny": ("xr0",),
         "starvla_qwenpi_v3_tiny": ("starvla_qwenpi_v3",), "starvla_gr00t_tiny": ("gr00t",),
         "qwen3_tiny": (), "qwen3vl_tiny": (), "qwen35_tiny": ()}
"""Every fixture directory that holds a model -> the heads `serve --ckpt DIR` serves (bare backbones: none)."""


def _tokenizer(ckpt) -> list[str]:
    """openpi's checkpoints ship no tokenizer (refused without one): the LeRobot fixture's 1024-piece PaliGemma-layout
    SentencePiece model fits their 1024-row vocabulary."""
    return ["--tokenizer", str(fixture("lerobot_tiny_pi05") / "tokenizer" / "tokenizer.model")] if "openpi" in str(ckpt) else []


def _serve_args(ckpt, *extra):
    return serve._parser().parse_args([
        "--ckpt", str(ckpt), "--image-size", str(IMAGE), "--robot", "libero", "--batch-sizes", "1", "--slots", "1",
        "--max-new-tokens", "2", "--tokens-per-frame", "2", "--port", "0", *_tokenizer(ckpt), *extra])


def _run(capsys, ckpt, *extra) -> str:
    assert run.main(["--ckpt", str(ckpt), "--image-size", str(IMAGE), "--frames", "1", "--steps", "1", "--slots", "1",
                     "--max-new-tokens", "2", "--tokens-per-frame", "2", "--no-cache", *extra]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(HEADS))
def test_serve_build_takes_every_fixture_model_with_its_own_heads(name):
    engine, tok, robot, _, _, rows = serve.build(_serve_args(fixture(name)))
    vla = engine.vla
    assert vla.heads == HEADS[name] and vla.has_language
    codec = make_codec(engine, robot, tok, **rows)
    meta = codec.metadata()
    if vla.heads:
        assert meta["action_horizon"] == vla.action_shape(vla.primary, robot.action_horizon)[0] > 0
    else:  # language only: an empty chunk in the robot's action dims
        assert meta["action_horizon"] == 0 and codec.outputs({}, 0, np.zeros(8))[0].shape == (0, robot.action_dim)


@pytest.mark.parametrize("name, kinds, heads", [
    ("qwen3vl_tiny", "xr0,starvla,gr00t", ("xr0", "starvla_qwenpi_v3", "gr00t")),
    ("qwen35_tiny", "gr00t,starvla", ("gr00t", "starvla_qwenpi_v3")),
    ("qwen3_tiny", "starvla", ("starvla_qwenpi_v3",)),
])
def test_serve_heads_on_a_bare_backbone_are_the_kinds_named_sized_to_it(name, kinds, heads):
    engine, tok, robot, _, _, rows = serve.build(_serve_args(fixture(name), "--heads", kinds))
    vla = engine.vla
    assert vla.heads == heads and vla.primary == heads[0] and vla.has_language
    for h in vla.spec.heads:
        h.check_backbone(vla.spec.backbone)
    assert make_codec(engine, robot, tok, **rows).metadata()["action_horizon"] == vla.action_shape(heads[0])[0]


def test_heads_are_sized_to_the_backbone_and_qwen35_refuses_kv_heads():
    for backbone in (bb.preset("qwen3vl_tiny"), qwen35.preset("qwen35_tiny").backbone):
        kv = backbone.family != "qwen3_5"
        for kind in ("xr0", "starvla", "gr00t") if kv else ("starvla", "gr00t"):
            head = presets.for_backbone(kind, backbone, "tiny")
            head.check_backbone(backbone)  # fits: K/V heads, widths and read layers come from the backbone
            assert max(head.kv_layers + head.hidden_layers) in (backbone.depth - 1, backbone.depth)
    assert presets.for_backbone("xr0", bb.preset("qwen3vl_tiny")) == presets.preset("xr0_tiny")
    with pytest.raises(ValueError, match="heads that fit it: starvla, gr00t"):
        serve.build(_serve_args(fixture("qwen35_tiny"), "--heads", "xr0"))


@pytest.mark.parametrize("name, flags, message", [
    ("xr0_tiny", ["--heads", "gr00t"], "argument --heads: random heads go on a bare .* a Xiaomi-Robotics-0 checkpoint "
                                       "with its own head: drop --heads"),
    ("openpi_tiny_pi05", ["--heads", "xr0"], "argument --heads: .* is an openpi π checkpoint: drop --heads"),
    ("qwen3_tiny", ["--action-mask", "m.npy"], "argument --action-mask: .* a bare Qwen3 / Qwen3-VL / Qwen3.5 backbone"),
    ("starvla_gr00t_tiny", ["--adapter", "a"], "argument --adapter: π language adapters; .* StarVLA checkpoint"),
    ("qwen3vl_tiny", ["--prompt-attention", "causal"], "argument --prompt-attention: .*: drop --prompt-attention"),
    ("qwen3_tiny", ["--rtc"], "argument --rtc: .* no action head"),
    ("qwen3_tiny", ["--head-size", "bench"], "argument --head-size: it sizes --heads KINDS"),
    ("qwen3vl_tiny", ["--heads", "tiny", "--head-size", "bench"], "drop --head-size bench"),
])
def test_flags_the_model_cannot_take_are_one_line_naming_the_flag(name, flags, message):
    with pytest.raises(ValueError, match=message) as e:
        serve.build(_serve_args(fixture(name), *flags))
    assert "\n" not in str(e.value)


def test_run_prints_every_heads_first_action_and_the_requests_token_ids(capsys):
    out = _run(capsys, fixture("qwen3vl_tiny"), "--heads", "xr0,gr00t", "--prompt-tokens", "5,6")
    assert "no tokenizer.json" in out and "heads: xr0 [" in out and "gr00t [" in out
    assert re.search(r"^\s+0\s+\d+\.\d+\s+\d+\s+\d+\s+xr0 \[", out, re.M) and re.search(r"^\s+gr00t \[", out, re.M)
    assert re.search(r"request 0 .* \[5, 6\] -> tokens \[\d+, \d+\]", out)


def test_run_takes_a_checkpoint_with_its_own_head(capsys):
    # One family's run (the loading is `serve.build`'s, tested on every directory above; π0.5 runs in test_run.py).
    name = "xr0_tiny"
    out = _run(capsys, fixture(name))
    (head,) = HEADS[name]
    assert f"heads: {head} [" in out and re.search(r"^\s+0\s+\d+\.\d+\s+\d+\s+\d+\s+\[", out, re.M)
    assert re.search(r"request 0 .* done after", out)


def test_run_refuses_chunk_flags_for_a_model_without_decoded_chunks_in_one_line(capsys):
    assert run.main(["--ckpt", str(fixture("qwen3_tiny")), "--chunk-slots", "1", "--no-cache"]) == 2  # as serve does
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --chunk-slots: " in err and "no actions (language only)" in err


def test_a_bare_backbone_runs_language_only_with_text_from_its_tokenizer_json(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from test_native_prompts import byte_level_tokenizer_json

    src, d = fixture("qwen3_tiny"), tmp_path / "qwen3"
    d.mkdir()
    for p in src.iterdir():
        os.symlink(p, d / p.name)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    byte_level_tokenizer_json(d, {k: vocab - 1 - i for i, k in
                                  enumerate(("image", "vision_start", "vision_end", "im_start", "im_end"))})
    out = _run(capsys, d, "--prompt", "Say: ")
    assert "heads: none (language only)" in out and re.search(r"^\s+0\s+\d+\.\d+\s+\d+\s+\d+\s+-$", out, re.M)
    assert re.search(r"request 0 .* 'Say: ' -> '.*'", out)
    assert run.main(["--ckpt", str(fixture("qwen3_tiny")), "--prompt", "Say: ", "--no-cache"]) == 2
    assert "--prompt is text and this model has no tokenizer" in capsys.readouterr().err
