"""Training never saves garbage: damaged checkpoints are detected and skipped, a diverged run stops without
writing weights, and bad input (an unwritable --out, a batch larger than the split, a --suffix-len too short
for the held-out split, a resume with other flags) is refused in one line before anything is trained.

One tiny adapter run (checkpoints at steps 2 and 4 of 6) is made once; every test works on a copy, and every
run of it uses the same `TrainConfig`, so the train step compiles once for the whole file.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import save_base

from oxygen_jax.ckpts.adapters import load_adapter
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import for_backend, init_params
from oxygen_jax.robots.tokenizer import encode_suffix_prompt, train_demo_tokenizer
from training.memory.__main__ import main
from training.memory.config import TrainConfig
from training.memory.data import StepBatches
from training.memory.model import init_state
from training.data.frames import frame_texts, open_memory_dataset, write_memory_dataset
from training.data.synthetic_memory import SyntheticMemoryConfig, synthetic_splits

STEPS, EVERY, BATCH = 6, 2, 4
# The held-out labels are longer than every training label: T must come from both splits.
HELDOUT_LABEL = "Done: red block in basket; blue block on plate; red block on plate; blue block in basket."


def _flags(data, out, base, *extra) -> list[str]:
    return ["--data", str(data), "--out", str(out), "--base", str(base), "--steps", str(STEPS), "--batch-size",
            str(BATCH), "--rank", "2", "--lr", "1e-2", "--warmup", "1", "--checkpoint-every", str(EVERY),
            "--eval-every", "0", "--devices", "1", "--no-progress", *extra]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """16 training frames (4 labels) and 4 held-out frames whose one label is longer than any training label."""
    splits = synthetic_splits(SyntheticMemoryConfig(image_size=56, num_inits=5, num_train_inits=4))
    splits["heldout"] = [{**f, "memory": HELDOUT_LABEL} for f in splits["heldout"]]
    return write_memory_dataset(tmp_path_factory.mktemp("faults_data"), splits, image_size=56, name="faults")


@pytest.fixture(scope="module")
def base(tiny_params, tmp_path_factory):
    return save_base(tmp_path_factory.mktemp("faults_base") / "base", tiny_params)


@pytest.fixture(scope="module")
def run(dataset, base, tmp_path_factory):
    """A run stopped after step 4: intact checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("faults_run") / "run"
    assert main(_flags(dataset, out, base, "--stop-at", "4")) == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4"]
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _largest_array_file(step_dir: Path) -> Path:
    return Path(max(glob.glob(str(step_dir / "state" / "**" / "d" / "*"), recursive=True), key=os.path.getsize))


def _flip_64_bytes(step_dir: Path) -> None:
    f = _largest_array_file(step_dir)
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    f.write_bytes(bytes(data))


def _truncate(step_dir: Path) -> None:
    f = _largest_array_file(step_dir)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _empty_every_file(step_dir: Path) -> None:
    for f in step_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(b"")


def _remove_state_item(step_dir: Path) -> None:
    shutil.rmtree(step_dir / "state")


def _empty_folder(step_dir: Path) -> None:
    for child in step_dir.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def _events(out: Path, name: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("python -m training.memory: error: "), err
    return err


def _resume_flags(run: Path, out: Path, *extra) -> list[str]:
    """The flags `run` was made with, pointed at `out`."""
    argv = json.loads((run / "run.json").read_text())["argv"]
    i = argv.index("--out")
    argv = argv[:i + 1] + [str(out)] + argv[i + 2:]
    if "--stop-at" in argv:
        j = argv.index("--stop-at")
        argv = argv[:j] + argv[j + 2:]
    return argv + list(extra)


def _saved_leaves(out: Path, step: int) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(out / "checkpoints", item_names=("state", "meta"))
    try:
        raw = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    finally:
        mgr.close()
    return {k: np.asarray(v) for k, v in raw.items()}


@pytest.mark.parametrize("damage", [_flip_64_bytes, _truncate, _empty_every_file, _remove_state_item, _empty_folder],
                         ids=["flipped-64-bytes", "truncated", "emptied-files", "missing-item", "emptied-folder"])
def test_a_damaged_latest_step_is_reported_in_one_line_and_the_run_resumes_from_the_intact_one(
        run, tmp_path, capsys, caplog, damage):
    out = _copy(run, tmp_path)
    damage(out / "checkpoints" / "4")
    capsys.readouterr()
    assert main(_resume_flags(run, out, "--stop-at", "4")) == 0
    captured = capsys.readouterr()
    rejected = _events(out, "checkpoint_rejected")
    assert [e["step"] for e in rejected] == [4], rejected
    assert len([ln for ln in captured.out.splitlines() if "checkpoint_rejected" in ln]) == 1
    assert "Traceback" not in captured.err, captured.err[-2000:]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]  # orbax's own complaints
    assert _events(out, "resumed")[-1]["step"] == 2
    assert (out / "checkpoints.rejected" / "4").is_dir()  # kept for inspection, out of the resumed run's way
    # steps 3 and 4 recomputed from the intact step 2 are bit for bit the lost step 4
    again, original = _saved_leaves(out, 4), _saved_leaves(run, 4)
    assert again.keys() == original.keys() and all(np.array_equal(again[k], original[k]) for k in again)


def test_with_no_intact_step_the_resume_stops_in_one_line_naming_every_step(run, tmp_path, capsys):
    out = _copy(run, tmp_path)
    _flip_64_bytes(out / "checkpoints" / "4")
    _truncate(out / "checkpoints" / "2")
    capsys.readouterr()
    assert main(_resume_flags(run, out)) == 2
    err = _one_line_error(capsys)
    assert "no intact training checkpoint" in err and "step 4: " in err and "step 2: " in err
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4"]  # nothing moved or deleted: the user decides
    assert not (out / "adapter").exists()


def test_a_nan_step_stops_the_run_naming_it_with_no_adapter_and_no_later_checkpoint(run, tmp_path, capsys,
                                                                                   monkeypatch):
    out = _copy(run, tmp_path)
    real = StepBatches.__call__

    def poisoned(self, step):  # the batch of step 5 (index 4) has NaN pixels: the loss becomes NaN there
        batch = real(self, step)
        if step == 4:
            images = np.full_like(batch.observation.images, np.nan)
            batch = dataclasses.replace(batch, observation=dataclasses.replace(batch.observation, images=images))
        return batch

    monkeypatch.setattr(StepBatches, "__call__", poisoned)
    capsys.readouterr()
    code = main(_resume_flags(run, out))
    err = _one_line_error(capsys)
    assert code == 1 and "step 5: the loss is nan" in err, err
    assert not (out / "adapter").exists()
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4"]  # no checkpoint of step 5 or 6


def test_saving_a_non_finite_state_is_refused_and_writes_nothing(run, tiny_params, tmp_path):
    from training.memory.checkpoints import StateCheckpoints  # new with verified checkpoints

    config = TrainConfig.from_json(json.loads((run / "run.json").read_text())["config"])
    state = init_state(config, for_backend(tiny_params), config.optimizer())
    state = dataclasses.replace(state, trainable=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan),
                                                               state.trainable))
    ckpt = StateCheckpoints(tmp_path / "ckpt")
    try:
        with pytest.raises(ValueError, match="refusing to save the training state of step 0: .*trainable.* is not finite"):
            ckpt.save(state, {})
        assert ckpt.latest_step() is None and not any((tmp_path / "ckpt").iterdir())
    finally:
        ckpt.close()


@pytest.mark.parametrize("flag, value, named", [
    ("--rank", "3", "rank: 2 in the checkpoint, 3 now"),
    ("--batch-size", "8", "batch_size: 4 in the checkpoint, 8 now"),
    ("--targets", "q,kv", "targets:"),
    ("--prompt-len", "40", "another prompt_len (48 in the checkpoint, 40 now)"),
])
def test_resuming_with_other_flags_names_the_differing_fields_in_one_line(run, tmp_path, capsys, flag, value, named):
    out = _copy(run, tmp_path)
    argv = _resume_flags(run, out) + [flag, value]  # argparse: the last occurrence wins
    before = {f: (out / f).read_bytes() for f in ("run.json", "tokenizer.model")}
    capsys.readouterr()
    assert main(argv) == 2
    err = _one_line_error(capsys)
    assert named in err and "checkpoint at step 4" in err and len(err) < 600, err
    assert {f: (out / f).read_bytes() for f in before} == before  # the refused run left the run's record alone


def test_resuming_on_another_base_is_refused_in_one_line(run, tmp_path, capsys):
    out = _copy(run, tmp_path)
    other = save_base(tmp_path / "other_base", init_params(model_config("tiny"), 1))
    argv = _resume_flags(run, out)
    argv[argv.index("--base") + 1] = str(other)
    capsys.readouterr()
    assert main(argv) == 2
    assert "another base_digest" in _one_line_error(capsys)


def _root_can_write_read_only_dirs(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    probe.chmod(0o500)
    try:
        (probe / "x").write_bytes(b"")
        return True
    except OSError:
        return False
    finally:
        probe.chmod(0o700)


@pytest.mark.parametrize("where", ["under-a-file", "read-only-dir"])
def test_an_unwritable_out_is_refused_in_one_line_before_anything_loads(tmp_path, capsys, where):
    if where == "under-a-file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "out"
    else:
        if _root_can_write_read_only_dirs(tmp_path):
            pytest.skip("running as a user whom chmod does not stop (root): a read-only folder is writable")
        out = tmp_path / "ro" / "out"
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o500)
    # --data does not exist: the refusal must come from --out, before anything is opened
    assert main(["--data", str(tmp_path / "no_data"), "--out", str(out), "--mode", "base", "--preset", "tiny"]) == 2
    err = _one_line_error(capsys)
    assert f"--out {out}" in err and "cannot create or write" in err


def test_a_batch_larger_than_the_training_split_is_refused_in_one_line(dataset, base, tmp_path, capsys):
    assert main(_flags(dataset, tmp_path / "out", base) + ["--batch-size", "64"]) == 2
    err = _one_line_error(capsys)
    assert "--batch-size 64 is larger than the 16 frames of split 'train'" in err


def test_a_suffix_len_too_short_for_the_heldout_split_is_refused_in_one_line(dataset, base, tmp_path, capsys):
    train_need = _suffix_need(dataset, "train")
    assert main(_flags(dataset, tmp_path / "out", base, "--suffix-len", str(train_need))) == 2
    err = _one_line_error(capsys)
    assert f"--suffix-len {train_need} is too short: split 'heldout' needs" in err


def test_the_default_suffix_len_holds_every_split_so_the_final_evaluation_runs(dataset, run, base, tiny_params, tmp_path):
    """T read from both splits (the held-out labels are longer), then the run finishes: evaluation on the held-out
    split, a finite adapter saved and loadable."""
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["suffix_len"] == _suffix_need(dataset, "heldout") > _suffix_need(dataset, "train")
    out = _copy(run, tmp_path)
    assert main(_resume_flags(run, out)) == 0
    assert [e["step"] for e in _events(out, "eval")] == [STEPS]
    adapter, _ = load_adapter(out / "adapter", tiny_params.config, base=base)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(adapter))


def _suffix_need(dataset, split: str) -> int:
    """Prompt + longest label + EOS of `split` with the built-in demo tokenizer (what the runs above use)."""
    tok = train_demo_tokenizer()
    labels = {f["memory"] for f in frame_texts(open_memory_dataset(dataset, split), ("memory",))}
    return len(encode_suffix_prompt(tok, "Memory: ")) + max(len(tok.encode(x)) for x in labels) + 1


def _damaged_after(monkeypatch, reads: int) -> None:
    """Training frames read after the first `reads` cannot be read (a damaged file found during training)."""
    from training.data.frames import MemoryFrameSource

    real, count = MemoryFrameSource.__getitem__, [0]

    def damaged(self, i):
        if self.split == "train":
            count[0] += 1
            if count[0] > reads:
                raise ValueError(f"{self.path}: frame {i}: image bytes damaged")
        return real(self, i)

    monkeypatch.setattr(MemoryFrameSource, "__getitem__", damaged)


def test_a_data_error_found_during_a_new_run_is_one_line_and_out_holds_nothing(dataset, base, tmp_path, capsys,
                                                                              monkeypatch):
    out = tmp_path / "new"
    _damaged_after(monkeypatch, 2 * BATCH)  # step 3 fails, after the checkpoint of step 2 was written
    capsys.readouterr()
    assert main(_flags(dataset, out, base)) == 2
    err = _one_line_error(capsys)
    assert "split 'train' frame" in err and "image bytes damaged" in err, err
    assert not out.exists() and not list(tmp_path.glob(".new*"))  # the step-2 checkpoint went with the hidden folder


def test_a_data_error_during_a_resumed_run_takes_back_what_the_run_added(run, tmp_path, capsys, monkeypatch):
    out = _copy(run, tmp_path)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _damaged_after(monkeypatch, 0)
    capsys.readouterr()
    assert main(_resume_flags(run, out)) == 2
    assert "image bytes damaged" in _one_line_error(capsys)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_refused_resume_puts_back_the_step_it_moved_aside(run, tmp_path, capsys, monkeypatch):
    out = _copy(run, tmp_path)
    _flip_64_bytes(out / "checkpoints" / "4")  # moved to checkpoints.rejected/ by the resume, which continues at 2
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _damaged_after(monkeypatch, 0)
    capsys.readouterr()
    assert main(_resume_flags(run, out)) == 2
    assert "image bytes damaged" in capsys.readouterr().err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not (out / "checkpoints.rejected").exists()
