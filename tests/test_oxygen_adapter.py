"""OxyGen's released adapter in and out: an OxyGen-layout file (openpi's LoRA keys on the VLM expert, a leading
layer axis, dims read from the base) imports into our adapter format, its merged weights compute openpi's
einsum-form LoRA, `serve --adapter NAME=DIR` serves it by name, it exports back byte for byte, bad files are
refused naming the key or field, and `training.memory --base` takes an openpi checkpoint."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from helpers import openpi_fixture
from oxygen_jax import serve
from oxygen_jax.ckpts import own
from oxygen_jax.ckpts.adapters import base_fingerprint, load_adapter, save_adapter
from oxygen_jax.ckpts.oxygen_adapter import CONFIG_FILE, export_oxygen, import_oxygen, load_named_bank, main
from oxygen_jax.ckpts.safetensors import write_safetensors
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import init_params, to_openpi_dict

W = "PaliGemma/llm/layers"
# openpi path of each adapted weight -> its LoRA keys (attention: .../lora_a; feed-forward: ..._lora_a).
WEIGHTS = {f"{W}/attn/q_einsum/w": f"{W}/attn/q_einsum/lora_", f"{W}/attn/kv_einsum/w": f"{W}/attn/kv_einsum/lora_",
           f"{W}/attn/attn_vec_einsum/w": f"{W}/attn/attn_vec_einsum/lora_", f"{W}/mlp/gating_einsum": f"{W}/mlp/gating_einsum_lora_",
           f"{W}/mlp/linear": f"{W}/mlp/linear_lora_"}


def _wider(config):
    """The tiny preset with another VLM width, MLP and KV heads (the action expert keeps sharing heads)."""
    return config.replace(vlm=dataclasses.replace(config.vlm, width=48, mlp_dim=80, num_kv_heads=1),
                          action_expert=dataclasses.replace(config.action_expert, num_kv_heads=1))


@pytest.fixture(scope="module", params=[("tiny", 3, 6.0), ("wider", 5, 5.0)], ids=["tiny-r3", "wider-r5"])
def case(request, tmp_path_factory):
    """(base params, our base directory, rank, alpha) at two widths and ranks."""
    kind, rank, alpha = request.param
    cfg = model_config("tiny")
    params = init_params(cfg if kind == "tiny" else _wider(cfg), 0)
    base = own.save_params(tmp_path_factory.mktemp("base") / "base", params)
    return params, base, rank, alpha


def _oxygen_arrays(params, rank: int, seed: int = 0) -> dict[str, np.ndarray]:
    """OxyGen's keys and shapes from the base's own weights by openpi's rule (A: rank on the last axis, B: rank on
    the second to last), float32, in a non-sorted order (the file's order must survive a round trip)."""
    rng = np.random.default_rng(seed)
    flat = to_openpi_dict(params)
    out = {}
    for weight, key in reversed(WEIGHTS.items()):
        shape = flat[weight].shape
        out[key + "a"] = (0.3 * rng.standard_normal((*shape[:-1], rank))).astype(np.float32)
        out[key + "b"] = (0.3 * rng.standard_normal((*shape[:-2], rank, shape[-1]))).astype(np.float32)
    return out


def _write_oxygen(folder, arrays, rank, alpha, fmt="npz", **config):
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"adapter_step_1500.{fmt}"
    if fmt == "npz":
        np.savez(file, **arrays)
    else:
        write_safetensors(file, arrays)
    cfg = {"adapter_type": "suffix_lora", "alpha": alpha, "rank": rank, "base_checkpoint": "gs://x/pi05_libero",
           "language_target": "visual_memory", "suffix_length": 28, "suffix_seed": "Memory: ", "training_step": 1500,
           **config}
    (folder / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
    return folder


_EQ = {  # (base einsum, x·A, (x·A)·B) per weight, every layer l at once; openpi's LoRA equations
    f"{W}/attn/q_einsum/w": ("td,lndh->ltnh", "td,lndr->ltnr", "ltnr,lnrh->ltnh"),
    f"{W}/attn/kv_einsum/w": ("td,lckdh->lctkh", "td,lckdr->lctkr", "lctkr,lckrh->lctkh"),
    f"{W}/attn/attn_vec_einsum/w": ("tnh,lnhd->ltd", "tnh,lnhr->ltr", "ltr,lnrd->ltd"),  # heads summed in both
    f"{W}/mlp/gating_einsum": ("td,lcdf->lctf", "td,lcdr->lctr", "lctr,lcrf->lctf"),
    f"{W}/mlp/linear": ("tf,lfd->ltd", "tf,lfr->ltr", "ltr,lrd->ltd"),
}
_SCALED = (f"{W}/attn/q_einsum/w", f"{W}/attn/kv_einsum/w", f"{W}/attn/attn_vec_einsum/w")


def _inputs(flat, rng):
    """Activations each weight reads: x [T, D] (q, kv, gating), attention output [T, N, H], MLP hidden [T, F]."""
    n, d, h = flat[f"{W}/attn/q_einsum/w"].shape[1:]
    f = flat[f"{W}/mlp/linear"].shape[1]
    x, o, m = rng.standard_normal((3, d)), rng.standard_normal((3, n, h)), rng.standard_normal((3, f))
    return {w: (o if "attn_vec" in w else m if w.endswith("linear") else x) for w in _EQ}


def _openpi_lora(flat, arrays, scale, inputs):
    """openpi's LoRA layers evaluated directly in float64: W plus s·(x·A)·B on attention (s = alpha / rank),
    plus the unscaled (x·A)·B on the feed-forward."""
    out = {}
    for w, (base_eq, a_eq, b_eq) in _EQ.items():
        a, b = (np.asarray(arrays[WEIGHTS[w] + c], np.float64) for c in "ab")
        lora_term = np.einsum(b_eq, np.einsum(a_eq, inputs[w], a), b)
        out[w] = np.einsum(base_eq, inputs[w], np.asarray(flat[w], np.float64)) + (scale if w in _SCALED else 1.0) * lora_term
    return out


def _plain(flat, inputs):
    """The same layers through plain weights, float64."""
    return {w: np.einsum(eq[0], inputs[w], np.asarray(flat[w], np.float64)) for w, eq in _EQ.items()}


def test_an_imported_adapter_merges_into_openpis_einsum_form_of_the_lora(case, tmp_path):
    params, base, rank, alpha = case
    arrays = _oxygen_arrays(params, rank)
    dest = import_oxygen(_write_oxygen(tmp_path / "ox", arrays, rank, alpha), tmp_path / "ours", base=base)
    adapter, meta = load_adapter(dest, params.config, base=base)
    assert (meta["rank"], meta["alpha"], meta["prompt"], meta["name"]) == (rank, alpha, "Memory: ", "memory")
    assert meta["base_fingerprint"] == base_fingerprint(base)
    merged = to_openpi_dict(pi05_lora.merge(params, pi05_lora.ModelLora(vlm=adapter, action_expert=None)))
    flat = to_openpi_dict(params)
    inputs = _inputs(flat, np.random.default_rng(1))
    want, got, before = _openpi_lora(flat, arrays, alpha / rank, inputs), _plain(merged, inputs), _plain(flat, inputs)
    for w in _EQ:
        assert np.abs(want[w] - before[w]).max() > 0.1, w  # the adapter changes every layer's output
        np.testing.assert_allclose(got[w], want[w], rtol=1e-5, atol=1e-5 * np.abs(want[w]).max(), err_msg=w)
