"""The generator's command line: `python -m training.data.libero --help` (the package docstring has the runs)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from training.data.libero import bddl_goals
from training.data.libero.config import RESET_BASE, GenConfig
from training.data.libero.export import export_tfds
from training.data.libero.generate import generate, load_suite, print_summary, summarize, task_problem, write_showcase

DEFAULT_OUT = Path("/work/data/libero_memory")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.data.libero",
        description="Generate memory-annotated LIBERO frames by placing objects (no demonstrations needed). "
        "Resumable: re-run the same command to continue. Needs the simulator venv (see the package docstring) "
        "and MUJOCO_GL=egl.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = GenConfig()
    p.add_argument("--run", default="main", help="run name: frames go to OUT/RUN/")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output root (outside the repository)")
    p.add_argument("--suite", default=d.suite, help="LIBERO suite")
    p.add_argument("--tasks", default="", help="task ids, e.g. '0,1,4-7'; default: tasks whose goals are only In/On")
    p.add_argument("--inits", default="0-49", help="stored initial-state indices")
    p.add_argument("--held-out", default="40-49", help="init indices whose frames form the held-out split")
    p.add_argument("--variants", type=int, default=d.variants, help="placements per non-empty predicate subset")
    p.add_argument("--resets", type=int, default=d.resets,
                   help=f"extra layouts per task drawn by environment resets (init index {RESET_BASE}+k, split train)")
    p.add_argument("--reset-variants", type=int, default=d.reset_variants,
                   help="placements per non-empty predicate subset of a reset layout")
    p.add_argument("--retries", type=int, default=d.retries, help="redraws of a rejected placement")
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--image-format", choices=("jpeg", "png"), default=d.image_format)
    p.add_argument("--jpeg-quality", type=int, default=d.jpeg_quality)
    p.add_argument("--presettle-steps", type=int, default=d.presettle_steps,
                   help="control steps (25 substeps) after restoring")
    p.add_argument("--settle-steps", type=int, default=d.settle_steps, help="max control steps after placing")
    p.add_argument("--clearance", type=float, default=d.clearance,
                   help="m from an object's lowest point to the surface at release")
    p.add_argument("--jitter", type=float, default=d.jitter, help="m of uniform xy jitter")
    p.add_argument("--spread", type=float, default=d.spread, help="m between objects that share a target")
    p.add_argument("--max-displacement", type=float, default=d.max_displacement,
                   help="m; reject if an unplaced object moves more")
    p.add_argument("--max-tilt", type=float, default=d.max_tilt_deg, help="degrees; reject if any object tilts more")
    p.add_argument("--shard-size", type=int, default=d.shard_size, help="frames per npz shard")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--list-tasks", action="store_true", help="print the suite's tasks and goals, then exit")
    p.add_argument("--summary-only", action="store_true", help="print the run's summary without generating")
    p.add_argument("--showcase", type=int, default=0, metavar="N",
                   help="after generating, copy N held-out frames as PNG to OUT/showcase/")
    p.add_argument("--export-tfds", type=Path, default=None, metavar="DIR",
                   help="after generating, convert the run with training.data.frames.write_memory_dataset")
    return p


def _config_from_args(args) -> GenConfig:
    parse = bddl_goals.parse_index_ranges
    return GenConfig(
        suite=args.suite, tasks=tuple(parse(args.tasks)) if args.tasks else None, inits=tuple(parse(args.inits)),
        held_out=tuple(parse(args.held_out)), variants=args.variants, resets=args.resets,
        reset_variants=args.reset_variants, retries=args.retries, image_size=args.image_size,
        image_format=args.image_format, jpeg_quality=args.jpeg_quality, presettle_steps=args.presettle_steps,
        settle_steps=args.settle_steps, min_settle_steps=min(3, args.settle_steps), clearance=args.clearance,
        jitter=args.jitter, spread=args.spread, max_displacement=args.max_displacement, max_tilt_deg=args.max_tilt,
        shard_size=args.shard_size, seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        cfg = _config_from_args(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    run_dir = args.out / args.run
    if args.list_tasks:
        suite = load_suite(cfg.suite)
        for t in range(suite.n_tasks):
            goal = bddl_goals.parse_goal(task_problem(suite, t)["goal_state"])
            usable = "movable" if all(p.is_placement for p in goal) else "articulation (skipped by default)"
            print(f"{t}: {suite.get_task(t).language!r} [{usable}] {' '.join(map(str, goal))}")
        return
    if args.summary_only:
        print_summary(summarize(run_dir))
    else:
        generate(cfg, run_dir)
    if args.showcase:
        meta = write_showcase(run_dir, args.out / "showcase", args.showcase)
        print(f"showcase: {len(meta)} held-out frames in {args.out / 'showcase'}")
    if args.export_tfds is not None:
        path = export_tfds(run_dir, args.export_tfds)
        print(f"tfds dataset: {path} (read it with training.data.frames.open_memory_dataset(path, 'train'))")


if __name__ == "__main__":
    sys.exit(main())
