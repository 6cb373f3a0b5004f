"""The main job's command line: labelled output on the embedded default, one-line errors for bad flags."""

from __future__ import annotations

import re

import pytest

from oxygen_jax import run


def test_main_job_explains_itself_and_labels_its_output(capsys):
    assert run.main(["--frames", "3", "--steps", "1", "--max-new-tokens", "3", "--tokens-per-frame", "2",
                     "--no-cache"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "embedded default" in lines[0] and "RANDOM weights" in lines[0]  # what the default is, first
    assert re.search(r"compiling the frame program .* \d+\.\d s", out)
    assert "legend:" in out and re.search(r"frame\s+ms\s+decoding\s+queued\s+action\[0\]", out)
    frames = [ln for ln in lines if re.match(r"\s+\d+\s+\d+\.\d+\s+\d+\s+\d+\s+\[", ln)]
    assert len(frames) == 3
    assert re.search(r"request 0 done after \d+ frames .*'Subtask: ' -> ", out)
    assert "action Hz" in out and "compile (once, before frame 0)" in out


@pytest.mark.parametrize("argv, flag", [
    (["--frames", "0"], "--frames"), (["--frames", "-3"], "--frames"), (["--slots", "0"], "--slots"),
    (["--steps", "0"], "--steps"), (["--tokens-per-frame", "x"], "--tokens-per-frame"),
    (["--tokenizer", "/nonexistent/tok.model"], "--tokenizer"), (["--ckpt", "/nonexistent/ckpt"], "--ckpt"),
    (["--preset", "huge"], "--preset"), (["--temperature", "-1"], "--temperature"),
])
def test_bad_flags_fail_in_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        run.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err


def test_a_damaged_checkpoint_directory_is_one_line(tmp_path, capsys):
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "_METADATA").write_text("not json")
    assert run.main(["--ckpt", str(tmp_path), "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ckpt" in err
