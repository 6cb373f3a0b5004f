"""The main job's command line: labelled output on the embedded default, one-line errors for bad flags."""

from __future__ import annotations

import re

import pytest

from oxygen_jax import run


def test_main_job_runs_the_embedded_demo_and_checks_its_memory_answers(capsys):
    assert run.main(["--frames", "3", "--steps", "1", "--tokens-per-frame", "8", "--no-cache"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("embedded default: ") and "untrained" in out  # what the default is, first
    assert re.search(r"compiling the frame program .* \d+\.\d s", out)
    assert "legend:" in out and re.search(r"frame\s+ms\s+decoding\s+queued\s+action\[0\]", out)
    assert len([ln for ln in lines if re.match(r"\s+\d+\s+\d+\.\d+\s+\d+\s+\d+\s+\[", ln)]) == 3
    answers = re.findall(r"'Memory: ' -> '(.*)'", out)
    assert answers and all(a.startswith("Done: ") for a in answers)  # grounded text, not a run of newlines
    assert "true label: 'Done: " in out and re.search(r"matching the true label in this run: \d+/\d+", out)
    # the shipped held-out figure is labelled as stored, with its evaluation and date
    assert re.search(r"stored with the demo, not measured in this run: \d+\.\d % exact match over all \d+ held-out "
                     r"frames .*\n  from `python -m eval.memory_eval` when the demo was exported on \d{4}-\d\d-\d\d", out)
    assert "action Hz" in out and "compile (once, before frame 0)" in out


def test_random_weights_preset_runs_on_synthetic_observations(capsys):
    assert run.main(["--preset", "tiny", "--frames", "2", "--steps", "1", "--max-new-tokens", "3",
                     "--tokens-per-frame", "2", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("random weights") and re.search(r"request 0 .* done after \d+ frames", out)


@pytest.mark.parametrize("argv, flag", [
    (["--frames", "0"], "--frames"), (["--frames", "-3"], "--frames"), (["--slots", "0"], "--slots"),
    (["--steps", "0"], "--steps"), (["--tokens-per-frame", "x"], "--tokens-per-frame"),
    (["--tokenizer", "/nonexistent/tok.model"], "--tokenizer"), (["--ckpt", "/nonexistent/ckpt"], "--ckpt"),
    (["--preset", "huge"], "--preset"), (["--temperature", "-1"], "--temperature"),
    (["--demo", "/nonexistent/demo"], "--demo"), (["--preset", "tiny", "--ckpt", "."], "--ckpt"),
    (["--tokenizer", __file__], "--tokenizer"),
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
