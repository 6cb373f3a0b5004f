"""`python -m training.memory`: train a "Memory: " adapter on a base π0.5, or pre-train the base on a text
task (`--mode base`); `python -m training.memory export-demo` assembles the embedded demo folder.

Writes into --out: adapter/ or base/, tokenizer.model, checkpoints/ (verified, resumed when present; damaged
steps are moved to checkpoints.rejected/), metrics.jsonl and run.json. A new run writes into a hidden folder
beside --out renamed to --out when it ends (`training.memory.run_folder`). Bad input (flags, data, an unwritable
--out, a batch larger than the training split, a --suffix-len too short for a split or a label over the caps,
checkpoints of another run or none intact, a frame that cannot be read, found whenever it is read) is one line
on stderr and exit status 2, and --out then holds nothing from the run; one labelled frame of every episode is
decoded before training (LeRobot data), so most data errors come first. A run whose loss, gradients or state
become non-finite stops at that step with one line and exit status 1, writing no adapter, base or checkpoint
from it. Axes (`oxygen_jax.axes`): T suffix tokens, Tp prompt tokens in the prefix, V vocabulary.

Several processes (`--coordinator HOST:PORT --num-processes N --process-id I`, or nothing under SLURM / Open MPI,
see `training.distributed`) train one data-parallel run: each decodes its own rows, every process writes its shards
of the checkpoints, and only process 0 writes the tokenizer, run.json, metrics.jsonl and the adapter or base.
Before the first step the processes agree on a digest of their data (`training.memory.data.data_digest`): a
process given other data is refused in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from oxygen_jax.cli import DefaultsHelpFormatter, OneLineParser, float_in, int_at_least
from oxygen_jax.ckpts import own
from oxygen_jax.ckpts.adapters import DEFAULT_ADAPTER_NAME, replace_dir, save_adapter, tree_digest
from oxygen_jax.robots.config import RobotConfig, robot_config
from oxygen_jax.models.pi05.params import for_backend, init_params
from oxygen_jax.robots.tokenizer import (
    MIN_TRAINED_VOCAB, Tokenizer, encode_suffix_prompt, train_demo_tokenizer, train_text_tokenizer,
)
from training import distributed
from training.memory.checkpoints import CheckpointError, first_non_finite
from training.memory.config import DEMO_PROMPT_LEN, TrainConfig, checkpoint_config_json, preset_config
from training.memory.data import MEMORY_PROMPT, CheckedSource, DataError, TextTask, data_digest, task_texts
from training.memory.export_demo import main as export_main
from training.memory.loop import NonFiniteStepError, train
from oxygen_jax.ckpts.load import base_tokenizer
from training.memory.model import load_base, make_mesh, with_base_trainable
from training.memory.run_folder import RunFolder
from training.data.frames import frame_texts, open_memory_dataset
from training.data.folders import (check_data_folder, is_lerobot_dataset, lerobot_flags_given,
                                   refuse_lerobot_flags_with_libero_hdf5)
from training.data.lerobot.keys import KeyMap
from training.data.lerobot.splits import open_lerobot_split, parse_episodes


MAX_SUFFIX_LEN = 1024  # T: prompt + label + EOS tokens (one long label sizes every batch of the run)
MAX_LABEL_CHARS = 4096  # characters of one label, checked before it is tokenized


def _robot(prompt_len: int) -> RobotConfig:
    return robot_config("libero", max_token_len=prompt_len)


def _load_base(args, tokenizer: Tokenizer):
    """(params, what they are, the base's robot I/O or None for a random preset)."""
    io = None
    if args.base is not None:
        params, what, io = load_base(args.base, args.base_dtype, vision_heads=args.vision_heads)
    else:
        cfg = preset_config(args.preset, tokenizer.vocab_size, args.image_size, args.patch_size)
        params = init_params(cfg, args.seed)
        what = f"random {args.preset} preset (seed {args.seed})"
    if tokenizer.vocab_size > params.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                         f"{params.config.vocab_size}; use the tokenizer the base was trained with (--tokenizer)")
    return params, what, io


def _tokenizer(args, train_source) -> Tokenizer:
    if args.tokenizer is not None:
        return Tokenizer.from_file(args.tokenizer)
    if args.base is not None:  # a base brings its own tokenizer: a stand-in would give its prompts other ids
        try:
            found, hint = base_tokenizer(args.base)
        except (OSError, ValueError) as e:
            raise _Refused(f"--base {args.base}: {str(e).splitlines()[0]}") from None
        if found is not None:
            return Tokenizer.from_file(found)
        if hint is not None:
            raise _Refused(f"--base {args.base} has no tokenizer in or beside it: fetch {hint} and pass --tokenizer FILE")
    if args.train_tokenizer:  # the task's texts plus both request prompts, so each prompt is a few pieces
        return train_text_tokenizer([MEMORY_PROMPT, "Scene: ", *task_texts(train_source)], args.train_tokenizer)
    return train_demo_tokenizer()


def _tokenizer_vocab(text: str) -> int:
    """--train-tokenizer: 0 (the built-in demo tokenizer) or a BPE size with room for the byte pieces."""
    value = int_at_least(0)(text)
    if 0 < value < MIN_TRAINED_VOCAB:
        raise argparse.ArgumentTypeError(
            f"expected 0 or a vocabulary of at least {MIN_TRAINED_VOCAB} (256 byte pieces + characters + specials), "
            f"got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m training.memory",
        description="Train a suffix-only language LoRA (default: the 'Memory: ' adapter) on a base π0.5, or "
                    "pre-train the base (VLM expert + SigLIP + embedding) on a text task with --mode base. "
                    "Data: a memory dataset folder (training.data.frames / training.data.synthetic_memory / "
                    "training.data.libero --export-tfds). Resumes from OUT/checkpoints when it exists.",
        formatter_class=DefaultsHelpFormatter,
        epilog="Outputs in OUT: adapter/ (adapter mode: load with oxygen_jax.ckpts.adapters.load_bank) or base/ (base "
               "mode: oxygen_jax.ckpts.own.restore_params), tokenizer.model, checkpoints/ (orbax, for resuming), "
               "metrics.jsonl, run.json. Assemble the embedded demo folder from a base and an adapter run with "
               "`python -m training.memory export-demo --help`.",
    )
    p.add_argument("--data", type=Path, required=True,
                   help="memory dataset version folder (tfds, array_record), or a LeRobot dataset folder (meta/info.json: "
                        "splits by episode, see --target, --heldout-episodes, --empty-label; docs/lerobot.md)")
    p.add_argument("--libero-hdf5", type=Path, default=None, metavar="DIR",
                   help="LIBERO's raw <suite>/<task>_demo.hdf5 folder; --data is then OxyGen's annotations folder, split, "
                        "sampled and evaluated as OxyGen does (training.data.oxygen_libero; --eval-split '' skips evaluation)")
    p.add_argument("--out", type=Path, required=True, help="output directory (created; an existing one is resumed)")
    p.add_argument("--mode", choices=("adapter", "base"), default="adapter",
                   help="adapter: LoRA bank only, base frozen; base: fine-tune VLM expert + SigLIP + embedding")
    m = p.add_argument_group("model")
    m.add_argument("--base", type=Path, default=None,
                   help="base π0.5 or π0 checkpoint: ours (e.g. OUT_OF_BASE_RUN/base), openpi's (e.g. pi05_libero) or "
                        "a LeRobot policy folder (anything load_model reads; its robot I/O builds the prefix); required "
                        "for adapters")
    m.add_argument("--vision-heads", type=int_at_least(1), default=None,
                   help="--base a LeRobot folder whose SigLIP is not So400m: its head count (no tensor stores it)")
    m.add_argument("--base-dtype", choices=("float32", "bfloat16"), default=None,
                   help="dtype of the frozen base (default: ours as stored, openpi's float32); the adapter is float32")
    m.add_argument("--preset", choices=("tiny", "demo"), default="demo", help="random init for --mode base without --base")
    m.add_argument("--image-size", type=int_at_least(28), default=None, help="SigLIP image side of the preset (default: preset's)")
    m.add_argument("--patch-size", type=int_at_least(1), default=None, help="SigLIP patch side of the preset (default: 14)")
    m.add_argument("--tokenizer", type=Path, default=None,
                   help="SentencePiece model (default: BASE/../tokenizer.model if present, else see --train-tokenizer)")
    m.add_argument("--train-tokenizer", type=_tokenizer_vocab, default=0, metavar="VOCAB",
                   help="train a BPE tokenizer of this size on the train split's texts (0: the built-in demo tokenizer)")
    m.add_argument("--prompt-len", type=int_at_least(1), default=DEMO_PROMPT_LEN, help="Tp: task-prompt tokens in the prefix")
    t = p.add_argument_group("task")
    t.add_argument("--prompt", default=None, help="request prompt (default 'Memory: ', or 'Scene: ' in base mode)")
    t.add_argument("--label-key", "--target", dest="label_key", default=None,
                   help="frame field to predict (default memory, or scene in base mode); LeRobot: memory, subtask, plan, "
                        "interjection, speech or a string column")
    t.add_argument("--heldout-episodes", default=None, metavar="LIST",
                   help="LeRobot data: held-out episodes, e.g. 3,7,10-12 (the eval split; train is every other episode)")
    t.add_argument("--empty-label", default=None, metavar="TEXT",
                   help="LeRobot data: label of frames with none active yet (default: such frames are left out)")
    t.add_argument("--key-map", action="append", default=[], metavar="FIELD=FEATURE",
                   help="LeRobot data: the feature feeding image / wrist_image / state / actions, e.g. "
                        "wrist_image=observation.images.hand (repeatable; default: openpi's and LeRobot's names)")
    t.add_argument("--train-split", default="train", help="split of --data to train on")
    t.add_argument("--eval-split", default="heldout", help="held-out split for greedy exact match ('': none)")
    t.add_argument("--suffix-len", type=int_at_least(2), default=None,
                   help=f"T (default: longest prompt + label + EOS in train; at most {MAX_SUFFIX_LEN})")
    o = p.add_argument_group("optimisation")
    d = TrainConfig()
    o.add_argument("--steps", type=int_at_least(1), default=d.steps, help="optimizer steps")
    o.add_argument("--batch-size", type=int_at_least(1), default=d.batch_size,
                   help="B: frames per step (at most the train split's frames; a multiple of --devices)")
    o.add_argument("--rank", type=int_at_least(1), default=d.rank, help="LoRA rank")
    o.add_argument("--alpha", type=float_in(0, low_open=True), default=None, help="LoRA alpha (default: rank)")
    o.add_argument("--targets", default=",".join(d.targets), help="comma-separated LoRA targets")
    o.add_argument("--lr", type=float_in(0, low_open=True), default=None, help="peak learning rate (default 3e-3 adapter, 1e-3 base)")
    o.add_argument("--final-lr", type=float_in(0), default=None, help="end of the cosine (default peak / 30)")
    o.add_argument("--warmup", type=int_at_least(0), default=d.warmup_steps, help="linear warm-up steps to the peak")
    o.add_argument("--weight-decay", type=float_in(0), default=d.weight_decay, help="AdamW weight decay")
    o.add_argument("--clip-norm", type=float_in(0, low_open=True), default=d.clip_norm, help="global gradient-norm clip")
    o.add_argument("--seed", type=int, default=d.seed, help="batch order, adapter init, random base, augmentation")
    o.add_argument("--augment", type=float_in(0), default=d.augment,
                   help="image augmentation: random shift up to this fraction of the side, brightness x(1 +- it)")
    o.add_argument("--devices", type=int_at_least(1), default=None, help="data-parallel devices (default: all)")
    o.add_argument("--fixed-order-reduction", action="store_true",
                   help="sum gradients over devices in a fixed order (all-gather, then device 0 first): the same bits "
                        "for any process layout of the same number of devices (slower; for bit-exact comparisons)")
    o.add_argument("--fsdp-min-size", type=int_at_least(1), default=None, metavar="ELEMENTS",
                   help="FSDP: shard trainable and optimizer leaves of at least this many elements over the devices "
                        "(default: everything replicated)")
    g = p.add_argument_group("multi-process (see docs/multihost.md; none under SLURM / Open MPI: detected)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address and a free port")
    g.add_argument("--num-processes", type=int_at_least(1), default=None, metavar="N", help="processes in the run")
    g.add_argument("--process-id", type=int_at_least(0), default=None, metavar="I", help="this process's index, 0 to N-1")
    dist = distributed.DistributedConfig()
    g.add_argument("--heartbeat-timeout", type=int_at_least(1), default=dist.heartbeat_timeout_s, metavar="SECONDS",
                   help="a process silent this long counts as dead: every other process exits non-zero")
    g.add_argument("--init-timeout", type=int_at_least(1), default=dist.init_timeout_s, metavar="SECONDS",
                   help="how long start-up waits for the coordinator to be reachable (TCP) and every process to join")
    e = p.add_argument_group("evaluation and checkpoints")
    e.add_argument("--eval-every", type=int_at_least(0), default=100, help="held-out greedy exact match every N steps (0: at the end)")
    e.add_argument("--eval-frames", type=int_at_least(1), default=None, help="held-out frames per evaluation (default: all)")
    e.add_argument("--checkpoint-every", type=int_at_least(1), default=50, help="save the training state every N steps")
    e.add_argument("--stop-at", type=int_at_least(1), default=None, help="stop after this step as if killed (resume later)")
    e.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs (or resumes) one training run, or `export-demo ...`; returns the exit status (2: bad input, 1: the run
    diverged (a non-finite step); nothing is saved from a diverged run)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export-demo"]:
        return export_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        distributed.initialize(distributed.DistributedConfig(
            coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
            heartbeat_timeout_s=args.heartbeat_timeout, init_timeout_s=args.init_timeout))
    except (ValueError, distributed.StartError) as e:
        print(f"python -m training.memory: error: {e}", file=sys.stderr)
        return 2
    try:
        return _run(args, argv)
    except (_Refused, CheckpointError, DataError) as e:
        print(f"python -m training.memory: error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteStepError, _NotSaved) as e:
        print(f"python -m training.memory: error: {e}; no adapter or base was written", file=sys.stderr)
        return 1


class _Refused(ValueError):
    """Bad input found before or instead of training (reported in one line, exit status 2)."""


class _NotSaved(ArithmeticError):
    """The trained weights have a NaN or ±inf leaf (reported in one line, exit status 1; nothing written)."""


def _run(args, argv: list[str]) -> int:
    base_mode = args.mode == "base"
    if not base_mode and args.base is None:
        raise _Refused("adapter mode needs --base (a π0.5 checkpoint: ours or openpi's)")
    if args.base is not None and not args.base.is_dir():
        raise _Refused(f"--base {args.base}: no such directory (a π0.5 checkpoint: ours or openpi's)")
    primary = distributed.is_primary()
    try:
        folder = RunFolder.open(args.out, create=primary)
    except OSError as e:
        raise _Refused(f"--out {args.out}: cannot create or write there ({type(e).__name__}: {e}); choose a writable "
                       "directory") from None
    try:
        code = _run_in(args, argv, folder)
    except (_Refused, CheckpointError, DataError):
        if primary:  # nothing from a refused run stays in --out
            folder.abandon()
        raise
    except (NonFiniteStepError, _NotSaved):
        if primary:  # the run's record up to the step that diverged (its metrics, earlier checkpoints)
            folder.commit()
        raise
    distributed.barrier("training_memory_ended")  # every process has closed its checkpoints before the rename
    if primary:
        folder.commit()
    return code


def _open_data(args, label_key: str) -> tuple:
    """(train source, eval source or None, the folders they come from), each source's read errors one line."""
    if is_lerobot_dataset(args.data):  # splits by episode; frames without an active label left out or filled
        heldout = parse_episodes(args.heldout_episodes) if args.heldout_episodes is not None else None
        kw = dict(target=label_key, heldout=heldout, empty_label=args.empty_label, key_map=KeyMap.parse(args.key_map))
        opened = {s: open_lerobot_split(args.data, s, **kw) for s in (args.train_split, args.eval_split) if s}
        for split in opened.values():  # one labelled frame per episode and camera: most data errors come first
            split.check_cameras()
        train_src, eval_src, folders = opened[args.train_split], opened.get(args.eval_split), [args.data]
    elif args.libero_hdf5 is not None:  # their split, task/target-balanced batches, 10 greedy-eval frames per task
        from training.data.oxygen_libero import open_oxygen_libero
        oxygen = open_oxygen_libero(args.data, args.libero_hdf5)
        train_src, eval_src = oxygen.train, (oxygen.eval if args.eval_split else None)
        folders = [args.data, args.libero_hdf5]
    else:
        train_src = open_memory_dataset(args.data, args.train_split)
        eval_src = open_memory_dataset(args.data, args.eval_split) if args.eval_split else None
        folders = [args.data]
    return (CheckedSource(train_src, args.train_split),
            CheckedSource(eval_src, args.eval_split) if eval_src is not None else None, folders)


def _run_in(args, argv: list[str], folder: RunFolder) -> int:
    base_mode = args.mode == "base"
    if args.libero_hdf5 is None:  # first after --out: a wrong path is the commonest first mistake
        try:
            check_data_folder(args.data, lerobot_flags=lerobot_flags_given(args))
        except FileNotFoundError as e:
            raise _Refused(f"--data {e}") from None
    else:
        try:
            refuse_lerobot_flags_with_libero_hdf5(args)
        except ValueError as e:
            raise _Refused(str(e)) from None
    prompt = args.prompt if args.prompt is not None else ("Scene: " if base_mode else MEMORY_PROMPT)
    label_key = args.label_key or ("scene" if base_mode else "memory")
    out = folder.work
    devices = args.devices or jax.device_count()
    if devices > jax.device_count():
        raise _Refused(f"--devices {devices}: only {jax.device_count()} device(s) exist; on CPU simulate more with "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=N")
    if args.batch_size % devices:
        raise _Refused(f"--batch-size {args.batch_size} is not a multiple of the {devices} data-parallel device(s)")
    try:
        train_src, eval_src, folders = _open_data(args, label_key)
        splits = {args.train_split: train_src, **({args.eval_split: eval_src} if eval_src is not None else {})}
        digest = data_digest(folders, splits, label_key)
    except (FileNotFoundError, ValueError) as e:
        raise _Refused(f"--data {args.data}: {str(e).splitlines()[0]}") from None
    try:  # before anything is loaded or written: processes given other data are refused together
        distributed.agree("the data (--data: its files, splits and labels)", digest)
    except ValueError as e:
        raise _Refused(str(e)) from None
    if len(train_src) < args.batch_size:
        raise _Refused(f"--batch-size {args.batch_size} is larger than the {len(train_src)} frames of split "
                       f"{args.train_split!r}; use --batch-size <= {len(train_src)}")
    if eval_src is not None and len(eval_src) == 0:
        raise _Refused(f"--eval-split {args.eval_split!r} has no frames; pass --eval-split '' to train without evaluation")
    tok_file = out / "tokenizer.model"
    tokenizer = Tokenizer.from_file(tok_file) if tok_file.is_file() and args.tokenizer is None else _tokenizer(args, train_src)
    suffix_len = _suffix_len(args.suffix_len, splits, tokenizer, prompt, label_key)
    lr = args.lr if args.lr is not None else (1e-3 if base_mode else 3e-3)
    try:
        config = TrainConfig(
            mode=args.mode, prompt=prompt, label_key=label_key, steps=args.steps, batch_size=args.batch_size,
            suffix_len=suffix_len, rank=args.rank, alpha=args.alpha, targets=tuple(args.targets.split(",")),
            peak_lr=lr, final_lr=args.final_lr if args.final_lr is not None else lr / 30, warmup_steps=args.warmup,
            weight_decay=args.weight_decay, clip_norm=args.clip_norm, seed=args.seed, augment=args.augment,
        )
    except ValueError as e:
        raise _Refused(str(e)) from None
    try:
        params, what, base_io = _load_base(args, tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise _Refused(f"--base {args.base}: {str(e).splitlines()[0]}" if args.base else str(e)) from None
    params = for_backend(params)
    task = TextTask(robot=_robot(args.prompt_len), tokenizer=tokenizer, prompt=prompt, label_key=label_key,
                    suffix_len=suffix_len, io=base_io)
    run = {"argv": argv, "base": what, "data": str(args.data.resolve()),
           "train_frames": len(train_src), "eval_frames": len(eval_src) if eval_src is not None else 0,
           "tokenizer_vocab": tokenizer.vocab_size, "prompt_len": args.prompt_len, "config": config.to_json(),
           "model": checkpoint_config_json(params.config), "devices": devices, "processes": jax.process_count(),
           "fixed_order_reduction": args.fixed_order_reduction, "fsdp_min_size": args.fsdp_min_size}
    primary = distributed.is_primary()
    if primary:
        print(f"{args.mode}: {what}; {len(train_src)} train / {len(eval_src) if eval_src else 0} eval frames; "
              f"task {prompt!r} -> {label_key!r}, T={suffix_len}; {devices} device(s), {jax.process_count()} process(es)",
              flush=True)
    digest_before = tree_digest(params)  # identifies the base a checkpoint continues (base mode trains from it)
    run_meta = {"base_digest": digest_before, "prompt_len": args.prompt_len, "tokenizer_vocab": tokenizer.vocab_size}
    def write_run_files():  # on a fresh start, or once a checkpoint was accepted (a refused resume changes nothing)
        if not primary:
            return
        tok_file.write_bytes(tokenizer.to_bytes())
        (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")

    ckpt_dir = out / "checkpoints"
    distributed.barrier("training_memory_read")  # every process has read --out (tokenizer) before process 0 writes
    if not (ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())):
        write_run_files()
    with open(out / "metrics.jsonl", "a") if primary else open(os.devnull, "w") as metrics_file:
        def log(entry):
            if entry["event"] == "resumed":
                write_run_files()
            metrics_file.write(json.dumps(entry) + "\n")
            metrics_file.flush()
            if entry["event"] != "train" and primary:
                print(json.dumps(entry), flush=True)

        try:
            mesh = make_mesh(None if jax.process_count() > 1 and args.devices is None else devices)
        except ValueError as e:
            raise _Refused(str(e)) from None
        try:
            result = train(config, params, task, train_src, eval_source=eval_src, eval_every=args.eval_every,
                           eval_frames=args.eval_frames, checkpoint_dir=ckpt_dir,
                           checkpoint_every=args.checkpoint_every, stop_at=args.stop_at, mesh=mesh,
                           fixed_order=args.fixed_order_reduction, fsdp_min_size=args.fsdp_min_size,
                           progress=primary and not args.no_progress, log=log, run_meta=run_meta)
        except DataError as e:  # a frame read during training (past the checks above)
            raise DataError(f"--data {args.data}: {e}") from None
    # One line per process (tests count them): the frames this process read and decoded.
    print(f"process {jax.process_index()} of {jax.process_count()}: decoded {result.frames_decoded} training frames",
          flush=True)
    if not base_mode and primary:  # the frozen base, checked rather than assumed
        unchanged = tree_digest(params) == digest_before
        with open(out / "metrics.jsonl", "a") as metrics_file:
            metrics_file.write(json.dumps({"event": "base_check", "base_leaves_bit_identical": unchanged}) + "\n")
        print(f"base leaves bit-identical after training: {unchanged}")
    step = int(distributed.host(result.state.step))
    if step < config.steps:
        if primary:
            print(f"stopped at step {step} of {config.steps}; rerun the same command to resume")
        return 0
    trainable = distributed.host(result.state.trainable)  # full values (gathered when FSDP-sharded), every process
    final = with_base_trainable(params, trainable) if base_mode else trainable.adapter(1)
    _require_finite(final, f"the {'trained base' if base_mode else 'adapter'} of step {config.steps}")  # every process
    dest = None
    if primary:  # one writer: no race on the folder, no barrier the others never reach
        if base_mode:  # written aside, then swapped in whole (an earlier base/ stays until then)
            aside = out / ".base.new"
            shutil.rmtree(aside, ignore_errors=True)
            replace_dir(own.save_params(aside, final), out / "base")
            dest = out / "base"
        else:
            dest = save_adapter(out / "adapter", final, name=DEFAULT_ADAPTER_NAME, prompt=prompt, base=args.base,
                                extra={"label_key": label_key, "suffix_len": suffix_len, "prompt_len": args.prompt_len,
                                       "steps": config.steps}, overwrite=True)
    distributed.barrier("training_memory_saved")  # no process exits before the weights are on disk
    evals = [h for h in result.history if h["event"] == "eval"]
    if primary:
        print(f"saved {folder.final_path(dest)}" + (f"; held-out greedy exact match {evals[-1]['exact_match']:.3f}" if evals else ""))
    return 0


def _suffix_len(given: int | None, splits, tokenizer: Tokenizer, prompt: str, label_key: str) -> int:
    """T: `given`, checked to hold the longest prompt + label + EOS of every split trained or evaluated on, or
    (None) that longest."""
    need = {name: _longest_suffix(src, name, tokenizer, prompt, label_key) for name, src in splits.items()}
    if given is None:
        return max(need.values())
    if given > MAX_SUFFIX_LEN:
        raise _Refused(f"--suffix-len {given} is above the cap {MAX_SUFFIX_LEN}; use --suffix-len {max(need.values())} "
                       "or leave it out")
    short = {name: n for name, n in need.items() if n > given}
    if short:
        name, n = max(short.items(), key=lambda kv: kv[1])
        raise _Refused(f"--suffix-len {given} is too short: split {name!r} needs {n} suffix tokens (prompt + longest "
                       f"{label_key!r} + EOS); use --suffix-len {max(need.values())} or leave it out")
    return given


def _require_finite(tree, what: str) -> None:
    """Refuses to write a tree with a NaN or ±inf leaf (a diverged run must leave no weights behind)."""
    bad = first_non_finite({jax.tree_util.keystr(k): np.asarray(x)
                            for k, x in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]})
    if bad is not None:
        raise _NotSaved(f"{what} has a non-finite leaf {bad}")


def _longest_suffix(source, split: str, tokenizer: Tokenizer, prompt: str, label_key: str) -> int:
    """Prompt + longest label + EOS tokens of `split`; a label over `MAX_LABEL_CHARS` characters or a suffix over
    `MAX_SUFFIX_LEN` tokens is refused naming the frame (one long label would size every batch of the run)."""
    texts = frame_texts(source, (label_key,))
    missing = next((i for i, f in enumerate(texts) if label_key not in f), None)
    if missing is not None:
        raise _Refused(f"frame {missing} of split {split!r} has no {label_key!r} field; choose another --label-key")
    labels = {}
    for i, f in enumerate(texts):
        text = f[label_key]
        if not isinstance(text, str) or len(text) > MAX_LABEL_CHARS:
            what = f"{len(text)} characters" if isinstance(text, str) else f"a {type(text).__name__}"
            raise _Refused(f"frame {i} of split {split!r}: its {label_key!r} label is {what}; labels are strings of "
                           f"at most {MAX_LABEL_CHARS} characters (leave that frame out of the data)")
        labels.setdefault(text, i)
    prompt_len = len(encode_suffix_prompt(tokenizer, prompt))
    longest, frame = max((len(tokenizer.encode(x)), i) for x, i in labels.items())
    if prompt_len + longest + 1 > MAX_SUFFIX_LEN:
        raise _Refused(f"frame {frame} of split {split!r}: its {label_key!r} label is {longest} tokens, so the suffix "
                       f"would be {prompt_len + longest + 1} > {MAX_SUFFIX_LEN} tokens (training.memory's cap); shorten "
                       "the label or leave that frame out")
    return prompt_len + longest + 1


if __name__ == "__main__":
    sys.exit(main())
