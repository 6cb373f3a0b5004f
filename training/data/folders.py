"""What a `--data` folder holds, and a one-line refusal when it holds nothing the commands read.

    kind = check_data_folder(path)                                   # "lerobot" or "tfds"
    check_data_folder(path, lerobot_flags=["--heldout-episodes"])    # those flags need a LeRobot dataset
    check_data_folder(args.data, lerobot_flags=lerobot_flags_given(args))   # a command's parsed flags

The kinds, by the files that mark them:

    lerobot   a LeRobot dataset root: meta/info.json (docs/lerobot.md)
    tfds      a tfds dataset version folder: dataset_info.json and features.json (memory datasets written by
              `training.data.frames`, RLDS TFRecord shards as LIBERO and DROID ship)
    frames    a run of `python -m training.data.libero` (shards/, index.jsonl): frames that are not a dataset
              yet; never opened, only named in the refusal (convert them with --export-tfds)

A refusal names what the folder holds, what is expected and, when a folder up to two levels below holds a
dataset (LeRobot's `dataset/` first), asks "did you mean …".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

_EXPECTED = ("a LeRobot dataset (meta/info.json) or a tfds dataset version folder (dataset_info.json and "
             "features.json, e.g. …/<name>/1.0.0)")
_LISTED = 8  # names of the folder's entries quoted in a refusal
_SEARCHED = 200  # entries looked at per level when searching below the folder for a dataset
# The flags (and argparse dests) of `training.memory` and `eval.memory_eval` that only LeRobot datasets take.
LEROBOT_FLAGS = {"--heldout-episodes": "heldout_episodes", "--empty-label": "empty_label", "--key-map": "key_map"}


def lerobot_flags_given(args) -> list[str]:
    """The `LEROBOT_FLAGS` given on a parsed command line (an argparse namespace): set, and not to an empty list."""
    return [flag for flag, dest in LEROBOT_FLAGS.items() if getattr(args, dest, None) not in (None, [])]


def is_lerobot_dataset(path: str | os.PathLike) -> bool:
    """A folder with `meta/info.json` (a LeRobot dataset root). A link or special file there counts (the reader
    then refuses it by name); an unreadable path is no dataset (os.path never raises PermissionError)."""
    return os.path.lexists(os.path.join(path, "meta", "info.json"))


def refuse_lerobot_flags_with_libero_hdf5(args) -> None:
    """--libero-hdf5 makes --data OxyGen's annotations, which take none of `LEROBOT_FLAGS`: refused, not ignored."""
    given = lerobot_flags_given(args)
    if getattr(args, "libero_hdf5", None) is not None and given:
        raise ValueError(f"{', '.join(given)}: for LeRobot datasets, but --libero-hdf5 makes --data OxyGen's LIBERO "
                         "annotations, which split and label frames their own way: drop "
                         f"{'it' if len(given) == 1 else 'them'}")


def folder_kind(path: str | os.PathLike) -> str | None:
    """'lerobot', 'tfds' or 'frames' (see the module docstring) by the files that mark each; None otherwise."""
    if is_lerobot_dataset(path):
        return "lerobot"
    j = lambda name: os.path.join(path, name)  # noqa: E731
    if os.path.isfile(j("dataset_info.json")) and os.path.isfile(j("features.json")):
        return "tfds"
    if os.path.isfile(j("index.jsonl")) and os.path.isdir(j("shards")):
        return "frames"
    return None


def _subfolders(p: Path) -> list[Path]:
    try:
        entries = sorted(os.scandir(p), key=lambda e: e.name)[:_SEARCHED]
    except OSError:
        return []
    return [Path(e.path) for e in entries if e.is_dir() and not e.name.startswith(".")]


def _candidates(p: Path, kinds: Sequence[str]) -> list[Path]:
    """Folders one or two levels below `p` of one of `kinds`; LeRobot's `dataset/` first."""
    found = []
    for child in _subfolders(p):
        if folder_kind(child) in kinds:
            found.append(child)
            continue
        found += [grand for grand in _subfolders(child) if folder_kind(grand) in kinds]
    return sorted(found, key=lambda c: (c.name != "dataset", len(c.parts), str(c)))


def _holds(p: Path) -> str:
    if not os.path.exists(p):
        return "nothing (no such directory)"
    if not os.path.isdir(p):
        return "a file, not a folder"
    try:
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(p))
    except OSError as e:
        return f"nothing readable ({type(e).__name__})"
    if not names:
        return "nothing (an empty folder)"
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def check_data_folder(path: str | os.PathLike, *, lerobot_flags: Sequence[str] = ()) -> str:
    """The kind of the dataset at `path`: 'lerobot' or 'tfds'.

    Args:
      path: the `--data` folder.
      lerobot_flags: flags given that only LeRobot datasets take (e.g. ["--heldout-episodes"]); then a tfds
        folder is refused too.
    Raises:
      FileNotFoundError (one line): `path` is no dataset of those kinds (or not LeRobot while `lerobot_flags` were
        given): what it holds, what is expected and, when a folder below it is one, "did you mean …".
    """
    p = Path(path)
    kind = folder_kind(p) if os.path.isdir(p) else None
    if kind == "lerobot" or (kind == "tfds" and not lerobot_flags):
        return kind
    wanted = ("lerobot",) if lerobot_flags else ("lerobot", "tfds")
    if lerobot_flags:
        head = (f"{p}: {', '.join(lerobot_flags)} {'is' if len(lerobot_flags) == 1 else 'are'} for LeRobot datasets "
                f"(meta/info.json), but this folder holds {'a tfds dataset' if kind == 'tfds' else _holds(p)}")
    elif kind == "frames":
        head = (f"{p}: a run of python -m training.data.libero (shards/, index.jsonl), not a dataset yet: convert it "
                "with --export-tfds DIR and pass DIR/<name>/1.0.0")
    else:
        head = f"{p}: not a dataset folder: it holds {_holds(p)}; expected {_EXPECTED}"
    near = _candidates(p, wanted) if os.path.isdir(p) else []
    raise FileNotFoundError(head + (f"; did you mean {near[0]}?" if near else ""))
