"""OxyGen's memory annotations on LIBERO's raw HDF5 layout: the reader, their split, their samplers, their metric.

The data is written here from the documented layouts (`training.data.oxygen_libero.synthetic`): three tasks in two
suites, 12 / 7 / 6 demonstrations of different lengths (12, so that demo_10 sorts after demo_9 by k, not by
name), memory texts that change at known frames, one task under the older field name `visual_memory`. Expected
values are restated from the protocol (sha256 seed + random.sample, kept-frame rule, rotation), not read back
from the implementation.
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
import shutil

import numpy as np
import pytest

from training.memory.data import StepBatches
from training.data.frames import frame_texts
from training.data.oxygen_libero import (
    BalancedSampler, LiberoHdf5, OxygenLiberoSource, build_split, exact_match, kept_frames, normalize,
    open_oxygen_libero, oxygen_metrics, select_eval_frames, word_f1,
)
from training.data.oxygen_libero.synthetic import write_task

TASKS = [  # suite, task, demos, target field name
    ("libero_goal", "KITCHEN_SCENE3_turn_on_the_stove", 12, "textual_memory"),
    ("libero_goal", "LIVING_ROOM_SCENE1_put_the_bowl_on_the_plate", 7, "visual_memory"),
    ("libero_spatial", "pick_up_the_black_bowl_next_to_the_ramekin", 6, "textual_memory"),
]
SIZE = 8


def _lengths(t: int, n: int) -> list[int]:
    return [9 + 5 * t + (7 * k) % 23 for k in range(n)]


def _changes(n: int) -> tuple[int, int]:  # synthetic.write_task's default change frames
    return (n // 3, 2 * n // 3)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    d = tmp_path_factory.mktemp("oxygen_libero")
    facts = ("the black bowl is on the plate", "the stove is on", "the top drawer of the cabinet is closed")
    for t, (suite, task, n, name) in enumerate(TASKS):
        write_task(d / "hdf5", d / "ann", suite=suite, task=task, instruction=task.lower().replace("_", " "),
                   task_id=t, lengths=_lengths(t, n), facts=facts[: 2 + t % 2], target_name=name, image_size=SIZE)
    return d / "ann", d / "hdf5"


@pytest.fixture(scope="module")
def data(roots):
    out = open_oxygen_libero(*roots)
    yield out
    out.close()


# --- the split -----------------------------------------------------------------------------------------------


def test_kept_frames_are_first_last_every_stride_and_both_sides_of_each_target_change():
    y = list("aaabbbbbcc")
    assert kept_frames(y, 4) == [0, 2, 3, 4, 7, 8, 9]
    assert kept_frames(y, 8) == [0, 2, 3, 7, 8, 9]
    assert kept_frames(["x"] * 20, 8) == [0, 8, 16, 19]
    assert kept_frames(["x"], 8) == [0]
    assert kept_frames(list("abab"), 8) == [0, 1, 2, 3]
    for stride in (1, 3, 8):
        assert kept_frames(list("a" * 17 + "b" * 5), stride) == sorted(
            {0, 21, 16, 17, *range(0, 22, stride)})


def test_split_holds_out_the_sha256_seeded_random_sample_of_demos_per_task_sorted_by_k(roots, data, tmp_path):
    split = data.split
    for suite, task, n, _ in TASKS:
        stems = [f"demo_{k}" for k in range(n)]  # k order: demo_10 and demo_11 come last
        seed = int.from_bytes(hashlib.sha256(f"7:{suite}:{task}".encode()).digest()[:8], "little")
        expect = sorted(random.Random(seed).sample(stems, 5))
        assert split.heldout_demos[f"{suite}/{task}"] == expect
        held = {r.demo for r in split.heldout if r.task == task}
        train = {r.demo for r in split.train if r.task == task}
        assert held == set(expect) and train == set(stems) - held
    assert split.manifest()["validation_episodes"] == 15 and split.train_demos == 25 - 15
    again = build_split(roots[0])
    assert (again.train, again.heldout) == (split.train, split.heldout)
    assert build_split(roots[0], seed=8).heldout_demos != split.heldout_demos
    suite, task = TASKS[2][:2]  # a task's draw does not depend on the other tasks
    shutil.copytree(roots[0] / suite / task, tmp_path / suite / task)
    alone = build_split(tmp_path)
    assert alone.heldout_demos == {f"{suite}/{task}": split.heldout_demos[f"{suite}/{task}"]}
    assert alone.heldout == [r for r in split.heldout if r.task == task]


def test_each_demo_contributes_first_last_every_8th_and_both_sides_of_each_memory_change(data):
    got = collections.defaultdict(list)
    for ref in data.split.train + data.split.heldout:
        got[(ref.task, ref.demo)].append(ref.frame)
    assert len(got) == sum(n for _, _, n, _ in TASKS)
    for t, (_, task, n, _) in enumerate(TASKS):
        for k, length in enumerate(_lengths(t, n)):
            changes = {c for c in _changes(length) if c > 0}
            expect = sorted({0, length - 1, *range(0, length, 8), *changes, *(c - 1 for c in changes)})
            assert got[(task, f"demo_{k}")] == expect, (task, k)


def test_both_memory_field_names_read_as_the_target_and_a_row_without_one_is_refused(roots, data, tmp_path):
    visual = [r for r in data.split.train if r.task == TASKS[1][1]]
    assert visual and {r.target for r in visual} >= {"No relevant task progress is visible yet.",
                                                     "The black bowl is on the plate."}
    bad = tmp_path / "libero_goal" / "T"
    bad.mkdir(parents=True)
    (bad / "demo_0.jsonl").write_text(json.dumps({"demo": "demo_0", "frame": 0, "task_instruction": "x",
                                                  "language": {"next": "y"}}) + "\n")
    with pytest.raises(ValueError, match=r"demo_0.jsonl row 0: row has no language.textual_memory or "
                                         r"language.visual_memory"):
        build_split(tmp_path, heldout_per_task=1)
    (bad / "demo_0.jsonl").write_text(json.dumps({"demo": "demo_0", "frame": 1, "task_instruction": "x",
                                                  "language": {"textual_memory": "y"}}) + "\n")
    with pytest.raises(ValueError, match="misaligned annotation row"):
        build_split(tmp_path, heldout_per_task=1)


# --- the frames ----------------------------------------------------------------------------------------------


def test_frames_are_both_cameras_rotated_180_degrees_with_ee_and_gripper_state(roots, data):
    import h5py

    src = data.heldout
    for i in (0, len(src) // 2, len(src) - 1):
        ref, frame = src.refs[i], src[i]
        with h5py.File(roots[1] / ref.suite / f"{ref.task}_demo.hdf5", "r") as f:
            obs = f[f"data/{ref.demo}/obs"]
            for key, cam in (("image", "agentview_rgb"), ("wrist_image", "eye_in_hand_rgb")):
                np.testing.assert_array_equal(frame[key], np.rot90(obs[cam][ref.frame], 2))
                assert frame[key].shape == (SIZE, SIZE, 3) and frame[key].dtype == np.uint8
            state = np.concatenate([obs["ee_states"][ref.frame], obs["gripper_states"][ref.frame]])
        np.testing.assert_array_equal(frame["state"], state.astype(np.float32))
        assert frame["state"].shape == (8,) and frame["state"].dtype == np.float32
        assert frame["memory"] == frame["textual_memory"] == frame["visual_memory"] == ref.target
        assert frame["language_instruction"] == ref.instruction == ref.task.lower().replace("_", " ")
        assert (frame["demo"], frame["frame"], frame["init_index"]) == (ref.demo, ref.frame, int(ref.demo[5:]))


def test_text_passes_read_the_annotations_only_and_a_missing_hdf5_file_is_named(roots, data):
    class _NoFiles(LiberoHdf5):
        def observation(self, ref):
            raise AssertionError("an HDF5 frame was read")

    src = OxygenLiberoSource(data.split.train, _NoFiles(roots[1]))
    assert [t["memory"] for t in frame_texts(src, ("memory",))] == [r.target for r in data.split.train]
    with pytest.raises(FileNotFoundError, match=r"_demo\.hdf5: missing LIBERO demonstration file"):
        open_oxygen_libero(roots[0], roots[1] / "elsewhere")


# --- the samplers --------------------------------------------------------------------------------------------


def test_balanced_sampler_draws_tasks_then_targets_uniformly_and_is_a_function_of_seed_and_step(data):
    refs = data.split.train
    a, b = BalancedSampler(refs, 7), BalancedSampler(refs, 7)
    late = a.batch(40, 2)  # drawn first: a step is replayed from the start of the stream (resume)
    assert [b.batch(s, 2).tolist() for s in range(41)][-1] == late.tolist()
    assert b.batch(3, 2).tolist() != BalancedSampler(refs, 8).batch(3, 2).tolist()
    draws = [refs[i] for i in BalancedSampler(refs, 0).draws(6000)]
    tasks = collections.Counter(r.task for r in draws)
    frames_per_task = collections.Counter(r.task for r in refs)
    assert len(set(frames_per_task.values())) == 3  # unequal sizes, yet ...
    assert all(abs(c / 6000 - 1 / 3) < 0.03 for c in tasks.values()), tasks  # ... each task a third
    for task in tasks:
        targets = collections.Counter(r.target for r in draws if r.task == task)
        share = 1 / len(targets)
        assert all(abs(c / tasks[task] - share) < 0.05 for c in targets.values()), (task, targets)


def test_train_batches_are_the_sources_balanced_draws(data):
    batches = StepBatches(data.train, task=None, model_config=None, batch_size=2, seed=7)
    sampler = BalancedSampler(data.split.train, 7)
    assert [batches.indices(s).tolist() for s in (0, 5, 1)] == [sampler.batch(s, 2).tolist() for s in (0, 5, 1)]


def test_eval_frames_take_one_frame_per_distinct_target_then_fill_to_per_task(data):
    held = data.split.heldout
    for per_task in (1, 2, 10, 40):
        picks = select_eval_frames(held, per_task=per_task, seed=7)
        assert picks == select_eval_frames(held, per_task=per_task, seed=7)
        assert len(set(picks)) == len(picks)
        for _, task, _, _ in TASKS:
            mine = [i for i in picks if held[i].task == task]
            frames = [r for r in held if r.task == task]
            targets = {r.target for r in frames}
            assert len(mine) == min(per_task, len(frames))
            chosen = [held[i].target for i in mine]
            if per_task <= len(targets):
                assert len(set(chosen)) == per_task  # distinct targets, not frequent ones
            else:
                assert set(chosen) == targets
    assert data.eval_indices == select_eval_frames(held, per_task=10, seed=7)
    assert [r for r in data.eval.refs] == [held[i] for i in data.eval_indices]
    assert select_eval_frames(held, per_task=2, seed=7) != select_eval_frames(held, per_task=2, seed=1)


# --- the metric ----------------------------------------------------------------------------------------------


def test_normalize_lowercases_collapses_whitespace_and_drops_final_periods():
    assert normalize("  The Black bowl\n is\ton  the plate.  ") == "the black bowl is on the plate"
    assert normalize("Done..") == "done" and normalize("done . ") == "done "  # their rstrip('.'), verbatim
    assert normalize("No relevant task progress is visible yet.") == normalize("no relevant task progress is visible yet")
    assert exact_match("The stove is on.", "the stove  is on") and not exact_match("The stove is off.", "The stove is on.")
    assert word_f1("a b c", "a b d") == pytest.approx(2 / 3) and word_f1("a a", "a") == pytest.approx(2 / 3)
    assert word_f1("", "") == 1.0 and word_f1("x", "") == 0.0 and word_f1("x y", "z") == 0.0
    m = oxygen_metrics(["The stove is on.", "the plate"], ["the stove is on", "The bowl is on the plate."])
    assert m["n"] == 2 and m["normalized_exact"] == 0.5
    assert m["word_f1"] == pytest.approx((1.0 + 2 * (2 / 2) * (2 / 6) / (1 + 2 / 6)) / 2)


def test_split_command_writes_the_split_and_the_evaluation_frames(roots, data, tmp_path, capsys):
    from training.data.oxygen_libero.__main__ import main

    assert main([str(roots[0]), "--out", str(tmp_path / "split.json")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["validation_samples"] == len(data.split.heldout) and printed["evaluation_samples"] == len(data.eval)
    written = json.loads((tmp_path / "split.json").read_text())
    assert [(r["demo"], r["frame"]) for r in written["evaluation"]] == [(r.demo, r.frame) for r in data.eval.refs]
    assert main([str(tmp_path / "nothing")]) == 2
    assert "no such annotations directory" in capsys.readouterr().err


def test_training_command_reads_annotations_with_libero_hdf5_and_names_a_missing_file(roots, tmp_path, capsys):
    from training.memory.__main__ import main

    argv = ["--data", str(roots[0]), "--libero-hdf5", str(tmp_path / "no_hdf5"), "--out", str(tmp_path / "o"),
            "--mode", "base", "--preset", "tiny", "--label-key", "memory"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "_demo.hdf5: missing LIBERO demonstration file" in err, err
