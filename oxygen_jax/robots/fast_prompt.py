"""π0-FAST's token layout over the PaliGemma vocabulary (openpi's `FASTTokenizer`): prompts in, actions out.

Axes: T = max_len text tokens, Ha chunk horizon, Ad action dims. Host-side (numpy).

    prefix   BOS "Task: " + cleaned prompt + ", State: " + state bins + ";\\n"      ar 0, loss False
    postfix  "Action: " + FAST ids as PaliGemma ids + "|" + EOS                    ar 1, loss True (training)
    padding  0, mask False, ar 0, loss False, up to T (a longer sequence is cut, with a warning)

The prompt is cleaned as openpi does: lower case, stripped, "_" -> " " (a newline inside stays). The state is
openpi's 256 bins of [-1, 1) (`tokenizer.discretize_state`, no clipping). FAST id k is PaliGemma id
V - 1 - 128 - k (`FAST_SKIP_TOKENS` = 128 ids at the end of the vocabulary are skipped; in PaliGemma the <loc>
block then holds the ids), the same map in both directions.

Example (V = 1024): "Pick_up" and state [0.0, -1.0] -> BOS "Task: pick up, State: 128 0;\\n"; FAST ids
[3, 40] -> PaliGemma ids [892, 855].

`extract_actions` reads a decoded row back as openpi's `extract_actions` does (decode the ids, take the text
between the first "Action: " and the next "|", stripped, re-encode it, map back, FAST-decode), except that a row
it cannot read is a `FastDecodeError` naming why, not a zero chunk, unless `on_failure="zeros"` asks for openpi's
fallback.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

from oxygen_jax.robots.fast import FastCodec, FastDecodeError, OnFailure
from oxygen_jax.robots.tokenizer import Tokenizer, discretize_state

FAST_SKIP_TOKENS = 128  # PaliGemma's last 128 ids (its <seg> block) hold no FAST token
CAMERAS = ("base_0_rgb", "base_1_rgb", "wrist_0_rgb")  # openpi's Pi0FASTConfig inputs, in prefix order
ACTION_MARK, END_MARK = "Action: ", "|"


class FastTokens(NamedTuple):
    """One row of π0-FAST's text: tokens int32 [T], mask bool [T], ar int32 [T] (1 = causal postfix),
    loss_mask bool [T] (the postfix's targets)."""

    tokens: np.ndarray
    mask: np.ndarray
    ar: np.ndarray
    loss_mask: np.ndarray


def fast_to_paligemma(ids, vocab_size: int) -> np.ndarray:
    """int64: PaliGemma id V - 1 - 128 - k of each FAST id k (its own inverse)."""
    return vocab_size - 1 - FAST_SKIP_TOKENS - np.asarray(ids, np.int64)


def clean_prompt(prompt) -> str:
    """openpi's π0-FAST prompt cleaning: lower case, stripped, "_" -> " " ("Pick_up\\n" -> "pick up")."""
    if isinstance(prompt, bytes):
        prompt = prompt.decode("utf-8")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
    return prompt.lower().strip().replace("_", " ")


def prefix_text(prompt, state: np.ndarray) -> str:
    """"Task: <prompt>, State: <bins>;\\n" for a normalised, unpadded state [Ds] (no BOS)."""
    bins = discretize_state(state)
    if bins.ndim != 1:
        raise ValueError(f"state must be one unpadded state vector [Ds], got shape {bins.shape}")
    return f"Task: {clean_prompt(prompt)}, State: {' '.join(str(int(b)) for b in bins)};\n"


def tokenize(tok: Tokenizer, prompt, state: np.ndarray, max_len: int, *, codec: FastCodec | None = None,
             actions: np.ndarray | None = None) -> FastTokens:
    """One row of π0-FAST text: the prefix, and with `actions` [Ha, Ad] the postfix (a training row).

    Args:
      tok: the PaliGemma tokenizer (the model's vocabulary); codec: the FAST codec (needed with `actions`).
      state: float [Ds], normalised, unpadded.
      max_len: T (openpi's `max_token_len`).
    """
    if max_len < 1:
        raise ValueError(f"max_len must be positive, got {max_len}")
    prefix = tok.encode(prefix_text(prompt, state), add_bos=True)
    postfix: list[int] = []
    if actions is not None:
        if codec is None:
            raise ValueError("tokenizing actions needs the FAST codec (codec=)")
        ids = fast_to_paligemma(codec.encode(actions), tok.vocab_size)
        postfix = tok.encode(ACTION_MARK) + [int(i) for i in ids] + tok.encode(END_MARK) + [tok.eos_id]
    tokens = prefix + postfix
    ar = [0] * len(prefix) + [1] * len(postfix)
    if len(tokens) > max_len:
        warnings.warn(f"π0-FAST text has {len(tokens)} tokens, more than max_len={max_len}: truncated", stacklevel=2)
    n = min(len(tokens), max_len)
    out = FastTokens(np.zeros(max_len, np.int32), np.zeros(max_len, bool), np.zeros(max_len, np.int32),
                     np.zeros(max_len, bool))
    out.tokens[:n], out.mask[:n], out.ar[:n] = tokens[:n], True, ar[:n]
    out.loss_mask[:n] = np.asarray(ar[:n], bool)
    return out


def tokenize_batch(tok: Tokenizer, prompts, states, max_len: int, *, codec: FastCodec | None = None,
                   actions=None) -> FastTokens:
    """`tokenize` per row, stacked: each field [B, T]."""
    rows = [tokenize(tok, p, s, max_len, codec=codec, actions=None if actions is None else actions[i])
            for i, (p, s) in enumerate(zip(prompts, states, strict=True))]
    return FastTokens(*(np.stack(field) for field in zip(*rows)))


def action_ids(tok: Tokenizer, ids, fast_vocab_size: int) -> list[int]:
    """The FAST ids a decoded row spells (openpi's reading of it); `FastDecodeError` when it spells none.

    Args:
      ids: the row's PaliGemma ids (0 padding and EOS decode to nothing).
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise FastDecodeError(f"a decoded row is one sequence of ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.array_equal(arr, np.round(arr)):
            raise FastDecodeError("decoded ids must be integers")
        arr = arr.astype(np.int64)  # openpi's sample_actions returns float32 ids
    try:
        text = tok.decode(arr)
    except ValueError as e:
        raise FastDecodeError(str(e)) from None
    if ACTION_MARK not in text:
        raise FastDecodeError(f"the decoded text has no {ACTION_MARK!r}: no action chunk")
    inner = text.split(ACTION_MARK, 1)[1].split(END_MARK, 1)[0].strip()
    pg = np.asarray(tok.encode(inner), np.int64)
    fast = fast_to_paligemma(pg, tok.vocab_size)
    bad = np.flatnonzero((fast < 0) | (fast >= fast_vocab_size))
    if bad.size:
        low, high = tok.vocab_size - FAST_SKIP_TOKENS - fast_vocab_size, tok.vocab_size - 1 - FAST_SKIP_TOKENS
        raise FastDecodeError(f"the action text holds PaliGemma id {int(pg[bad[0]])}, not a FAST token (the "
                              f"{fast_vocab_size} FAST ids are PaliGemma ids [{low}, {high}])")
    return [int(i) for i in fast]


def extract_actions(tok: Tokenizer, codec: FastCodec, ids, horizon: int | None = None, action_dim: int | None = None,
                    *, on_failure: OnFailure = "raise") -> np.ndarray:
    """The action chunk float32 [Ha, Ad] a decoded row spells (normalised, as the model emits it).

    Args:
      ids: one row of decoded PaliGemma ids (`pi0_fast_decode.sample_tokens`), 0-padded.
      horizon, action_dim: the chunk shape (default: the codec's).
      on_failure: "raise" (default): `FastDecodeError` naming why the row is no chunk; "zeros": openpi's
        silent fallback, a zero chunk.
    """
    h, a = codec.shape(horizon, action_dim)
    try:
        fast = action_ids(tok, ids, codec.vocab_size)
        return codec.decode(fast, h, a).astype(np.float32)
    except FastDecodeError:
        if on_failure == "zeros":
            return np.zeros((h, a), np.float32)
        raise
