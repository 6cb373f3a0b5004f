"""`python -m training.data.oxygen_libero ANNOTATIONS [--out split.json]`: rebuild OxyGen's split from the annotation
files alone and print its manifest (with the released annotations: 1,800 training / 200 held-out
demonstrations, 5,082 held-out frames) and the number of greedy-evaluation frames; --out writes the frame
lists (suite, task, demo, frame, instruction, target; train, validation, evaluation) as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from training.data.oxygen_libero.sampling import EVAL_PER_TASK, select_eval_frames
from training.data.oxygen_libero.split import HELDOUT_PER_TASK, SEED, STRIDE, build_split


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.data.oxygen_libero", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("annotations", type=Path, help="folder holding <suite>/<task>/demo_<k>.jsonl")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--heldout-per-task", type=int, default=HELDOUT_PER_TASK)
    p.add_argument("--stride", type=int, default=STRIDE)
    p.add_argument("--eval-per-task", type=int, default=EVAL_PER_TASK)
    p.add_argument("--target", default=None, help="language field (default: textual_memory or visual_memory)")
    p.add_argument("--out", type=Path, default=None, help="write the frame lists here (JSON)")
    args = p.parse_args(argv)
    try:
        split = build_split(args.annotations, seed=args.seed, heldout_per_task=args.heldout_per_task,
                            stride=args.stride, target=args.target)
    except (FileNotFoundError, ValueError) as e:
        print(f"python -m training.data.oxygen_libero: error: {e}", file=sys.stderr)
        return 2
    picks = select_eval_frames(split.heldout, per_task=args.eval_per_task, seed=args.seed)
    manifest = {**split.manifest(), "evaluation_samples": len(picks)}
    print(json.dumps({k: v for k, v in manifest.items() if k != "validation_demos"}, indent=1))
    if args.out is not None:
        rows = lambda refs: [dataclasses.asdict(r) for r in refs]  # noqa: E731
        args.out.write_text(json.dumps({"manifest": manifest, "train": rows(split.train),
                                        "validation": rows(split.heldout),
                                        "evaluation": rows(split.heldout[i] for i in picks)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
