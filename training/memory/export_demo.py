"""Assembles the embedded demo folder (`oxygen_jax.demo`, default checkpoints/demo) from a base run and an
adapter run: copies of both, the tokenizer, a few held-out frames as PNG with the demo's own greedy answers,
and demo.json.

    python -m training.memory export-demo --base B/base --adapter A/adapter --data DS [--eval-json E]

Axes (`oxygen_jax.axes`): Px image side of the stored frames, Ds state dims.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from oxygen_jax.cli import DefaultsHelpFormatter, OneLineParser, existing, int_at_least
from oxygen_jax.ckpts import own
from oxygen_jax.ckpts.adapters import DEFAULT_ADAPTER_NAME, load_bank
from oxygen_jax.demo import DEMO_DIR, DEMO_MANIFEST
from oxygen_jax.robots.config import robot_config
from oxygen_jax.models.pi05.params import for_backend
from oxygen_jax.robots.tokenizer import Tokenizer
from training.memory.data import TextTask, fixed_batches
from training.memory.evaluate import engine_answers
from training.data.frames import frame_texts, open_memory_dataset


def _pick_frames(source: Sequence[Mapping], n: int, seed: int = 0) -> list[int]:
    """n frame indices covering as many (task, label) pairs as possible, round-robin over tasks."""
    by_task: dict[str, dict[str, list[int]]] = {}
    for i, f in enumerate(frame_texts(source, ("language_instruction", "memory"))):
        by_task.setdefault(str(f["language_instruction"]), {}).setdefault(str(f["memory"]), []).append(i)
    rng = np.random.default_rng(seed)
    queues = {t: [rng.choice(ix) for _, ix in sorted(labels.items())] for t, labels in sorted(by_task.items())}
    for q in queues.values():
        rng.shuffle(q)
    picked: list[int] = []
    while len(picked) < n and any(queues.values()):
        for q in queues.values():
            if q and len(picked) < n:
                picked.append(int(q.pop()))
    return picked


def export_demo(base: str | os.PathLike, adapter: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike,
                *, split: str = "heldout", num_frames: int = 8, evaluation: Mapping | None = None) -> Path:
    """Assembles a demo folder: `base/` (copy of a save_params dir), `memory_adapter/`, `tokenizer.model`
    (from beside the adapter's run), `frames/` (PNG of both cameras + frames.json with true labels and the
    demo's own greedy answers) and `demo.json`."""
    base, adapter, out = Path(base).resolve(), Path(adapter).resolve(), Path(out).resolve()
    tok_file = adapter.parent / "tokenizer.model"
    run = json.loads((adapter.parent / "run.json").read_text())
    extra = json.loads((adapter / "adapter.json").read_text()).get("extra", {})
    if out.exists():
        shutil.rmtree(out)
    (out / "frames").mkdir(parents=True)
    shutil.copytree(base, out / "base")
    shutil.copytree(adapter, out / "memory_adapter")
    meta = json.loads((out / "memory_adapter" / "adapter.json").read_text())
    meta["base"] = "../base"  # relative: the folder moves with the repository (the fingerprint identifies it)
    (out / "memory_adapter" / "adapter.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.copyfile(tok_file, out / "tokenizer.model")

    source = open_memory_dataset(data, split)
    picked = _pick_frames(source, num_frames)
    config, params = own.restore_params(out / "base")
    params = for_backend(params)
    tokenizer = Tokenizer.from_file(out / "tokenizer.model")
    bank, _ = load_bank([out / "memory_adapter"], config, base=out / "base")
    task = TextTask(robot=robot_config("libero", max_token_len=run["prompt_len"]), tokenizer=tokenizer,
                    prompt=meta["prompt"], label_key=extra.get("label_key", "memory"),
                    suffix_len=extra.get("suffix_len", run["config"]["suffix_len"]))
    frames = [source[i] for i in picked]
    answers = engine_answers(params, task, fixed_batches(frames, task, config, len(frames)), bank=bank,
                             adapter=DEFAULT_ADAPTER_NAME)
    rows = []
    for k, (f, answer) in enumerate(zip(frames, answers.texts)):
        row = {key: f[key] for key in ("language_instruction", "memory", "scene", "task", "init_index", "frame_key")
               if key in f}
        for key in ("image", "wrist_image"):
            name = f"{k:02d}_{key}.png"
            Image.fromarray(np.asarray(f[key])).save(out / "frames" / name, optimize=True)
            row[key] = name
        row["state"] = [float(x) for x in np.asarray(f["state"])]
        row["predicted"] = answer
        rows.append(row)
    (out / "frames" / "frames.json").write_text(json.dumps(rows, indent=1) + "\n")
    manifest = {
        "base": "base", "adapter": "memory_adapter", "tokenizer": "tokenizer.model", "frames": "frames/frames.json",
        "adapter_name": meta["name"], "prompt": meta["prompt"], "robot": "libero", "prompt_len": run["prompt_len"],
        "max_new_tokens": task.suffix_len - len(task.prompt_ids), "tokenizer_vocab": tokenizer.vocab_size,
        "data": str(Path(data).resolve()), "frames_split": split, "actions": "random: the action expert was never trained",
        **({"evaluation": dict(evaluation)} if evaluation else {}),
    }
    (out / DEMO_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def main(argv: Sequence[str]) -> int:
    """`python -m training.memory export-demo ...`; returns the exit status."""
    p = OneLineParser(prog="python -m training.memory export-demo",
                      description="Assemble the embedded demo folder from a base run and an adapter run.",
                      formatter_class=DefaultsHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the base run's base/ (own.save_params dir)")
    p.add_argument("--adapter", type=Path, required=True, help="the adapter run's adapter/ (tokenizer.model beside it)")
    p.add_argument("--data", type=Path, required=True, help="memory dataset the frames are taken from")
    p.add_argument("--split", default="heldout", help="split of --data the frames come from")
    p.add_argument("--frames", type=int_at_least(1), default=8, help="held-out frames to include (PNG, both cameras)")
    p.add_argument("--eval-json", type=existing("file"), default=None,
                   help="eval.memory_eval's memory_eval.json to summarise (its memory_eval.md is copied too)")
    p.add_argument("--out", type=Path, default=DEMO_DIR, help="the demo folder written")
    args = p.parse_args(argv)
    evaluation = None
    if args.eval_json is not None:
        r = json.loads(args.eval_json.read_text())
        evaluation = {k: r[k] for k in ("n", "exact_match", "token_accuracy", "majority_label", "majority_baseline",
                                        "per_task_majority_baseline", "per_task_oracle_constant", "base_exact_match",
                                        "action_max_abs_diff", "per_instruction", "train_frames", "train_layouts")
                      if k in r}
        # when the evaluation wrote its file: `python -m oxygen_jax.run` prints it beside the stored figure
        written = datetime.datetime.fromtimestamp(args.eval_json.stat().st_mtime, datetime.timezone.utc)
        evaluation["date"] = written.date().isoformat()
    out = export_demo(args.base, args.adapter, args.data, args.out, split=args.split, num_frames=args.frames,
                      evaluation=evaluation)
    if args.eval_json is not None and (args.eval_json.parent / "memory_eval.md").is_file():
        shutil.copyfile(args.eval_json.parent / "memory_eval.md", out / "memory_eval.md")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB)")
    return 0
