"""What a new user of `python -m training.memory` meets first, host-side only (no model, no compile): `--help`
shows every default, a wrong `--data` is refused in one line that says what was found, what is expected and
"did you mean …", and a refused run leaves nothing behind; the progress bar names what it trains."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from training.data.folders import check_data_folder, refuse_lerobot_flags_with_libero_hdf5
from training.memory.__main__ import _parser, main
from training.memory.config import TrainConfig
from training.memory.export_demo import main as export_main
from training.memory.loop import progress_label
from training.memory.run_folder import RunFolder


def _option_help(text: str, option: str) -> str:
    """The help of one option in `--help`'s text, whitespace collapsed (argparse wraps lines anywhere)."""
    blocks = re.split(r"\n(?=  -)", text)  # each option's block starts on a line indented by two spaces
    block = next(b for b in blocks if re.match(rf"\s*{re.escape(option)}[ ,\n]", b))
    return re.sub(r"\s+", " ", block)


def test_training_memory_help_shows_every_default_once():
    text = _parser().format_help()
    d = TrainConfig()
    for option, value in (("--steps", d.steps), ("--batch-size", d.batch_size), ("--rank", d.rank),
                          ("--warmup", d.warmup_steps), ("--weight-decay", d.weight_decay),
                          ("--clip-norm", d.clip_norm), ("--train-split", "train"), ("--eval-split", "heldout")):
        assert f"(default: {value})" in _option_help(text, option), option
    assert "(default: None)" not in text and "(default: [])" not in text
    assert _option_help(text, "--alpha").count("default") == 1  # its own words, not a second "(default: None)"


def test_export_demo_help_shows_its_defaults(capsys):
    with pytest.raises(SystemExit):
        export_main(["--help"])
    text = capsys.readouterr().out
    assert "(default: heldout)" in _option_help(text, "--split") and "(default: 8)" in _option_help(text, "--frames")


def test_the_progress_label_names_the_field_and_mode_without_a_colon():
    assert progress_label(TrainConfig()) == "memory adapter"
    assert progress_label(TrainConfig(mode="base", prompt="Scene: ", label_key="scene")) == "scene base"


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")


def test_a_lerobot_parent_folder_is_refused_naming_meta_info_and_the_dataset_below(tmp_path, capsys):
    root = tmp_path / "lerobot_download"
    _touch(root / "dataset" / "meta" / "info.json")
    _touch(root / "README.md")
    base = tmp_path / "base"
    base.mkdir()
    out = tmp_path / "runs" / "new" / "run"
    rc = main(["--data", str(root), "--out", str(out), "--base", str(base), "--heldout-episodes", "1", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "--heldout-episodes is for LeRobot datasets (meta/info.json)" in err and "README.md, dataset/" in err
    assert err.endswith(f"did you mean {root / 'dataset'}?")
    assert not (tmp_path / "runs").exists()  # nothing written on refusal, not even --out's parents


def test_data_folder_refusals_say_what_was_found_and_what_is_expected(tmp_path):
    tfds = tmp_path / "data_dir" / "synthetic_memory" / "1.0.0"
    for name in ("dataset_info.json", "features.json"):
        _touch(tfds / name)
    assert check_data_folder(tfds) == "tfds"
    for given in (tmp_path / "data_dir", tmp_path / "data_dir" / "synthetic_memory"):
        with pytest.raises(FileNotFoundError, match=rf"expected a LeRobot dataset \(meta/info.json\) or a tfds .*"
                                                    rf"did you mean {re.escape(str(tfds))}\?$"):
            check_data_folder(given)
    with pytest.raises(FileNotFoundError, match="--key-map, --empty-label are for LeRobot datasets .* holds a tfds"):
        check_data_folder(tfds, lerobot_flags=["--key-map", "--empty-label"])
    run = tmp_path / "libero_run"
    _touch(run / "index.jsonl")
    (run / "shards").mkdir()
    with pytest.raises(FileNotFoundError, match="training.data.libero .* --export-tfds"):
        check_data_folder(run)
    with pytest.raises(FileNotFoundError, match="holds nothing \\(no such directory\\)"):
        check_data_folder(tmp_path / "absent")


def test_lerobot_flags_on_other_data_name_what_it_holds_and_are_never_ignored(tmp_path):
    run = tmp_path / "libero_run"
    _touch(run / "index.jsonl")
    (run / "shards").mkdir()
    with pytest.raises(FileNotFoundError, match=r"--heldout-episodes is for LeRobot .* holds index.jsonl, shards/$"):
        check_data_folder(run, lerobot_flags=["--heldout-episodes"])
    hdf5 = SimpleNamespace(libero_hdf5=str(tmp_path), heldout_episodes="1", empty_label=None, key_map=None)
    with pytest.raises(ValueError, match="--heldout-episodes: for LeRobot datasets, but --libero-hdf5"):
        refuse_lerobot_flags_with_libero_hdf5(hdf5)
    refuse_lerobot_flags_with_libero_hdf5(SimpleNamespace(libero_hdf5=str(tmp_path), heldout_episodes=None))


def test_a_refused_new_run_removes_the_folders_it_created_above_out(tmp_path):
    (tmp_path / "kept").mkdir()
    folder = RunFolder.open(tmp_path / "kept" / "a" / "b" / "run")
    assert folder.work.is_dir()
    folder.abandon()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())


def test_only_process_0_creates_the_run_folder_so_a_refused_run_leaves_nothing_whoever_opened_first(tmp_path):
    """Another process of the run opening first (create=False) writes nothing; process 0 still owns the folder."""
    other = RunFolder.open(tmp_path / "a" / "run", create=False)
    assert other.work == tmp_path / "a" / ".run.partial" and not other.created and not any(tmp_path.iterdir())
    first = RunFolder.open(tmp_path / "a" / "run")
    assert first.created and first.work == other.work and first.work.is_dir()
    RunFolder.open(tmp_path / "a" / "run", create=False)  # after process 0: probes, keeps nothing
    first.abandon()
    assert not any(tmp_path.iterdir())
