"""OxyGen's per-frame annotation files: where they are, how a row is read, and which text is the target.

Layout (one JSONL file per raw LIBERO demonstration, one row per simulator frame, in frame order):

    <annotations>/<suite>/<task>/demo_<k>.jsonl      # <task> = the HDF5 file stem without "_demo"

Each row carries (among predicate bookkeeping this reader ignores) `demo` ("demo_<k>"), `frame` (0-based index
into the HDF5 arrays), `task_instruction`, and `language` = {completed, remaining, next, textual_memory}. The
memory target is `language.textual_memory`; some released versions name the same field `visual_memory`, so
both are read (`textual_memory` first when a row has both).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

MEMORY_TARGETS = ("textual_memory", "visual_memory")  # the two names of the memory field, in lookup order
FILE_GLOB = "*/*/demo_*.jsonl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrameRef:
    """One annotated frame: which HDF5 demonstration and frame, its instruction and its target text.

    Attributes:
      suite, task: the annotation folder names (`task` is the HDF5 file stem without "_demo").
      demo: "demo_<k>", the HDF5 group under `data/`.
      frame: 0-based index into that demonstration's arrays.
      instruction: the row's `task_instruction` (the prompt).
      target: the row's target text (the memory label by default).
    """

    suite: str
    task: str
    demo: str
    frame: int
    instruction: str
    target: str

    @property
    def task_key(self) -> tuple[str, str]:
        return (self.suite, self.task)

    @property
    def demo_index(self) -> int:
        return demo_index(self.demo)


def demo_index(name: str) -> int:
    """k of "demo_<k>" (a file stem or an HDF5 group name)."""
    head, _, k = name.rpartition("_")
    if head != "demo" or not k.isdigit():
        raise ValueError(f"{name!r} is not a demonstration name; expected demo_<k> (e.g. demo_12)")
    return int(k)


def annotation_files(root: str | Path) -> dict[tuple[str, str], list[Path]]:
    """{(suite, task): [demo_<k>.jsonl paths sorted by k]} over `root/<suite>/<task>/demo_*.jsonl`, tasks sorted.

    Raises:
      FileNotFoundError when `root` is not a directory or holds no annotation file.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such annotations directory; pass the folder holding <suite>/<task>/demo_<k>.jsonl")
    grouped: dict[tuple[str, str], list[Path]] = {}
    for path in sorted(root.glob(FILE_GLOB)):
        grouped.setdefault((path.parent.parent.name, path.parent.name), []).append(path)
    if not grouped:
        raise FileNotFoundError(f"{root}: no <suite>/<task>/demo_<k>.jsonl annotation files; pass the annotations folder "
                                "(e.g. dataset/annotations of the released annotations)")
    return {key: sorted(paths, key=lambda p: demo_index(p.stem)) for key, paths in sorted(grouped.items())}


def row_target(row: Mapping, target: str | None, where: str) -> str:
    """The row's target text: `language[target]`, or (target None) the memory field under either name."""
    language = row.get("language")
    if not isinstance(language, Mapping):
        raise ValueError(f"{where}: row has no 'language' object; expected OxyGen's annotation rows")
    names = MEMORY_TARGETS if target is None else (target,)
    for name in names:
        if name in language:
            value = language[name]
            if not isinstance(value, str):
                raise ValueError(f"{where}: language.{name} must be a string, got {type(value).__name__}")
            return value
    raise ValueError(f"{where}: row has no language.{' or language.'.join(names)} (it has {sorted(language)}); "
                     "choose a target that the rows carry")


def read_rows(path: str | Path) -> Iterator[dict]:
    """The rows of one annotation file, parsed one line at a time (blank lines skipped)."""
    with open(path, encoding="utf-8") as stream:
        for line_no, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line_no}: not valid JSON ({e.msg}); re-download the annotations") from None


def read_demo(path: str | Path, suite: str, task: str, target: str | None = None) -> list[FrameRef]:
    """Every frame of one annotation file as a `FrameRef`, checked to be aligned: row i is frame i of its demo.

    Raises:
      ValueError naming the file and line of a misaligned or malformed row.
    """
    path = Path(path)
    demo = path.stem
    refs = []
    for i, row in enumerate(read_rows(path)):
        where = f"{path} row {i}"
        if row.get("frame") != i or row.get("demo") != demo:
            raise ValueError(f"{where}: misaligned annotation row (frame {row.get('frame')!r}, demo {row.get('demo')!r}; "
                             f"expected frame {i} of {demo})")
        instruction = row.get("task_instruction")
        if not isinstance(instruction, str):
            raise ValueError(f"{where}: task_instruction must be a string, got {type(instruction).__name__}")
        refs.append(FrameRef(suite=suite, task=task, demo=demo, frame=i, instruction=instruction,
                             target=row_target(row, target, where)))
    if not refs:
        raise ValueError(f"{path}: no rows; every demonstration file holds one row per frame")
    return refs
