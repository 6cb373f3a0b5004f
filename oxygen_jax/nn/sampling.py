"""Per-row token sampling: greedy, temperature and nucleus (top-p), with per-row keys.

Each row carries its own temperature, top-p and RNG key, so a request samples the same tokens
whatever else shares its batch. Temperature 0 means greedy (argmax, first index on ties).

Logits may be batch-major [B, V] or vocabulary-major [V, B] (`vocab_axis=0`). The decoder uses the
vocabulary-major layout: XLA's CPU backend computes `table @ h.T` ([V, D] x [D, B]) at batch 6 to 16
in about half the time of `h @ table.T`, and reduces over the leading axis faster too.

The values are used in float32 on the device, so the host checks them after that cast
(`check_temperature`, `check_top_p`): a temperature that overflows float32 (1e300 -> inf) divides every
logit to 0 (uniform sampling over the whole vocabulary, ids a tokenizer may not decode), one that
underflows turns greedy silently, and a top-p that underflows to 0 keeps no token (only id 0 is drawn).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

TEMPERATURE_RANGE = (1e-3, 100.0)
"""Accepted sampling temperatures besides 0 (greedy). Below 1e-3, logits / t stretch logit gaps over 1000-fold
(a gap of 0.02 already gives odds of e^-20: greedy in all but name, use 0) on the way to float32 overflow; above
100, logits spanning O(10) become probabilities within about 10 % of uniform. Values outside are mistakes and
are refused rather than run."""

TOP_P_MIN = 1e-6
"""Smallest accepted top-p: any top-p in (0, 1e-6] keeps only the most likely token, and float32 flushes
values near 1e-38 (and below) to 0, which would keep none."""


def _show(value, limit: int = 40) -> str:
    """A value for an error message, at most `limit` characters (a client's 3 MiB value is not echoed)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if isinstance(value, (numbers.Number, str, bytes, type(None))) else type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_float32(x) -> float:
    """A real number as float32 (NaN for non-numbers, booleans, non-finite values and values beyond float32)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool) or not abs(x) < 3e38:  # NaN fails the comparison
        return math.nan
    return float(np.float32(x))


def check_temperature(temperature) -> float:
    """`temperature` as the float32 value the device uses; ValueError unless it is 0 or in TEMPERATURE_RANGE."""
    lo, hi = (float(np.float32(x)) for x in TEMPERATURE_RANGE)
    t32 = _as_float32(temperature)
    if not ((t32 == 0.0 and temperature == 0) or lo <= t32 <= hi):  # 0 itself, not a value that underflows to it
        raise ValueError(f"temperature must be 0 (greedy) or a number in [{lo:g}, {hi:g}], got {_show(temperature)}")
    return t32


def check_top_p(top_p) -> float:
    """`top_p` as the float32 value the device uses; ValueError unless it lies in [TOP_P_MIN, 1]."""
    p32 = _as_float32(top_p)
    if not float(np.float32(TOP_P_MIN)) <= p32 <= 1.0:
        raise ValueError(f"top_p must be a number in [{TOP_P_MIN:g}, 1], got {_show(top_p)}")
    return p32


def _top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks logits [B, V] outside the smallest set whose probability reaches top_p (per row)."""
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    keep_sorted = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("vocab_axis",))
def sample_tokens(
    logits: jax.Array, temperature: jax.Array, top_p: jax.Array, keys: jax.Array, vocab_axis: int = -1
) -> jax.Array:
    """Samples one token per row.

    Args:
      logits: float32 [B, V] (vocab_axis=-1) or [V, B] (vocab_axis=0).
      temperature: float32 [B]; 0 = greedy.
      top_p: float32 [B] in (0, 1]; 1 = no nucleus filtering.
      keys: typed PRNG keys [B].
    Returns:
      int32 [B].
    """
    if vocab_axis not in (0, -1, 1):
        raise ValueError(f"vocab_axis must be 0 or -1, got {vocab_axis}")
    vocab_major = vocab_axis == 0
    greedy = jnp.argmax(logits, axis=0 if vocab_major else -1).astype(jnp.int32)
    stochastic = temperature > 0

    def draw(logits):
        rows = logits.T if vocab_major else logits  # the rare path may pay for a transpose
        scaled = rows / jnp.where(stochastic, temperature, 1.0)[:, None]
        # Sorting the vocabulary per row is costly; only do it when some sampled row asks for top-p.
        scaled = jax.lax.cond(
            jnp.any(stochastic & (top_p < 1.0)), lambda s: _top_p_filter(s, top_p), lambda s: s, scaled
        )
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(stochastic, drawn, greedy)

    # Gumbel noise over the whole vocabulary costs as much as a small matmul: skip it when all rows are greedy.
    return jax.lax.cond(jnp.any(stochastic), draw, lambda _: greedy, logits)
