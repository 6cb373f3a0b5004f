"""Text adapters on LeRobot data: `training.memory --data <LeRobot dir> --target memory` trains on the episodes not
held out, `eval.memory_eval` evaluates on the held-out episodes, and frames without an active label are left out
(or given the --empty-label text), as `training.data.lerobot.splits` documents."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import save_base

from tests.helpers import fixture
from training.data.lerobot.splits import open_lerobot_split, parse_episodes, split_episodes
from training.data.lerobot.synthetic import write_dataset


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("lerobot_splits")
    truth = write_dataset(root, lengths=[7, 4, 8, 5], fps=20, cameras={"observation.images.image": ("video", 32, 48)},
                          episodes_per_file=2, language=True)
    return root, truth


def test_splits_are_disjoint_episode_lists(written):
    root, _ = written
    assert parse_episodes("3, 0-1,7") == [3, 0, 1, 7]
    assert split_episodes(root, "heldout", [2]) == [2] and split_episodes(root, "train", [2]) == [0, 1, 3]
    assert split_episodes(root, "all") == [0, 1, 2, 3] == split_episodes(root, "train")  # info.json's "0:4"
    with pytest.raises(ValueError, match="give the held-out episodes"):
        split_episodes(root, "heldout")
    with pytest.raises(ValueError, match="episode 9 is not in"):
        split_episodes(root, "train", [9])


@pytest.mark.parametrize("target", ["memory", "subtask"])
def test_frames_without_an_active_label_are_left_out_or_filled(written, target):
    root, truth = written
    split = open_lerobot_split(root, "train", target=target, heldout=[1])
    starts = np.concatenate([[0], np.cumsum([7, 4, 8, 5])])
    frames = [i for e in (0, 2, 3) for i in range(starts[e], starts[e + 1])]
    labelled = [i for i in frames if truth[target][i]]
    assert len(split) == len(labelled) and all(split.texts(k)[target] for k in range(len(split)))
    assert [split.texts(k)[target] for k in range(len(split))] == [truth[target][i] for i in labelled]
    frame = split[len(split) - 1]
    assert frame[target] == truth[target][labelled[-1]] and frame["episode_index"] == 3
    filled = open_lerobot_split(root, "train", target=target, heldout=[1], empty_label="nothing yet")
    assert len(filled) == len(frames)
    assert [filled.texts(k)[target] for k in range(len(filled))] == [truth[target][i] or "nothing yet" for i in frames]


def test_an_unknown_target_names_the_choices(written):
    root, _ = written
    with pytest.raises(ValueError, match="not memory / subtask / plan"):
        open_lerobot_split(root, "all", target="scene")


@pytest.fixture(scope="module")
def trained(tiny_params, tmp_path_factory):
    """A memory adapter trained for 3 steps on the v3.0 fixture's episodes 0 and 2, evaluated on episode 1."""
    from eval.memory_eval import main as eval_main
    from training.memory.__main__ import main as train_main

    data = fixture("lerobot_libero_tiny", "dataset")
    root = tmp_path_factory.mktemp("lerobot_memory")
    base = save_base(root / "base", tiny_params)
    out = root / "run"
    rc = train_main(["--data", str(data), "--out", str(out), "--base", str(base), "--target", "memory",
                     "--heldout-episodes", "1", "--key-map", "wrist_image=wrist_image", "--eval-split", "", "--steps", "3", "--batch-size", "2", "--rank", "2",
                     "--prompt-len", "24", "--devices", "1", "--no-progress"])
    eval_rc = eval_main(["--base", str(base), "--adapter", str(out / "adapter"), "--data", str(data),
                         "--heldout-episodes", "1", "--out", str(root / "report"), "--batch-size", "2", "--limit", "2",
                         "--num-steps", "1"])
    return rc, out, eval_rc, root / "report"


def test_training_memory_on_a_lerobot_dataset_trains_on_the_episodes_not_held_out(trained):
    rc, out, _, _ = trained
    assert rc == 0 and (out / "adapter").is_dir()
    run = json.loads((out / "run.json").read_text())
    # episodes 0 and 2 hold 8 + 10 frames; memory is active on 6 + 7 of them (none before the 2nd subtask)
    assert run["train_frames"] == 13 and run["config"]["label_key"] == "memory"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["event"] == "train"][-1] == 3
    assert all(np.isfinite(s["loss"]) for s in steps if s["event"] == "train")


def test_memory_eval_on_the_held_out_episode(trained):
    _, _, eval_rc, report_dir = trained
    assert eval_rc == 0
    report = json.loads((report_dir / "memory_eval.json").read_text())
    assert report["n"] == 2 and report["label_key"] == "memory"
    assert report["action_max_abs_diff"] == {"on_vs_off": 0.0, "on_vs_zeroed": 0.0, "off_vs_zeroed": 0.0}
    held_out = open_lerobot_split(fixture("lerobot_libero_tiny", "dataset"), "heldout", heldout=[1])
    assert set(report["per_label"]) <= {held_out.texts(k)["memory"].casefold().rstrip(".") for k in range(len(held_out))}
    n = report["train_layouts"]  # LeRobot frames have no init index: often one layout per instruction, so "1 layout"
    assert f"from {n} layout{'' if n == 1 else 's'} (instruction" in (report_dir / "memory_eval.md").read_text()
