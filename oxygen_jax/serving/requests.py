"""What one client frame may cost: the fields of an observation checked and bounded before any work.

Every check here runs on a prep thread (never the event loop, never the engine thread) and is cheap
whatever the client sends: lengths are compared before anything is decoded or tokenized, a language
prompt is tokenized here (bounded by `max_prompt_chars`), and every value a refusal quotes is cut short
(`wire.short`, `request_limits.show_value`), so no reply is larger than a few hundred characters whatever
the frame carried. A language request's fields are read here (types, names, string caps) and checked
against the engine's limits in one place, `runtime.request_limits` (`engine.limits`): the engine thread
queues the result (`Engine.enqueue`) without a second check.

    sample = wire.unpack(frame)                       # depth, container and size caps (serving.wire)
    prompt_of(sample, max_chars=1024)                 # "prompt" (str or msgpack bin) capped before decoding
    requests = parse_language_requests(sample.get("language_requests"), max_requests=8, default_max_tokens=32)
    check_requests(requests, tokenizer, limits=engine.limits)   # tokenized, then every field against the limits

Refusals raise `BadRequest` (a ValueError); the server sends its text as "BadRequest: ..." and keeps the
connection. A refusal is cheap but not free (the frame was read and decoded), so `RefusalBudget` caps how
fast one connection's refused frames are read.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from oxygen_jax.models.decoder import MAX_STOP_IDS
from oxygen_jax.runtime.request_limits import RequestError, RequestLimits, is_int
from oxygen_jax.serving.records import LanguageRequest
from oxygen_jax.serving.wire import short

LANGUAGE_FIELDS = ("prompt", "prompt_tokens", "max_tokens", "temperature", "top_p", "seed", "adapter", "stop_at_eos",
                   "stop", "id")
MAX_NAME_CHARS = 128  # a language request's "id" tag and "adapter" name


class BadRequest(ValueError):
    """A frame the server refuses; the text is sent back and the connection stays open.

    Attributes:
      field: the language-request field a refusal names ("max_tokens", ...; `RequestError.field`), "" for others.
    """

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def prompt_of(sample: Mapping, *, max_chars: int) -> Mapping:
    """The sample with its "prompt" checked: a str, or UTF-8 msgpack bin, of at most `max_chars` characters.

    The length is compared before bytes are decoded or anything is tokenized (a 3.6 MB bin prompt costs
    a length comparison). Returns `sample` itself, or a shallow copy with the bin prompt decoded.

    Raises:
      BadRequest naming the length and the limit.
    """
    prompt = sample.get("prompt")
    if prompt is None:
        return sample
    if isinstance(prompt, (bytes, bytearray)):
        if len(prompt) > 4 * max_chars:  # no UTF-8 character takes more than 4 bytes
            raise BadRequest(f"prompt has {len(prompt)} bytes; at most {max_chars} characters are accepted")
        try:
            prompt = bytes(prompt).decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("prompt bytes are not UTF-8 text; send the prompt as a msgpack str") from None
        sample = {**sample, "prompt": prompt}
    if isinstance(prompt, str) and len(prompt) > max_chars:
        raise BadRequest(f"prompt has {len(prompt)} characters; at most {max_chars} are accepted")
    return sample


def check_images_uint8(sample: Mapping, where: str = "") -> None:
    """Images travel as uint8 pixels (openpi-client converts before sending); anything else is refused.

    Recursion is bounded: `wire.unpack` refuses messages nested deeper than `Limits.max_depth`.
    """
    for key, value in sample.items():
        if isinstance(value, Mapping):
            check_images_uint8(value, f"{where}{key}/")
        elif isinstance(value, np.ndarray) and value.ndim == 3 and value.dtype != np.uint8:
            raise BadRequest(f"{where}{short(key)}: images must be uint8 pixels, got dtype {value.dtype}; "
                             "convert with openpi_client.image_tools.convert_to_uint8")


def deadline_s(sample: Mapping, *, max_ms: float) -> float | None:
    """The "deadline_ms" a robot declares, in seconds, capped at the server's `max_ms` (None: not sent).

    The cap keeps one robot's budget from setting how long the batcher waits for it: a robot that
    declares an hour is treated as declaring `max_ms`.
    """
    value = sample.get("deadline_ms")
    if value is None:
        return None
    if not _is_real(value) or not 0 < float(value) <= 3.6e6:
        raise BadRequest(f"deadline_ms must be a number of milliseconds in (0, 3600000], got {short(value)}")
    return min(float(value), max_ms) / 1e3


def _name(value, where: str, what: str, field: str = ""):
    if isinstance(value, str):
        if len(value) > MAX_NAME_CHARS:
            raise BadRequest(f"{where} has {len(value)} characters; at most {MAX_NAME_CHARS}", field)
        return value
    if is_int(value):
        return int(value)
    raise BadRequest(f"{where} must be {what}, got {short(value)}", field)


def parse_language_requests(value, *, max_requests: int, default_max_tokens: int,
                            max_prompt_chars: int = 1024) -> list[LanguageRequest]:
    """Reads the optional "language_requests" field: a list of maps (or one map) of request fields.

    Field names, types and string lengths are checked here; values against the engine's limits (token
    budget, sampling ranges, token ids, adapters) in `check_requests`.

    Raises:
      BadRequest naming the request index and field.
    """
    if value is None:
        return []
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list):
        raise BadRequest(f"language_requests must be a list of maps, got {type(value).__name__}")
    if len(value) > max_requests:
        raise BadRequest(f"language_requests has {len(value)} entries; at most {max_requests} per frame")
    out = []
    for i, req in enumerate(value):
        where = f"language_requests[{i}]"
        if not isinstance(req, Mapping):
            raise BadRequest(f"{where} must be a map with a 'prompt', got {type(req).__name__}")
        unknown = [k for k in req if k not in LANGUAGE_FIELDS]
        if unknown:
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise BadRequest(f"{where}: unknown fields {[short(k, 40) for k in unknown[:3]]}{more}; "
                             f"known: {list(LANGUAGE_FIELDS)}")
        prompt, tokens = _prompt(req, where, max_prompt_chars)
        max_tokens = req.get("max_tokens", default_max_tokens)
        if not is_int(max_tokens):
            raise BadRequest(f"{where}.max_tokens must be an integer, got {short(max_tokens)}", "max_tokens")
        for name, default in (("temperature", 0.0), ("top_p", 1.0)):
            x = req.get(name, default)
            if not _is_real(x):
                raise BadRequest(f"{where}.{name} must be a number, got {short(x)}", name)
        seed = req.get("seed")
        if seed is not None and not is_int(seed):
            raise BadRequest(f"{where}.seed must be an integer, got {short(seed)}", "seed")
        adapter = _name(req.get("adapter", "base"), f"{where}.adapter", "an adapter name", "adapter")
        stop = req.get("stop_at_eos", True)
        if not isinstance(stop, (bool, np.bool_)):
            raise BadRequest(f"{where}.stop_at_eos must be true or false, got {short(stop)}")
        stop_ids = _ids(req.get("stop", []), f"{where}.stop", MAX_STOP_IDS)
        tag = req.get("id")
        if tag is not None:
            tag = _name(tag, f"{where}.id", "a string or an integer")
        out.append(LanguageRequest(
            prompt=prompt, max_tokens=int(max_tokens), temperature=req.get("temperature", 0.0),
            top_p=req.get("top_p", 1.0), seed=None if seed is None else int(seed), adapter=adapter,
            stop_at_eos=bool(stop), stop_ids=stop_ids, tag=tag, tokens=tokens))
    return out


def _ids(value, where: str, limit: int, field: str = "") -> tuple[int, ...]:
    """A list of at most `limit` integers (their range against the vocabulary: `check_requests`). The count is
    read before any value, so a 4 MiB array costs a robot's frame microseconds, not the prep threads seconds."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and len(value) <= limit:
        value = value.tolist()
    if not isinstance(value, (list, tuple, np.ndarray)) or getattr(value, "ndim", 1) != 1:
        raise BadRequest(f"{where} must be a list of token ids, got {short(value)}", field)
    if len(value) > limit:
        raise BadRequest(f"{where} has {len(value)} entries; at most {limit}", field)
    if not all(is_int(t) for t in value):
        raise BadRequest(f"{where} must be a list of token ids, got {short(value)}", field)
    return tuple(int(t) for t in value)


def _prompt(req: Mapping, where: str, max_chars: int) -> tuple[str, tuple[int, ...] | None]:
    """(text, None) for a text prompt, ("", ids) for token ids given as "prompt_tokens" or as a "prompt" list."""
    prompt, tokens = req.get("prompt"), req.get("prompt_tokens")
    if isinstance(prompt, (list, tuple, np.ndarray)):
        prompt, tokens = (None, prompt) if tokens is None else (prompt, tokens)
    if prompt is not None and tokens is not None:
        raise BadRequest(f"{where}: give either prompt (text) or prompt_tokens (token ids), not both")
    if tokens is not None:
        return "", _ids(tokens, f"{where}.prompt_tokens", max_chars, "prompt_tokens")
    if not isinstance(prompt, str):
        raise BadRequest(f"{where}.prompt must be a string (e.g. 'Subtask: ') or a list of token ids "
                         f"(or give prompt_tokens), got {type(prompt).__name__}")
    if len(prompt) > max_chars:
        raise BadRequest(f"{where}.prompt has {len(prompt)} characters; at most {max_chars} are accepted")
    return prompt, None


def check_requests(requests: Sequence[LanguageRequest], tokenizer, *, limits: RequestLimits) -> list[LanguageRequest]:
    """Tokenizes each request's text prompt (`tokenizer.encode`), then checks every field against `limits`.

    Runs on a prep thread: a costly prompt is paid for there, never on the thread that steps the
    engine, and a request the engine could not run is refused before the engine sees it. The requests
    come back with `tokens` and `checked` set (`request_limits.CheckedRequest`, what `Engine.enqueue`
    queues); their stop ids are the model's (`limits.stop_ids`, unless "stop_at_eos" is false) and the
    client's "stop".

    Raises:
      BadRequest naming the request index and field (the one-line `RequestError` of `limits.check`).
    """
    out = []
    for i, req in enumerate(requests):
        where = f"language_requests[{i}]"
        if req.tokens is not None:
            ids = list(req.tokens)
        elif tokenizer is None and req.prompt:
            raise BadRequest(f"{where}.prompt: this model has no tokenizer, so prompts are token ids: send "
                             "prompt_tokens (a list of ints)", "tokenizer")
        else:
            ids = [int(t) for t in tokenizer.encode(req.prompt)] if req.prompt else []
        stops = (*(limits.stop_ids if req.stop_at_eos else ()), *req.stop_ids)
        labels = {f: f"{where}.{f}" for f in ("max_tokens", "temperature", "top_p", "seed", "adapter")}
        labels.update(stop_ids=f"{where}.stop", prompt_tokens=f"{where}.prompt" if req.tokens is None else
                      f"{where}.prompt_tokens")
        try:
            checked = limits.check(prompt_tokens=ids, max_tokens=req.max_tokens, temperature=req.temperature,
                                   top_p=req.top_p, stop_ids=sorted(set(stops)), seed=req.seed, adapter=req.adapter,
                                   labels=labels)
        except RequestError as e:
            raise BadRequest(str(e), e.field) from None
        out.append(dataclasses.replace(req, tokens=tuple(ids), checked=checked))  # the engine thread never tokenizes
    return out


class RefusalBudget:
    """A token bucket of refused frames for one connection: `rate` per second, in bursts of up to `rate`.

    A client whose frames keep being refused (cheap to send, not free to read and refuse: a 3.6 MB
    frame is still received and decoded) is read at `rate` frames per second once its burst is spent:
    the server waits before reading its next frame, so those frames wait in TCP, not in the server, and
    cannot take the CPU that other robots' frames need.

        budget = RefusalBudget(rate=20.0)
        budget.charge(now)   # 0.0 for 20 refusals in a row, then about 1/20 s per refusal
    """

    def __init__(self, rate: float):
        if not rate > 0:
            raise ValueError(f"RefusalBudget rate must be > 0 refusals per second, got {rate}")
        self.rate, self._burst, self._last = rate, max(rate, 1.0), None
        self._tokens = self._burst

    def charge(self, now: float) -> float:
        """Counts one refusal at time `now` (seconds); returns the seconds to wait before the next read."""
        if self._last is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate
