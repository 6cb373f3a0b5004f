"""Numerical parity with Hugging Face Qwen3 / Qwen3-VL reference fixtures.

    python -m eval.parity.hf FIXTURE_DIR         # `python -m eval.parity FIXTURE_DIR` picks it for such a fixture

FIXTURE_DIR is an HF checkpoint directory (config.json + model.safetensors or a sharded index)
plus `reference.npz` made by transformers (the shared `qwen3_tiny` and `qwen3vl_tiny` fixtures the tests
read, whose READMEs list the arrays). The family is recognised from the files (config.json
`model_type` / `architectures`, cross-checked against the presence of `model.visual.*` weights),
the spec from config.json and every shape from the arrays: nothing about a particular fixture is
hard-wired.

Compared: (Qwen3-VL only) patchified pixels, ViT output, merged image tokens, DeepStack features,
M-RoPE position ids, rope deltas and the image-token mask; then logits, K/V (after k-norm and
RoPE) and the HF `hidden_states` (pre-DeepStack convention) on real (non-pad) positions; and
greedy tokens through a cached decode of the left-padded batch (positions continue at
`num_valid + step` for 1-D RoPE, `max prefix position + 1 + step` for M-RoPE).

A float quantity passes when max |ours - ref| <= atol (absolute, float32 on CPU); integer
quantities must match exactly (`eval.parity.checks`). Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity.checks import Checker, Row, report
from oxygen_jax.models import backbone
from oxygen_jax.ckpts import hf as hf_checkpoint
from oxygen_jax.ckpts.safetensors import read_checkpoint_tensors
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.backbone import BackboneSpec, Decoder
from oxygen_jax.nn.masks import last_valid_index

ATOL = 1e-4  # logits, K/V, hidden states, vision stages (float32)
PIXEL_ATOL = 1e-6  # our patchify of the raw uint8 images vs the HF processor's output


def _tolerance(quantity: str, family: str | None) -> tuple[float, None]:
    return (PIXEL_ATOL if family == "pixels" else ATOL), None  # absolute tolerances only


def _safetensors_present(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def is_hf_fixture(path) -> bool:
    """True for a directory holding an HF Qwen3 / Qwen3-VL checkpoint (config.json + safetensors)."""
    path = Path(path)
    if not (path.is_dir() and (path / "config.json").is_file() and _safetensors_present(path)):
        return False
    try:
        config = json.loads((path / "config.json").read_text())
        hf_checkpoint.detect_family(config, read_checkpoint_tensors(path).keys())
    except (ValueError, KeyError, OSError):
        return False
    return True


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def greedy_decode(spec: BackboneSpec, decoder: Decoder, k, v, input_mask, first_logits, start, num_tokens: int):
    """Greedy continuation of a prefilled (possibly left-padded) batch through a K/V cache.

    Args:
      k, v: prefix caches [L, B, T, K, H]; input_mask: bool [B, T]; first_logits: [B, V] at the last
        real prefix token; start: int [B] position of the first decoded token (then + step).
    Returns:
      (tokens int32 [B, n], logits float32 [B, n, V]: the logits that chose each token).
    """
    b, t = input_mask.shape
    pad = [(0, 0), (0, 0), (0, num_tokens), (0, 0), (0, 0)]
    ck, cv = jnp.pad(k, pad), jnp.pad(v, pad)
    mask = jnp.concatenate([input_mask, jnp.zeros((b, num_tokens), bool)], axis=1)
    tok0 = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)

    def step(carry, j):
        ck, cv, mask, tok = carry
        write = t + j
        mask = mask.at[:, write].set(True)
        x = backbone.embed_tokens(spec, decoder, tok[:, None])
        h, (ck, cv) = backbone.forward_write(spec, decoder.layers, x, (start + j)[:, None], mask[:, None, :], ck, cv,
                                             jnp.full((b, 1), write, jnp.int32))
        logits = backbone.lm_logits(spec, decoder, backbone.final_norm(spec, decoder, h[:, 0]))
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (ck, cv, mask, nxt), (nxt, logits)

    _, (toks, logits) = jax.lax.scan(step, (ck, cv, mask, tok0), jnp.arange(num_tokens - 1))
    tokens = jnp.concatenate([tok0[:, None], toks.T], axis=1)
    return tokens, jnp.concatenate([first_logits[:, None], jnp.swapaxes(logits, 0, 1)], axis=1)


_encode = jax.jit(qwen3_vl.encode, static_argnums=(0, 3))
_embed_text = jax.jit(backbone.embed_tokens)


@functools.partial(jax.jit, static_argnames=("image_token_id",))
def _embed_images(spec: BackboneSpec, decoder: Decoder, input_ids, image_tokens, deepstack, image_token_id: int):
    x, image_mask = qwen3_vl.embed_multimodal(spec, decoder, input_ids, image_tokens, image_token_id)
    return x, image_mask, qwen3_vl.scatter_deepstack(deepstack, image_mask)


@jax.jit
def _forward(spec: BackboneSpec, decoder: Decoder, x, positions, input_mask, deepstack):
    """Prefill with HF hidden states, all logits, and the logits at each row's last real token."""
    out = backbone.prefill(spec, decoder, x, positions, input_mask, deepstack=deepstack, return_hidden=True)
    out["logits"] = backbone.lm_logits(spec, decoder, out["normed"])
    last = last_valid_index(input_mask)
    out["first_logits"] = jnp.take_along_axis(out["logits"], last[:, None, None], axis=1)[:, 0]
    return out


def _raw_images(ref) -> list[np.ndarray]:
    keys = [k for k in ref if re.fullmatch(r"images?_row(\d+)(_\d+)?_uint8", k)]
    return [ref[k] for k in sorted(keys, key=lambda k: [int(x) for x in re.findall(r"\d+", k)])]


def _check_vision(chk: Checker, ck: hf_checkpoint.HFCheckpoint, ref):
    """ViT stages, M-RoPE positions and image embedding; returns (x [B, T, D], positions, start, deepstack)."""
    spec, vspec = ck.spec, ck.spec.vision
    ids, am = ref["input_ids"], ref["attention_mask"].astype(bool)
    image_id = int(ck.config["image_token_id"])
    if "pixel_values" not in ref:  # a text-only prompt: M-RoPE with equal axes, no DeepStack
        positions, nxt = qwen3_vl.mrope_positions(ids, am, None, image_token_id=image_id,
                                                  spatial_merge_size=vspec.spatial_merge_size)
        return _embed_text(spec, ck.decoder, jnp.asarray(ids)), positions, nxt, None
    grid = qwen3_vl.as_grid(ref["image_grid_thw"])
    images = _raw_images(ref)
    if images:
        pv, grids = zip(*(qwen3_vl.patchify(im, vspec) for im in images))
        chk.exact("image_grid_thw (from raw images)", np.asarray(grids), ref["image_grid_thw"])
        chk.close("pixel_values (patchify raw images)", np.concatenate(pv), ref["pixel_values"], "pixels")
    enc = _encode(vspec, ck.vision, jnp.asarray(ref["pixel_values"]), grid)
    if "vit_last_hidden" in ref:
        chk.close("vision/vit_last_hidden", enc["vit"], ref["vit_last_hidden"])
    if "vision_tokens" in ref:
        chk.close("vision/merged_tokens", enc["tokens"], ref["vision_tokens"])
    if "deepstack_features" in ref:
        chk.close("vision/deepstack_features", enc["deepstack"], ref["deepstack_features"])

    positions, nxt = qwen3_vl.mrope_positions(ids, am, grid, image_token_id=image_id, spatial_merge_size=vspec.spatial_merge_size)
    if "position_ids" in ref:
        chk.exact("mrope position_ids (real tokens)", positions, ref["position_ids"], np.broadcast_to(am, positions.shape))
    if "rope_deltas" in ref:
        chk.exact("rope_deltas", nxt - am.sum(-1), ref["rope_deltas"].reshape(-1))
    x, image_mask, deepstack = _embed_images(spec, ck.decoder, jnp.asarray(ids), enc["tokens"], enc["deepstack"], image_id)
    if "mm_token_type_ids" in ref:
        chk.exact("image token mask (mm_token_type_ids)", image_mask, ref["mm_token_type_ids"].astype(bool))
    return x, positions, nxt, deepstack


def run_fixture(fixture: Path) -> tuple[BackboneSpec, list[Row]]:
    """Loads the fixture's checkpoint by its own config and compares every reference array present.

    Matmuls run at full float32 precision (accelerators would otherwise use TF32 / bf16 passes, whose
    ~1e-3 errors exceed the tolerances).
    """
    with jax.default_matmul_precision("float32"):
        return _run_fixture(fixture)


def _run_fixture(fixture: Path) -> tuple[BackboneSpec, list[Row]]:
    fixture = Path(fixture).resolve()
    if not (fixture / "reference.npz").is_file():
        raise SystemExit(f"{fixture}: reference.npz not found")
    ck = hf_checkpoint.load(fixture)
    spec, dec = ck.spec, ck.decoder
    ref = dict(np.load(fixture / "reference.npz"))
    chk = Checker(_tolerance)
    ids, am = ref["input_ids"], ref["attention_mask"].astype(bool)
    valid = am

    if spec.family == "qwen3_vl":
        x, positions, start, deepstack = _check_vision(chk, ck, ref)
    else:
        positions = np.cumsum(am, axis=-1, dtype=np.int32) - 1  # masks.positions_from_mask, on the host
        if "position_ids" in ref:
            chk.exact("position_ids (real tokens)", positions, ref["position_ids"], am)
        x, start, deepstack = _embed_text(spec, dec, jnp.asarray(ids)), am.sum(-1), None

    out = _forward(spec, dec, x, jnp.asarray(positions), jnp.asarray(am), deepstack)
    logits = out["logits"]
    if "logits" in ref:
        chk.close("logits (real tokens)", logits, ref["logits"], valid=valid)
    for name in ("k", "v"):
        if f"{name}_cache" in ref:  # HF (L, B, K, T, H) -> ours [L, B, T, K, H]; compare per real (b, t)
            theirs = np.transpose(ref[f"{name}_cache"], (1, 3, 0, 2, 4))
            chk.close(f"{name}_cache (real tokens, all layers)", np.transpose(np.asarray(out[name]), (1, 2, 0, 3, 4)), theirs, valid=valid)
    if "hidden_states" in ref:
        ours_hs = np.transpose(np.asarray(out["hidden_states"]), (1, 2, 0, 3))
        chk.close("hidden_states (emb, layers pre-DeepStack, final norm)", ours_hs, np.transpose(ref["hidden_states"], (1, 2, 0, 3)), valid=valid)
    if "final_hidden" in ref:
        chk.close("final_hidden (real tokens)", out["normed"], ref["final_hidden"], valid=valid)

    if "gen_tokens" in ref:
        n = ref["gen_tokens"].shape[1]
        tokens, step_logits = greedy_decode(spec, dec, out["k"], out["v"], jnp.asarray(am), out["first_logits"],
                                            jnp.asarray(start, jnp.int32), n)
        chk.exact(f"greedy tokens, cached decode ({n} steps, left padding)", tokens, ref["gen_tokens"])
        if "gen_step_logits" in ref:
            chk.close("decode step logits", step_logits, ref["gen_step_logits"])
        if "decode_position_ids" in ref:
            chk.exact("decode position ids", np.asarray(start)[:, None] + np.arange(n), ref["decode_position_ids"])
    return spec, chk.rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.parity.hf",
                                 description="Compare oxygen_jax's Qwen3 / Qwen3-VL backbone with Hugging Face reference outputs.")
    ap.add_argument("fixture", type=Path, help="HF checkpoint directory with config.json, safetensors and reference.npz")
    args = ap.parse_args(argv)
    if not args.fixture.is_dir():
        ap.error(f"fixture directory not found: {args.fixture}")
    if not is_hf_fixture(args.fixture):
        ap.error(f"{args.fixture}: not an HF Qwen3 / Qwen3-VL checkpoint (needs config.json with model_type 'qwen3' or "
                 "'qwen3_vl' and model.safetensors)")
    spec, rows = run_fixture(args.fixture)
    v = spec.vision
    print(f"[{spec.family}] {args.fixture}: width {spec.width}, depth {spec.depth}, heads {spec.num_heads}/{spec.num_kv_heads}, "
          f"head_dim {spec.head_dim}, mlp {spec.mlp_dim}, vocab {spec.vocab_size}, rope {spec.rope.kind} theta {spec.rope.theta:g}"
          + (f" sections {spec.rope.mrope_section}" if spec.rope.mrope_section else "")
          + f", {'tied' if spec.tie_embeddings else 'untied'} head"
          + (f"; ViT {v.depth} x {v.width}, DeepStack {v.deepstack_layers}" if v is not None else ""))
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
