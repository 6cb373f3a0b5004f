"""Memory data without TensorFlow: the TFRecord reader against TF's own read-back, CRC checks, the tfds
array_record writer/reader round trip, one-line errors for bad input, fixed-shape deterministic batches,
and the synthetic memory task."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import numpy as np
import pytest

from helpers import shared_dir
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.robots.config import robot_config
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from training.data import frames as frame_format, rlds_tfrecord
from training.data.frames import frame_texts, open_memory_dataset, write_array_record_dataset, write_memory_dataset
from training.memory.data import MemoryBatch, encode_memory_suffix, epoch_batches, memory_batches
from training.data.rlds_tfrecord import (
    RldsTFRecordSource,
    TFRecordError,
    crc32c,
    index_records,
    iter_records,
    masked_crc32c,
    stack_steps,
)
from training.data.synthetic_memory import (
    SyntheticMemoryConfig,
    all_labels,
    render_frame,
    synthetic_frames,
    synthetic_splits,
)

PX = 56  # the tiny preset's SigLIP image side


def _fixture_dir():
    path = shared_dir() / "fixtures" / "rlds_tfrecord_tiny"
    if not path.is_dir():
        pytest.skip(f"../shared fixtures not present: {path} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    return path


def _bitwise_crc32c(data: bytes) -> int:
    """CRC-32C one bit at a time, straight from the definition (reflected 0x82F63B78)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _tfrecord(payloads) -> bytes:
    out = b""
    for p in payloads:
        length = struct.pack("<Q", len(p))
        out += length + struct.pack("<I", masked_crc32c(length)) + p + struct.pack("<I", masked_crc32c(p))
    return out


# --- CRC-32C and TFRecord framing -------------------------------------------------------------------


def test_crc32c_matches_the_definition_on_every_length_class(monkeypatch):
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    monkeypatch.setattr(rlds_tfrecord, "_CHUNK", 1024)  # exercise the chunked path on small inputs
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 511, 512, 513, 1023, 1024, 1025, 3000, 5003):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert crc32c(data) == _bitwise_crc32c(data), n


def test_tfrecord_framing_round_trips_and_corruption_names_file_and_record(tmp_path):
    payloads = [b"first episode", bytes(range(256)) * 4, b""]
    path = tmp_path / "x.tfrecord-00000-of-00001"
    path.write_bytes(_tfrecord(payloads))
    assert list(iter_records(path)) == payloads
    assert [n for _, n in index_records(path)] == [len(p) for p in payloads]

    blob = bytearray(path.read_bytes())
    second = 16 + len(payloads[0])  # record 1 starts here
    blob[second + 12 + 100] ^= 0x01  # one bit of record 1's data
    path.write_bytes(bytes(blob))
    with pytest.raises(TFRecordError, match=rf"{path.name}: record 1 at byte {second}: data CRC mismatch"):
        list(iter_records(path))
    assert len(list(iter_records(path, check_crc=False))) == 3

    blob[second + 12 + 100] ^= 0x01
    blob[second] ^= 0x04  # record 1's length field
    path.write_bytes(bytes(blob))
    with pytest.raises(TFRecordError, match=rf"{path.name}: record 1 at byte {second}: length CRC mismatch"):
        index_records(path)

    path.write_bytes(_tfrecord(payloads)[:-3])  # cut inside the last record
    with pytest.raises(TFRecordError, match=r"record 2 at byte \d+ claims 0 data bytes but the file ends"):
        index_records(path)


# --- TF-free RLDS TFRecord reader vs TensorFlow's read-back ------------------------------------------


def test_tfrecord_reader_reproduces_tensorflows_read_back_on_both_splits():
    fixture = _fixture_dir()
    ref = np.load(fixture / "reference.npz", allow_pickle=False)
    meta = json.loads((fixture / "reference.json").read_text())
    ds_dir = fixture / meta["dataset"]["path"]
    tf_vs_pil = meta["jpeg_decode_max_abs_diff_tf_vs_pil"]
    for split in ("train", "val"):
        src = RldsTFRecordSource(ds_dir, split)
        raw = RldsTFRecordSource(ds_dir, split, decode_images=False)
        episodes = meta["splits"][split]["episodes"]
        assert len(src) == len(episodes)
        for e, info in enumerate(episodes):
            assert hashlib.sha256(src.record(e)).hexdigest() == info["record_sha256"]
            p = f"{split}/{e}/"
            ep = src[e]
            steps, raw_steps = stack_steps(ep["steps"]), stack_steps(raw[e]["steps"])
            assert len(ep["steps"]) == info["num_steps"]
            for key in ("action", "discount", "reward", "is_first", "is_last", "is_terminal"):
                np.testing.assert_array_equal(steps[key], ref[p + "steps/" + key], err_msg=p + key)
                assert steps[key].dtype == ref[p + "steps/" + key].dtype
            for key in ("state", "joint_state"):
                np.testing.assert_array_equal(steps["observation"][key], ref[p + "steps/observation/" + key])
                assert steps["observation"][key].dtype == np.float32
            for key in ("language_instruction", "memory"):
                assert list(steps[key]) == list(ref[p + "steps/" + key])  # UTF-8 bytes, incl. non-ASCII
                assert [t.decode("utf-8") for t in steps[key]] == info[key]
            assert ep["episode_metadata"]["file_path"] == ref[p + "episode_metadata/file_path"].item()
            for cam in ("image", "wrist_image"):
                pixels = steps["observation"][cam]
                np.testing.assert_array_equal(pixels, ref[p + f"steps/observation/{cam}_pil"])  # same decoder: exact
                tf_pixels = ref[p + f"steps/observation/{cam}"]
                assert pixels.shape == tf_pixels.shape and pixels.dtype == np.uint8
                assert np.abs(pixels.astype(int) - tf_pixels).max() <= tf_vs_pil  # TF's IDCT differs from Pillow's
                digests = [hashlib.sha256(b).hexdigest() for b in raw_steps["observation"][cam]]
                assert digests == [d.decode() for d in ref[p + f"steps/observation/{cam}_jpeg_sha256"]]


def test_corrupt_shard_fails_on_read_naming_shard_and_record(tmp_path):
    fixture = _fixture_dir()
    ds_dir = tmp_path / "libero_memory_tiny" / "1.0.0"
    shutil.copytree(fixture / "libero_memory_tiny" / "1.0.0", ds_dir, copy_function=shutil.copyfile)  # writable
    shard = sorted(ds_dir.glob("*-val.tfrecord-*"))[0]
    blob = bytearray(shard.read_bytes())
    blob[5000] ^= 0xFF
    shard.write_bytes(bytes(blob))
    src = RldsTFRecordSource(ds_dir, "val")  # headers are intact
    with pytest.raises(TFRecordError, match=rf"{shard.name}: record 0 at byte 0: data CRC mismatch"):
        src[0]
    with pytest.raises(TFRecordError):
        open_memory_dataset(ds_dir, "val")[0]


# --- the tfds memory dataset: write, read back, bad input ---------------------------------------------


@pytest.fixture(scope="module")
def synthetic_config():
    return SyntheticMemoryConfig(image_size=PX, num_inits=4, num_train_inits=3)


@pytest.fixture(scope="module")
def written(tmp_path_factory, synthetic_config):
    frames = synthetic_splits(synthetic_config)
    for i, f in enumerate(frames["train"]):
        f["note"] = f"layout {f['init_index']} ünïcode"  # extra str metadata (besides "scene", "done_mask")
        f["score"] = 0.25 * i  # an extra float
    for f in frames["heldout"]:
        f["note"], f["score"] = "held out", -1.0
    path = write_memory_dataset(tmp_path_factory.mktemp("mem"), frames, image_size=PX, name="synthetic_memory")
    return frames, path


def test_memory_dataset_round_trips_text_exactly_and_images_within_jpeg_tolerance(written):
    frames, path = written
    assert (path / "dataset_info.json").is_file() and path.name == "1.0.0"
    for split in ("train", "heldout"):
        src = open_memory_dataset(path, split)
        assert len(src) == len(frames[split])
        for i, want in enumerate(frames[split]):  # stored in the order written
            got = src[i]
            assert set(got) == set(want)
            for key in ("language_instruction", "memory", "task", "init_index", "done_mask", "scene", "note", "score"):
                assert got[key] == want[key] and type(got[key]) is type(want[key]), key
            np.testing.assert_array_equal(got["state"], want["state"])
            assert got["state"].dtype == np.float32
            for key in ("image", "wrist_image"):
                assert got[key].dtype == np.uint8 and got[key].shape == (PX, PX, 3)
                diff = np.abs(got[key].astype(int) - want[key])
                assert diff.mean() < 4 and diff.max() <= 32, (key, diff.mean(), diff.max())


def test_text_reads_equal_the_frames_without_images_and_decode_no_jpeg(written, monkeypatch):
    frames, path = written
    src = open_memory_dataset(path, "train")
    full = [src[i] for i in range(len(src))]
    monkeypatch.setattr(frame_format, "decode_image", lambda *a: pytest.fail("a text read decoded an image"))
    texts = [src.texts(i) for i in range(len(src))]
    assert texts == [{k: v for k, v in f.items() if k not in ("image", "wrist_image", "state")} for f in full]
    keys = ("memory", "language_instruction", "absent")
    assert frame_texts(src, keys, limit=2) == [{k: f[k] for k in keys[:2]} for f in full[:2]]
    assert frame_texts(frames["train"], ("memory",)) == [{"memory": f["memory"]} for f in frames["train"]]


def test_writing_over_an_existing_dataset_needs_overwrite(written):
    frames, path = written
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_memory_dataset(path.parents[1], {"train": frames["train"][:1]}, image_size=PX, name="synthetic_memory")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: f.update(wrist_image=f["wrist_image"][:50]), r"frame 1: 'wrist_image' must be uint8 \[56, 56, 3\]"),
        (lambda f: f.update(image=f["image"].astype(np.float32)), r"frame 1: 'image' must be uint8 .* got float32"),
        (lambda f: f.pop("memory"), r"frame 1: missing \['memory'\]"),
        (lambda f: f.update(state=np.zeros(7, np.float32)), r"frame 1: 'state' must be 8 finite floats"),
        (lambda f: f.update(memory=3), r"frame 1: 'memory' must be a str"),
        (lambda f: f.update(note="x"), r"frame 1: extra keys differ .*unexpected \['note'\]"),
        (lambda f: f.update(done_mask="3"), r"frame 1: 'done_mask' must be int, as in the first frame; got str"),
    ],
)
def test_bad_frames_raise_naming_split_frame_and_field(tmp_path, synthetic_config, change, message):
    frames = [render_frame(synthetic_config, 0, (False, True)), render_frame(synthetic_config, 0, (True, False))]
    change(frames[1])
    with pytest.raises(ValueError, match=r"split 'train' " + message):
        write_memory_dataset(tmp_path, {"train": frames}, image_size=PX)
    assert not (tmp_path / "memory_frames" / "1.0.0").exists()  # nothing half-written is left behind


def test_dataset_missing_a_feature_fails_in_one_line_naming_feature_and_path(tmp_path, synthetic_config):
    from training.data.frames import memory_features
    import tensorflow_datasets as tfds

    full = memory_features(image_size=PX)
    step = {k: v for k, v in full["steps"].feature.items() if k != "memory"}
    features = tfds.features.FeaturesDict({"steps": tfds.features.Dataset(step),
                                           "episode_metadata": full["episode_metadata"]})
    frame = render_frame(synthetic_config, 0, (True, True))
    example = {"steps": [{"observation": {"image": _png(frame["image"]), "wrist_image": _png(frame["wrist_image"]),
                                          "state": frame["state"]},
                          "language_instruction": frame["language_instruction"],
                          "is_first": True, "is_last": True, "is_terminal": True}],
               "episode_metadata": {"task": "t", "init_index": 0}}
    path = write_array_record_dataset(tmp_path, "no_memory", features, {"train": [example]})
    with pytest.raises(ValueError) as e:
        open_memory_dataset(path, "train")
    assert "'steps/memory'" in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"no split 'val'; the dataset has splits \['train'\]"):
        open_memory_dataset(path, "val")


def _png(img) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def test_rlds_tfrecord_episodes_open_as_frames_in_episode_order():
    fixture = _fixture_dir()
    meta = json.loads((fixture / "reference.json").read_text())
    src = open_memory_dataset(fixture / "libero_memory_tiny/1.0.0", "train")
    episodes = meta["splits"]["train"]["episodes"]
    assert len(src) == sum(ep["num_steps"] for ep in episodes)  # 7 + 6 frames from 2 episodes
    memories = [m for ep in episodes for m in ep["memory"]]
    assert [src[i]["memory"] for i in range(len(src))] == memories
    frame = src[episodes[0]["num_steps"]]  # first step of the second episode
    assert src.locate(episodes[0]["num_steps"]) == (1, 0)
    assert frame["task"] == frame["language_instruction"] and frame["init_index"] == -1  # absent metadata
    assert frame["file_path"] == episodes[1]["file_path"]
    assert frame["image"].shape == (64, 64, 3) and frame["state"].shape == (8,)


# --- batches for the suffix-only memory loss ------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return train_demo_tokenizer()


def _batches(source, tok, **kw):
    robot, cfg = robot_config("libero", max_token_len=32), model_config("tiny")
    return list(memory_batches(source, robot, cfg, tok, batch_size=3, suffix_len=40, **kw))


def test_batches_have_static_shapes_and_depend_only_on_the_seed(written, tok):
    frames, path = written
    src = open_memory_dataset(path, "train")  # 12 frames
    a = _batches(src, tok, seed=1, epochs=2, drop_remainder=False)
    b = _batches(src, tok, seed=1, epochs=2, drop_remainder=False)
    c = _batches(src, tok, seed=2, epochs=2, drop_remainder=False)
    assert len(a) == 8
    for batch in a:
        assert isinstance(batch, MemoryBatch)
        assert batch.observation.images.shape == (3, 2, PX, PX, 3) and batch.observation.tokens.shape == (3, 32)
        assert batch.suffix_tokens.shape == batch.suffix_mask.shape == batch.loss_mask.shape == (3, 40)
        assert batch.suffix_tokens.dtype == np.int32 and batch.loss_mask.dtype == bool
    for x, y in zip(a, b):
        for leaf_x, leaf_y in zip(_leaves(x), _leaves(y)):
            np.testing.assert_array_equal(leaf_x, leaf_y)
    assert any(not np.array_equal(x.suffix_tokens, y.suffix_tokens) for x, y in zip(a, c))

    # Another suffix task over the same frames: prompt "Scene: ", label from the "scene" field.
    scene = _batches(src, tok, seed=1, shuffle=False, prompt="Scene: ", label_key="scene")[0]
    assert tok.decode(scene.suffix_tokens[0][scene.loss_mask[0]][:-1]) == frames["train"][0]["scene"]

    # The suffix is "Memory: " ‖ label ‖ EOS; the loss covers the label and EOS only.
    labels = {f["memory"] for f in frames["train"]}
    for batch in a[:2]:
        for row in range(3):
            tokens, loss = batch.suffix_tokens[row], batch.loss_mask[row]
            assert tok.decode(tokens[batch.suffix_mask[row] & ~loss]) == "Memory: "
            assert tok.decode(tokens[loss][:-1]) in labels and tokens[loss][-1] == tok.eos_id


def _leaves(batch):
    import jax

    return jax.tree.leaves(batch)


def test_epochs_visit_every_frame_once_and_padding_rows_carry_no_loss(tok, synthetic_config):
    for seed in (0, 3):
        batches = epoch_batches(10, batch_size=4, seed=seed, epoch=1, drop_remainder=False)
        assert [len(b) for b in batches] == [4, 4, 2]
        assert sorted(np.concatenate(batches).tolist()) == list(range(10))
    assert [b.tolist() for b in epoch_batches(5, batch_size=2, seed=0, epoch=0, shuffle=False)] == [[0, 1], [2, 3]]
    assert not np.array_equal(np.concatenate(epoch_batches(10, batch_size=5, seed=0, epoch=0)),
                              np.concatenate(epoch_batches(10, batch_size=5, seed=0, epoch=1)))

    frames = list(synthetic_frames(synthetic_config, range(1)))  # 4 frames
    kept = _batches(frames, tok, shuffle=False, drop_remainder=False)
    assert [b.loss_mask.any(-1).tolist() for b in kept] == [[True] * 3, [True, False, False]]
    assert len(_batches(frames, tok, shuffle=False)) == 1  # drop_remainder drops the partial batch


def test_a_label_that_does_not_fit_the_suffix_raises_instead_of_truncating(tok):
    with pytest.raises(ValueError, match=r"needs \d+ suffix tokens .* but suffix_len=8; raise suffix_len"):
        encode_memory_suffix(tok, "Done: red block in basket.", suffix_len=8)
    with pytest.raises(ValueError, match="the suffix prompt is empty"):
        encode_memory_suffix(tok, "Done: nothing.", suffix_len=40, prompt="")


def test_batching_names_the_frames_of_a_malformed_batch(tok, synthetic_config):
    frames = list(synthetic_frames(synthetic_config, range(1)))
    del frames[2]["memory"]
    with pytest.raises(ValueError, match=r"frames \[0, 1, 2\] \(epoch 0\): frame 2 of the batch lacks \['memory'\]"):
        _batches(frames, tok, shuffle=False)


# --- the synthetic memory task ---------------------------------------------------------------------------


def test_synthetic_labels_are_few_distinct_and_round_trip_through_the_demo_tokenizer(tok, synthetic_config):
    labels = all_labels(synthetic_config)
    assert labels == ["Done: nothing.", "Done: red block in basket.", "Done: blue block on plate.",
                      "Done: red block in basket; blue block on plate."]
    for text in [*labels, "Memory: "]:
        assert tok.decode(tok.encode(text)) == text
    splits = synthetic_splits(synthetic_config)
    assert {f["init_index"] for f in splits["train"]}.isdisjoint({f["init_index"] for f in splits["heldout"]})
    assert [f["memory"] for f in splits["heldout"]] == labels  # every label in both splits


def test_synthetic_label_is_what_the_pixels_show(synthetic_config):
    """The block colour appears inside the basket / on the plate exactly when the label says it is done."""
    from training.data.synthetic_memory import _layout

    for init in range(3):
        layout = _layout(synthetic_config, init)
        for done in [(False, False), (True, False), (False, True), (True, True)]:
            frame = render_frame(synthetic_config, init, done)
            for obj, d in zip(synthetic_config.objects, done):
                cx, cy = (layout[obj.target] * PX).astype(int)
                patch = frame["image"][cy - 6 : cy + 7, cx - 6 : cx + 7].astype(int)
                near = np.abs(patch - np.array(obj.color)).max(-1) < 40
                assert near.sum() >= 20 if d else near.sum() == 0, (init, done, obj.name)
            assert frame["memory"] == all_labels(synthetic_config)[frame["done_mask"]]
