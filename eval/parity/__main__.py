"""`python -m eval.parity`: numerical parity on a reference fixture, or a parameter-manifest check.

    python -m eval.parity FIXTURE_DIR           # restore the fixture's checkpoints, compare everything
    python -m eval.parity --manifest FILE       # parameter manifest vs the full-size pi05 tree

The fixture's kind picks the comparison: a Hugging Face Qwen3 / Qwen3-VL checkpoint directory
(config.json + safetensors, `eval.parity.hf.is_hf_fixture`) runs `eval.parity.hf`; an openpi π0.5
fixture (`params/` or `train_checkpoint/<step>/params/`) runs `eval.parity.openpi`, in both checkpoint
layouts; the real-time chunking reference (`rtc_reference`: meta.json + reference.npz,
`eval.parity.rtc.is_rtc_fixture`) runs `eval.parity.rtc`.
A released-layout Xiaomi-Robotics-0 directory (config.json model_type 'mibot' + reference.npz,
`eval.parity.xr0.is_xr0_fixture`) runs `eval.parity.xr0`. A Qwen3.5 directory (config.json model_type
'qwen3_5', `eval.parity.qwen35.is_qwen35_fixture`) runs `eval.parity.qwen35`.
A StarVLA QwenPI_v3 / QwenGR00T checkpoint (config.yaml + StarVLA's state_dict names + reference.npz,
`eval.parity.starvla.is_starvla_fixture`) runs `eval.parity.starvla`. A LeRobot dataset fixture (dataset/ +
reference.npz, `eval.parity.lerobot.is_lerobot_fixture`) runs `eval.parity.lerobot`; a LeRobot π0.5 / π0 checkpoint
(pretrained_model/ + reference.npz, `eval.parity.lerobot_policy.is_lerobot_policy_fixture`) runs
`eval.parity.lerobot_policy`. An openpi π0-FAST fixture (an openpi checkpoint with `fast_tokenizer/` and
reference.npz, `eval.parity.openpi_fast.is_fast_fixture`) runs `eval.parity.openpi_fast`. Exit status 1 on any FAIL.

    python -m eval.parity FIXTURE_DIR --quantized QDIR   # int8 / fp8 weights quantized from the fixture's checkpoint

`--quantized` (openpi and LeRobot π0.5 / π0 fixtures: the checkpoints `python -m oxygen_jax.quantize` reads) runs
`eval.parity.quantized`: QDIR's actions and teacher-forced text against the native reference, within the
documented quantization bounds instead of float32 tolerances; a QDIR quantized from another checkpoint is refused
in one line (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.parity import hf, openpi, openpi_fast, quantized, qwen35, rtc
from eval.parity import lerobot as lerobot_parity
from eval.parity import lerobot_policy
from eval.parity import xr0 as xr0_parity
from eval.parity import starvla as starvla_parity
from eval.parity.checks import format_table, report, summary
from oxygen_jax.ckpts.manifest import check_manifest
from oxygen_jax.cli import add_quant_matmul_flag


def _manifest(path: Path) -> bool:
    result = check_manifest(path)
    print(result.summary())
    return result.ok and result.matches_preset


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m eval.parity",
        description="Compare oxygen_jax with openpi/OxyGen reference outputs, or check a parameter manifest.",
    )
    ap.add_argument("fixture", nargs="?", type=Path,
                    help="fixture directory: openpi (params/, train_checkpoint/, reference.npz) or Hugging Face "
                         "(config.json, safetensors, reference.npz)")
    ap.add_argument("--manifest", type=Path, help="parameter manifest JSON to check against the full-size pi05 tree")
    ap.add_argument("--quantized", type=Path, metavar="QDIR",
                    help="int8 / fp8 weights python -m oxygen_jax.quantize made from the fixture's checkpoint (openpi or "
                         "LeRobot π0.5 / π0): its actions and text against the reference, within the quantization bounds")
    add_quant_matmul_flag(ap)
    args = ap.parse_args(argv)
    if (args.fixture is None) == (args.manifest is None):
        ap.error("give exactly one of FIXTURE_DIR or --manifest FILE")
    if args.manifest is not None:
        if not args.manifest.is_file():
            ap.error(f"manifest not found: {args.manifest}")
        return 0 if _manifest(args.manifest) else 1
    if not args.fixture.is_dir():
        ap.error(f"fixture directory not found: {args.fixture}")
    if args.quantized is not None:
        try:
            return report(quantized.run_fixture(args.fixture, args.quantized, args.quant_matmul))
        except quantized.Refused as e:
            print(f"python -m eval.parity: error: {e}", file=sys.stderr)
            return 2
    if lerobot_parity.is_lerobot_fixture(args.fixture):  # a LeRobot dataset: dataset/ + reference.npz
        return lerobot_parity.main([str(args.fixture)])
    if lerobot_policy.is_lerobot_policy_fixture(args.fixture):  # a LeRobot π0.5 / π0 checkpoint: pretrained_model/
        return lerobot_policy.main([str(args.fixture)])
    if rtc.is_rtc_fixture(args.fixture):
        return rtc.main([str(args.fixture)])
    if xr0_parity.is_xr0_fixture(args.fixture):
        return xr0_parity.main([str(args.fixture)])
    if qwen35.is_qwen35_fixture(args.fixture):  # before hf: a Qwen3.5 checkpoint has model.visual.* too
        return qwen35.main([str(args.fixture)])
    if hf.is_hf_fixture(args.fixture):
        return hf.main([str(args.fixture)])
    if starvla_parity.is_starvla_fixture(args.fixture):  # StarVLA QwenPI_v3 / QwenGR00T: config.yaml + its state_dict
        return starvla_parity.main([str(args.fixture)])
    if openpi_fast.is_fast_fixture(args.fixture):  # π0-FAST: an openpi checkpoint with fast_tokenizer/ beside it
        return report(openpi_fast.run_fixture(args.fixture))
    if not openpi.is_openpi_fixture(args.fixture):
        ap.error(f"{args.fixture}: neither an openpi fixture (params/ or train_checkpoint/<step>/params/ with "
                 "reference.npz) nor an HF Qwen3 / Qwen3-VL checkpoint (config.json with model_type 'qwen3' or "
                 "'qwen3_vl', model.safetensors, reference.npz)")
    rows = openpi.run_fixture(args.fixture)
    print(format_table(rows))
    if (args.fixture / "reference_text_oxygen.npz").is_file():
        print("\nnote: oxygen/* (OxyGen's own decode of rows with a masked camera, seeded at n_valid - 1) is not "
              "reproduced on purpose; maskaware/* is the reference for masked cameras.")
    print("\n" + summary(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
