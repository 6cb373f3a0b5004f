"""openpi's msgpack-numpy wire format, with a decoder that checks every array header before using it.

The format (openpi-client's `msgpack_numpy`, written here from its description): a message is one
msgpack value; maps keep their keys (str keys stay str); a numpy array travels as the map

    {b"__ndarray__": True, b"data": <raw bytes, C order>, b"dtype": "<f4", b"shape": [224, 224, 3]}

and a numpy scalar as {b"__npgeneric__": True, b"data": <python number>, b"dtype": "<f8"} (bytes keys).

openpi's own decoder builds `np.ndarray(buffer=data, dtype=np.dtype(dtype), shape=shape)` from
whatever the peer wrote: an object dtype ("|O") reads raw bytes as pointers and crashes the process,
and a shape larger than the buffer raises deep inside numpy. `unpack` accepts only bool, integer and
float dtypes (`|b1 |u1 <i4 <f4 …`, itemsize <= 8), requires prod(shape) * itemsize == len(data),
and caps ndim, array bytes, message bytes and msgpack container sizes before any array is built.
Decoding stops as soon as a message holds more than `Limits.max_containers` maps and lists (a frame
of a million tiny lists would otherwise cost a second of decoding), and a value nested deeper than
`Limits.max_depth` is refused before any recursive code sees it. Every rejection is a `WireError` (a
ValueError) with a one-line reason; values quoted in it are cut to `short(value)` (a few dozen
characters), so a refusal never echoes a large client value back.

    data = pack({"actions": np.zeros((10, 7), np.float32)})
    unpack(data)["actions"].shape   # (10, 7); a read-only view of the message buffer
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import msgpack
import numpy as np

_ARRAY_KEYS = {b"__ndarray__", b"data", b"dtype", b"shape"}
_SCALAR_KEYS = {b"__npgeneric__", b"data", b"dtype"}
# Byte order (optional), kind (bool, signed, unsigned, float), itemsize in bytes.
_DTYPE_RE = re.compile(r"^[<>|=]?([biuf])([1248])$")
_PACKABLE_KINDS = "biuf"


class WireError(ValueError):
    """A message that is not a well-formed openpi msgpack-numpy value; the text says what is wrong."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """Caps applied while decoding one message (all sizes in bytes unless named otherwise)."""

    max_message_bytes: int = 4 << 20  # whole message (the websocket layer enforces the same cap)
    max_array_bytes: int = 4 << 20  # one array's data
    max_ndim: int = 8  # dimensions of one array
    max_str_bytes: int = 64 << 10  # one msgpack str (prompts are short)
    max_container_len: int = 4096  # entries of one msgpack array or map
    max_containers: int = 1024  # maps and lists in one message (an observation holds a few dozen)
    max_depth: int = 16  # nesting of maps and lists (an observation is 3 deep: ALOHA's images map)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"Limits.{f.name} must be >= 1, got {getattr(self, f.name)}")


DEFAULT_LIMITS = Limits()

_SHORT = 60


def short(value: Any, limit: int = _SHORT) -> str:
    """`repr(value)` cut to about `limit` characters, for error messages that quote a client's value.

    Large bytes and str values are sliced before `repr` runs, so quoting a 3 MiB field costs nothing.

        short(b"x" * 3_000_000)   # "b'xxxx…' (3000000 bytes)"
    """
    if isinstance(value, (bytes, bytearray, memoryview)) and len(value) > limit:
        return f"{bytes(value[:limit])!r}… ({len(value)} bytes)"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value)} characters)"
    if isinstance(value, (list, tuple, dict)) and len(value) > 8:
        return f"<{type(value).__name__} of {len(value)} entries>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _check_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, bytes):
        dtype = dtype.decode("ascii", "replace")
    if not isinstance(dtype, str) or not _DTYPE_RE.match(dtype):
        raise WireError(
            f"array dtype {short(dtype)} is not accepted; send bool, integer or float arrays (e.g. '|u1', '<f4')")
    return np.dtype(dtype)


def _check_shape(shape: Any, limits: Limits) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)):
        raise WireError(f"array shape must be a list of integers, got {type(shape).__name__}")
    if len(shape) > limits.max_ndim:
        raise WireError(f"array has {len(shape)} dimensions; at most {limits.max_ndim} are accepted")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise WireError(f"array shape must hold non-negative integers, got {short(list(shape))}")
    return tuple(shape)


def decode_array(header: dict, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """Builds the array of one `__ndarray__` header after checking dtype, shape and buffer size.

    Returns:
      A read-only array viewing `header[b"data"]`.
    Raises:
      WireError: unknown keys, a dtype outside bool/int/float, a bad shape, too many dimensions or
        bytes, or a buffer whose length is not prod(shape) * itemsize.
    """
    if set(header) != _ARRAY_KEYS or header[b"__ndarray__"] is not True:
        raise WireError(f"an ndarray header needs exactly the keys {sorted(k.decode() for k in _ARRAY_KEYS)}")
    dtype, shape, data = _check_dtype(header[b"dtype"]), _check_shape(header[b"shape"], limits), header[b"data"]
    if not isinstance(data, bytes):
        raise WireError(f"array data must be bytes, got {type(data).__name__}")
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: a huge shape cannot overflow
    if nbytes > limits.max_array_bytes:
        raise WireError(f"array of shape {shape} and dtype {dtype.str} needs {nbytes} bytes; "
                        f"at most {limits.max_array_bytes} are accepted")
    if nbytes != len(data):
        raise WireError(f"array of shape {shape} and dtype {dtype.str} needs {nbytes} bytes but the message "
                        f"carries {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _decode_scalar(header: dict) -> np.generic:
    if set(header) != _SCALAR_KEYS or header[b"__npgeneric__"] is not True:
        raise WireError(f"a numpy scalar needs exactly the keys {sorted(k.decode() for k in _SCALAR_KEYS)}")
    dtype, value = _check_dtype(header[b"dtype"]), header[b"data"]
    if not isinstance(value, (bool, int, float)):
        raise WireError(f"numpy scalar data must be a number, got {type(value).__name__}")
    try:
        return dtype.type(value)
    except (OverflowError, ValueError, TypeError):
        raise WireError(f"value {short(value)} does not fit dtype {dtype.str}") from None


class _Hooks:
    """msgpack hooks of one decode: build checked arrays, and stop after `max_containers` maps and lists."""

    def __init__(self, limits: Limits):
        self.limits, self.containers = limits, 0

    def _count(self) -> None:
        self.containers += 1
        if self.containers > self.limits.max_containers:
            raise WireError(f"message holds more than {self.limits.max_containers} maps and lists; "
                            "an observation needs a few dozen")

    def map(self, obj: dict):
        self._count()
        if b"__ndarray__" in obj:
            return decode_array(obj, self.limits)
        if b"__npgeneric__" in obj:
            return _decode_scalar(obj)
        return obj

    def list(self, obj: list):
        self._count()
        return obj


def _check_depth(value: Any, max_depth: int) -> None:
    """Refuses maps and lists nested deeper than `max_depth`, level by level (no recursion)."""
    level, depth = [value] if isinstance(value, (dict, list)) else [], 0
    while level:
        depth += 1
        if depth > max_depth:
            raise WireError(f"message nests maps and lists more than {max_depth} deep; an observation is 3 deep")
        below = []
        for obj in level:
            values = obj.values() if isinstance(obj, dict) else obj
            kinds = set(map(type, values))  # C speed for the common case: a container of scalars
            if dict in kinds or list in kinds:
                below.extend(v for v in values if isinstance(v, (dict, list)))
        level = below


def unpack(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decodes one message; arrays are checked before they are built (see the module docstring).

    Raises:
      WireError: the message is not a single well-formed msgpack value within `limits`.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected a binary msgpack message, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {limits.max_message_bytes}")
    hooks = _Hooks(limits)
    try:
        value = msgpack.unpackb(
            data, object_hook=hooks.map, list_hook=hooks.list, raw=False, strict_map_key=True, use_list=True,
            max_bin_len=limits.max_message_bytes, max_str_len=limits.max_str_bytes,
            max_array_len=limits.max_container_len, max_map_len=limits.max_container_len, max_ext_len=0,
        )
    except WireError:
        raise
    except msgpack.StackError:
        raise WireError(f"not a valid msgpack message (nested deeper than the decoder's stack; at most "
                        f"{limits.max_depth} levels are accepted)") from None
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types for bad input
        reason = str(e).splitlines()[0][:_SHORT] if str(e) else type(e).__name__
        raise WireError(f"not a valid msgpack message ({reason})") from None
    _check_depth(value, limits.max_depth)
    return value


def _encode(obj: Any):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind not in _PACKABLE_KINDS:
        raise TypeError(f"cannot send dtype {obj.dtype}: only bool, integer and float arrays travel on the wire")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__} over the wire")


def pack(obj: Any) -> bytes:
    """Encodes `obj` (maps, lists, str, numbers, bool/int/float numpy arrays and scalars) in openpi's format."""
    return msgpack.packb(obj, default=_encode, use_bin_type=True)
