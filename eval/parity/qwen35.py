"""Numerical parity with a Hugging Face Qwen3.5 reference fixture (`../shared/fixtures/qwen35_tiny`).

    python -m eval.parity.qwen35 FIXTURE_DIR     # `python -m eval.parity FIXTURE_DIR` picks it for such a fixture

FIXTURE_DIR holds an HF Qwen3.5 checkpoint (config.json with model_type 'qwen3_5' or 'qwen3_5_text',
model.safetensors) and `reference.npz` made by transformers' own Qwen3.5 (the fixture's README lists the arrays;
`eval/refs/qwen35_refs.py` writes the same layout at any dims, without images; arrays it leaves out are skipped).
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
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity.checks import Checker, Row, report
from oxygen_jax.ckpts import qwen35 as ckpt
from oxygen_jax.models.qwen35 import decoder as qwen35_decoder
from oxygen_jax.models import backbone
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.models.qwen35 import layers as qwen35_layers
from oxygen_jax.models.qwen35 import steps as qwen35_steps
from oxygen_jax.models.backbone import Decoder
from oxygen_jax.models.qwen35.model import Qwen35Spec
from oxygen_jax.nn import torch_order
from oxygen_jax.nn.masks import last_valid_index
from oxygen_jax.runtime import decode

_TOL = {"logits": 2e-4, "kv": 2e-4, "proj": 2e-4, "state": 2e-5, "core": 2e-5, "window": 5e-5, "pixels": 1e-6, "vision": 1e-4}
HIDDEN_RTOL = 2e-5


def _tolerance(quantity: str, family: str | None):
    if family == "hidden":
        return 0.0, HIDDEN_RTOL
    return _TOL[family or "logits"], None


EXACT_FACTOR = 1.5  # the fidelity bound: max(tolerance, EXACT_FACTOR x transformers' own float32 error)


@dataclasses.dataclass(frozen=True)
class FidelityRow:
    """One quantity against the float64 reference (`reference_f64.npz`): our max error, transformers' float32
    max error (`reference.npz` vs the same), the bound max(tolerance, EXACT_FACTOR x theirs), both errors'
    root mean square (steadier than a max over few values), and per layer, where the quantity has a layer
    axis, (ours, theirs, ours rms, theirs rms) (else ())."""

    quantity: str
    ours: float
    theirs: float
    tol: float
    ours_rms: float
    theirs_rms: float
    layers: tuple[tuple[float, float, float, float], ...]

    @property
    def bound(self) -> float:
        return max(self.tol, EXACT_FACTOR * self.theirs)

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.ours) and self.ours <= self.bound)


def _errors(ours, theirs, exact, valid) -> tuple[float, float, float, float]:
    """(max |ours - exact|, max |theirs - exact|, and their root mean squares) over the `valid` entries."""
    out = []
    for a in (ours, theirs):
        d = np.abs(a - exact)
        d = d if valid is None else d[valid]
        out.append((float(np.max(d)), float(np.sqrt(np.mean(d * d)))) if d.size else (0.0, 0.0))
    return out[0][0], out[1][0], out[0][1], out[1][1]


class _Compare:
    """Compares each quantity with `ref` (transformers' float32 results: a parity `Row` in `chk`) and, when
    `exact` (the float64 reference) is given, records a `FidelityRow` for it in `fidelity`."""

    def __init__(self, chk: Checker, ref: dict, exact: dict | None):
        self.chk, self.ref, self.exact, self.fidelity = chk, ref, exact, []

    def close(self, name: str, ours, key: str, family: str, valid=None, view=None, layer_axis: int | None = None):
        """`view` maps a reference array to our layout (transposes, row selections); `valid` selects entries
        of that layout; `layer_axis` of it, if any, is reported layer by layer."""
        view = view or (lambda a: a)
        theirs = view(self.ref[key])
        self.chk.close(name, ours, theirs, family, valid=valid)
        if self.exact is None or key not in self.exact:
            return
        ours, theirs, exact = (np.asarray(a, np.float64) for a in (ours, theirs, view(self.exact[key])))
        if ours.shape != exact.shape:
            self.fidelity.append(FidelityRow(name, np.inf, 0.0, 0.0, np.inf, 0.0, ()))
            return
        sel = None if valid is None else np.broadcast_to(np.asarray(valid), exact.shape[:np.ndim(valid)])
        atol, rtol = _tolerance(name, family)
        scale = float(np.max(np.abs(exact if sel is None else exact[sel]))) if exact.size else 0.0
        layers = ()
        if layer_axis is not None:  # after the axes `valid` selects on
            take = lambda a, i: np.take(a, i, axis=layer_axis)  # noqa: E731
            layers = tuple(_errors(take(ours, i), take(theirs, i), take(exact, i), sel) for i in range(exact.shape[layer_axis]))
        m_ours, m_theirs, r_ours, r_theirs = _errors(ours, theirs, exact, sel)
        self.fidelity.append(FidelityRow(name, m_ours, m_theirs, atol + (rtol or 0.0) * scale, r_ours, r_theirs, layers))


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
        logits = backbone.lm_logits(spec.backbone, decoder, qwen35_layers.norm(spec.backbone, h[:, 0], decoder.final_norm))
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (ck, cv, win, st, mask, nxt), (nxt, logits)

    (_, _, window, state, _, _), (toks, logits) = jax.lax.scan(step, (ck, cv, window, state, mask, tok0), jnp.arange(num_tokens - 1))
    tokens = jnp.concatenate([tok0[:, None], toks.T], axis=1)
    return tokens, jnp.concatenate([first_logits[:, None], jnp.swapaxes(logits, 0, 1)], axis=1), (window, state)


@jax.jit
def _first_windows(spec: Qwen35Spec, decoder: Decoder, tokens):
    """The first linear layer's conv inputs of `tokens` [B, Kc] summed in order and in four lanes: [2, B, Kc, Cc]."""
    lp = jax.tree.map(lambda a: a[0, 0], decoder.layers.linear)
    h = qwen35_layers.norm(spec.backbone, backbone.embed_tokens(spec.backbone, decoder, tokens), lp.attn_norm)
    return jnp.stack([torch_order.dense(h, lp.qkv), qwen35_steps.dense(h, lp.qkv)])


def reference_step_sums(spec: Qwen35Spec, decoder: Decoder, ref) -> str:
    """`Qwen35Spec.step_sums` of the torch that made `ref`, read off its first layer: when layer 0 is a linear
    layer, its window after decoding holds in_proj_qkv of the last Kc fed tokens (norm and projection of their
    embeddings, nothing else), which one order reproduces bit for bit. 'in_order' when it cannot tell."""
    p = "" if "gen_final_conv_states" in ref else "vl_"
    if p + "gen_final_conv_states" not in ref or spec.linear_layers[0] != 0:
        return "in_order"
    kc, tokens = spec.gdn.conv_kernel, np.asarray(ref[p + "gen_tokens"])
    if tokens.shape[1] - 1 < kc:  # the window still holds prompt columns (the prefill's order)
        return "in_order"
    fed = tokens[:, tokens.shape[1] - 1 - kc:tokens.shape[1] - 1]  # the last token is never fed
    want = np.swapaxes(ref[p + "gen_final_conv_states"][0], 1, 2)
    ours = np.asarray(_first_windows(spec, decoder, jnp.asarray(fed, jnp.int32)))
    return "four_lanes" if np.array_equal(ours[1], want) and not np.array_equal(ours[0], want) else "in_order"


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


def _batch(cmp: _Compare, spec: Qwen35Spec, dec: Decoder, p: str, x, ids, positions, am, start, tag: str,
           pool: bool = True) -> None:
    """Every comparison of one batch (`p` = '' for text, 'vl_' for images) whose inputs are x, positions."""
    chk, ref = cmp.chk, cmp.ref
    out = _forward(spec, dec, x, jnp.asarray(positions), jnp.asarray(am))
    cmp.close(f"{tag} logits (valid tokens)", out["logits"], p + "logits", "logits", valid=am)
    hs = np.asarray(out["hidden_states"])
    for i in range(hs.shape[0]):
        cmp.close(f"{tag} hidden_states[{i}] (valid tokens)", hs[i], p + "hidden_states", "hidden", valid=am,
                  view=lambda a, i=i: a[i])
    for name in ("k", "v"):  # HF [Lf, B, K, T, H] -> ours [Lf, B, T, K, H]
        cmp.close(f"{tag} {name}_cache, full layers (valid tokens)", np.transpose(np.asarray(out[name]), (1, 2, 0, 3, 4)),
                  f"{p}{name}_cache", "kv", valid=am, view=lambda a: np.transpose(a, (1, 3, 0, 2, 4)), layer_axis=2)
    for ours, theirs, fam in (("qkv", "gdn_qkv", "proj"), ("z", "gdn_z", "proj"), ("a", "gdn_a", "proj"), ("b", "gdn_b", "proj"),
                              ("core", "gdn_core", "core")):
        if not p and theirs in ref:
            cmp.close(f"{tag} linear layers' {theirs} (valid tokens)", np.moveaxis(np.asarray(out["taps"][ours]), 0, 2), theirs,
                      fam, valid=am, view=lambda a: np.moveaxis(a, 0, 2), layer_axis=2)
    window, state = np.asarray(out["window"]), np.asarray(out["state"])
    right = am[:, -1] == 0  # right-padded rows: HF's batch state absorbed the pads
    for name, ours, fam in (("conv_states", window, "window"), ("recurrent_states", state, "state")):
        cmp.close(f"{tag} {name}, rows without right padding, vs HF batch", ours[:, ~right], p + name, fam,
                  view=lambda a: a[:, ~right], layer_axis=0)
        if p + "solo_" + name in ref:
            cmp.close(f"{tag} {name}, every row, vs each row alone (state at its last real token)", ours, p + "solo_" + name, fam,
                      layer_axis=0)
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
    cmp.close(f"{tag} decode step logits", step_logits, p + "gen_logits", "logits")
    pos_key = "gen_decode_position_ids" if not p else "vl_decode_position_ids"
    if pos_key in ref:
        chk.exact(f"{tag} decode position ids", np.asarray(start)[rows, None] + np.arange(ref[pos_key].shape[1]), ref[pos_key])
    for name, ours, fam in (("conv_states", win, "window"), ("recurrent_states", st, "state")):
        if f"{p}gen_final_{name}" in ref:
            cmp.close(f"{tag} {name} after decoding", ours, f"{p}gen_final_{name}", fam, layer_axis=0)


@dataclasses.dataclass(frozen=True)
class FixtureResult:
    """`compare_fixture`'s result: the spec, the parity rows against transformers' float32 results, and the
    fidelity rows against the float64 reference (empty without `reference_f64.npz`)."""

    spec: Qwen35Spec  # with the reference's `step_sums`
    rows: list[Row]
    fidelity: list[FidelityRow]


def run_fixture(fixture: Path, dtype: str = "float32", pool: bool = True) -> tuple[Qwen35Spec, list[Row]]:
    """`compare_fixture`'s spec and parity rows."""
    result = compare_fixture(fixture, dtype, pool)
    return result.spec, result.rows


def compare_fixture(fixture: Path, dtype: str = "float32", pool: bool = True, step_sums: str | None = None) -> FixtureResult:
    """Loads the fixture by its own config.json and compares every reference array present (full float32
    matmul precision; `dtype` 'float64', with JAX_ENABLE_X64=1, runs a program without float32 steps);
    `pool=False` leaves out the slot-pool rows (tests/test_qwen35_runtime.py checks those). Inputs (ids,
    masks, pixels) always come from `reference.npz`; with `reference_f64.npz` beside it every float quantity
    it holds is also compared with it (`FidelityRow`). Decode steps sum as the reference's torch did
    (`reference_step_sums`) unless `step_sums` names an order."""
    fixture = Path(fixture).resolve()
    if not (fixture / "reference.npz").is_file():
        raise SystemExit(f"{fixture}: reference.npz not found")
    exact_file = fixture / "reference_f64.npz"
    with jax.default_matmul_precision("float32"):
        ck = ckpt.load(fixture, dtype)
        dec = ck.decoder
        ref = dict(np.load(fixture / "reference.npz"))
        spec = dataclasses.replace(ck.spec, step_sums=step_sums or reference_step_sums(ck.spec, dec, ref))
        chk = Checker(_tolerance)
        cmp = _Compare(chk, ref, dict(np.load(exact_file)) if exact_file.is_file() else None)
        if "linear_layer_indices" in ref:
            chk.exact("linear / full layer indices (layer_types)", np.asarray(spec.linear_layers + spec.full_layers),
                      np.concatenate([ref["linear_layer_indices"], ref["full_layer_indices"]]))
        am = ref["attention_mask"].astype(bool)
        positions = np.where(am, np.cumsum(am, axis=-1, dtype=np.int32) - 1, 0).astype(np.int32)
        if "position_ids" in ref:
            chk.exact("text position_ids (valid tokens)", np.broadcast_to(positions, ref["position_ids"].shape), ref["position_ids"],
                      np.broadcast_to(am, ref["position_ids"].shape))
        x = backbone.embed_tokens(spec.backbone, dec, jnp.asarray(ref["input_ids"]))
        _batch(cmp, spec, dec, "", x, ref["input_ids"], positions, am, am.sum(-1), "text", pool)
        if "vl_input_ids" in ref and ck.vision is not None:
            _vision_batch(cmp, spec, ck, pool)
    return FixtureResult(spec, chk.rows, cmp.fidelity)


def _vision_batch(cmp: _Compare, spec: Qwen35Spec, ck: ckpt.Qwen35Checkpoint, pool: bool = True) -> None:
    chk, ref = cmp.chk, cmp.ref
    vspec = spec.backbone.vision
    ids, am = ref["vl_input_ids"], ref["vl_attention_mask"].astype(bool)
    image_id = int(ck.config["image_token_id"])
    grid = qwen3_vl.as_grid(ref["vl_image_grid_thw"])
    keys = sorted((k for k in ref if k.startswith("vl_image") and k.endswith("_uint8")), key=lambda k: int(k[8:-6]))
    if keys:
        pv, grids = zip(*(qwen3_vl.patchify(ref[k], vspec) for k in keys))
        chk.exact("vl image_grid_thw (from raw images)", np.asarray(grids), ref["vl_image_grid_thw"])
        cmp.close("vl pixel_values (patchify raw images)", np.concatenate(pv), "vl_pixel_values", "pixels")
    enc = _encode(vspec, ck.vision, jnp.asarray(ref["vl_pixel_values"], ck.decoder.embedding.dtype), grid)
    cmp.close("vl vision: ViT output before the merger", enc["vit"], "vl_vit_last_hidden", "vision")
    cmp.close("vl vision: merged image tokens", enc["tokens"], "vl_vision_tokens", "vision")
    positions, nxt = qwen3_vl.mrope_positions(ids, am, grid, image_token_id=image_id, spatial_merge_size=vspec.spatial_merge_size)
    chk.exact("vl M-RoPE position_ids (valid tokens)", positions, ref["vl_position_ids"], np.broadcast_to(am, positions.shape))
    if "vl_rope_deltas" in ref:
        chk.exact("vl rope_deltas", nxt - am.sum(-1), ref["vl_rope_deltas"].reshape(-1))
    x, image_mask = _embed_images(spec, ck.decoder, jnp.asarray(ids), enc["tokens"], image_id)
    if "vl_mm_token_type_ids" in ref:
        chk.exact("vl image token mask (mm_token_type_ids)", image_mask, ref["vl_mm_token_type_ids"].astype(bool))
    _batch(cmp, spec, ck.decoder, "vl_", x, ids, positions, am, nxt, "vl", pool)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.parity.qwen35",
                                 description="Compare oxygen_jax's Qwen3.5 with Hugging Face reference outputs.")
    ap.add_argument("fixture", type=Path, help="HF Qwen3.5 checkpoint directory with config.json, safetensors and reference.npz")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                    help="float64 (needs JAX_ENABLE_X64=1) measures HF's own float32 error instead")
    args = ap.parse_args(argv)
    if not is_qwen35_fixture(args.fixture):
        ap.error(f"{args.fixture}: not an HF Qwen3.5 checkpoint (needs config.json with model_type 'qwen3_5' and model.safetensors)")
    result = compare_fixture(args.fixture, args.dtype)
    spec, rows = result.spec, result.rows
    b, g = spec.backbone, spec.gdn
    print(f"[qwen3_5] {args.fixture}: width {b.width}, layers {spec.layer_types.count('linear_attention')} linear + "
          f"{spec.layer_types.count('full_attention')} full (group {len(spec.group)} x {spec.num_groups}), heads {b.num_heads}/{b.num_kv_heads} "
          f"x {b.head_dim} (rotary {b.rotary_dim or b.head_dim}), GDN Hk {g.num_key_heads} Hv {g.num_value_heads} Dk {g.key_dim} "
          f"Dv {g.value_dim} Kc {g.conv_kernel}, {'tied' if b.tie_embeddings else 'untied'} head"
          + (f"; ViT {b.vision.depth} x {b.vision.width}" if b.vision is not None else "") + f"; decode steps sum {spec.step_sums}")
    if result.fidelity:
        print(f"\nAgainst reference_f64.npz (bound: max(tolerance, {EXACT_FACTOR} x transformers' float32 error)):\n")
        print(fidelity_table(result.fidelity) + "\n")
    return report(rows)


def fidelity_table(rows: list[FidelityRow]) -> str:
    """A markdown table of `FidelityRow`s: errors, the bound, ours / theirs, and the largest per-layer ratio."""
    lines = ["| quantity | ours | transformers f32 | bound | ours / theirs | rms: ours / theirs | worst layer: ours / theirs "
             "| result |", "|---|---|---|---|---|---|---|---|"]
    ratio = lambda a, b: f"{a / b:.2f}" if b else "-"  # noqa: E731
    for r in rows:
        layer = max(r.layers, key=lambda e: e[0] / max(e[1], 1e-30), default=None)
        worst = "-" if layer is None else f"{ratio(layer[0], layer[1])} (layer {r.layers.index(layer)})"
        lines.append(f"| {r.quantity} | {r.ours:.3g} | {r.theirs:.3g} | {r.bound:.3g} | {ratio(r.ours, r.theirs)} | "
                     f"{ratio(r.ours_rms, r.theirs_rms)} | {worst} | {'PASS' if r.ok else 'FAIL'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
