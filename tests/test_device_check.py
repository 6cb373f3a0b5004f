"""eval/device_check.sh, the GPU check, runs every step end to end (`--smoke`: CPU, tiny preset, tiny sizes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

STEPS = ("weights", "settings", "decode", "serve", "adapter", "train")
RUNS = ("settings", "serve", "adapter", "train")  # the steps with a results folder (decode is in the settings run)


def test_device_check_smoke_runs_every_step_and_writes_the_summary(tmp_path):
    out = tmp_path / "check"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "eval" / "device_check.sh"), "--smoke", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    for step in STEPS:
        assert re.search(rf"^\| {step} \| [^|]+ \| 0 \| (\d+|–) \|$", summary, re.M), (step, summary)
    for step in RUNS:
        assert (out / step / "summary.json").is_file(), step
    for section in ("## settings", "## decode step", "## serving", "## adapter overhead", "## memory-adapter training step"):
        assert section in summary  # the key ratios were read from each step's JSON


def test_device_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    if subprocess.run(["sh", "-c", "nvidia-smi -L 2>/dev/null | grep -q ^GPU"]).returncode == 0:
        pytest.skip("a GPU machine: the check would measure, not decline")
    proc = subprocess.run(["bash", str(REPO / "eval" / "device_check.sh"), "--out", str(tmp_path / "x")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.count("\n") == 1 and "no GPU" in proc.stdout
    assert not (tmp_path / "x").exists()
