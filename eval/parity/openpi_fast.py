"""Numerical parity with openpi's π0-FAST on a reference fixture (`openpi_tiny_pi0_fast` and its held-out twins).

    python -m eval.parity FIXTURE_DIR           # recognised by `is_fast_fixture` (see `eval.parity.__main__`)

The fixture holds openpi's checkpoint in both layouts (`params/`, `train_checkpoint/<step>/params/`), the FAST
processor folder (`fast_tokenizer/`), the PaliGemma tokenizer (`paligemma_tokenizer.model`), `reference.npz` and
`config.json` (prompts, tolerances). Every dimension (cameras, text length, horizon, action dim, FAST vocabulary,
decode length) is read from the files. Compared per checkpoint layout:

* tokenization (`robots.fast_prompt.tokenize`, `FastCodec.encode`): exact;
* SigLIP stages, input embeddings, the teacher-forced logits over the whole text, each next token's log p and
  the loss, with all cameras and with the masked camera (`masked/*`);
* openpi's right-aligned prefill (mask, positions, lengths exact; embeddings, K/V of valid slots, last logits)
  and its greedy decode: positions and steps exact, every step's logits with openpi's own tokens fed, and the
  free-running tokens, identical up to the first step whose reference top-2 margin is within the rounding spread
  (2 x the logits atol: two logits each within it can swap) — a flip there and the divergence after it pass;
* `extract_actions` on openpi's cases: the working ones within the actions atol, the failing ones (openpi's zero
  chunks) reported as failures (`FastDecodeError`), and zeros only through `on_failure="zeros"`; the same for
  the decoded rows of the random model.

Tolerances: config.json `suggested_tolerances_float32_cpu` where it names the quantity, else the π0.5 defaults
(`eval.parity.openpi.Tolerances`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity.checks import Checker, Row
from eval.parity.openpi import Tolerances, check_siglip, checkpoint_layouts
from oxygen_jax.ckpts.openpi_fast import load_fast_codec, load_openpi_fast_params
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.pi05 import pi0_fast, pi0_fast_decode
from oxygen_jax.models.pi05.params import to_openpi_dict
from oxygen_jax.robots import fast_prompt
from oxygen_jax.robots.fast import FastCodec, FastDecodeError
from oxygen_jax.robots.tokenizer import Tokenizer

TOKENIZER_FILE = "paligemma_tokenizer.model"


def is_fast_fixture(fixture: Path) -> bool:
    """An openpi π0-FAST fixture: the FAST processor folder beside an openpi checkpoint and reference.npz."""
    return (fixture / "fast_tokenizer" / "processor_config.json").is_file() and (fixture / "reference.npz").is_file()


class Fixture:
    """The fixture's files and reference arrays, read once."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.ref = dict(np.load(self.root / "reference.npz"))
        config_path = self.root / "config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.strings = self.config.get("strings", {})
        self.tol = Tolerances(self.config.get("suggested_tolerances_float32_cpu"))
        self.tokenizer = Tokenizer.from_file(self.root / TOKENIZER_FILE)
        self.codec: FastCodec = load_fast_codec(self.root / "fast_tokenizer")
        self.cameras = tuple(self.config.get("dims", {}).get("camera_keys_in_order", fast_prompt.CAMERAS))
        self.horizon, self.action_dim = self.ref["actions"].shape[1:]

    def observation(self, text: str, masked: bool = False) -> Observation:
        """Images, camera masks (all present unless `masked`) and the `tok/<text>/*` tokens."""
        ref, b = self.ref, self.ref["state"].shape[0]
        masks = [ref[f"image_mask/{c}"] if masked else np.ones(b, bool) for c in self.cameras]
        return Observation(images=jnp.stack([jnp.asarray(ref[f"image/{c}"], jnp.float32) for c in self.cameras], 1),
                           image_masks=jnp.asarray(np.stack(masks, 1)), tokens=jnp.asarray(ref[f"tok/{text}/tokens"]),
                           token_mask=jnp.asarray(ref[f"tok/{text}/mask"]))


def _check_tokenize(chk: Checker, fx: Fixture) -> None:
    ref, prompts = fx.ref, fx.strings.get("prompts")
    if prompts is None:
        chk.add("tok/* (config.json has no strings/prompts)", math.inf, math.inf, "needs the prompts", False)
        return
    t = ref["tok/train/tokens"].shape[1]
    fields = ("tokens", "mask", "ar_mask", "loss_mask")
    for text, actions in (("train", ref["actions"]), ("infer", None)):
        ours = fast_prompt.tokenize_batch(fx.tokenizer, prompts, ref["state"], t, codec=fx.codec, actions=actions)
        for field, value in zip(fields, ours):
            chk.exact(f"tok/{text}/{field}", value, ref[f"tok/{text}/{field}"])
    fast = [fx.codec.encode(a) for a in ref["actions"]]
    chk.exact("tok/fast_len", [len(f) for f in fast], ref["tok/fast_len"])
    width = ref["tok/fast_ids"].shape[1]
    padded = np.asarray([f + [-1] * (width - len(f)) for f in fast]) if max(map(len, fast)) <= width else None
    if padded is None:
        chk.add("tok/fast_ids", math.inf, math.inf, "longer than the reference", False)
        return
    chk.exact("tok/fast_ids", padded, ref["tok/fast_ids"])
    mapped = np.where(padded >= 0, fast_prompt.fast_to_paligemma(padded, fx.tokenizer.vocab_size), -1)
    chk.exact("tok/fast_ids_in_paligemma", mapped, np.where(ref["tok/fast_ids"] >= 0, ref["tok/fast_ids_in_paligemma"], -1))


def _check_embeddings(chk: Checker, fx: Fixture, params) -> None:
    ref, obs = fx.ref, fx.observation("train")
    check_siglip(chk, params, ref, obs, fx.cameras)
    x, mask, ar = jax.jit(pi0_fast.embed_inputs)(params, obs, jnp.asarray(ref["tok/train/ar_mask"]))
    chk.close("embed/train/tokens", x, ref["embed/train/tokens"], "prefix_tokens")
    chk.exact("embed/train/input_mask", mask, ref["embed/train/input_mask"])
    chk.exact("embed/train/ar_mask", ar, ref["embed/train/ar_mask"])


def _check_teacher(chk: Checker, fx: Fixture, params, pre: str) -> None:
    """Teacher-forced logits, target log p and the loss (`pre` "" or "masked/")."""
    ref = fx.ref
    obs = fx.observation("train", masked=bool(pre))
    ar, loss_mask = jnp.asarray(ref["tok/train/ar_mask"]), jnp.asarray(ref["tok/train/loss_mask"])
    logits, target = pi0_fast.teacher_forced(params, obs, ar)
    chk.close(f"{pre}teacher/logits", logits, ref[f"{pre}teacher/logits"], "logits", like="teacher/logits")
    chk.close(f"{pre}teacher/target_logp", target, ref[f"{pre}teacher/target_logp"], "logits", like="teacher/logits")
    loss = pi0_fast.compute_loss(params, obs, ar, loss_mask)
    chk.close(f"{pre}loss/loss", loss, ref[f"{pre}loss/loss"], "loss", like="loss/loss")


def _check_decode(chk: Checker, fx: Fixture, params, pre: str) -> None:
    """openpi's prefill and greedy decode (`pre` "decode/" or "masked/decode/")."""
    ref = fx.ref
    obs = fx.observation("infer", masked=pre.startswith("masked/"))
    steps = ref[f"{pre}tokens"].shape[1]
    cache = pi0_fast_decode.prefill(params, obs, steps)
    chk.exact(f"{pre}prefill_mask", cache.mask, ref[f"{pre}prefill_mask"])
    chk.exact(f"{pre}prefill_positions", cache.positions, ref[f"{pre}prefill_positions"])
    chk.exact(f"{pre}prefill_len", cache.prefill_len, ref[f"{pre}prefill_len"])
    chk.exact(f"{pre}prefix_start", cache.prefix_start, ref[f"{pre}prefix_start"])
    chk.close(f"{pre}prefill_last_logits", cache.last_logits, ref[f"{pre}prefill_last_logits"], "logits",
              like="decode/prefill_last_logits")
    if f"{pre}prefill_tokens" in ref:
        x, _, _ = jax.jit(pi0_fast_decode.aligned_inputs)(params, obs)
        chk.close(f"{pre}prefill_tokens", x, ref[f"{pre}prefill_tokens"], "prefix_tokens")
    valid = np.asarray(ref[f"{pre}prefill_mask"])
    p = valid.shape[1]
    for kv, ours in (("k", cache.k), ("v", cache.v)):
        if f"{pre}prefill_kv_{kv}" in ref:  # [L, B, P, K, H] compared per valid (row, slot)
            chk.close(f"{pre}prefill_kv_{kv} (valid slots)", np.moveaxis(np.asarray(ours[:, :, :p]), 0, 2),
                      np.moveaxis(ref[f"{pre}prefill_kv_{kv}"], 0, 2), "prefix_out", valid, like="decode/prefill_kv_k")
    free = pi0_fast_decode.decode(params, cache, steps)
    chk.exact(f"{pre}num_steps_run", free.num_steps, ref[f"{pre}num_steps_run"])
    chk.exact(f"{pre}positions", free.positions, ref[f"{pre}positions"])
    _check_greedy(chk, fx, pre, np.asarray(free.tokens))
    kept = ref[f"{pre}step_logits"].shape[1]
    fed = pi0_fast_decode.decode(params, pi0_fast_decode.prefill(params, obs, steps), steps,
                                 jnp.asarray(ref[f"{pre}tokens"]), keep_logits=kept)
    chk.close(f"{pre}step_logits (openpi's tokens fed)", fed.logits, ref[f"{pre}step_logits"], "logits",
              like="decode/step_logits")


def _check_greedy(chk: Checker, fx: Fixture, pre: str, tokens: np.ndarray) -> None:
    """Free-running tokens against openpi's: identical, or identical up to a reference near-tie (then diverging)."""
    ref_tokens, margin = fx.ref[f"{pre}tokens"], fx.ref[f"{pre}top2_margin"]
    atol, _ = fx.tol.get("decode/step_logits", "logits")
    spread = 2 * atol
    worst, ok = 0, True
    for b in range(ref_tokens.shape[0]):
        diff = np.flatnonzero(tokens[b] != ref_tokens[b])
        if diff.size:
            first = int(diff[0])
            ok &= bool(margin[b, first] <= spread)
            worst = max(worst, ref_tokens.shape[1] - first)
    chk.add(f"{pre}tokens (free greedy)", float(worst), worst / ref_tokens.shape[1],
            f"exact, or a flip at a reference margin <= {spread:g}", ok)


def _check_extract(chk: Checker, fx: Fixture) -> None:
    ref, names = fx.ref, fx.strings.get("extract_cases/names")
    cases = [(f"extract_cases/{names[i] if names else i}", ref["extract_cases/tokens"][i], ref["extract_cases/actions"][i])
             for i in range(ref["extract_cases/tokens"].shape[0])]
    for pre in ("", "masked/"):
        if f"{pre}extract/decoded_actions" in ref:
            cases += [(f"{pre}extract/decoded_actions[{b}]", row, ref[f"{pre}extract/decoded_actions"][b])
                      for b, row in enumerate(ref[f"{pre}decode/tokens"])]
    for name, ids, want in cases:
        zeros = fast_prompt.extract_actions(fx.tokenizer, fx.codec, ids, fx.horizon, fx.action_dim, on_failure="zeros")
        try:
            ours = fast_prompt.extract_actions(fx.tokenizer, fx.codec, ids, fx.horizon, fx.action_dim)
        except FastDecodeError as e:
            failed = not np.any(want)  # openpi's failure value is a zero chunk
            chk.add(f"{name} reported: {e}", 0.0 if failed else math.inf, 0.0, "openpi: zeros", failed)
            chk.close(f"{name} (on_failure='zeros')", zeros, want, "actions", like="extract_cases/actions")
            continue
        chk.close(name, ours, want, "actions", like="extract_cases/actions")


def run_fixture(fixture: Path) -> list[Row]:
    """Every check of a π0-FAST fixture, per checkpoint layout."""
    fx = Fixture(fixture)
    rows, first = [], None
    for layout, path in checkpoint_layouts(fx.root):
        config, params = load_openpi_fast_params(path)
        chk = Checker(fx.tol.get, layout)
        flat = {k: np.asarray(v) for k, v in to_openpi_dict(params).items()}
        if first is None:
            first = flat
            _check_tokenize(chk, fx)
            _check_extract(chk, fx)
        else:
            same = flat.keys() == first.keys() and all(np.array_equal(flat[k], first[k]) for k in flat)
            chk.add("params identical to released layout", 0.0 if same else math.inf, 0.0, "exact", same)
        _check_embeddings(chk, fx, params)
        for pre in ("", "masked/"):
            if f"{pre}teacher/logits" in fx.ref:
                _check_teacher(chk, fx, params, pre)
            if f"{pre}decode/tokens" in fx.ref:
                _check_decode(chk, fx, params, f"{pre}decode/")
        rows += chk.rows
        print(f"[{layout}] {path}: vlm {config.vlm}, siglip {config.siglip}, vocab {config.vocab_size}; FAST "
              f"vocab {fx.codec.vocab_size}, chunk {fx.horizon} x {fx.action_dim}", file=sys.stderr)
    return rows
