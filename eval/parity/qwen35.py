"""Numerical parity with a Hugging Face Qwen3.5 reference fixture (`../shared/fixtures/qwen35_tiny`).

    python -m eval.parity.qwen35 FIXTURE_DIR     # `python -m eval.parity FIXTURE_DIR` picks it for such a fixture

FIXTURE_DIR holds an HF Qwen3.5 checkpoint (config.json with model_type 'qwen3_5' or 'qwen3_5_text',
model.safetensors) and `reference.npz` made by transformers' own Qwen3.5 (the fixture's README lists the arrays;
`eval/qwen35_refs.py` writes the same layout at any dims, without images; arrays it leaves out are skipped).
The spec comes from config.json and every shape from the arrays; nothing about the fixture is hard-wired.

Compared, for the text batch and (when present) the image batch:
- positions (cumsum(mask) - 1 for text; M-RoPE from the image grids), the image stages (patchify, ViT
  output, merged tokens), logits, HF hidden states (one row per index), full-layer K/V, and each linear
  layer's conv input / gate / decay / β / delta-rule output, on valid tokens;
- every linear layer's conv window and recurrent state after prefill. Left-padded and unpadded rows are
  compared with HF's batch cache and with `solo_*` (each row alone); a right-padded row only with `solo_*`,
  the state at its last real token, which is what this implementation keeps (HF's batch state for such
  a row has absorbed the pads; a row reports how far ours is from it, and must be far);
- greedy tokens (exact) and step logits of a cached decode (K/V for full layers, the recurrent form for
  linear ones), and the conv window / state after it;
- greedy tokens (exact) through the runtime's decode slot pool (`runtime.decode`): the prompt's last 3
  tokens are each row's request prompt in a capacity of 5 (2 padding entries, identity steps), admitted
  after a prefix pass over the rest.

Tolerances (absolute unless marked; float32 on CPU): HF's own float32 result is about 1e-4 from a
float64 run of the same maths on logits (measured with this module's float64 mode), so logits, K/V and
projections use 2e-4; hidden states grow to |h| ~ 45 and use 2e-5 relative to each index's max |ref|;
recurrent states and the delta-rule output 2e-5; conv windows (projections, |c| ~ 5) 5e-5. HF's own
left-pad spread is 3.6e-5 (logits), 1.0e-5 (conv), 2.2e-6 (state): every tolerance is at least that. On
some dims HF's own float32 error exceeds them (up to 2.8x on a 20-layer model's states); our float32 program
rounds as transformers' torch code does (`nn.torch_order`, docs/qwen35.md "Float32 order"), which is what
keeps it inside. Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity.checks import Checker, Row, report
from oxygen_jax.ckpts import qwen35 as ckpt
from oxygen_jax.models import qwen35_decoder
from oxygen_jax.models import backbone, qwen3_vl, qwen35
from oxygen_jax.models.backbone import Decoder
from oxygen_jax.models.qwen35 import Qwen35Spec
from oxygen_jax.nn.masks import last_valid_index
from oxygen_jax.runtime import decode

_TOL = {"logits": 2e-4, "kv": 2e-4, "proj": 2e-4, "state": 2e-5, "core": 2e-5, "window": 5e-5, "pixels": 1e-6, "vision": 1e-4}
HIDDEN_RTOL = 2e-5


def _tolerance(quantity: str, family: str | None):
    if family == "hidden":
        return 0.0, HIDDEN_RTOL
    return _TOL[family or "logits"], None


def is_qwen35_fixture(path) -> bool:
    """True for a directory holding an HF Qwen3.5 checkpoint (config.json + safetensors)."""
    return Path(path).is_dir() and ckpt.is_qwen35_dir(path)


@functools.partial(jax.jit, static_argnames=("taps",))
def _forward(spec: Qwen35Spec, decoder: Decoder, x, positions, input_mask, taps: bool = True):
    out = qwen35.prefill(spec, decoder, x, positions, input_mask, return_hidden=True, return_taps=taps)
    out["logits"] = backbone.lm_logits(spec.backbone, decoder, out["normed"])
    last = last_valid_index(input_mask)
    out["first_logits"] = jnp.take_along_axis(out["logits"], last[:, None, None], axis=1)[:, 0]
    return out


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def greedy_decode(spec: Qwen35Spec, decoder: Decoder, k, v, window, state, input_mask, first_logits, start, num_tokens: int):
    """Greedy continuation of a prefilled batch: full layers through a K/V cache, linear layers through
    their (window, state) in the recurrent form, one token per step.

    Args:
      k, v: [Lf, B, T, K, H]; window: [Lg, B, Cc, Kc]; state: [Lg, B, Hv, Dk, Dv]; input_mask: bool [B, T];
      first_logits: [B, V] at the last valid token; start: int [B] position of the first decoded token.
    Returns:
      (tokens int32 [B, n], logits float32 [B, n, V], (window, state) after the n - 1 fed tokens).
    """
    b, t = input_mask.shape
    pad = [(0, 0), (0, 0), (0, num_tokens), (0, 0), (0, 0)]
    ck, cv = jnp.pad(k, pad), jnp.pad(v, pad)
    mask = jnp.concatenate([input_mask, jnp.zeros((b, num_tokens), bool)], axis=1)
    tok0 = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)
    every = jnp.ones((b, 1), bool)

    def step(carry, j):
        ck, cv, win, st, mask, tok = carry
        write = t + j
        mask = mask.at[:, write].set(True)
        x = backbone.embed_tokens(spec.backbone, decoder, tok[:, None])
        h, (ck, cv), (win, st) = qwen35.forward_step(spec, decoder.layers, x, (start + j)[:, None], every, mask[:, None, :],
                                                     ck, cv, jnp.full((b, 1), write, jnp.int32), win, st)
        logits = backbone.lm_logits(spec.backbone, decoder, backbone.final_norm(spec.backbone, decoder, h[:, 0]))
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (ck, cv, win, st, mask, nxt), (nxt, logits)

    (_, _, window, state, _, _), (toks, logits) = jax.lax.scan(step, (ck, cv, window, state, mask, tok0), jnp.arange(num_tokens - 1))
    tokens = jnp.concatenate([tok0[:, None], toks.T], axis=1)
    return tokens, jnp.concatenate([first_logits[:, None], jnp.swapaxes(logits, 0, 1)], axis=1), (window, state)


_prefix_pass = jax.jit(qwen35.prefix_pass, static_argnums=0, static_argnames=("hidden_layers", "language"))
POOL_PROMPT, POOL_CAPACITY = 3, 5  # request-prompt tokens taken off each row's end, and the pool's prompt capacity


def pool_greedy(spec: Qwen35Spec, decoder: Decoder, x, ids, positions, input_mask, num_tokens: int,
                prompt: int = POOL_PROMPT, capacity: int = POOL_CAPACITY) -> np.ndarray:
    """Greedy tokens of each row through the decode slot pool: a prefix pass over all but the last
    `prompt` tokens, then those tokens as the row's request prompt (capacity `capacity`), `num_tokens` tokens.

    Args: x [B, T, D] embeddings, ids int [B, T], positions int [B, T] or [Mr, B, T], input_mask bool [B, T]
    (the last `prompt` tokens real text tokens of every row). Returns int32 [B, num_tokens].
    """
    b, t = input_mask.shape
    cut = t - prompt
    pre = _prefix_pass(spec, decoder, x[:, :cut], jnp.asarray(positions)[..., :cut], jnp.asarray(input_mask[:, :cut]))
    lm = qwen35_decoder.language_model(spec, decoder)
    pool = decode.init_pool(lm, b, cut, num_tokens, capacity)
    req = decode.make_requests(b, capacity, list(range(b)), rows=list(range(b)), prompts=[list(r) for r in np.asarray(ids)[:, cut:]],
                               budgets=[num_tokens] * b, stop_ids=[-1] * b)
    pool, _, _ = decode.admit(lm, pool, pre, req)
    return np.asarray(decode.decode_to_completion(lm, pool).tokens)


_encode = jax.jit(qwen3_vl.encode, static_argnums=(0, 3))


@functools.partial(jax.jit, static_argnames=("image_token_id",))
def _embed_images(spec: Qwen35Spec, decoder: Decoder, input_ids, image_tokens, image_token_id: int):
    return qwen3_vl.embed_multimodal(spec.backbone, decoder, input_ids, image_tokens, image_token_id)


def _batch(chk: Checker, spec: Qwen35Spec, dec: Decoder, ref, p: str, x, ids, positions, am, start, tag: str,
           pool: bool = True) -> None:
    """Every comparison of one batch (`p` = '' for text, 'vl_' for images) whose inputs are x, positions."""
    out = _forward(spec, dec, x, jnp.asarray(positions), jnp.asarray(am))
    chk.close(f"{tag} logits (valid tokens)", out["logits"], ref[p + "logits"], "logits", valid=am)
    hs = np.asarray(out["hidden_states"])
    for i in range(hs.shape[0]):
        chk.close(f"{tag} hidden_states[{i}] (valid tokens)", hs[i], ref[p + "hidden_states"][i], "hidden", valid=am)
    for name in ("k", "v"):  # HF [Lf, B, K, T, H] -> ours [Lf, B, T, K, H]
        theirs = np.transpose(ref[f"{p}{name}_cache"], (1, 3, 0, 2, 4))
        chk.close(f"{tag} {name}_cache, full layers (valid tokens)", np.transpose(np.asarray(out[name]), (1, 2, 0, 3, 4)), theirs,
                  "kv", valid=am)
    for ours, theirs, fam in (("qkv", "gdn_qkv", "proj"), ("z", "gdn_z", "proj"), ("a", "gdn_a", "proj"), ("b", "gdn_b", "proj"),
                              ("core", "gdn_core", "core")):
        if not p and theirs in ref:
            chk.close(f"{tag} linear layers' {theirs} (valid tokens)", np.moveaxis(np.asarray(out["taps"][ours]), 0, 2),
                      np.moveaxis(ref[theirs], 0, 2), fam, valid=am)
    window, state = np.asarray(out["window"]), np.asarray(out["state"])
    right = am[:, -1] == 0  # right-padded rows: HF's batch state absorbed the pads
    for name, ours, fam in (("conv_states", window, "window"), ("recurrent_states", state, "state")):
        ok_rows = ~right
        chk.close(f"{tag} {name}, rows without right padding, vs HF batch", ours[:, ok_rows], ref[p + name][:, ok_rows], fam)
        if p + "solo_" + name in ref:
            chk.close(f"{tag} {name}, every row, vs each row alone (state at its last real token)", ours,
                      ref[p + "solo_" + name], fam)
        if right.any():
            gap = float(np.max(np.abs(ours[:, right] - ref[p + name][:, right])))
            chk.add(f"{tag} {name}, right-padded rows, distance from HF's pad-contaminated batch state (must be large)",
                    gap, gap, "> 1e-2", gap > 1e-2)

    rows = ref.get(p + "gen_rows", np.arange(ref[p + "gen_tokens"].shape[0])) if p + "gen_tokens" in ref else None
    if rows is None:
        return
    rows = np.asarray(rows)
    n = ref[p + "gen_tokens"].shape[1]
    sel = lambda a, axis: jnp.take(a, jnp.asarray(rows), axis=axis)  # noqa: E731
    tokens, step_logits, (win, st) = greedy_decode(spec, dec, sel(out["k"], 1), sel(out["v"], 1), sel(out["window"], 1),
                                                   sel(out["state"], 1), jnp.asarray(am[rows]), sel(out["first_logits"], 0),
                                                   jnp.asarray(np.asarray(start)[rows], jnp.int32), n)
    chk.exact(f"{tag} greedy tokens, cached decode ({n} steps)", tokens, ref[p + "gen_tokens"])
    mm = ref.get(p + "mm_token_type_ids")  # the request prompt must be text: real tokens, no image placeholders
    if pool and am[rows, -POOL_PROMPT:].all() and (mm is None or not mm[rows, -POOL_PROMPT:].any()):
        pool_tokens = pool_greedy(spec, dec, sel(x, 0), np.asarray(ids)[rows], np.take(positions, rows, axis=-2), am[rows], n)
        chk.exact(f"{tag} greedy tokens through the decode slot pool (prompt tail as request prompt)", pool_tokens,
                  ref[p + "gen_tokens"])
    chk.close(f"{tag} decode step logits", step_logits, ref[p + "gen_logits"], "logits")
    pos_key = "gen_decode_position_ids" if not p else "vl_decode_position_ids"
    if pos_key in ref:
        chk.exact(f"{tag} decode position ids", np.asarray(start)[rows, None] + np.arange(ref[pos_key].shape[1]), ref[pos_key])
    for name, ours, fam in (("conv_states", win, "window"), ("recurrent_states", st, "state")):
        if f"{p}gen_final_{name}" in ref:
            chk.close(f"{tag} {name} after decoding", ours, ref[f"{p}gen_final_{name}"], fam)


def run_fixture(fixture: Path, dtype: str = "float32", pool: bool = True) -> tuple[Qwen35Spec, list[Row]]:
    """Loads the fixture by its own config.json and compares every reference array present (full float32
    matmul precision; `dtype` 'float64' shows HF's own float32 error); `pool=False` leaves out the slot-pool
    rows (tests/test_qwen35_runtime.py checks those)."""
    fixture = Path(fixture).resolve()
    if not (fixture / "reference.npz").is_file():
        raise SystemExit(f"{fixture}: reference.npz not found")
    with jax.default_matmul_precision("float32"):
        ck = ckpt.load(fixture, dtype)
        spec, dec = ck.spec, ck.decoder
        ref = dict(np.load(fixture / "reference.npz"))
        chk = Checker(_tolerance)
        if "linear_layer_indices" in ref:
            chk.exact("linear / full layer indices (layer_types)", np.asarray(spec.linear_layers + spec.full_layers),
                      np.concatenate([ref["linear_layer_indices"], ref["full_layer_indices"]]))
        am = ref["attention_mask"].astype(bool)
        positions = np.where(am, np.cumsum(am, axis=-1, dtype=np.int32) - 1, 0).astype(np.int32)
        if "position_ids" in ref:
            chk.exact("text position_ids (valid tokens)", np.broadcast_to(positions, ref["position_ids"].shape), ref["position_ids"],
                      np.broadcast_to(am, ref["position_ids"].shape))
        x = backbone.embed_tokens(spec.backbone, dec, jnp.asarray(ref["input_ids"]))
        _batch(chk, spec, dec, ref, "", x, ref["input_ids"], positions, am, am.sum(-1), "text", pool)
        if "vl_input_ids" in ref and ck.vision is not None:
            _vision_batch(chk, ck, ref, pool)
    return spec, chk.rows


def _vision_batch(chk: Checker, ck: ckpt.Qwen35Checkpoint, ref, pool: bool = True) -> None:
    spec, vspec = ck.spec, ck.spec.backbone.vision
    ids, am = ref["vl_input_ids"], ref["vl_attention_mask"].astype(bool)
    image_id = int(ck.config["image_token_id"])
    grid = qwen3_vl.as_grid(ref["vl_image_grid_thw"])
    keys = sorted((k for k in ref if k.startswith("vl_image") and k.endswith("_uint8")), key=lambda k: int(k[8:-6]))
    if keys:
        pv, grids = zip(*(qwen3_vl.patchify(ref[k], vspec) for k in keys))
        chk.exact("vl image_grid_thw (from raw images)", np.asarray(grids), ref["vl_image_grid_thw"])
        chk.close("vl pixel_values (patchify raw images)", np.concatenate(pv), ref["vl_pixel_values"], "pixels")
    enc = _encode(vspec, ck.vision, jnp.asarray(ref["vl_pixel_values"]), grid)
    chk.close("vl vision: ViT output before the merger", enc["vit"], ref["vl_vit_last_hidden"], "vision")
    chk.close("vl vision: merged image tokens", enc["tokens"], ref["vl_vision_tokens"], "vision")
    positions, nxt = qwen3_vl.mrope_positions(ids, am, grid, image_token_id=image_id, spatial_merge_size=vspec.spatial_merge_size)
    chk.exact("vl M-RoPE position_ids (valid tokens)", positions, ref["vl_position_ids"], np.broadcast_to(am, positions.shape))
    if "vl_rope_deltas" in ref:
        chk.exact("vl rope_deltas", nxt - am.sum(-1), ref["vl_rope_deltas"].reshape(-1))
    x, image_mask = _embed_images(spec, ck.decoder, jnp.asarray(ids), enc["tokens"], image_id)
    if "vl_mm_token_type_ids" in ref:
        chk.exact("vl image token mask (mm_token_type_ids)", image_mask, ref["vl_mm_token_type_ids"].astype(bool))
    _batch(chk, spec, ck.decoder, ref, "vl_", x, ids, positions, am, nxt, "vl", pool)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.parity.qwen35",
                                 description="Compare oxygen_jax's Qwen3.5 with Hugging Face reference outputs.")
    ap.add_argument("fixture", type=Path, help="HF Qwen3.5 checkpoint directory with config.json, safetensors and reference.npz")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                    help="float64 (needs JAX_ENABLE_X64=1) measures HF's own float32 error instead")
    args = ap.parse_args(argv)
    if not is_qwen35_fixture(args.fixture):
        ap.error(f"{args.fixture}: not an HF Qwen3.5 checkpoint (needs config.json with model_type 'qwen3_5' and model.safetensors)")
    spec, rows = run_fixture(args.fixture, args.dtype)
    b, g = spec.backbone, spec.gdn
    print(f"[qwen3_5] {args.fixture}: width {b.width}, layers {spec.layer_types.count('linear_attention')} linear + "
          f"{spec.layer_types.count('full_attention')} full (group {len(spec.group)} x {spec.num_groups}), heads {b.num_heads}/{b.num_kv_heads} "
          f"x {b.head_dim} (rotary {b.rotary_dim or b.head_dim}), GDN Hk {g.num_key_heads} Hv {g.num_value_heads} Dk {g.key_dim} "
          f"Dv {g.value_dim} Kc {g.conv_kernel}, {'tied' if b.tie_embeddings else 'untied'} head"
          + (f"; ViT {b.vision.depth} x {b.vision.width}" if b.vision is not None else ""))
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
