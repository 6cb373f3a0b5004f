"""Training-state checkpoints that are verified before they are trusted (`StateCheckpoints`).

Each saved step is an orbax `CheckpointManager` step folder: the state's leaves as one flat item, a JSON item
with the leaf names, the run's identity (`TrainConfig`, model config, base digest, ...) and one SHA-256 per
leaf (dtype, shape and bytes), and beside them `digests.json`: the size and SHA-256 of every file orbax wrote
for the step, plus a SHA-256 of that list itself. A step is trusted only when every file is there with its
size and digest (checked before orbax reads anything, so a damaged file never reaches its readers), every
leaf restores and matches its digest, and every float leaf is finite. A non-finite state is never written.

Resuming (`resume`) walks the steps newest first: a step that fails verification (flipped bytes, a truncated,
emptied or missing file) is reported in one line and moved aside to `<directory>.rejected/<step>` (so the
resumed run can write that step again), and the next older step is tried; when no step is intact the run
stops with one line naming every step and why (the user moves the folder aside to start afresh: a fresh
start is never chosen silently). A step written by another run (another config, base or task) is not
damage: it is refused in one line naming the fields that differ.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import jax
import numpy as np

from training import distributed

STATE_FORMAT = 2  # 2: per-leaf and per-file SHA-256 (format 1, before verification, had neither)
DIGESTS_FILE = "digests.json"  # in each step folder, beside orbax's items


class CheckpointError(ValueError):
    """A training checkpoint that cannot be resumed: none intact, or written by another run."""


class _Rejected(Exception):
    """One step failed verification (the message is the reason)."""


def leaf_names(tree) -> list[str]:
    """Key paths of `tree`'s leaves, in `jax.tree.leaves` order."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def leaf_sha256(x: np.ndarray) -> str:
    """SHA-256 of a host array's dtype, shape and little-endian bytes."""
    a = np.ascontiguousarray(x)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    h = hashlib.sha256(f"{a.dtype.str}{list(a.shape)}".encode())
    h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def first_non_finite(named: Mapping[str, np.ndarray]) -> str | None:
    """The name of the first float leaf with a NaN or ±inf, or None."""
    for name, x in named.items():
        if np.issubdtype(x.dtype, np.inexact) and not np.isfinite(x).all():
            return name
    return None


def _json_sha256(info: Mapping) -> str:
    body = {k: v for k, v in info.items() if k != "json_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_file_digests(folder: Path) -> None:
    """`folder/digests.json`: {relative path: [size, sha256]} of every file under `folder`, written atomically."""
    files = {p.relative_to(folder).as_posix(): [p.stat().st_size, _file_sha256(p)]
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != DIGESTS_FILE}
    record = {"format": STATE_FORMAT, "files": files}
    record["json_sha256"] = _json_sha256(record)
    tmp = folder / f".{DIGESTS_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, folder / DIGESTS_FILE)


def _check_file_digests(folder: Path) -> None:
    """Raises `_Rejected` naming the first file of `folder` that is missing, resized or altered."""
    try:
        record = json.loads((folder / DIGESTS_FILE).read_text())
    except FileNotFoundError:
        raise _Rejected(f"it has no {DIGESTS_FILE} (not written by this trainer, or interrupted before it was)") from None
    except (OSError, ValueError) as e:
        raise _Rejected(f"its {DIGESTS_FILE} does not read ({_one_line(e)})") from None
    if not isinstance(record, dict) or record.get("json_sha256") != _json_sha256(record) \
            or not isinstance(record.get("files"), dict) or not record["files"]:
        raise _Rejected(f"its {DIGESTS_FILE} does not match its own SHA-256")
    for name, entry in record["files"].items():
        path = folder / name
        if not path.is_file():
            raise _Rejected(f"file {name} is missing")
        if not (isinstance(entry, list) and len(entry) == 2):
            raise _Rejected(f"its {DIGESTS_FILE} entry for {name} is malformed")
        size, digest = entry
        if path.stat().st_size != size:
            raise _Rejected(f"file {name} has {path.stat().st_size} bytes, {size} were written")
        if _file_sha256(path) != digest:
            raise _Rejected(f"file {name} does not match its SHA-256")


def _flat_items(d, prefix: str = "") -> dict:
    if not isinstance(d, Mapping):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flat_items(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _describe_difference(saved, now, limit: int = 4) -> str:
    """'rank: 4 in the checkpoint, 8 now, ...' for the (nested) fields that differ, at most `limit` of them."""
    a, b = (_flat_items(x) if isinstance(x, Mapping) else {} for x in (saved, now))
    diff = [k for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]
    parts = [f"{k}: {_short(a.get(k, '<absent>'))} in the checkpoint, {_short(b.get(k, '<absent>'))} now"
             for k in diff[:limit]]
    return ", ".join(parts) + (f", and {len(diff) - limit} more" if len(diff) > limit else "")


def _short(value, limit: int = 24) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Orbax logs its own errors about damaged files through absl; the caller reports them in one line."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class StateCheckpoints:
    """Verified training-state checkpoints under `directory` (an orbax `CheckpointManager`, one folder per step).

    `save` refuses a non-finite state; `restore` returns one verified step; `resume` falls back from damaged
    steps to the newest intact one. `meta` (given to all three) identifies the run, e.g. {"train": ...,
    "model": ..., "base_fingerprint": ...}; every key given is compared with what the step recorded.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).expanduser().resolve()  # orbax needs absolute paths
        with _quiet_orbax():  # it reads every step's metadata file, damaged or not
            self.manager = ocp.CheckpointManager(
                self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
                item_names=("state", "meta"),
            )

    @property
    def rejected_dir(self) -> Path:
        """Where `resume` moves steps that failed verification."""
        return self.directory.parent / f"{self.directory.name}.rejected"

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state, meta: Mapping) -> None:
        """Writes `state` (exact bytes) with its digests as step `state.step`; every process calls it.

        The arrays are written as they are laid out: with several processes each writes its own shards (FSDP
        leaves are never gathered into one file), and the step restores onto any number of processes. The
        digests are of the full values (gathered on every process); process 0 writes the file digests.

        Raises:
          ValueError: a float leaf is NaN or ±inf (nothing is written).
        """
        names, leaves = leaf_names(state), jax.tree.leaves(state)
        host = dict(zip(names, distributed.host(leaves)))
        step = int(distributed.host(state.step))
        bad = first_non_finite(host)
        if bad is not None:
            raise ValueError(f"refusing to save the training state of step {step}: {bad} is not finite")
        flat = {f"{i:04d}": x for i, x in enumerate(leaves)}
        info = {**meta, "format": STATE_FORMAT, "leaves": names, "step": step,
                "sha256": [leaf_sha256(x) for x in host.values()]}
        info["json_sha256"] = _json_sha256(info)
        ocp = self._ocp
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(info)),
                          force=True)
        self.manager.wait_until_finished()
        distributed.barrier(f"state_checkpoint_written_{step}")
        if distributed.is_primary():
            _write_file_digests(self._step_dir(step))
        distributed.barrier(f"state_checkpoint_digested_{step}")

    def restore(self, template, meta: Mapping, step: int | None = None):
        """The verified state of `step` (default the latest), shaped like `template`.

        Raises:
          FileNotFoundError: no step at all.
          CheckpointError: the step failed verification, or was written by another run (fields named).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no training checkpoint in {self.directory}")
        try:
            return self._verified(step, template, meta)
        except _Rejected as why:
            raise CheckpointError(f"{self.directory}: step {step} failed verification: {why}") from None

    def resume(self, template, meta: Mapping, report: Callable[[int, str], None] | None = None):
        """The newest intact step's state, or None when there is no step; damaged steps are reported and moved
        aside (to `rejected_dir`) on the way.

        Args:
          report: called once per rejected step with (step, reason).
        Raises:
          CheckpointError: steps exist but none is intact (one line naming each), or one was written by another run.
        """
        with _quiet_orbax():
            steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            return None
        rejected: list[tuple[int, str]] = []
        for step in steps:
            try:
                state = self._verified(step, template, meta)
            except _Rejected as why:
                rejected.append((step, str(why)))
                if report is not None:
                    report(step, str(why))
                continue
            if rejected:
                distributed.barrier("state_checkpoint_verified")
                if distributed.is_primary():
                    for bad, _ in rejected:
                        self._move_aside(bad)
                distributed.barrier("state_checkpoint_moved_aside")
                with _quiet_orbax():
                    self.manager.reload()
            return state
        reasons = "; ".join(f"step {s}: {why}" for s, why in rejected)
        raise CheckpointError(f"{self.directory}: no intact training checkpoint ({reasons}); move the folder aside "
                              "(or delete it) to train from step 0")

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)  # orbax's default step folder name

    def _verified(self, step: int, template, meta: Mapping):
        ocp = self._ocp
        _check_file_digests(self._step_dir(step))
        with _quiet_orbax():
            try:
                info = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            except Exception as e:  # a damaged or missing JSON item: orbax raises whatever its readers raise
                raise _Rejected(f"its JSON item does not read ({_one_line(e)})") from None
        if not isinstance(info, dict) or info.get("format") != STATE_FORMAT:
            raise _Rejected("it has no digests (written before checkpoints were verified, or not by this trainer)")
        if info.get("json_sha256") != _json_sha256(info):
            raise _Rejected("its JSON item does not match its SHA-256")
        if info.get("step") != step:
            raise _Rejected(f"its JSON item names step {info.get('step')}")
        want = json.loads(json.dumps(dict(meta)))  # tuples read back as lists
        differ = [k for k in want if info.get(k) != want[k]]
        if differ:
            what = "; ".join(f"another {k} config ({_describe_difference(info.get(k), want[k])})"
                             if isinstance(want[k], Mapping) else
                             f"another {k} ({_short(info.get(k, '<absent>'))} in the checkpoint, {_short(want[k])} now)"
                             for k in differ)
            raise CheckpointError(f"{self.directory}: the checkpoint at step {step} was written by a run with {what}; "
                                  "resume with the checkpoint's flags, base and tokenizer, or choose a new --out")
        names, (leaves, treedef) = leaf_names(template), jax.tree_util.tree_flatten(template)
        if info.get("leaves") != names:
            raise CheckpointError(f"{self.directory}: the checkpoint's state tree differs from this run's "
                                  "(mode, rank or targets changed); resume with the checkpoint's flags or choose a new --out")
        digests = info.get("sha256")
        if not isinstance(digests, list) or len(digests) != len(leaves):
            raise _Rejected("its JSON item has no digest per leaf")
        # Restored with the template's layout (e.g. this run's mesh), whatever layout wrote the step.
        abstract = {f"{i:04d}": jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                                     sharding=x.sharding if isinstance(x, jax.Array) else None)
                    for i, x in enumerate(leaves)}
        with _quiet_orbax():
            try:
                restored = self.manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
                arrays = [restored[f"{i:04d}"] for i in range(len(leaves))]
                host = distributed.host(arrays)
            except Exception as e:  # truncated, emptied or missing array files
                raise _Rejected(f"its arrays do not read ({_one_line(e)})") from None
        for name, x, want in zip(names, host, digests):
            if leaf_sha256(x) != want:
                raise _Rejected(f"leaf {name} does not match its SHA-256")
        bad = first_non_finite(dict(zip(names, host)))
        if bad is not None:
            raise _Rejected(f"leaf {bad} is not finite")
        keep = [a if isinstance(x, jax.Array) else h for a, h, x in zip(arrays, host, leaves)]
        return jax.tree_util.tree_unflatten(treedef, keep)

    def _move_aside(self, step: int) -> None:
        src = self._step_dir(step)
        if not src.exists():
            return
        dest = self.rejected_dir / str(step)
        k = 1
        while dest.exists():
            dest, k = self.rejected_dir / f"{step}.{k}", k + 1
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dest))

    def close(self) -> None:
        self.manager.close()


def _one_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:limit]}" + ("..." if len(text) > limit else "")
