"""What one language request may ask of an engine: the limits, defined once, and the one check against them.

`Engine.submit` checks a caller's fields here; the policy server checks a robot's request here too, on
its prep thread, and hands the engine the result (`Engine.enqueue`), so a served request is checked
once, against the same numbers, before the engine thread sees it.

    limits = engine.limits                        # RequestLimits(max_new_tokens=32, prompt_capacity=16, ...)
    req = limits.check(prompt_tokens=[5, 6], max_tokens=20, temperature=0.7)
    rid = engine.enqueue(req)                     # no second check

Every refusal is a one-line `RequestError` naming the field (as the caller spells it: `labels`) and the
allowed range; its `field` says which check refused, in this module's names.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping

import numpy as np

from oxygen_jax.models.decoder import MAX_STOP_IDS
from oxygen_jax.nn.sampling import check_temperature, check_top_p

MAX_SEED = 2**32 - 1
MAX_STREAM = 2**31 - 1  # stream ids (rows) are int32 on the device side; -1 marks a padding row


class RequestError(ValueError):
    """A language request that cannot be accepted; the message names the field and the allowed range.

    Attributes:
      field: the field refused, in `RequestLimits.check`'s argument names ("max_tokens", "stop_ids", ...).
    """

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
    """A request's fields once `RequestLimits.check` accepted them (plain host values)."""

    prompt: tuple[int, ...]  # token ids written after the shared prefix, each in [0, vocab_size)
    max_tokens: int  # in [1, max_new_tokens]
    temperature: float  # the float32 value the device samples with (0: greedy)
    top_p: float  # float32, in [TOP_P_MIN, 1]
    stop_ids: tuple[int, ...]  # sorted unique ids (the model's own when the caller named none)
    seed: int | None  # in [0, MAX_SEED]; None: the request's id
    adapter: int  # adapter id (0: the base weights)
    row: int  # the stream whose observation the request continues


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """The limits of one engine's language requests (from `EngineConfig`, the model and its adapters)."""

    max_new_tokens: int  # M: a request's token budget is in [1, M]
    prompt_capacity: int  # Q: request-prompt tokens written after the shared prefix
    vocab_size: int  # V: prompt and stop ids lie in [0, V)
    adapters: tuple[str, ...] = ("base",)  # adapter names by id; id 0 is "base", the model's own weights
    stop_ids: tuple[int, ...] = ()  # the model's own stop ids (`MultiHead.stop_ids`): what stop_ids=None means
    max_stop_ids: int = MAX_STOP_IDS  # explicit stop ids of one request (the pool's static width)
    max_seed: int = MAX_SEED
    max_stream: int = MAX_STREAM

    def __post_init__(self):
        for f in ("max_new_tokens", "vocab_size"):
            if not is_int(getattr(self, f)) or getattr(self, f) < 1:
                raise ValueError(f"RequestLimits.{f} must be an integer >= 1, got {getattr(self, f)!r}")
        if not is_int(self.prompt_capacity) or self.prompt_capacity < 0:
            raise ValueError(f"RequestLimits.prompt_capacity must be an integer >= 0, got {self.prompt_capacity!r}")
        if not self.adapters or self.adapters[0] != "base" or len(set(self.adapters)) != len(self.adapters):
            raise ValueError(f"RequestLimits.adapters must be unique names starting with 'base', got {self.adapters}")

    def check(self, *, prompt_tokens=(), max_tokens, temperature=0.0, top_p=1.0, stop_ids=None, seed=None,
              row=0, adapter=None, labels: Mapping[str, str] | None = None) -> CheckedRequest:
        """Every field of one request checked against these limits, in one place.

        Args:
          prompt_tokens: a list, tuple or 1-D integer array of token ids.
          max_tokens, temperature, top_p, seed, row: as `Engine.submit` takes them.
          stop_ids: None (the model's own, `self.stop_ids`), one id, or at most `max_stop_ids` ids.
          adapter: a name in `adapters`, an id, or None (the base weights).
          labels: how the caller spells each field in messages (default: these argument names), e.g.
            {"max_tokens": "language_requests[0].max_tokens", "stop_ids": "language_requests[0].stop"}.

        Raises:
          RequestError: one line naming the first field refused.
        """
        name = (lambda f: f) if labels is None else (lambda f: labels.get(f, f))
        return CheckedRequest(
            prompt=self._prompt(prompt_tokens, name("prompt_tokens")),
            max_tokens=self._max_tokens(max_tokens, name("max_tokens")),
            temperature=_sampling(check_temperature, temperature, "temperature", name),
            top_p=_sampling(check_top_p, top_p, "top_p", name),
            stop_ids=self._stop_ids(stop_ids, name("stop_ids")),
            seed=self._seed(seed, name("seed")), row=self._row(row, name("row")),
            adapter=self.adapter_id(adapter, name("adapter")))

    def adapter_id(self, adapter, label: str = "adapter") -> int:
        """The id of an adapter name or id (None: the base weights)."""
        if adapter is None:
            return 0
        if isinstance(adapter, str):
            if adapter not in self.adapters:
                raise RequestError(f"{_lead(label, 'adapter')}unknown adapter {show_value(adapter)}; this engine has "
                                   f"{sorted(self.adapters)}", "adapter")
            return self.adapters.index(adapter)
        if not is_int(adapter) or not 0 <= adapter < len(self.adapters):
            raise RequestError(f"{label.removesuffix('adapter')}adapter id must be an integer in "
                               f"[0, {len(self.adapters)}), got {show_value(adapter)}", "adapter")
        return int(adapter)

    def _prompt(self, tokens, label: str) -> tuple[int, ...]:
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise RequestError(f"{label} must be a 1-D integer array, got {tokens.dtype} {tokens.shape}",
                                   "prompt_tokens")
            tokens = tokens.tolist()
        if isinstance(tokens, (list, tuple)) and len(tokens) > self.prompt_capacity:  # the count before any value
            prompt = label.removesuffix("_tokens")
            raise RequestError(f"{prompt} has {len(tokens)} tokens; the engine's prompt_capacity is "
                               f"{self.prompt_capacity}", "prompt_tokens")
        if not isinstance(tokens, (list, tuple)) or not all(is_int(t) for t in tokens):
            raise RequestError(f"{label} must be a list of integer token ids, got {show_value(tokens)}",
                               "prompt_tokens")
        if not all(0 <= t < self.vocab_size for t in tokens):
            raise RequestError(f"{label} must hold token ids in [0, {self.vocab_size}), got {show_value(list(tokens))}",
                               "prompt_tokens")
        return tuple(int(t) for t in tokens)

    def _max_tokens(self, value, label: str) -> int:
        if not is_int(value) or not 1 <= value <= self.max_new_tokens:
            raise RequestError(f"{label} must be an integer in [1, {self.max_new_tokens}] "
                               f"(EngineConfig.max_new_tokens), got {show_value(value)}", "max_tokens")
        return int(value)

    def _stop_ids(self, value, label: str) -> tuple[int, ...]:
        if value is None:
            return self.stop_ids
        if is_int(value):
            value = [value]
        if isinstance(value, np.ndarray) and value.ndim == 1 and np.issubdtype(value.dtype, np.integer):
            value = value.tolist()
        if not isinstance(value, (list, tuple)):
            raise RequestError(f"{label} must be None (the model's), or a list of token ids, got {show_value(value)}",
                               "stop_ids")
        if len(value) > self.max_stop_ids:
            raise RequestError(f"{label} has {len(value)} entries; at most {self.max_stop_ids}", "stop_ids")
        if not all(is_int(t) and 0 <= t < self.vocab_size for t in value):
            raise RequestError(f"{label} must hold token ids in [0, {self.vocab_size}), got {show_value(value)}",
                               "stop_ids")
        return tuple(sorted({int(t) for t in value}))

    def _seed(self, value, label: str) -> int | None:
        if value is not None and (not is_int(value) or not 0 <= value <= self.max_seed):
            raise RequestError(f"{label} must be None or an integer in [0, {self.max_seed}], got {show_value(value)}",
                               "seed")
        return None if value is None else int(value)

    def _row(self, value, label: str) -> int:
        if not is_int(value) or not 0 <= value <= self.max_stream:
            raise RequestError(f"{label} must be an integer stream id in [0, {self.max_stream}] (the stream / batch "
                               f"row), got {show_value(value)}", "row")
        return int(value)


def _sampling(check, value, field: str, name) -> float:
    """A sampling value as the float32 the device uses (`nn.sampling`'s ranges), or a RequestError."""
    try:
        return check(value)
    except ValueError as e:
        raise RequestError(f"{name(field).removesuffix(field)}{e}", field) from None


def _lead(label: str, field: str) -> str:
    """"language_requests[0].adapter" -> "language_requests[0].adapter: "; a bare field name -> ""."""
    return "" if label == field else f"{label}: "


def is_int(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def show_value(value, limit: int = 40) -> str:
    """A caller's value for an error message, at most `limit` characters (a 3 MiB value is not echoed)."""
    if is_int(value) and int(value).bit_length() > 64:
        return f"an integer of {int(value).bit_length()} bits"
    if isinstance(value, (numbers.Number, str, bytes, type(None))):
        text = repr(value)
    elif isinstance(value, (list, tuple)) and len(value) <= 8:
        text = repr(type(value)(show_value(v, 12) for v in value)).replace("'", "")
    else:
        text = f"{type(value).__name__}" + (f" of length {len(value)}" if hasattr(value, "__len__") else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."

