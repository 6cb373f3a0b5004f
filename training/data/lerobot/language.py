"""Per-frame text from LeRobot's language columns (`language_persistent`, `language_events`).

`language_persistent` repeats the episode's whole list of spans on every frame; each row {role, content, style,
timestamp, camera, tool_calls} becomes active at its `timestamp` and stays active until the next row of the same
style. `language_events` holds only the rows emitted at that frame (no timestamp). Per frame at time t:

    active_at(rows, t, style)  content of the row of `style` with the largest timestamp <= t ('' if none)
    emitted(events, style)     content of the event row of `style` ('' if none)
    speech(events)             the text argument of the assistant's `say` tool call ('' if none)

e.g. memory rows at 0.2 s and 0.5 s: frames at 0.0, 0.1 s have no memory (''), 0.2 to 0.4 s the first, from
0.5 s the second. Times are compared exactly: t is the frame's float32 timestamp widened to float64, as the
persistent timestamps are (LeRobot's `language_render.active_at`). Several rows of one style at the latest
time are ambiguous, as in LeRobot: a one-line ValueError. So is a row that is not a struct, a `content` that is
not a string, or a `timestamp` that is not a finite number (the file is not what LeRobot writes).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence

PERSISTENT = "language_persistent"
EVENTS = "language_events"
PERSISTENT_STYLES = ("subtask", "plan", "memory", "motion", "task_aug")
EVENT_STYLES = ("interjection", "vqa", "trace")


def _rows(rows, where: str = "language columns") -> list[Mapping]:
    """The non-null rows of one frame's language cell, each checked to be a struct with a string (or null)
    `content` and, when present, a finite `timestamp`."""
    if rows is None:
        return []
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"{where}: a language cell holds {type(rows).__name__}, expected a list of rows")
    out = []
    for r in rows:
        if r is None:
            continue
        if not isinstance(r, Mapping):
            raise ValueError(f"{where}: a language row is {type(r).__name__} {str(r)[:40]!r}, expected a struct "
                             "{role, content, style, timestamp, ...}")
        content, t = r.get("content"), r.get("timestamp")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where}: a language row's content is {type(content).__name__}, expected a string")
        if t is not None and not (isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t)):
            raise ValueError(f"{where}: a language row's timestamp is {t!r:.40}, expected a finite number")
        out.append(r)
    return out


def active_at(rows: Sequence[Mapping] | None, t: float, style: str, where: str = "language_persistent") -> str:
    """The content of the `style` row active at `t` ('' when none is active yet); see the module docstring."""
    matches = [r for r in _rows(rows, where) if r.get("style") == style and r.get("timestamp") is not None
               and float(r["timestamp"]) <= t]
    if not matches:
        return ""
    latest = max(float(r["timestamp"]) for r in matches)
    at = [r for r in matches if float(r["timestamp"]) == latest]
    if len(at) > 1:
        raise ValueError(f"{where}: {len(at)} rows of style {style!r} become active at t={latest}; "
                         "the annotation is ambiguous (LeRobot's active_at refuses it too)")
    return at[0].get("content") or ""


def emitted(events: Sequence[Mapping] | None, style: str, role: str | None = None, where: str = EVENTS) -> str:
    """The content of this frame's event row of `style` (and `role`, when given), '' if none."""
    matches = [r for r in _rows(events, where) if r.get("style") == style and (role is None or r.get("role") == role)]
    if len(matches) > 1:
        raise ValueError(f"{where}: {len(matches)} event rows of style {style!r} on one frame; pass a role")
    return (matches[0].get("content") or "") if matches else ""


def _tool_calls(row: Mapping) -> list:
    calls = row.get("tool_calls") or []
    out = []
    for call in calls if isinstance(calls, (list, tuple)) else []:
        if isinstance(call, str):  # the declared schema stores tool calls as JSON strings
            try:
                call = json.loads(call)
            except ValueError:
                continue
        if isinstance(call, Mapping):
            out.append(call)
    return out


def speech(events: Sequence[Mapping] | None, where: str = EVENTS) -> str:
    """The text the assistant says on this frame (its `say` tool call's `text` argument), '' if none."""
    said = []
    for row in _rows(events, where):
        if row.get("role") != "assistant":
            continue
        for call in _tool_calls(row):
            fn = call.get("function") or {}
            if not isinstance(fn, Mapping) or fn.get("name") != "say":
                continue
            args = fn.get("arguments") or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip().startswith("{") else {"text": args}
                except ValueError:
                    raise ValueError(f"{where}: a 'say' call's arguments are not valid JSON") from None
            text = args.get("text") if isinstance(args, Mapping) else None
            if not isinstance(text, (str, type(None))):
                raise ValueError(f"{where}: a 'say' call's text is {type(text).__name__}, expected a string")
            said.append(text or "")
    if len(said) > 1:
        raise ValueError(f"{where}: {len(said)} 'say' tool calls on one frame")
    return said[0] if said else ""


def frame_texts(persistent: Sequence[Mapping] | None, events: Sequence[Mapping] | None, t: float,
                where: str = "language columns") -> dict[str, str]:
    """LeRobot's default bindings at time `t`: subtask, plan, memory (active), interjection, speech (emitted)."""
    out = {s: active_at(persistent, t, s, where) for s in ("subtask", "plan", "memory")}
    out["interjection"] = emitted(events, "interjection", where=where)
    out["speech"] = speech(events, where)
    return out
