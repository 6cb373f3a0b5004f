"""The wire codec: openpi's msgpack-numpy format, and array headers checked before anything is built."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from oxygen_jax.serving import wire


def _header(dtype="<f4", shape=(2, 3), data=None, **extra) -> dict:
    if data is None:
        data = bytes(int(np.prod(shape)) * np.dtype(dtype if dtype[-1].isdigit() else "<f4").itemsize)
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": list(shape), **extra}


def _message(header: dict) -> bytes:
    return msgpack.packb({"observation/image": header}, use_bin_type=True)


@pytest.mark.parametrize("dtype", ["|b1", "|u1", "|i1", "<u2", "<i4", ">i8", "<f2", "<f4", "<f8"])
def test_every_numeric_dtype_round_trips_exactly(dtype):
    x = (np.arange(24) % 7).reshape(2, 3, 4).astype(dtype)
    got = wire.unpack(wire.pack({"x": x, "nested": {"y": [x[0], 3, "s"]}}))
    np.testing.assert_array_equal(got["x"], x)
    assert got["x"].dtype == x.dtype and got["x"].shape == (2, 3, 4)
    np.testing.assert_array_equal(got["nested"]["y"][0], x[0])
    assert got["nested"]["y"][1:] == [3, "s"]


def test_numpy_scalars_keep_their_dtype():
    # np.float64 is a Python float subclass: msgpack sends it as a plain float, as with openpi-client.
    for x in (np.float32(2.5), np.int16(-3), np.uint8(7), np.bool_(True)):
        got = wire.unpack(wire.pack({"v": x}))["v"]
        assert got == x and got.dtype == x.dtype


def test_openpi_client_messages_decode_and_ours_decode_in_openpi_client():
    msgpack_numpy = pytest.importorskip(
        "openpi_client.msgpack_numpy",
        reason="openpi-client not installed (pip install --no-deps -r requirements-test.txt)")
    obs = {"observation/image": np.arange(224 * 224 * 3, dtype=np.uint8).reshape(224, 224, 3),
           "observation/state": np.linspace(-1, 1, 8), "prompt": "pick up the bowl", "step": np.int64(4)}
    got = wire.unpack(msgpack_numpy.packb(obs))
    assert sorted(got) == sorted(obs) and got["prompt"] == obs["prompt"] and got["step"] == 4
    for key in ("observation/image", "observation/state"):
        np.testing.assert_array_equal(got[key], obs[key])
        assert got[key].dtype == obs[key].dtype
    reply = msgpack_numpy.unpackb(
        wire.pack({"actions": np.ones((10, 7), np.float32), "server_timing": {"infer_ms": 1.5}}))
    np.testing.assert_array_equal(reply["actions"], np.ones((10, 7), np.float32))
    assert reply["server_timing"] == {"infer_ms": 1.5}


@pytest.mark.parametrize("dtype", ["|O", "O", "<U4", "|S4", "|V8", "<c8", "<M8[ns]", "<m8[s]", "i4,O", "(2,)i4",
                                   "<f16", "float32", "", 7])
def test_dtypes_other_than_bool_int_float_are_refused_before_any_array_exists(dtype):
    # "|O" is the payload that segfaults openpi's own decoder (raw bytes read as object pointers).
    with pytest.raises(wire.WireError, match="dtype"):
        wire.unpack(_message(_header(dtype=dtype, data=b"A" * 8, shape=(1,))))


@pytest.mark.parametrize("shape, data_len, match", [
    ((2, 3), 23, "needs 24 bytes but the message carries 23"),  # short buffer
    ((2, 3), 25, "needs 24 bytes but the message carries 25"),
    ((2**40, 2**40), 24, "at most"),  # huge shape: product checked in Python ints, no overflow, no allocation
    ((-1, 6), 24, "non-negative"),
    ((True, 6), 24, "non-negative"),
    ((1,) * 9, 4, "dimensions"),
])
def test_shape_and_buffer_size_must_agree(shape, data_len, match):
    with pytest.raises(wire.WireError, match=match):
        wire.unpack(_message(_header(shape=shape, data=b"\0" * data_len)))


@pytest.mark.parametrize("header, match", [
    (_header(extra=1), "exactly the keys"),
    ({b"__ndarray__": True, b"data": b"\0" * 4, b"dtype": "<f4"}, "exactly the keys"),
    ({**_header(), b"__ndarray__": 1}, "exactly the keys"),
    ({**_header(), b"data": "text"}, "bytes"),
    ({**_header(), b"shape": 6}, "list of integers"),
    ({b"__npgeneric__": True, b"data": "x", b"dtype": "<f4"}, "number"),
    ({b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}, "does not fit"),
    ({b"__npgeneric__": True, b"data": 1, b"dtype": "|O"}, "dtype"),
])
def test_malformed_array_and_scalar_headers_are_refused(header, match):
    with pytest.raises(wire.WireError, match=match):
        wire.unpack(_message(header))


@pytest.mark.parametrize("data, match", [
    (b"garbage", "not a valid msgpack message"),
    (msgpack.packb({"a": 1})[:-1], "not a valid msgpack message"),
    (b"\x91" * 100_000 + b"\xc0", "not a valid msgpack message"),  # nesting deeper than the decoder's stack
    (msgpack.packb({1: 2}), "not a valid msgpack message"),  # non-string map keys
    (b"\xd6\xff\x00\x00\x00\x01", "not a valid msgpack message"),  # extension types (a timestamp)
    (msgpack.packb("x" * 70_000), "not a valid msgpack message"),  # string over max_str_bytes
    (msgpack.packb(list(range(5000))), "not a valid msgpack message"),  # container over max_container_len
    ("text frame", "binary"),
])
def test_bad_messages_are_one_line_wire_errors(data, match):
    with pytest.raises(wire.WireError, match=match) as exc:
        wire.unpack(data)
    assert "\n" not in str(exc.value)


def test_message_and_array_byte_caps():
    limits = wire.Limits(max_message_bytes=1000, max_array_bytes=100)
    with pytest.raises(wire.WireError, match="exceeds the limit of 1000"):
        wire.unpack(wire.pack({"x": np.zeros(2000, np.uint8)}), limits)
    with pytest.raises(wire.WireError, match="at most 100 are accepted"):
        wire.unpack(_message(_header(dtype="|u1", shape=(200,), data=b"\0" * 200)), limits)
    assert wire.unpack(wire.pack({"x": np.zeros(100, np.uint8)}), limits)["x"].shape == (100,)
    with pytest.raises(ValueError, match="max_ndim"):
        wire.Limits(max_ndim=0)


def test_pack_refuses_what_the_decoder_would_refuse():
    with pytest.raises(TypeError, match="dtype"):
        wire.pack({"x": np.array([object()])})
    with pytest.raises(TypeError, match="dtype"):
        wire.pack({"x": np.zeros(2, np.complex64)})
    with pytest.raises(TypeError, match="set"):
        wire.pack({"x": {1, 2}})
