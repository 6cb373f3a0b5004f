"""Held-out evaluation of a language adapter as it is served: greedy answers from the slot pool.

    python -m eval.memory_eval --base CKPT --adapter DIR --data DS [--split heldout] [--out DIR]
    python -m eval.memory_eval --base CKPT --adapter DIR --data ANNOTATIONS --libero-hdf5 HDF5  # OxyGen's split + metric

Reports (JSON + markdown):

* exact match of the greedy answers (normalised: strip, collapse whitespace, case-fold, trailing period
  optional), decoded by `oxygen_jax.runtime.engine.Engine` with the adapter (one control frame per batch);
* teacher-forced token accuracy and loss on the answer tokens (`training.memory.model.suffix_logits`);
* baselines: the majority label of the training split, the majority label per task instruction (the
  instruction is in the prefix, so a model could reach it without looking), the best constant answer per
  instruction chosen on the evaluated frames' own labels (an upper bound for any image-blind answer), and
  the base model (adapter off);
* a per-label accuracy table and a confusion table (true label × predicted answer; answers outside the label
  set count as "(other)");
* the action difference with the adapter on / off / zeroed: max |Δ| over every held-out frame's action chunk,
  same observations and noise. Actions never read the bank, so all three must be exactly 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.ckpts.adapters import DEFAULT_ADAPTER_NAME
from oxygen_jax.demo import normalize_answer
from oxygen_jax.models import lora
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.params import Params
from training.memory.data import TextTask, fixed_batches
from training.memory.evaluate import engine_answers
from training.memory.model import answer_loss, load_base, teacher_forced_logits
from training.data.frames import frame_texts  # text fields only: no image decoding

OTHER = "(other)"


def zeroed_bank(bank: lora.LoraBank) -> lora.LoraBank:
    """The bank with every B factor set to 0 (same shapes, so the same compiled program as the trained bank)."""
    return jax.tree_util.tree_map_with_path(  # host zeros: nothing to compile
        lambda path, x: np.zeros(x.shape, x.dtype) if getattr(path[-1], "name", None) == "b" else x, bank)


def majority(labels: Sequence[str]) -> tuple[str, int]:
    """(most common normalised label, count); ties go to the label seen first."""
    counts = collections.Counter(normalize_answer(x) for x in labels)
    if not counts:
        raise ValueError("majority of an empty label list")
    return max(counts.items(), key=lambda kv: kv[1])


def label_metrics(preds: Sequence[str], refs: Sequence[str]) -> dict:
    """Exact match plus per-label accuracy and a confusion table, all on normalised text.

    Returns:
      {"exact_match", "n", "per_label": {label: {"n", "correct", "accuracy"}},
       "confusion": {true label: {predicted label or "(other)": count}}}.
    """
    if len(preds) != len(refs) or not refs:
        raise ValueError(f"need as many predictions as references (> 0), got {len(preds)} and {len(refs)}")
    p = [normalize_answer(x) for x in preds]
    r = [normalize_answer(x) for x in refs]
    labels = sorted(set(r))
    per_label, confusion = {}, {}
    for label in labels:
        idx = [i for i, x in enumerate(r) if x == label]
        correct = sum(p[i] == label for i in idx)
        per_label[label] = {"n": len(idx), "correct": correct, "accuracy": correct / len(idx)}
        confusion[label] = dict(collections.Counter(p[i] if p[i] in labels else OTHER for i in idx))
    return {"exact_match": float(np.mean([a == b for a, b in zip(p, r)])), "n": len(r), "per_label": per_label,
            "confusion": confusion}


def evaluate_adapter(
    params: Params,
    adapter: lora.ExpertLora,
    task: TextTask,
    source: Sequence[Mapping],
    *,
    train_source: Sequence[Mapping] | None = None,
    batch_size: int = 16,
    limit: int | None = None,
    num_steps: int = 2,
    noise_seed: int = 0,
    examples: int = 8,
) -> dict:
    """Everything in the module docstring, as a JSON-able dict (see `to_markdown`).

    Args:
      adapter: one VLM-expert adapter (leaves [L, ...]), served as adapter id 1.
      task: robot transform, tokenizer, prompt and label key (the adapter's training task).
      source: held-out frames; train_source: training frames, for the majority baselines (else: none).
      limit: evaluate the first `limit` frames only.
      num_steps: denoising steps of each frame's action chunk (the actions are only compared).
      examples: how many wrong answers to list.
    """
    batches = fixed_batches(source, task, params.config, batch_size, limit)
    n = sum(real for _, real in batches)
    bank = pi05_lora.stack_adapters([adapter], params.config)
    kw = dict(num_steps=num_steps, noise_seed=noise_seed)
    on = engine_answers(params, task, batches, bank=bank, adapter=DEFAULT_ADAPTER_NAME, **kw)
    off = engine_answers(params, task, batches, bank=None, adapter="base", **kw)
    zero = engine_answers(params, task, batches, bank=zeroed_bank(bank), adapter=DEFAULT_ADAPTER_NAME, **kw)

    meta = frame_texts(source, (task.label_key, "language_instruction"), n)
    refs = [str(m[task.label_key]) for m in meta]
    report = {"n": n, "prompt": task.prompt, "label_key": task.label_key, **label_metrics(on.texts, refs)}
    report["base_exact_match"] = label_metrics(off.texts, refs)["exact_match"]
    groups = collections.defaultdict(list)  # instruction -> indices of its frames
    for i, m in enumerate(meta):
        groups[m["language_instruction"]].append(i)
    ok = [normalize_answer(pred) == normalize_answer(ref) for pred, ref in zip(on.texts, refs)]
    report["per_instruction"] = {}
    for text, ix in sorted(groups.items()):
        hit = sum(ok[i] for i in ix)
        report["per_instruction"][text] = {"n": len(ix), "correct": hit, "accuracy": hit / len(ix)}
    # The best image-blind answer: one constant label per instruction, chosen on these very frames' labels.
    report["per_task_oracle_constant"] = sum(majority([refs[i] for i in ix])[1] for ix in groups.values()) / n

    correct = tokens = loss_sum = 0.0
    ids = jnp.ones((batch_size,), jnp.int32)
    for batch, _ in batches:
        logits = teacher_forced_logits(params, batch, bank, ids)
        loss, stats = jax.device_get(answer_loss(logits, jnp.asarray(batch.suffix_tokens), jnp.asarray(batch.loss_mask)))
        correct, tokens = correct + float(stats["correct"]), tokens + float(stats["tokens"])
        loss_sum += float(loss) * float(stats["tokens"])
    report["token_accuracy"] = correct / max(tokens, 1.0)
    report["answer_loss"] = loss_sum / max(tokens, 1.0)

    if train_source is not None:
        train_meta = frame_texts(train_source, (task.label_key, "language_instruction", "init_index"), len(train_source))
        label, _ = majority([str(m[task.label_key]) for m in train_meta])
        report["majority_label"] = label
        report["majority_baseline"] = float(np.mean([normalize_answer(r) == label for r in refs]))
        by_task = collections.defaultdict(list)
        for m in train_meta:
            by_task[m["language_instruction"]].append(str(m[task.label_key]))
        guess = {t: majority(v)[0] for t, v in by_task.items()}
        hits = [guess.get(m["language_instruction"]) == normalize_answer(r) for m, r in zip(meta, refs)]
        report["per_task_majority_baseline"] = float(np.mean(hits))
        for text, row in report["per_instruction"].items():
            row["majority_baseline"] = float(np.mean([hits[i] for i in groups[text]]))
        report["train_frames"] = len(train_meta)
        # Distinct object layouts trained on (instruction, init index): what held-out layouts must generalise from.
        report["train_layouts"] = len({(m["language_instruction"], m.get("init_index")) for m in train_meta})

    def diff(a, b) -> float:
        return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))

    report["action_max_abs_diff"] = {"on_vs_off": diff(on.actions, off.actions),
                                     "on_vs_zeroed": diff(on.actions, zero.actions),
                                     "off_vs_zeroed": diff(off.actions, zero.actions)}
    report["zeroed_exact_match_vs_base"] = float(np.mean([a == b for a, b in zip(zero.texts, off.texts)]))
    wrong = [{"frame": i, "instruction": meta[i]["language_instruction"], "expected": refs[i], "got": on.texts[i]}
             for i in range(n) if normalize_answer(on.texts[i]) != normalize_answer(refs[i])]
    report["wrong_examples"] = wrong[:examples]
    report["answers"] = list(on.texts)  # greedy answers in source order (for other metrics, e.g. OxyGen's)
    return report


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _count(n: int, noun: str) -> str:
    """'1 layout', '2 layouts'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def to_markdown(report: Mapping, title: str = "Memory adapter evaluation") -> str:
    """A readable report: headline table, per-label accuracy, confusion, action differences, wrong answers."""
    lines = [f"# {title}", "", f"{report['n']} held-out frames, request prompt {report['prompt']!r}, label "
             f"`{report['label_key']}`; greedy answers decoded by the slot pool (Engine).", "",
             "| metric | value |", "|---|---|",
             f"| exact match (adapter) | **{_pct(report['exact_match'])}** |",
             f"| teacher-forced token accuracy | {_pct(report['token_accuracy'])} |",
             f"| answer loss (nats/token) | {report['answer_loss']:.4f} |",
             f"| base model (adapter off) exact match | {_pct(report['base_exact_match'])} |"]
    if "majority_baseline" in report:
        lines += [f"| majority-label baseline (`{report['majority_label']}`) | {_pct(report['majority_baseline'])} |",
                  f"| per-instruction majority baseline | {_pct(report['per_task_majority_baseline'])} |"]
    if "per_task_oracle_constant" in report:
        lines.append(f"| best constant answer per instruction, chosen on these frames' labels | "
                     f"{_pct(report['per_task_oracle_constant'])} |")
    a = report["action_max_abs_diff"]
    lines.append(f"| action max abs diff on/off, on/zeroed, off/zeroed | {a['on_vs_off']:g}, {a['on_vs_zeroed']:g}, "
                 f"{a['off_vs_zeroed']:g} |")
    if "train_layouts" in report:
        lines += ["", f"Trained on {_count(report['train_frames'], 'frame')} from "
                      f"{_count(report['train_layouts'], 'layout')} (instruction, init index)."]
    lines += ["", "## Per label", "", "| label | n | correct | accuracy |", "|---|---|---|---|"]
    for label, row in report["per_label"].items():
        lines.append(f"| {label} | {row['n']} | {row['correct']} | {_pct(row['accuracy'])} |")
    if "per_instruction" in report:
        base = any("majority_baseline" in row for row in report["per_instruction"].values())
        lines += ["", "## Per task instruction", "",
                  "| instruction | n | correct | accuracy |" + (" per-instruction majority |" if base else ""),
                  "|---|---|---|---|" + ("---|" if base else "")]
        for text, row in report["per_instruction"].items():
            lines.append(f"| {text} | {row['n']} | {row['correct']} | {_pct(row['accuracy'])} |"
                         + (f" {_pct(row['majority_baseline'])} |" if "majority_baseline" in row else ""))
    labels = list(report["per_label"])
    cols = labels + ([OTHER] if any(OTHER in c for c in report["confusion"].values()) else [])
    lines += ["", "## Confusion (rows: true label, columns: greedy answer)", "",
              "| true \\ predicted | " + " | ".join(f"L{j}" for j in range(len(cols))) + " |",
              "|---|" + "---|" * len(cols)]
    for i, label in enumerate(labels):
        row = report["confusion"][label]
        lines.append(f"| L{i}: {label} | " + " | ".join(str(row.get(c, 0)) for c in cols) + " |")
    if OTHER in cols:
        lines.append(f"\nL{len(cols) - 1} = {OTHER}: an answer that is none of the labels.")
    if report.get("wrong_examples"):
        lines += ["", "## Wrong answers (first few)", "", "| frame | expected | got |", "|---|---|---|"]
        lines += [f"| {w['frame']} | {w['expected']} | {w['got']!r} |" for w in report["wrong_examples"]]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval.memory_eval",
        description="Evaluate a trained language adapter on held-out frames through the slot pool: exact match, "
                    "token accuracy, baselines, per-label table, confusion, and the action difference with the "
                    "adapter on/off/zeroed (must be exactly 0).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base", type=Path, required=True,
                   help="base π0.5 checkpoint: ours or openpi's (e.g. pi05_libero; anything load_model reads)")
    p.add_argument("--base-dtype", choices=("float32", "bfloat16"), default=None,
                   help="dtype of the base (default: ours as stored, openpi's float32)")
    p.add_argument("--adapter", type=Path, required=True,
                   help="adapter directory (training.memory output or oxygen_adapter import) or OxyGen's released folder")
    p.add_argument("--data", type=Path, required=True, help="memory dataset version folder")
    p.add_argument("--libero-hdf5", type=Path, default=None, metavar="DIR",
                   help="LIBERO's raw <suite>/<task>_demo.hdf5 folder; --data is then OxyGen's annotations folder and the "
                        "report adds their metric (training.data.oxygen_libero)")
    p.add_argument("--libero-frames", choices=("eval", "heldout"), default="eval",
                   help="with --libero-hdf5: their 10 greedy-evaluation frames per task, or every held-out frame")
    p.add_argument("--split", default="heldout")
    p.add_argument("--heldout-episodes", default=None, metavar="LIST",
                   help="LeRobot --data: the held-out episodes, e.g. 3,7,10-12 (--split heldout; train: the others)")
    p.add_argument("--empty-label", default=None, metavar="TEXT",
                   help="LeRobot --data: label of frames with none active yet (default: such frames are left out)")
    p.add_argument("--key-map", action="append", default=[], metavar="FIELD=FEATURE",
                   help="LeRobot --data: the feature feeding image / wrist_image / state / actions (repeatable)")
    p.add_argument("--train-split", default="train", help="split for the majority baselines ('' to skip)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="SentencePiece model (default: tokenizer.model beside the base or the adapter, else the demo tokenizer)")
    p.add_argument("--prompt-len", type=int, default=None, help="Tp (default: the adapter's training value)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N frames only")
    p.add_argument("--num-steps", type=int, default=10, help="denoising steps per action chunk")
    p.add_argument("--out", type=Path, default=None, help="write memory_eval.json and memory_eval.md here")
    return p


def _find_tokenizer(args):
    from oxygen_jax.ckpts.load import find_tokenizer
    from oxygen_jax.robots.tokenizer import Tokenizer, train_demo_tokenizer

    if args.tokenizer is not None:
        return Tokenizer.from_file(args.tokenizer)
    found = find_tokenizer(args.base, args.adapter)
    return Tokenizer.from_file(found) if found else train_demo_tokenizer()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from oxygen_jax.ckpts.oxygen_adapter import load_any
    from oxygen_jax.robots.config import robot_config
    from oxygen_jax.models.pi05.params import for_backend
    from training.memory.config import DEMO_PROMPT_LEN
    from training.data.lerobot.keys import KeyMap
    from training.data.lerobot.splits import open_lerobot_split, parse_episodes
    from training.data.folders import (check_data_folder, is_lerobot_dataset, lerobot_flags_given,
                                       refuse_lerobot_flags_with_libero_hdf5)
    from training.data.frames import open_memory_dataset

    try:
        if args.libero_hdf5 is None:  # before the base loads: what --data holds, what is expected, "did you mean"
            check_data_folder(args.data, lerobot_flags=lerobot_flags_given(args))
        refuse_lerobot_flags_with_libero_hdf5(args)
        params, _, _ = load_base(args.base, args.base_dtype)
        adapter, meta = load_any(args.adapter, params.config, base=args.base)
        if is_lerobot_dataset(args.data):  # splits by episode, the adapter's target (training.data.lerobot.splits)
            heldout = parse_episodes(args.heldout_episodes) if args.heldout_episodes is not None else None
            kw = dict(target=meta.get("extra", {}).get("label_key", "memory"), heldout=heldout,
                      empty_label=args.empty_label, key_map=KeyMap.parse(args.key_map))
            source = open_lerobot_split(args.data, args.split, **kw)
            train_source = open_lerobot_split(args.data, args.train_split, **kw) if args.train_split else None
        elif args.libero_hdf5 is not None:  # OxyGen's split and evaluation frames (seed 7)
            from training.data.oxygen_libero import open_oxygen_libero
            oxygen = open_oxygen_libero(args.data, args.libero_hdf5)
            source = getattr(oxygen, args.libero_frames)
            train_source = oxygen.train if args.train_split else None
        else:
            source = open_memory_dataset(args.data, args.split)
            train_source = open_memory_dataset(args.data, args.train_split) if args.train_split else None
    except (FileNotFoundError, ValueError) as e:
        print(f"python -m eval.memory_eval: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    extra = meta.get("extra", {})
    tokenizer = _find_tokenizer(args)
    prompt_len = args.prompt_len or extra.get("prompt_len", DEMO_PROMPT_LEN)
    task = TextTask(robot=robot_config("libero", max_token_len=prompt_len), tokenizer=tokenizer, prompt=meta["prompt"],
                    label_key=extra.get("label_key", "memory"), suffix_len=extra.get("suffix_len", 32))
    report = evaluate_adapter(for_backend(params), adapter, task, source, train_source=train_source,
                              batch_size=args.batch_size, limit=args.limit, num_steps=args.num_steps)
    report["base"], report["adapter"], report["data"] = str(args.base), str(args.adapter), f"{args.data} [{args.split}]"
    md = to_markdown(report)
    if args.libero_hdf5 is not None:
        from training.data.oxygen_libero import oxygen_metrics
        refs = [str(source.texts(i)[task.label_key]) for i in range(report["n"])]
        report["oxygen"] = {"frames": args.libero_frames, **oxygen_metrics(report["answers"], refs)}
        md += (f"\nOxyGen's metric ({report['n']} {args.libero_frames} frames of their split): normalized exact match "
               f"**{_pct(report['oxygen']['normalized_exact'])}**, word F1 {_pct(report['oxygen']['word_f1'])}\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory_eval.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "memory_eval.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
