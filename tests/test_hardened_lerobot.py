"""What a downloaded LeRobot dataset's files say cannot reach outside its folder, crash a run or change data
silently (issue 42, items 1-3): every case is refused in one line naming the file and field, before the bytes
it would make the reader read or allocate; `training.memory` then exits 2 and `--out` holds nothing.

One small v3.0 dataset (two episodes, a video and a PNG camera, language columns) is written once; every test
edits a copy of it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.data.lerobot import LeRobotDataset, LeRobotSource, read_meta, read_stats
from training.data.lerobot.synthetic import write_dataset
from training.data.lerobot.video import VideoFrames

CAMERAS = {"image": ("video", 32, 32), "wrist": ("image", 16, 16)}
LENGTHS = [5, 4]
DATA = "data/chunk-000/file-000.parquet"
VIDEO = "videos/image/chunk-000/file-000.mp4"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardened") / "ds"
    write_dataset(root, lengths=LENGTHS, fps=10, cameras=CAMERAS, language=True)
    return root


@pytest.fixture
def ds(written, tmp_path):
    """A copy of the dataset to damage."""
    return shutil.copytree(written, tmp_path / "ds")


def _edit_info(root, **changes):
    info = json.loads((root / "meta/info.json").read_text())
    info.update(changes)
    (root / "meta/info.json").write_text(json.dumps(info))
    return info


def _set_column(root, column: str, values) -> None:
    """Rewrites the data file with `column` replaced, one row group per episode as LeRobot writes."""
    table = pq.read_table(root / DATA)
    table = table.set_column(table.column_names.index(column), column, pa.array(values))
    with pq.ParquetWriter(root / DATA, table.schema) as w:
        for start, n in zip(np.cumsum([0] + LENGTHS[:-1]), LENGTHS):
            w.write_table(table.slice(int(start), n))


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and len(text) < 700, text
    return text


# ------------------------------------------------------------------------------------------------------------
# 1. Paths a file names stay inside the dataset; templates are checked before use
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, template, named", [
    ("data_path", "../outside/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet", "leaves the dataset folder"),
    ("data_path", "/tmp/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet", "leaves the dataset folder"),
    ("data_path", "data/{foo}/file-{file_index:03d}.parquet", "field {foo} is not allowed"),
    ("data_path", "data/{chunk_index.__class__}.parquet", "is not allowed"),
    ("data_path", "data/{chunk_index:0999999999d}.parquet", "is not allowed"),
    ("data_path", 5, "must be a path template string"),
    ("video_path", "videos/../../{video_key}/{chunk_index}-{file_index}.mp4", "leaves the dataset folder"),
    ("video_path", None, "'video_path' is missing"),
])
def test_a_path_template_that_leaves_the_dataset_or_names_other_fields_is_refused(ds, field, template, named):
    _edit_info(ds, **{field: template})
    with pytest.raises(ValueError) as e:
        read_meta(ds)
    text = _one_line(e)
    assert named in text and ("info.json" in text or "meta/episodes" in text), text


def test_a_link_that_leaves_the_dataset_is_refused(ds, tmp_path):
    outside = tmp_path / "outside.parquet"
    shutil.copy(ds / DATA, outside)
    (ds / DATA).unlink()
    (ds / DATA).symlink_to(outside)
    with pytest.raises(ValueError) as e:
        read_meta(ds)
    assert "outside the dataset folder" in _one_line(e) and "file-000.parquet" in str(e.value)


# ------------------------------------------------------------------------------------------------------------
# 2. training.memory: one line, exit 2, nothing in --out (refused before the base is even loaded)
# ------------------------------------------------------------------------------------------------------------


def _train(ds, tmp_path, capsys, *extra) -> str:
    from training.memory.__main__ import main

    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["--data", str(ds), "--out", str(out), "--base", str(base), "--eval-split", "", "--steps", "1",
                 "--batch-size", "1", "--no-progress", "--devices", "1", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and err.startswith("python -m training.memory: error: --data"), err
    assert not out.exists() and not list(tmp_path.glob(".out*")), "the refused run left files behind"
    return err


def _outside_template(ds):
    _edit_info(ds, data_path="../stolen/file-{file_index:03d}.parquet")
    (ds.parent / "stolen").mkdir()
    shutil.copy(ds / DATA, ds.parent / "stolen" / "file-000.parquet")  # readable: only the check stops it


def _truncated_video(ds):
    data = (ds / VIDEO).read_bytes()
    (ds / VIDEO).write_bytes(data[: len(data) // 2])


def _task_without_a_task(ds):
    _set_column(ds, "task_index", np.full(sum(LENGTHS), 7, np.int64))


def _language_of_ints(ds):
    _set_column(ds, "language_persistent", [[1, 2]] * sum(LENGTHS))


def _png(height: int, width: int) -> bytes:
    """A PNG whose header declares height x width (the pixel data is a stub: a header check must come first)."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def _huge_png(ds):
    table = pq.read_table(ds / DATA)
    _set_column(ds, "wrist", [{"bytes": _png(20000, 20000), "path": None}] * table.num_rows)


@pytest.mark.parametrize("damage, named", [
    (_outside_template, "leaves the dataset folder"),
    (_truncated_video, "file-000.mp4: not a readable video"),
    (_task_without_a_task, "field 'task_index' 7 has no task"),
    (_language_of_ints, "a language row is int"),
    (_huge_png, "column 'wrist'"),
], ids=["outside", "truncated-mp4", "task-index", "language-ints", "png-20000"])
def test_training_memory_refuses_damaged_data_in_one_line_and_writes_nothing(ds, tmp_path, capsys, damage, named):
    damage(ds)
    err = _train(ds, tmp_path, capsys, "--key-map", "wrist_image=wrist")
    assert named in err and (damage is _outside_template or "episode 0" in err), err


def test_one_long_label_is_refused_reading_at_most_a_bounded_amount(ds, tmp_path, capsys):
    table = pq.read_table(ds / DATA)
    rows = table.column("language_persistent").to_pylist()
    long = "x" * (4 << 20)
    _set_column(ds, "language_persistent", [[{**r, "content": long if r["style"] == "memory" else r["content"]}
                                             for r in frame] for frame in rows])
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        err = _train(ds, tmp_path, capsys)
    finally:
        pa.set_memory_pool(previous)
    assert "a string of 4194304 bytes, above the cap 65536" in err and "language_persistent" in err
    assert pool.max_memory() < 64 << 20  # the 4 MB string held once (dictionary-encoded), not once per frame


# ------------------------------------------------------------------------------------------------------------
# 3. Caps and agreement: fps, sizes, the frame cache, non-finite numbers
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fps", [0, None, 1e308, -10, "10", True, float("nan")])
def test_an_fps_that_is_not_a_positive_finite_number_is_refused(ds, fps):
    _edit_info(ds, fps=fps)
    with pytest.raises(ValueError) as e:
        read_meta(ds)
    assert "info.json: fps must be a number in (0," in _one_line(e)


def test_an_fps_other_than_the_videos_rate_is_refused_when_the_video_opens(ds):
    _edit_info(ds, fps=5)  # the mp4 runs at 10 fps: timestamps would address other frames
    with pytest.raises(ValueError) as e:
        LeRobotDataset(ds).item(0)
    assert "frame rate is 10 fps but info.json says fps 5" in _one_line(e) and "episode 0 frame 0" in str(e.value)


@pytest.mark.parametrize("camera, shape, named", [
    ("image", [64, 64, 3], "the video is 32 x 32 px but info.json says 64 x 64"),
    ("wrist", [32, 32, 3], "the image is 16 x 16 px but info.json says 32 x 32"),
])
def test_decoded_images_of_another_size_than_info_json_says_are_refused(ds, camera, shape, named):
    info = json.loads((ds / "meta/info.json").read_text())
    info["features"][camera]["shape"] = shape
    (ds / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError) as e:
        LeRobotDataset(ds).item(0)
    assert named in _one_line(e)


def test_a_png_whose_header_claims_144_megapixels_is_refused_before_decoding(ds):
    _set_column(ds, "wrist", [{"bytes": _png(12000, 12000), "path": None}] * sum(LENGTHS))
    with pytest.raises(ValueError) as e:
        LeRobotDataset(ds).item(0)
    assert "column 'wrist'" in _one_line(e) and "cannot decode" in str(e.value)


def test_the_frame_cache_answers_only_for_the_frame_decoding_would_return(ds):
    video = VideoFrames()
    first = video.frame(ds / VIDEO, 0.0, 10.0, (32, 32))
    assert np.array_equal(video.frame(ds / VIDEO, 0.0, 10.0), first) and video.decoded_frames >= 1
    with pytest.raises(ValueError) as e:  # 0.04 s: no frame there (the old cache key round(t * fps) said frame 0)
        video.frame(ds / VIDEO, 0.04, 10.0)
    assert "no frame within" in _one_line(e)


@pytest.mark.parametrize("column", ["state", "actions"])
def test_non_finite_states_and_actions_are_refused_where_used(ds, column):
    values = pq.read_table(ds / DATA).column(column).to_pylist()
    values[6][1] = float("inf") if column == "state" else float("nan")
    _set_column(ds, column, values)
    src = LeRobotSource(ds, action_horizon=2)
    src[0]  # episode 0 is intact
    with pytest.raises(ValueError) as e:
        src.texts(6)  # episode 1, frame 1 (its state and the first row of its action chunk)
    assert f"field '{column}' holds" in _one_line(e) and "episode 1 frame 1" in str(e.value)


def test_non_finite_statistics_are_refused(ds):
    stats = json.loads((ds / "meta/stats.json").read_text())
    stats["state"]["std"][2] = None
    (ds / "meta/stats.json").write_text(json.dumps(stats).replace("null", "Infinity"))
    with pytest.raises(ValueError) as e:
        read_stats(read_meta(ds))
    assert "state.std holds inf" in _one_line(e)


def test_a_special_file_in_place_of_info_json_is_refused_unread(ds):
    os.remove(ds / "meta/info.json")
    os.symlink("/dev/zero", ds / "meta/info.json")
    with pytest.raises(ValueError) as e:
        read_meta(ds)
    assert "not a regular file" in _one_line(e)
