"""Where a training run writes: `--out` itself when it resumes a run there, else a hidden folder beside it that
is renamed into place when the run ends, so a refused run leaves `--out` without anything from it.

    OUT/ absent or empty      writes .OUT.partial/   ended (finished, stopped, diverged): renamed to OUT/
                                                     refused: removed (with the folders above it the
                                                     run created)
    OUT/ holds a run          writes OUT/            refused: what this run added is taken back (new
                                                     checkpoints removed, metrics.jsonl cut to its old
                                                     length, run.json and tokenizer.model restored)
    .OUT.partial/ remains     writes .OUT.partial/   (a run killed before it ended) resumed there, then renamed;
                                                     refused: taken back as above

The name of the hidden folder depends only on `--out`, so every process of a multi-process run writes its
checkpoint shards into the same folder; only process 0 creates it, renames it or takes anything back (were
another process to create it first, process 0 would take the folder for one a killed run left and keep it
when the run is refused).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

_RESTORED = ("run.json", "tokenizer.model")  # small files a resumed run rewrites: kept whole to restore
_LOG = "metrics.jsonl"  # appended to: cut back to its old length
_STEPS = ("checkpoints", "checkpoints.rejected")  # folders of steps: new entries removed, moved ones put back


@dataclasses.dataclass
class RunFolder:
    """The folder a run writes into (`work`) and the one it ends up as (`final`, the resolved `--out`).

    Attributes:
      final: `--out`, resolved.
      work: where this run writes (`final`, or the hidden folder beside it).
      created: whether this run created `work`.
      made_parents: the folders above `work` this run created (deepest first), removed again when it is refused.
    """

    final: Path
    work: Path
    created: bool
    made_parents: tuple[Path, ...] = ()
    _entries: frozenset[str] = frozenset()
    _steps: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)
    _log_size: int | None = None
    _files: dict[str, bytes | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def open(cls, out: str | os.PathLike, *, create: bool = True) -> "RunFolder":
        """Chooses and creates the work folder (see the module docstring), probing that it is writable.

        `create=False` (every process but 0 of a multi-process run): only names it; folders that already
        exist are still probed.

        Raises:
          OSError: `--out` cannot be created or written (a file in the way, no permission).
        """
        final = Path(out).expanduser().resolve()
        if final.exists() and not final.is_dir():
            raise NotADirectoryError(f"{final} exists and is not a directory")
        resume_here = final.is_dir() and any(final.iterdir())
        work = final if resume_here else final.parent / f".{final.name}.partial"
        created = create and not work.exists()
        made_parents = tuple(a for a in work.parents if not a.exists()) if create else ()  # deepest first
        if create:
            work.mkdir(parents=True, exist_ok=True)
        for folder in (work, work / "checkpoints"):
            if folder.is_dir():
                fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=folder)
                os.close(fd)
                os.remove(probe)
        for name in (*_RESTORED, _LOG):
            if (work / name).exists() and not os.access(work / name, os.W_OK):
                raise PermissionError(f"{work / name} is read-only")
        return cls(final=final, work=work, created=created, made_parents=made_parents, _entries=frozenset(_dir_names(work)),
                   _steps={d: frozenset(_dir_names(work / d)) for d in _STEPS},
                   _log_size=(work / _LOG).stat().st_size if (work / _LOG).is_file() else None,
                   _files={n: (work / n).read_bytes() if (work / n).is_file() else None for n in _RESTORED})

    def final_path(self, path: str | os.PathLike) -> Path:
        """Where `path` (inside `work`) lies once the run has ended (`commit`)."""
        return self.final / Path(path).relative_to(self.work)

    def commit(self) -> Path:
        """The run ended: the work folder becomes `--out` (an empty `--out` is replaced). Returns `final`."""
        if self.work != self.final:
            if self.final.is_dir():
                self.final.rmdir()  # empty (else the run would have resumed there)
            os.replace(self.work, self.final)
        return self.final

    def abandon(self) -> None:
        """The run was refused: nothing it wrote stays (see the module docstring)."""
        if self.created:
            shutil.rmtree(self.work, ignore_errors=True)
            for parent in self.made_parents:  # e.g. --out a/b/run made a/ and a/b/: gone too, unless now in use
                try:
                    parent.rmdir()
                except OSError:
                    break
            return
        rejected = self.work / "checkpoints.rejected"
        for name in sorted(set(_dir_names(rejected)) - self._steps["checkpoints.rejected"]):
            if name in self._steps["checkpoints"] and not (self.work / "checkpoints" / name).exists():
                os.replace(rejected / name, self.work / "checkpoints" / name)  # moved aside by this run: back
        for folder in _STEPS:
            for name in set(_dir_names(self.work / folder)) - self._steps[folder]:
                _remove(self.work / folder / name)
        for name in {p.name for p in self.work.iterdir()} - self._entries:
            _remove(self.work / name)
        log = self.work / _LOG
        if self._log_size is not None and log.is_file() and log.stat().st_size > self._log_size:
            os.truncate(log, self._log_size)
        for name, data in self._files.items():
            if data is not None and (not (self.work / name).is_file() or (self.work / name).read_bytes() != data):
                (self.work / name).write_bytes(data)


def _dir_names(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir()] if folder.is_dir() else []


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
