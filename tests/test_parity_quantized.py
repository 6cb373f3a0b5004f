"""`eval.parity FIXTURE --quantized QDIR`: quantized weights against the native reference, within the bounds."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from eval.parity import __main__ as parity_cli
from eval.parity import quantized
from eval.parity.lerobot_policy import vision_heads_of
from helpers import fixture
from oxygen_jax.ckpts.own import save_params
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import init_params
from oxygen_jax.quantize import main as quantize_main


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """openpi's π0.5 quantized to int8 from its released layout; LeRobot's π0 to fp8 (other widths, a state)."""
    root = tmp_path_factory.mktemp("pq")
    pi05, pi0 = fixture("openpi_tiny_pi05"), fixture("lerobot_tiny_pi0")
    assert quantize_main(["--ckpt", str(pi05 / "params"), "--out", str(root / "pi05_int8"), "--weights", "int8"]) == 0
    assert quantize_main(["--ckpt", str(pi0), "--out", str(root / "pi0_fp8"), "--weights", "fp8",
                          "--vision-heads", str(vision_heads_of(pi0))]) == 0
    return root, pi05, pi0


def test_int8_pi05_actions_and_teacher_forced_text_stay_within_the_bounds_of_openpis_reference(made, capsys):
    root, pi05, _ = made
    assert parity_cli.main([str(pi05), "--quantized", str(root / "pi05_int8")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")][1:]  # after the header
    names = " ".join(rows)
    for key in ("actions/num_steps_10", "maskaware/tokens (teacher-forced)", "oxygen_allcams/tokens (teacher-forced)",
                "oxygen_actions/num_steps_10 (causal prompt)"):
        assert key in names, key
    assert all("PASS" in r for r in rows[1:]) and "checks passed" in out
    assert all("int8 of released, " in r and " products |" in r for r in rows[1:])  # the products `run` would use


def test_fp8_lerobot_pi0_actions_with_its_state_stay_within_the_fp8_bounds(made):
    root, _, pi0 = made
    rows = quantized.run_fixture(pi0, root / "pi0_fp8", "weight_only")
    assert [r.quantity.split(" (")[0] for r in rows] == [f"sample/actions_num_steps_{n}" for n in (1, 3, 10)]
    assert all(r.ok for r in rows) and all(0 < r.max_abs < np.inf for r in rows)
    assert all(r.layout == "fp8 of LeRobot policy, weight-only products" for r in rows)
    assert all(r.tol == "RMS-relative max <= 0.75, mean <= 0.1" for r in rows)


def test_a_quantized_checkpoint_of_another_source_is_refused_in_one_line(made, tmp_path, capsys):
    root, pi05, pi0 = made
    other = save_params(tmp_path / "float", init_params(model_config("tiny"), 0))
    assert quantize_main(["--ckpt", str(other), "--out", str(tmp_path / "other_int8"), "--weights", "int8"]) == 0
    capsys.readouterr()
    cases = {  # QDIR -> what the refusal names
        tmp_path / "other_int8": "not from a checkpoint of",
        root / "pi0_fp8": "not from a checkpoint of",  # another fixture's quantization
        other: "holds no quantized weights",
        tmp_path / "absent": "no such directory",
    }
    damaged = shutil.copytree(root / "pi05_int8", tmp_path / "damaged")
    biggest = max((damaged / "quantized" / "ocdbt.process_0" / "d").iterdir(), key=lambda f: f.stat().st_size)
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2] ^= 1
    biggest.write_bytes(bytes(raw))
    cases[damaged] = "the checkpoint is damaged"  # its source is right; its bytes are not
    for qdir, says in cases.items():
        assert parity_cli.main([str(pi05), "--quantized", str(qdir)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and says in err and err.startswith("python -m eval.parity: error:"), err
    assert parity_cli.main([str(pi05), "--quantized", str(root / "pi05_int8"), "--quant-matmul", "fp8"]) == 2
    assert "needs fp8 weights and this model's are int8" in capsys.readouterr().err
    kind = fixture("qwen3_tiny")  # a kind quantize does not read
    assert parity_cli.main([str(kind), "--quantized", str(root / "pi05_int8")]) == 2
    assert "takes an openpi π0.5 / π0 fixture or a LeRobot" in capsys.readouterr().err


def test_outputs_beyond_the_bounds_fail():
    judge = quantized.Bounds(quantized.BOUNDS["int8"], "int8 of x")
    ref = np.linspace(-1, 1, 200).reshape(2, 10, 10)
    rms = np.sqrt(np.mean(ref ** 2))
    judge.actions("close", ref + 0.2 * rms * (np.arange(200).reshape(ref.shape) % 2 == 0) * 0.1, ref)
    judge.actions("one outlier", ref + np.where(np.arange(200).reshape(ref.shape) == 7, 0.3 * rms, 0.0), ref)
    judge.actions("drifted", ref + 0.05 * rms, ref)  # max 0.05 but mean 0.05 > 0.03
    judge.actions("shape", ref[:1], ref)
    tokens = np.arange(16).reshape(2, 8)
    judge.tokens("tokens 3/4", np.where(np.arange(16).reshape(2, 8) % 4 == 0, -1, tokens), tokens)
    judge.tokens("tokens 11/16", np.where(np.arange(16).reshape(2, 8) < 5, -1, tokens), tokens)
    assert [r.ok for r in judge.chk.rows] == [True, False, False, False, True, False]
