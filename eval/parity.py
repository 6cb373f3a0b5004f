"""Numerical parity with openpi (and OxyGen's text decoding) on a reference fixture.

    python -m eval.parity FIXTURE_DIR           # restore both checkpoint layouts, compare everything
    python -m eval.parity --manifest FILE       # parameter manifest vs the full-size pi05 tree

FIXTURE_DIR is laid out like ../shared/fixtures/openpi_tiny_pi05: `params/` (released layout),
`train_checkpoint/<step>/params/` (training layout, trailing `value` keys), `reference.npz` and
optionally `reference_text_oxygen.npz`. Every dimension (batch, cameras, horizon, action dim, prompt
length, step counts, decode length) is inferred from the checkpoint and the arrays; config.json is
not read.

A quantity passes when max|ours - ref| <= atol + rtol * max|ref| (tolerances from the fixture's
README: float32 on CPU). Integer and boolean quantities must match exactly. Exit status 1 on any
FAIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax import checkpoint, decode, gemma, model, siglip
from oxygen_jax.config import CAMERA_SLOTS
from oxygen_jax.masks import last_valid_index
from oxygen_jax.observation import Observation
from oxygen_jax.params import to_openpi_dict

# (atol, rtol) per family, from the fixture README's suggested float32 tolerances.
_TOL = {
    "siglip": (1e-5, 1e-5),
    "prefix_tokens": (1e-5, 1e-5),
    "prefix_out": (5e-4, 1e-4),
    "actions": (2e-4, 1e-4),
    "loss": (5e-4, 2e-4),
    "logits": (5e-4, 0.0),
    "bf16": (0.15, 0.0),
}


@dataclasses.dataclass
class Row:
    quantity: str
    layout: str
    max_abs: float
    max_rel: float  # max_abs / max|ref|
    tol: str
    ok: bool


class _Checker:
    def __init__(self, layout: str):
        self.layout, self.rows = layout, []

    def close(self, name: str, ours, ref, family: str, valid=None):
        ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
        if ours.shape != ref.shape:
            self.rows.append(Row(name, self.layout, math.inf, math.inf, f"shape {ours.shape} vs {ref.shape}", False))
            return
        if valid is not None:
            ours, ref = ours[valid], ref[valid]
        atol, rtol = _TOL[family]
        d = float(np.max(np.abs(ours - ref))) if ref.size else 0.0
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        ok = bool(np.isfinite(d) and d <= atol + rtol * scale)
        self.rows.append(Row(name, self.layout, d, d / scale if scale else d, f"atol {atol:g} rtol {rtol:g}", ok))

    def exact(self, name: str, ours, ref):
        ours, ref = np.asarray(ours), np.asarray(ref)
        ok = ours.shape == ref.shape and bool(np.array_equal(ours, ref))
        d = float(np.sum(ours != ref)) if ours.shape == ref.shape else math.inf
        self.rows.append(Row(name, self.layout, d, d / max(ref.size, 1), "exact (mismatches)", ok))


def _observation(ref) -> Observation:
    cams = [c for c in CAMERA_SLOTS if f"image/{c}" in ref]
    return Observation(
        images=jnp.stack([jnp.asarray(ref[f"image/{c}"], jnp.float32) for c in cams], 1),
        image_masks=jnp.stack([jnp.asarray(ref[f"image_mask/{c}"]) for c in cams], 1),
        tokens=jnp.asarray(ref["tokenized_prompt"], jnp.int32),
        token_mask=jnp.asarray(ref["tokenized_prompt_mask"]),
    )


def _check_model(chk: _Checker, params, ref, obs: Observation):
    cams = [c for c in CAMERA_SLOTS if f"image/{c}" in ref]
    for i, cam in enumerate(cams):
        if f"siglip/{cam}/tokens" not in ref:
            continue
        st = jax.jit(siglip.encode_stages, static_argnums=2)(params.siglip, obs.images[:, i], params.config.jnp_dtype)
        stem_ref = ref[f"siglip/{cam}/stem"]
        chk.close(f"siglip/{cam}/stem", np.asarray(st["stem"]).reshape(stem_ref.shape), stem_ref, "siglip")
        chk.close(f"siglip/{cam}/encoded", st["encoded"], ref[f"siglip/{cam}/encoded"], "siglip")
        chk.close(f"siglip/{cam}/tokens", st["tokens"], ref[f"siglip/{cam}/tokens"], "siglip")

    out = jax.jit(model.prefix_forward)(params, obs)
    valid = np.asarray(ref["prefix/input_mask"])
    if "prefix/tokens" in ref:
        chk.close("prefix/tokens", out["tokens"], ref["prefix/tokens"], "prefix_tokens")
    chk.exact("prefix/input_mask", out["input_mask"], ref["prefix/input_mask"])
    if "prefix/ar_mask" in ref:
        chk.exact("prefix/ar_mask", out["ar"], ref["prefix/ar_mask"])
    chk.exact("prefix/positions", out["positions"], ref["prefix/positions"])
    if "prefix/out_final_norm" in ref:
        normed, _ = gemma.rms_norm(out["hidden"], params.vlm.final_norm)
        chk.close("prefix/out_final_norm (valid rows)", normed, ref["prefix/out_final_norm"], "prefix_out", valid)
    for kv in ("k", "v"):
        if f"prefix/kv_cache_{kv}" in ref:
            chk.close(
                f"prefix/kv_cache_{kv} (valid rows)", np.transpose(np.asarray(out[kv]), (1, 2, 0, 3, 4)),
                np.transpose(ref[f"prefix/kv_cache_{kv}"], (1, 2, 0, 3, 4)), "prefix_out", valid,
            )

    cache = model.prefill(params, obs)
    noise = jnp.asarray(ref["noise"], jnp.float32)
    b, ha = noise.shape[:2]
    if "step1/velocity_t1" in ref:
        ones = jnp.ones((b,), jnp.float32)
        chk.close("step1/velocity_t1", jax.jit(model.velocity)(params, cache, noise, ones), ref["step1/velocity_t1"], "actions")
        chk.exact("step1/suffix_positions", cache.num_valid[:, None] + jnp.arange(ha), ref["step1/suffix_positions"])
        chk.close("step1/adarms_cond_t1", jax.jit(model.time_condition)(params, ones), ref["step1/adarms_cond_t1"], "actions")
        chk.close(
            "step1/suffix_tokens_t1", model._dense(params.action_in, noise), ref["step1/suffix_tokens_t1"], "actions"
        )
    for key in sorted(k for k in ref if k.startswith("actions/num_steps_")):
        n = int(key.rsplit("_", 1)[1])
        chk.close(key, model.denoise(params, cache, noise, n), ref[key], "actions")

    if "loss/actions" in ref:
        actions = jnp.asarray(ref["loss/actions"])
        lnoise, ltime = jnp.asarray(ref["loss/noise"]), jnp.asarray(ref["loss/time"])
        loss = model.compute_loss(params, obs, actions, lnoise, ltime)
        chk.close("loss/loss_explicit", loss, ref["loss/loss_explicit"], "loss")
        t = ltime[:, None, None]
        x_t = t * lnoise + (1 - t) * actions
        chk.close("loss/x_t", x_t, ref["loss/x_t"], "loss")
        chk.close("loss/u_t", lnoise - actions, ref["loss/u_t"], "loss")
        chk.close("loss/v_t", jax.jit(model.velocity)(params, cache, x_t, ltime), ref["loss/v_t"], "loss")
        chk.exact(
            "loss/positions",
            jnp.concatenate([cache.positions, cache.num_valid[:, None] + jnp.arange(ha)], axis=1),
            ref["loss/positions"],
        )
        if "loss/loss" in ref:
            # openpi's rng-driven loss drew exactly the stored noise/time, so it is the same computation.
            chk.close("loss/loss (stored noise/time)", loss, ref["loss/loss"], "loss")


def _check_bf16(chk: _Checker, path: Path, ref, obs: Observation):
    _, p16 = checkpoint.load_openpi_params(path, dtype="bfloat16")
    noise = jnp.asarray(ref["noise"], jnp.float32)
    if "bf16/actions/num_steps_10" in ref:
        chk.close("bf16/actions/num_steps_10 (smoke)", model.sample_actions(p16, obs, noise, 10), ref["bf16/actions/num_steps_10"], "bf16")
    if "bf16/loss/loss" in ref:
        loss = model.compute_loss(p16, obs, jnp.asarray(ref["loss/actions"]), jnp.asarray(ref["loss/noise"]), jnp.asarray(ref["loss/time"]))
        chk.close("bf16/loss/loss (smoke)", loss, ref["bf16/loss/loss"], "bf16")


def greedy_text(params, obs: Observation, num_tokens: int):
    """Greedy decode of every row without a stop token; returns (tokens [B, n], logits [B, n, V], cache)."""
    cache = model.prefill(params, obs)
    b = obs.batch_size
    pool = decode.init_pool(params, b, cache.length, num_tokens)
    req = decode.make_requests(b, 0, list(range(b)), rows=list(range(b)), budgets=[num_tokens] * b, stop_tokens=[-1] * b)
    logits = [model.lm_logits(params, cache.last_hidden)]
    pool, _, _ = decode.admit(params, pool, cache, req)
    for _ in range(num_tokens - 1):
        pool, _, lg = decode.decode_step(params, pool)
        logits.append(lg)
    return np.asarray(pool.tokens), np.stack([np.asarray(x) for x in logits], 1), cache


def _check_text(chk: _Checker, params, text, obs: Observation, noise):
    causal = params.with_config(prompt_attention="causal")
    variants = {"maskaware": obs, "oxygen_allcams": dataclasses.replace(obs, image_masks=jnp.ones_like(obs.image_masks))}
    for name, o in variants.items():
        if f"{name}/tokens" not in text:
            continue
        n = text[f"{name}/tokens"].shape[1]
        tokens, logits, cache = greedy_text(causal, o, n)
        chk.exact(f"{name}/tokens", tokens, text[f"{name}/tokens"])
        chk.close(f"{name}/first_step_logits", logits[:, 0], text[f"{name}/first_step_logits"], "logits")
        chk.close(f"{name}/logits", logits, text[f"{name}/logits"], "logits")
        chk.exact(f"{name}/seed_index", last_valid_index(cache.mask), text[f"{name}/seed_index"])
        chk.exact(f"{name}/prefill_len", cache.num_valid, text[f"{name}/prefill_len"])
        chk.exact(f"{name}/decode_positions", cache.num_valid[:, None] + jnp.arange(n), text[f"{name}/decode_positions"])
        chk.exact(f"{name}/prefix_positions", cache.positions, text[f"{name}/prefix_positions"])
        out = jax.jit(model.prefix_forward)(causal, o)
        normed, _ = gemma.rms_norm(out["hidden"], causal.vlm.final_norm)
        chk.close(f"{name}/prefix_out_final_norm (valid rows)", normed, text[f"{name}/prefix_out_final_norm"], "prefix_out",
                  np.asarray(cache.mask))
    if "oxygen/prefix_ar_mask" in text:
        chk.exact("oxygen/prefix_ar_mask", jax.jit(model.embed_prefix)(causal, obs)[2], text["oxygen/prefix_ar_mask"])
    if "oxygen_actions/num_steps_10" in text:
        chk.close("oxygen_actions/num_steps_10 (causal prompt)", model.sample_actions(causal, obs, jnp.asarray(noise, jnp.float32), 10),
                  text["oxygen_actions/num_steps_10"], "actions")


def _layouts(fixture: Path) -> list[tuple[str, Path]]:
    out = []
    if (fixture / "params").is_dir():
        out.append(("released", fixture / "params"))
    train = fixture / "train_checkpoint"
    if train.is_dir():
        for step in sorted(p for p in train.iterdir() if (p / "params").is_dir()):
            out.append((f"training/{step.name}", step / "params"))
    if not out:
        raise SystemExit(f"{fixture}: no params/ or train_checkpoint/<step>/params/ directory found")
    return out


def run_fixture(fixture: Path) -> list[Row]:
    fixture = fixture.resolve()
    ref_path = fixture / "reference.npz"
    if not ref_path.is_file():
        raise SystemExit(f"{fixture}: reference.npz not found")
    ref = dict(np.load(ref_path))
    text_path = fixture / "reference_text_oxygen.npz"
    text = dict(np.load(text_path)) if text_path.is_file() else None
    obs = _observation(ref)
    rows, flat_first = [], None
    for layout, path in _layouts(fixture):
        cfg, params = checkpoint.load_openpi_params(path)
        chk = _Checker(layout)
        flat = {k: np.asarray(v) for k, v in to_openpi_dict(params).items()}
        if flat_first is None:
            flat_first = flat
        else:
            same = flat.keys() == flat_first.keys() and all(np.array_equal(flat[k], flat_first[k]) for k in flat)
            chk.rows.append(Row("params identical to released layout", layout, 0.0 if same else math.inf, 0.0, "exact", same))
        _check_model(chk, params, ref, obs)
        if text is not None:
            _check_text(chk, params, text, obs, ref["noise"])
        if any(k.startswith("bf16/") for k in ref):
            _check_bf16(chk, path, ref, obs)
        rows += chk.rows
        print(f"[{layout}] {path}: vlm {cfg.vlm}, action expert {cfg.action_expert}, siglip {cfg.siglip}, vocab {cfg.vocab_size}",
              file=sys.stderr)
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| quantity | layout | max abs err | max abs / max ref | tolerance | result |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.quantity} | {r.layout} | {r.max_abs:.3g} | {r.max_rel:.3g} | {r.tol} | {'PASS' if r.ok else 'FAIL'} |"
        )
    return "\n".join(lines)


def _manifest(path: Path, allow_lora: bool) -> bool:
    result = checkpoint.check_manifest(path, allow_lora=allow_lora)
    print(result.summary())
    return result.ok and result.matches_preset


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m eval.parity",
        description="Compare oxygen_jax with openpi/OxyGen reference outputs, or check a parameter manifest.",
    )
    ap.add_argument("fixture", nargs="?", type=Path, help="fixture directory (params/, train_checkpoint/, reference.npz)")
    ap.add_argument("--manifest", type=Path, help="parameter manifest JSON to check against the full-size pi05 tree")
    ap.add_argument("--allow-lora", action="store_true", help="treat openpi LoRA leaves in a manifest as ignorable")
    args = ap.parse_args(argv)
    if (args.fixture is None) == (args.manifest is None):
        ap.error("give exactly one of FIXTURE_DIR or --manifest FILE")
    if args.manifest is not None:
        if not args.manifest.is_file():
            ap.error(f"manifest not found: {args.manifest}")
        return 0 if _manifest(args.manifest, args.allow_lora) else 1
    if not args.fixture.is_dir():
        ap.error(f"fixture directory not found: {args.fixture}")
    rows = run_fixture(args.fixture)
    print(format_table(rows))
    if (args.fixture / "reference_text_oxygen.npz").is_file():
        print("\nnote: oxygen/* (OxyGen's own decode of rows with a masked camera, seeded at n_valid - 1) is not "
              "reproduced on purpose; maskaware/* is the reference for masked cameras.")
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed" + (f"; FAILED: {', '.join(r.quantity for r in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
