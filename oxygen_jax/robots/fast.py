"""The FAST action codec: an action chunk as a few BPE tokens, and back (Pertsch et al. 2025, "FAST").

Axes: Ha chunk horizon (time steps), Ad action dims, n FAST tokens. Everything here runs on the host (numpy).

A chunk [Ha, Ad] becomes tokens in four steps, each inverted on the way back:

    DCT-II (orthonormal) along time, per action dim     coef[k, a] = sum_t C[k, t] x[t, a]
    round(coef * scale) to integers                     (the codec's only loss: |error| <= 0.5 / scale per coef)
    flatten time-major, shift, one character each       chars = chr(max(c - min_token, 0)) for c in coef[0, :], coef[1, :], ...
    byte-level BPE (`tokenizers`, the processor's tokenizer.json)

Decoding: BPE decode -> characters -> ord + min_token -> exactly Ha * Ad integers -> [Ha, Ad] / scale -> the
inverse DCT (DCT-III, orthonormal: C^T). A token sequence that does not give exactly Ha * Ad coefficients (a
truncated chunk), holds ids outside the vocabulary, or bytes that are not text is a `FastDecodeError` naming
the problem: openpi's processor returns zeros for it (printing a line), which is `decode(..., on_failure="zeros")`
here and never the default.

Example (Ha = 2, Ad = 1, scale 10, min_token -5): x = [[0.5], [0.3]] -> coef = [0.566, 0.141] -> [6, 1]
-> chars chr(11), chr(6) -> BPE ids; back: [11, 6] - 5 = [6, 1] / 10 -> idct -> [[0.495], [0.354]].

The processor folder a checkpoint ships (`tokenizer.json`, `processor_config.json`; openpi's
`physical-intelligence/fast`) is read by `ckpts.openpi_fast.load_fast_codec`, which bounds both files; the
Python file beside them is never imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

OnFailure = Literal["raise", "zeros"]


class FastDecodeError(ValueError):
    """A token sequence that is not a FAST chunk of the asked shape (one line naming why)."""


def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix C float64 [n, n]: coef = C @ x along time; its inverse is C.T.

    C[k, t] = sqrt(2 / n) * cos(pi * (2t + 1) * k / (2n)), row 0 scaled by 1 / sqrt(2).
    """
    if n < 1:
        raise ValueError(f"a DCT needs at least one sample, got {n}")
    k, t = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    c = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * t + 1) * k / (2 * n))
    c[0] /= np.sqrt(2.0)
    return c


def dct(x: np.ndarray) -> np.ndarray:
    """Orthonormal DCT-II along axis 0 (time): float64 [Ha, ...]."""
    x = np.asarray(x, np.float64)
    return np.tensordot(dct_matrix(x.shape[0]), x, axes=1)


def idct(coef: np.ndarray) -> np.ndarray:
    """Orthonormal inverse DCT (DCT-III) along axis 0: float64 [Ha, ...]; `idct(dct(x)) == x` to rounding."""
    coef = np.asarray(coef, np.float64)
    return np.tensordot(dct_matrix(coef.shape[0]).T, coef, axes=1)


@dataclasses.dataclass(frozen=True)
class FastCodec:
    """A FAST processor: its byte-level BPE and quantisation settings.

    Attributes:
      bpe: the `tokenizers.Tokenizer` of the processor's tokenizer.json.
      scale: coefficients are multiplied by it before rounding (openpi's universal FAST: 10).
      min_token: the smallest integer coefficient (shifted to character 0).
      vocab_size: FAST ids lie in [0, vocab_size) (openpi maps id k to PaliGemma id V - 1 - 128 - k).
      horizon, action_dim: the chunk shape the processor was fitted for (processor_config.json's
        `time_horizon`, `action_dim`), or None where the file leaves them to the caller.
      source: where it was read from, for messages.
    """

    bpe: Any = dataclasses.field(repr=False)
    scale: float
    min_token: int
    vocab_size: int
    horizon: int | None = None
    action_dim: int | None = None
    source: str = "FAST processor"

    def __post_init__(self):
        if not (np.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"{self.source}: scale must be a finite number > 0, got {self.scale!r}")
        size = self.bpe.get_vocab_size(with_added_tokens=True)
        if size > self.vocab_size:
            raise ValueError(f"{self.source}: tokenizer.json has {size} tokens, more than the processor's vocab_size "
                             f"{self.vocab_size}; the two files are not one processor")

    def shape(self, horizon: int | None = None, action_dim: int | None = None) -> tuple[int, int]:
        """(Ha, Ad): the given ones, else the processor's; one-line ValueError when neither names one."""
        h, a = horizon or self.horizon, action_dim or self.action_dim
        if not h or not a:
            raise ValueError(f"{self.source} names no {'time_horizon' if not h else 'action_dim'}: pass the chunk's "
                             "horizon and action dim (the model config's action_horizon / action_dim)")
        return int(h), int(a)

    def encode(self, actions: np.ndarray) -> list[int]:
        """FAST ids of one chunk [Ha, Ad] (openpi's training targets). Coefficients below `min_token` are clipped
        to it (the format does); ValueError for a chunk the tokenizer cannot spell (a coefficient past its
        alphabet would be dropped by the BPE, silently shortening the chunk)."""
        x = np.asarray(actions, np.float64)
        if x.ndim != 2 or not np.isfinite(x).all():
            raise ValueError(f"FAST encodes one finite chunk [horizon, action_dim], got shape {x.shape}"
                             + ("" if x.ndim != 2 else " with NaN or inf"))
        coef = np.around(dct(x) * self.scale).astype(np.int64).reshape(-1)
        chars = np.maximum(coef - self.min_token, 0)
        text = "".join(map(chr, chars))
        ids = list(self.bpe.encode(text).ids)
        if self.bpe.decode(ids, skip_special_tokens=False) != text:
            raise ValueError(f"{self.source}: the chunk's coefficients (up to {int(coef.max())} with scale {self.scale:g}) "
                             "are outside what this FAST tokenizer spells; scale the actions into its fitted range")
        return ids

    def decode(self, ids, horizon: int | None = None, action_dim: int | None = None, *,
               on_failure: OnFailure = "raise") -> np.ndarray:
        """One chunk float64 [Ha, Ad] from FAST ids.

        Args:
          ids: FAST ids (not PaliGemma's; `robots.fast_prompt` maps those).
          horizon, action_dim: the chunk shape (default: the processor's).
          on_failure: "raise" (default): `FastDecodeError` naming the problem; "zeros": openpi's fallback, a
            zero chunk, asked for by name.
        """
        if on_failure not in ("raise", "zeros"):
            raise ValueError(f"on_failure must be 'raise' or 'zeros', got {on_failure!r}")
        h, a = self.shape(horizon, action_dim)
        try:
            coef = self._coefficients(ids, h * a)
        except FastDecodeError:
            if on_failure == "zeros":
                return np.zeros((h, a))
            raise
        return idct(coef.reshape(h, a) / self.scale)

    def _coefficients(self, ids, count: int) -> np.ndarray:
        arr = np.asarray(ids).reshape(-1)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise FastDecodeError(f"FAST ids must be integers, got dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise FastDecodeError(f"FAST id {int(bad[0])} is outside the FAST vocabulary [0, {self.vocab_size})")
        text = self.bpe.decode([int(i) for i in arr], skip_special_tokens=False)
        if "\ufffd" in text:
            raise FastDecodeError("the FAST tokens' BPE decode gives bytes that are not text (a broken chunk)")
        if len(text) != count:
            raise FastDecodeError(f"the FAST tokens' BPE decode gives {len(text)} coefficients, not horizon x "
                                  f"action_dim = {count} (a truncated or overlong chunk)")
        return np.fromiter(map(ord, text), np.int64, count) + self.min_token
