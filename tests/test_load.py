"""The one loader (`ckpts.load`): every source kind, a tokenizer found beside the checkpoint, one-line errors;
and the one compile-cache directory `run` and `serve` share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import leaves_equal, shared_dir, write_norm_stats
from oxygen_jax.ckpts import hf
from oxygen_jax.ckpts.load import find_tokenizer, load_model, source_kind
from oxygen_jax.ckpts.own import save_params
from oxygen_jax.models import mot
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import for_backend, init_params
from oxygen_jax.runtime import compile_cache


def _bf16(tree):
    return jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), tree)


def _hf_fixture(name: str) -> Path:
    path = shared_dir() / "fixtures" / name
    return path if path.is_dir() else pytest.skip(f"fixture {name} not present: {path}")


@pytest.fixture(scope="module")
def tiny():
    config = model_config("tiny")
    return config, init_params(config, jax.random.key(0))


@pytest.fixture()
def own_ckpt(tmp_path, tiny):
    """One of our checkpoints as a training run leaves it: out/base and out/tokenizer.model."""
    config, params = tiny
    (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")  # found, not parsed, by the loader
    return save_params(tmp_path / "base", params, config)


# --------------------------------------------------------------------------------------------
# Each source kind
# --------------------------------------------------------------------------------------------


def test_load_model_reads_either_kind_in_the_requested_dtype(own_ckpt, tiny):
    config, params = tiny
    m = load_model(own_ckpt, dtype="bfloat16", prompt_attention="causal")
    assert m.source == "checkpoint" and m.family == "pi05" and m.what == f"checkpoint {own_ckpt}"
    assert m.config == config.replace(dtype="bfloat16", prompt_attention="causal")
    assert leaves_equal(m.params, for_backend(_bf16(params)))
    shutil.rmtree(own_ckpt / "config")  # without our config item the folder is refused, naming it
    with pytest.raises(ValueError, match="an oxygen_jax checkpoint missing its config/ item"):
        load_model(own_ckpt)
    m = load_model(own_ckpt / "params")  # the params item alone is openpi's layout (openpi's tools read it)
    assert m.source == "openpi" and m.what == f"openpi checkpoint {own_ckpt / 'params'}"
    assert m.config == config and leaves_equal(m.params, for_backend(params))


def test_presets_give_seeded_random_weights_laid_out_for_the_backend():
    m = load_model(preset="tiny", seed=3, dtype="bfloat16")
    cfg = model_config("tiny", dtype="bfloat16")
    assert (m.source, m.family, m.what, m.norm_stats, m.tokenizer) == ("preset", "pi05", "random 'tiny' weights", None, None)
    assert m.config == cfg and leaves_equal(m.params, for_backend(init_params(cfg, 3)))
    stacked = load_model(preset=cfg, seed=3, dtype="bfloat16", backend="gpu")  # the accelerators' layout
    assert leaves_equal(stacked.params, init_params(cfg, 3))
    spec = mot.preset("tiny")
    m = load_model(preset=spec, seed=1)
    assert m.family == "multihead" and m.config == spec
    assert leaves_equal(m.params, mot.for_backend(spec, mot.init_model(spec, 1)))


def test_openpi_checkpoint_brings_its_norm_stats_and_the_tokenizer_beside_it(own_ckpt, tiny):
    config, params = tiny
    shutil.rmtree(own_ckpt / "config")
    shutil.rmtree(own_ckpt / "checksums")  # openpi's layout: a params/ item beside assets/
    write_norm_stats(own_ckpt, "physical-intelligence/libero", 8)
    for path in (own_ckpt, own_ckpt / "params"):
        m = load_model(path)
        assert m.source == "openpi" and m.config == config and leaves_equal(m.params, for_backend(params))
        assert set(m.norm_stats) == {"state", "actions"} and m.norm_stats["state"].dim == 8
    assert load_model(own_ckpt).tokenizer == own_ckpt.parent / "tokenizer.model"


def test_own_checkpoint_finds_the_tokenizer_beside_it(own_ckpt):
    m = load_model(own_ckpt)
    assert m.tokenizer == own_ckpt.parent / "tokenizer.model" and m.norm_stats is None


def test_hugging_face_qwen3_directory_is_a_language_model():
    path = _hf_fixture("qwen3_tiny")
    m = load_model(path)
    ck = hf.load(path)
    assert m.source == "hf" and m.family == "multihead" and m.what == f"Hugging Face qwen3 checkpoint {path}"
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]  # where its text stops
    assert m.config == mot.ModelSpec(backbone=ck.spec, heads=(), language=True, stop_ids=(eos,))
    assert m.stop_ids == m.vla().stop_ids == (eos,)
    assert m.params.vision is None and m.params.heads == {}
    assert leaves_equal(m.params.decoder, mot.for_backend(m.config, mot.ModelParams(ck.decoder, None, {})).decoder)
    assert m.tokenizer is None and m.norm_stats is None


def test_hugging_face_qwen3_vl_backbone_takes_random_heads():
    path = _hf_fixture("qwen3vl_tiny")
    heads = mot.preset("tiny").heads
    m = load_model(path, heads=heads, seed=2)
    ck = hf.load(path)
    assert m.config.image_token_id == ck.config["image_token_id"] and m.config.heads == heads
    random = mot.init_model(mot.ModelSpec(backbone=ck.spec, heads=heads, image_token_id=m.config.image_token_id), 2)
    assert leaves_equal(m.params.heads, mot.for_backend(m.config, random).heads)
    assert leaves_equal(m.params.vision, mot.for_backend(m.config, mot.ModelParams(ck.decoder, ck.vision, {})).vision)


# --------------------------------------------------------------------------------------------
# Wrong sources: one line naming the problem
# --------------------------------------------------------------------------------------------


def _one_line(err: pytest.ExceptionInfo, *words: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_a_directory_of_no_known_kind_is_one_line_naming_it(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError) as e:
        load_model(tmp_path)
    _one_line(e, str(tmp_path), "holds no model checkpoint", "openpi", "Hugging Face")
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "notes.txt")
    _one_line(e, "not a directory")
    with pytest.raises(FileNotFoundError) as e:
        load_model(tmp_path / "absent")
    _one_line(e, str(tmp_path / "absent"))


def test_both_or_neither_source_is_refused():
    with pytest.raises(ValueError) as e:
        load_model()
    _one_line(e, "neither")
    with pytest.raises(ValueError) as e:
        load_model("somewhere", preset="tiny")
    _one_line(e, "both")


def test_a_model_of_another_family_is_refused_before_it_is_read(own_ckpt):
    with pytest.raises(ValueError) as e:
        load_model(own_ckpt, family="multihead")
    _one_line(e, str(own_ckpt), "oxygen_jax checkpoint of a pi05 model", "backbone with heads")
    with pytest.raises(ValueError) as e:
        load_model(preset=mot.preset("tiny"), family="pi05")
    _one_line(e, "multihead", "pi05")
    with pytest.raises(ValueError) as e:
        load_model(own_ckpt, heads=mot.preset("tiny").heads)
    _one_line(e, "Hugging Face backbone")
    path = _hf_fixture("qwen3_tiny")
    with pytest.raises(ValueError) as e:
        load_model(path, family="pi05")
    _one_line(e, str(path), "Hugging Face checkpoint", "π0.5")


def test_a_damaged_openpi_item_is_still_named_by_the_openpi_reader(tmp_path):
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "manifest.ocdbt").write_bytes(b"")  # the item lost its _METADATA
    assert source_kind(tmp_path) == "openpi"
    with pytest.raises(ValueError) as e:
        load_model(tmp_path)
    _one_line(e, "_METADATA")


# --------------------------------------------------------------------------------------------
# Tokenizer discovery
# --------------------------------------------------------------------------------------------


def test_find_tokenizer_looks_in_then_beside_each_directory_in_order(tmp_path):
    base, adapter = tmp_path / "run" / "base", tmp_path / "other" / "adapter"
    base.mkdir(parents=True)
    adapter.mkdir(parents=True)
    assert find_tokenizer(base, adapter) is None and find_tokenizer() is None and find_tokenizer(None) is None
    (adapter.parent / "tokenizer.model").write_bytes(b"a")
    assert find_tokenizer(base, adapter) == adapter.parent / "tokenizer.model"
    (base.parent / "tokenizer.model").write_bytes(b"b")
    assert find_tokenizer(base, adapter) == base.parent / "tokenizer.model"
    (base / "tokenizer.model").write_bytes(b"c")
    assert find_tokenizer(base, adapter) == base / "tokenizer.model"


# --------------------------------------------------------------------------------------------
# One compile-cache directory for run and serve
# --------------------------------------------------------------------------------------------


class _Chosen(Exception):
    """Raised by the recording `compile_cache.enable`: the command has chosen its directory."""


def _chosen_dirs(monkeypatch) -> list[Path]:
    chosen = []

    def record(path=None):
        chosen.append(Path(path).expanduser() if path is not None else compile_cache.default_dir())
        raise _Chosen  # stop before anything is compiled or configured

    monkeypatch.setattr(compile_cache, "enable", record)
    return chosen


def test_run_and_serve_choose_the_same_cache_directory_and_honour_the_env_var(tmp_path, monkeypatch, capsys):
    from oxygen_jax import run, serve

    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "from_env"))
    chosen = _chosen_dirs(monkeypatch)
    with pytest.raises(_Chosen):
        run.main(["--preset", "tiny"])
    assert serve.main(["--preset", "tiny", "--log-level", "ERROR"]) == 1  # the server's one-line failure path
    assert chosen == [tmp_path / "from_env"] * 2
    monkeypatch.delenv(compile_cache.ENV_VAR)
    assert compile_cache.default_dir() == Path.home() / ".cache" / "oxygen_jax" / "xla"


def test_serve_without_a_creatable_cache_directory_warns_and_carries_on(tmp_path, monkeypatch, caplog):
    from oxygen_jax import serve

    blocked = tmp_path / "file"
    blocked.write_text("")  # a file: no directory can be created below it
    reached = []

    def build(args):
        reached.append(args)
        raise _Chosen  # past the cache: the server went on to load its model

    monkeypatch.setattr(serve, "build", build)
    assert serve.main(["--preset", "tiny", "--compile-cache", str(blocked / "xla"), "--log-level", "WARNING"]) == 1
    assert reached, "the server stopped at the cache directory"
    assert any("serving without a persistent cache" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert jax.config.jax_compilation_cache_dir != str(blocked / "xla")
