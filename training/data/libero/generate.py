"""Planning and running a generation: which frames each task and layout gets (`layout_inits`), making
every pending one (`generate`, resumable), and reading a run back (`summarize`, `write_showcase`).

Needs the simulator venv (`training.data.libero`'s docstring) for everything but the summary and showcase.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import time
from pathlib import Path

from oxygen_jax.robots.libero import CAMERAS
from training.data.libero import bddl_goals
from training.data.libero.config import RESET_BASE, GenConfig, frame_key, frame_rng
from training.data.libero.scene import TaskScene, make_frame
from training.data.libero.shards import ShardWriter, append_jsonl, iter_frames, read_jsonl


# ----------------------------------------------------------------------------- planning


def load_suite(name: str):
    """The LIBERO benchmark suite `name` (e.g. "libero_10"); exits naming the suites when it is unknown."""
    from libero.libero import benchmark

    suites = benchmark.get_benchmark_dict()
    if name not in suites:
        raise SystemExit(f"unknown LIBERO suite {name!r}; choose from {sorted(suites)}")
    return suites[name]()


def task_problem(suite, task_id: int) -> dict:
    """The task's parsed BDDL problem (goal, objects, fixtures), without building the simulator."""
    from libero.libero import get_libero_path
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    if not 0 <= task_id < suite.n_tasks:
        raise SystemExit(f"task {task_id} is not in the suite (it has tasks 0-{suite.n_tasks - 1})")
    task = suite.get_task(task_id)
    return robosuite_parse_problem(os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file))


def _planned_placeable(problem: dict) -> tuple[bddl_goals.Predicate, ...]:
    """Goal In/On predicates whose subject is a BDDL object (LIBERO objects have free joints; checked later)."""
    objects = [o for instances in problem["objects"].values() for o in instances]
    return bddl_goals.placement_predicates(bddl_goals.parse_goal(problem["goal_state"]), objects)


def _default_tasks(suite) -> list[int]:
    """Tasks whose goal has only In/On predicates (articulation goals need joint edits, not placements)."""
    goals = {t: bddl_goals.parse_goal(task_problem(suite, t)["goal_state"]) for t in range(suite.n_tasks)}
    return [t for t, goal in goals.items() if all(p.is_placement for p in goal)]


def _plan(cfg: GenConfig, k: int, init: int = 0) -> list[tuple[tuple[int, ...], int]]:
    """(subset, variant) pairs of one layout: the empty subset once, the others cfg.variants times
    (cfg.reset_variants for reset layouts, init >= RESET_BASE)."""
    n = cfg.reset_variants if init >= RESET_BASE else cfg.variants
    return [(s, v) for s in bddl_goals.goal_subsets(k) for v in range(n if s else 1)]


def layout_inits(cfg: GenConfig) -> list[int]:
    """Every layout's init index: the stored ones, then RESET_BASE + k for k < cfg.resets."""
    return [*cfg.inits, *range(RESET_BASE, RESET_BASE + cfg.resets)]


# ----------------------------------------------------------------------------- the run


def _check_run_config(run_dir: Path, cfg: GenConfig) -> None:
    path = run_dir / "config.json"
    key = cfg.physics_key()
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in key.items() if old.get(k) != v}
        if diff:
            raise SystemExit(
                f"{run_dir} was made with other settings {diff} (old, new); use a new --run name or the old settings"
            )
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(key, indent=1) + "\n")


def generate(cfg: GenConfig, run_dir: Path) -> None:
    """Make every pending frame of the run (resuming), then write summary.json and print the summary."""
    from tqdm import tqdm

    _check_run_config(run_dir, cfg)
    done = {r["key"] for r in read_jsonl(run_dir / "index.jsonl") if (run_dir / "shards" / r["shard"]).exists()}
    attempts = collections.Counter(r["key"] for r in read_jsonl(run_dir / "rejected.jsonl"))

    def pending(key: str, subset: tuple[int, ...]) -> bool:
        return key not in done and attempts[key] <= (cfg.retries if subset else 0)

    suite = load_suite(cfg.suite)
    tasks = list(cfg.tasks) if cfg.tasks is not None else _default_tasks(suite)
    n_inits = len(suite.get_task_init_states(tasks[0])) if tasks else 0
    if any(i >= n_inits for i in cfg.inits):
        raise SystemExit(f"--inits goes up to {max(cfg.inits)} but the suite stores {n_inits} initial states per task")
    work = {}  # task -> (placeable, {init: [(subset, variant), ...]})
    for task_id in tasks:
        placeable = _planned_placeable(task_problem(suite, task_id))
        todo = {i: [(s, v) for s, v in _plan(cfg, len(placeable), i) if pending(frame_key(task_id, i, s, v), s)]
                for i in layout_inits(cfg)}
        work[task_id] = placeable, {i: items for i, items in todo.items() if items}
    total = sum(len(items) for _, todo in work.values() for items in todo.values())
    print(f"tasks {tasks}; {len(cfg.inits)} stored inits, {len(cfg.held_out)} of them held out, {cfg.resets} reset "
          f"layouts per task; "
          f"{len(done)} frames already written, {total} to make", flush=True)
    held_out = set(cfg.held_out)
    writer = ShardWriter(run_dir, cfg)
    bar = tqdm(total=total, unit="frame", dynamic_ncols=True, mininterval=10.0)
    counts = collections.Counter()
    try:
        for task_id, (placeable, todo) in work.items():
            if not todo:
                continue
            bar.set_description(f"task {task_id} (building env)")
            scene = TaskScene(suite, task_id, cfg)
            if scene.placeable != placeable:
                raise RuntimeError(
                    f"task {task_id}: placeable predicates {scene.placeable} differ from the BDDL plan {placeable}"
                )
            bar.set_description(f"task {task_id}")
            tqdm.write(f"task {task_id} {scene.task_name}: env built in {scene.construct_s:.1f}s; placeable "
                       f"{[str(p) for p in placeable]}; {sum(map(len, todo.values()))} frames to make")
            for init, items in todo.items():
                t0 = time.perf_counter()
                snapshot = scene.presettle(init)
                presettle_s = time.perf_counter() - t0
                for subset, variant in items:
                    key = frame_key(task_id, init, subset, variant)
                    meta = {
                        "key": key, "task": task_id, "task_name": scene.task_name, "init_index": init,
                        "subset": list(subset), "variant": variant, "split": "heldout" if init in held_out else "train",
                        "language_instruction": scene.instruction,
                    }
                    while pending(key, subset):
                        record = make_frame(scene, snapshot, subset, frame_rng(cfg, key, attempts[key]))
                        timings = dict(record.pop("timings"), presettle_s=round(presettle_s, 4))
                        presettle_s = 0.0  # shared by the frames of this init: charged to its first attempt
                        row = {**meta, "attempt": attempts[key], **record, "timings": timings}
                        if record["accepted"]:
                            images, state = row.pop("images"), row.pop("state")
                            row["state"] = [round(float(x), 6) for x in state]
                            writer.add(row, images, state)
                            done.add(key)
                            counts["accepted"] += 1
                        else:
                            append_jsonl(run_dir / "rejected.jsonl", [row])
                            attempts[key] += 1
                            counts["rejected"] += 1
                    bar.update(1)
                    bar.set_postfix(ok=counts["accepted"], rejected=counts["rejected"],
                                    s_per_frame=f"{bar.format_dict['elapsed'] / max(bar.n, 1):.2f}", refresh=False)
            scene.close()
    finally:
        writer.flush()
        bar.close()
    print_summary(summarize(run_dir))


# ----------------------------------------------------------------------------- summary and showcase


def summarize(run_dir: str | Path) -> dict:
    """Counts and timings of a run from its index and rejection log; also written to summary.json."""
    run_dir = Path(run_dir)
    ok, rejected = read_jsonl(run_dir / "index.jsonl"), read_jsonl(run_dir / "rejected.jsonl")
    labels = collections.Counter(r["memory"] for r in ok)
    reasons = collections.Counter(reason.split(" ")[0] for r in rejected for reason in r["reasons"])
    # "tilt basket_1 41deg" -> "tilt basket_1": the kind and what it concerns, without the amount.
    details = collections.Counter(
        " ".join(w for w in reason.split() if not w[0].isdigit()) for r in rejected for reason in r["reasons"]
    )

    def per_task(rows):
        return dict(sorted(collections.Counter(f"{r['task']} {r['task_name']}" for r in rows).items()))

    def median(rows, field):
        values = [r["timings"].get(field) for r in rows if r["timings"].get(field)]
        return round(statistics.median(values), 4) if values else None

    frame_s = [sum(v for k, v in r["timings"].items()) for r in ok + rejected]
    summary = {
        "accepted": len(ok),
        "rejected_attempts": len(rejected),
        "accepted_per_task": per_task(ok),
        "rejected_per_task": per_task(rejected),
        "accepted_per_split": dict(collections.Counter(r["split"] for r in ok)),
        "rejection_reasons": dict(reasons.most_common()),
        "rejection_details": dict(details.most_common()),
        "label_histogram": dict(labels.most_common()),
        "distinct_labels": len(labels),
        "majority_label_share": round(labels.most_common(1)[0][1] / len(ok), 4) if ok else None,
        "distinct_scene_labels": len({r["scene"] for r in ok}),
        "median_s": {f: median(ok, f) for f in ("presettle_s", "place_s", "settle_s", "eval_s", "render_s",
                                                 "encode_s")},
        "mean_s_per_attempt": round(sum(frame_s) / len(frame_s), 4) if frame_s else None,
        "mean_s_per_accepted_frame": round(sum(frame_s) / len(ok), 4) if ok else None,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def print_summary(s: dict) -> None:
    print(f"\naccepted frames: {s['accepted']}   rejected attempts: {s['rejected_attempts']}   "
          f"per split: {s['accepted_per_split']}")
    print("per task (accepted / rejected attempts):")
    for task in sorted(set(s["accepted_per_task"]) | set(s["rejected_per_task"])):
        print(f"  {task}: {s['accepted_per_task'].get(task, 0)} / {s['rejected_per_task'].get(task, 0)}")
    print("rejection reasons:", s["rejection_reasons"] or "none")
    for detail, n in s["rejection_details"].items():
        print(f"  {n:6d}  {detail}")
    print(f"labels ({s['distinct_labels']} distinct, majority share {s['majority_label_share']}):")
    for label, n in s["label_histogram"].items():
        print(f"  {n:6d}  {label}")
    print(f"distinct scene labels: {s['distinct_scene_labels']}")
    print(f"median seconds per frame: {s['median_s']}; mean s/attempt {s['mean_s_per_attempt']}, "
          f"s/accepted frame {s['mean_s_per_accepted_frame']} (presettle shared by an init's frames)")


def write_showcase(run_dir: Path, out_dir: Path, n: int) -> list[dict]:
    """Copy n held-out frames (both cameras as PNG) with their labels to out_dir, varying task and label."""
    from PIL import Image

    frames = list(iter_frames(run_dir, split="heldout"))
    if not frames:
        raise SystemExit(f"no held-out frames in {run_dir}; generate some first")
    by_task: dict[int, list[dict]] = collections.defaultdict(list)
    for f in frames:
        by_task[f["task"]].append(f)
    picked, labels = [], set()
    while len(picked) < n and any(by_task.values()):  # round-robin over tasks, a new label when there is one
        for candidates in by_task.values():
            if candidates and len(picked) < n:
                i = next((i for i, c in enumerate(candidates) if c["memory"] not in labels), 0)
                f = candidates.pop(i)
                picked.append(f)
                labels.add(f["memory"])
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = []
    for f in picked:
        for k in CAMERAS:
            Image.fromarray(f[k]).save(out_dir / f"{f['key']}_{k}.png", optimize=True)
        keep = ("key", "task", "init_index", "split", "language_instruction", "memory", "scene", "predicates")
        meta.append({k: f[k] for k in keep} | {"state": [float(x) for x in f["state"]]}
                    | {k: f"{f['key']}_{k}.png" for k in CAMERAS})
    (out_dir / "frames.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta
