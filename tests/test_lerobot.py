"""The LeRobot reader (`training.data.lerobot`): LeRobot's own fixtures reproduced bit for bit, and datasets written
here across versions, camera counts and sizes, rates, key names and file roll-over read back as written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from eval.parity import lerobot as lerobot_parity
from tests.helpers import fixture
from training.data.lerobot import KeyMap, LeRobotDataset, LeRobotSource, ShardView, read_meta, read_stats, shard_order
from training.data.lerobot.language import active_at, speech
from training.data.lerobot.synthetic import write_dataset

# ------------------------------------------------------------------------------------------------------------
# LeRobot's fixtures: every frame, index and string identical to what LeRobot returned
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lerobot_libero_tiny", "lerobot_libero_tiny_v21"])
def test_lerobot_fixture_every_frame_index_and_string_is_identical(name):
    rows = lerobot_parity.run_fixture(fixture(name))
    failed = [(r.quantity, r.max_abs) for r in rows if not r.ok]
    assert not failed
    quantities = {r.quantity.split(" ")[0] for r in rows}
    assert {"index", "timestamp", "task", "cam0", "cam1", "action_chunk", "action_chunk_is_pad", "memory"} <= quantities


def test_eval_parity_command_dispatches_a_lerobot_fixture(capsys):
    from eval.parity.__main__ import main

    assert main([str(fixture("lerobot_libero_tiny"))]) == 0
    assert "checks passed" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------------
# Datasets written here (training.data.lerobot.synthetic) across dimensions
# ------------------------------------------------------------------------------------------------------------

CASES = {
    # v3.0, LeRobot's canonical names, three cameras (two videos of other sizes, one PNG); data files roll over
    # every 2 episodes, videos every 3
    "v30_lerobot_names_rollover": dict(
        version="v3.0", lengths=[5, 7, 4, 6, 3], fps=15, episodes_per_file=2, video_episodes_per_file=3, language=True,
        cameras={"observation.images.image": ("video", 48, 80), "observation.images.image2": ("image", 24, 40),
                 "observation.images.side": ("video", 64, 48)},
        state_key="observation.state", action_key="action", state_dim=6, action_dim=3),
    # v2.1, openpi's names, one non-square H.264 camera (B-frames, a key frame every 6 frames), 30 fps
    "v21_openpi_names_h264": dict(
        version="v2.1", lengths=[6, 9], fps=30, vcodec="libx264", cameras={"image": ("video", 40, 72), "wrist_image": ("image", 16, 16)},
        state_dim=8, action_dim=7),
    # v3.0 without any video (no video_path), image cameras only, one episode per file, 5 fps
    "v30_images_only": dict(
        version="v3.0", lengths=[4, 3, 5], fps=5, episodes_per_file=1, cameras={"image": ("image", 20, 28)},
        state_dim=2, action_dim=4, language=True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def written(request, tmp_path_factory):
    spec = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    truth = write_dataset(root, **spec)
    return spec, root, truth


def _nearest_is_own(ours: np.ndarray, truth: np.ndarray, i: int, starts: np.ndarray) -> bool:
    """Decoded frame i is far closer to its own recorded pixels than to its neighbours in the same episode."""
    e = int(np.searchsorted(starts, i, side="right") - 1)
    own = np.abs(ours.astype(np.float64) - truth[i]).mean()
    near = [np.abs(ours.astype(np.float64) - truth[j]).mean() for j in (i - 1, i + 1) if starts[e] <= j < starts[e + 1]]
    return own < 10 and all(d > 2 * own for d in near)


def test_written_dataset_reads_back_as_written(written):
    spec, root, truth = written
    ds = LeRobotDataset(root)
    n, starts = sum(spec["lengths"]), np.concatenate([[0], np.cumsum(spec["lengths"])])
    assert len(ds) == n and ds.meta.version == spec["version"] and ds.meta.fps == spec["fps"]
    state_key, action_key = spec.get("state_key", "state"), spec.get("action_key", "actions")
    for i in range(n):
        item = ds.item(i)
        e = int(np.searchsorted(starts, i, side="right") - 1)
        assert (item["index"], item["episode_index"], item["frame_index"]) == (i, e, i - starts[e])
        assert item["timestamp"] == np.float32((i - starts[e]) / spec["fps"])
        assert np.array_equal(item[state_key], truth["state"][i]) and np.array_equal(item[action_key], truth["actions"][i])
        assert item["task"] == truth["tasks"][i]
        for key in ("subtask", "memory", "plan", "interjection", "speech"):
            assert item[key] == truth[key][i], (key, i)
        for key, (kind, h, w) in spec["cameras"].items():
            assert item[key].shape == (h, w, 3) and item[key].dtype == np.uint8
            if kind == "image":
                assert np.array_equal(item[key], truth["frames"][key][i])
            else:
                assert _nearest_is_own(item[key], truth["frames"][key], i, starts), (key, i)


_VIDEO_CASES = sorted(name for name, spec in CASES.items() if any(c[0] == "video" for c in spec["cameras"].values()))


@pytest.mark.parametrize("written", _VIDEO_CASES, indirect=True)
def test_video_cache_on_and_off_give_identical_frames_and_the_cache_is_bounded(written):
    spec, root, _ = written
    video = [k for k, (kind, _, _) in spec["cameras"].items() if kind == "video"]
    assert video
    on, off = LeRobotDataset(root), LeRobotDataset(root, video_cache_mb=0)
    order = np.random.default_rng(0).permutation(len(on))
    for i in order:
        a, b = on.item(int(i)), off.item(int(i))
        assert all(np.array_equal(a[k], b[k]) for k in video)
    assert off.video._cached_bytes == 0 and not off.video._cache
    assert len(on.video._cache) == len(video) * len(on)
    decoded = on.video.decoded_frames
    for i in order:  # a second pass comes from the cache
        on.item(int(i))
    assert on.video.decoded_frames == decoded
    # random access decodes from the key frame before the frame (LeRobot's AV1: one every 2 frames; our H.264: 6)
    gop = 6 if spec.get("vcodec") == "libx264" else 2
    assert off.video.decoded_frames <= gop * len(video) * len(off)
    tiny = LeRobotDataset(root, video_cache_mb=1e-6)
    for i in order:
        tiny.item(int(i))
    assert len(tiny.video._cache) == 1


def test_reading_in_time_order_decodes_each_frame_once(written):
    spec, root, _ = written
    video = [k for k, (kind, _, _) in spec["cameras"].items() if kind == "video"]
    ds = LeRobotDataset(root, video_cache_mb=0)
    for i in range(len(ds)):
        ds.item(i)
    assert ds.video.decoded_frames == len(video) * len(ds)


def test_texts_read_no_camera(written):
    spec, root, truth = written
    ds = LeRobotDataset(root)
    t = ds.texts(len(ds) - 1)
    assert not set(spec["cameras"]) & set(t) and t["memory"] == truth["memory"][-1]
    assert ds.video.decoded_frames == 0


def test_action_chunks_repeat_the_last_row_past_the_episode_end_and_flag_it(written):
    spec, root, truth = written
    h = 4
    src = LeRobotSource(root, action_horizon=h)
    starts = np.concatenate([[0], np.cumsum(spec["lengths"])])
    for i in range(len(src)):
        t = src.texts(i)
        e = int(np.searchsorted(starts, i, side="right") - 1)
        want = np.arange(i, i + h)
        rows = np.minimum(want, starts[e + 1] - 1)
        assert np.array_equal(t["actions"], truth["actions"][rows])
        assert np.array_equal(t["actions_is_pad"], want != rows)


def test_key_map_gives_the_project_frame_fields_whatever_the_dataset_calls_them(written):
    spec, root, truth = written
    src = LeRobotSource(root)
    assert src.keys["state"] == spec.get("state_key", "state") and src.keys["actions"] == spec.get("action_key", "actions")
    frame = src[1]
    assert np.array_equal(frame["state"], truth["state"][1]) and frame["language_instruction"] == truth["tasks"][1]
    assert frame["image"].shape[-1] == 3 and frame["init_index"] == -1 and frame["memory"] == truth["memory"][1]


def test_episode_list_selects_those_episodes_in_dataset_order(written):
    spec, root, truth = written
    keep = [len(spec["lengths"]) - 1, 0]
    src = LeRobotSource(root, episodes=keep)
    assert src.episodes == (0, keep[0]) and len(src) == spec["lengths"][0] + spec["lengths"][-1]
    assert [src.texts(i)["episode_index"] for i in range(len(src))] == \
        [0] * spec["lengths"][0] + [keep[0]] * spec["lengths"][-1]
    with pytest.raises(ValueError, match="episode 99 is not in meta"):
        LeRobotSource(root, episodes=[0, 99])


def test_statistics_match_the_frames(written):
    spec, root, truth = written
    stats = read_stats(read_meta(root))
    a = stats[spec.get("action_key", "actions")]
    np.testing.assert_allclose(a["mean"], truth["actions"].mean(0), atol=1e-6)
    np.testing.assert_allclose(a["std"], truth["actions"].std(0), atol=1e-6)
    np.testing.assert_array_equal(a["max"], truth["actions"].max(0))


# ------------------------------------------------------------------------------------------------------------
# Language columns, sampling, errors
# ------------------------------------------------------------------------------------------------------------


def test_active_at_takes_the_latest_row_of_the_style_at_or_before_t():
    t02, t05 = float(np.float32(0.2)), float(np.float32(0.5))
    rows = [{"style": "memory", "content": "a", "timestamp": t02}, {"style": "memory", "content": "b", "timestamp": t05},
            {"style": "subtask", "content": "s", "timestamp": 0.0}]
    got = [active_at(rows, float(np.float32(k / 10)), "memory") for k in range(7)]
    assert got == ["", "", "a", "a", "a", "b", "b"]
    with pytest.raises(ValueError, match="ambiguous"):
        active_at(rows + [{"style": "memory", "content": "c", "timestamp": t05}], 0.6, "memory")


def test_speech_reads_the_say_call_stored_as_a_struct_or_as_json():
    call = {"type": "function", "function": {"name": "say", "arguments": {"text": "Hi."}}}
    assert speech([{"role": "assistant", "tool_calls": [call]}]) == "Hi."
    assert speech([{"role": "assistant", "tool_calls": [json.dumps(call)]}]) == "Hi."
    assert speech([{"role": "user", "tool_calls": [call]}]) == ""


@pytest.mark.parametrize("n,count", [(10, 3), (7, 2), (5, 1)])
def test_shards_are_disjoint_equal_and_deterministic(n, count):
    for seed in (None, 3):
        parts = [shard_order(n, seed=seed, shard_index=h, shard_count=count) for h in range(count)]
        flat = np.concatenate(parts)
        assert len(set(flat.tolist())) == len(flat) == (n // count) * count
        assert all(len(p) == n // count for p in parts)
        assert all(np.array_equal(p, shard_order(n, seed=seed, shard_index=h, shard_count=count))
                   for h, p in enumerate(parts))
    assert not np.array_equal(shard_order(50, seed=3, epoch=0), shard_order(50, seed=3, epoch=1))
    view = ShardView(list(range(n)), seed=1, shard_index=count - 1, shard_count=count)
    assert [view[k] for k in range(len(view))] == shard_order(n, seed=1, shard_index=count - 1,
                                                              shard_count=count).tolist()


def test_bad_files_are_one_line_errors_naming_file_and_field(tmp_path):
    root = tmp_path / "ds"
    write_dataset(root, lengths=[3, 2], cameras={"cam": ("video", 32, 32)})
    info = json.loads((root / "meta/info.json").read_text())
    bad = tmp_path / "version"
    shutil.copytree(root, bad)
    (bad / "meta/info.json").write_text(json.dumps({**info, "codebase_version": "v1.6"}))
    with pytest.raises(ValueError, match=r"info.json: codebase_version 'v1.6'") as e:
        LeRobotDataset(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="no meta/info.json"):
        LeRobotDataset(tmp_path)
    with pytest.raises(ValueError, match="no feature matches the key map's image"):
        LeRobotSource(root)
    assert LeRobotSource(root, key_map=KeyMap(image=("cam",))).keys["image"] == "cam"
    # an episode table whose video offsets disagree with the mp4
    import pyarrow.parquet as pq

    shifted = tmp_path / "shifted"
    shutil.copytree(root, shifted)
    ep = shifted / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(ep)
    col = table.column_names.index("videos/cam/from_timestamp")
    pq.write_table(table.set_column(col, "videos/cam/from_timestamp",
                                    [[x + 0.05 for x in table.column(col).to_pylist()]]), ep)
    with pytest.raises(ValueError, match=r"file-000.mp4: no frame within 0.0001 s") as e:
        LeRobotDataset(shifted).item(0)
    assert "\n" not in str(e.value)
    # a data file without a column every LeRobot data file has
    dropped = tmp_path / "dropped"
    shutil.copytree(root, dropped)
    data = dropped / "data/chunk-000/file-000.parquet"
    pq.write_table(pq.read_table(data).drop_columns(["task_index"]), data)
    with pytest.raises(ValueError, match=r"file-000.parquet: column 'task_index' is missing") as e:
        LeRobotDataset(dropped).texts(0)
    assert "\n" not in str(e.value)


def test_a_used_source_pickles_without_its_open_files_and_reads_the_same(written):
    import pickle

    spec, root, _ = written
    src = LeRobotSource(root)
    first = src[len(src) - 1]
    copy = pickle.loads(pickle.dumps(src))
    assert not copy.dataset.video._cache and not copy.dataset.rows._files
    again = copy[len(src) - 1]
    assert all(np.array_equal(np.asarray(first[k]), np.asarray(again[k])) for k in first)


def _reference(root, items, cams):
    ref = {k: np.asarray([it[k] for it in items]) for k in ("index", "episode_index", "frame_index", "task_index",
                                                            "timestamp", "task", "memory", "subtask")}
    ref["state"] = np.stack([it["observation.state"] for it in items])
    for n, key in enumerate(cams):
        ref[f"cam{n}"] = np.stack([it[key] for it in items])
    return ref


def test_parity_tool_catches_one_wrong_pixel_or_string_and_accepts_either_lerobot_backend(tmp_path):
    fx = tmp_path / "fixture"
    cams = {"observation.images.front": ("video", 32, 48), "wrist": ("image", 16, 16)}
    write_dataset(fx / "dataset", lengths=[4, 3], cameras=cams, state_key="observation.state", action_key="action",
                  language=True)
    (fx / "reference.json").write_text(json.dumps({"camera_npz_prefix": {k: f"cam{n}" for n, k in enumerate(cams)},
                                                   "state_key": "observation.state", "action_key": "action"}))
    ds = LeRobotDataset(fx / "dataset")
    good = _reference(fx, [ds.item(i) for i in range(len(ds))], cams)

    def run(**changes):
        np.savez(fx / "reference.npz", **{**good, **changes})
        return {r.quantity.split(" ")[0]: r.ok for r in lerobot_parity.run_fixture(fx)}

    assert all(run().values()) and lerobot_parity.is_lerobot_fixture(fx)
    cam0 = good["cam0"].copy()
    cam0[5, 3, 4, 1] ^= 1
    assert run(cam0=cam0)["cam0"] is False
    assert run(cam0=cam0, cam0_pyav=good["cam0"])["cam0"] is True  # the frames of LeRobot's other backend
    memory = good["memory"].copy()
    memory[-1] = memory[-1] + "x"
    assert run(memory=memory)["memory"] is False


def test_camera_shapes_are_read_through_their_names_and_the_key_map_parses_overrides(tmp_path):
    write_dataset(tmp_path, lengths=[2], cameras={"image": ("image", 8, 8)})
    meta = read_meta(tmp_path)
    chw = {"dtype": "video", "shape": [3, 48, 80], "names": ["channel", "height", "width"]}
    hwc = {"dtype": "image", "shape": [48, 80, 3], "names": ["height", "width", "channel"]}
    meta = type(meta)(**{**meta.__dict__, "features": {"a": chw, "b": hwc}})
    assert meta.image_shape("a") == meta.image_shape("b") == (48, 80)
    km = KeyMap.parse(["image=observation.images.top", "state=obs"])
    assert km.image == ("observation.images.top",) and km.state == ("obs",) and km.actions == KeyMap().actions
    with pytest.raises(ValueError, match="FIELD=FEATURE"):
        KeyMap.parse(["camera=x"])
    with pytest.raises(ValueError, match="KeyMap.image must be a tuple"):
        KeyMap(image="image")
