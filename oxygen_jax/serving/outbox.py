"""A robot's language outbox: its live requests, and what its next reply says about them.

Every language request a robot owns (one it sent, or an automatic one: `serving.auto_language`) is followed
from acceptance to exactly one final result. Engine steps between two replies of that robot (its own steps
and other robots') emit tokens; its next reply's "language" carries

* "updates": one entry per request that advanced since the last reply, by request id (acceptance order):
  {"id", "tag", "new_tokens": [ids emitted since the last reply], "text": the text so far, "finished": bool}
  (the concatenated "new_tokens" of a request are its tokens; its last update has "finished": true);
* "finished": [{"id", "tag", "text", "tokens", "latency_frames", "latency_ms"}] and "failed": [{"id", "tag",
  "error"}], each request in exactly one of them, exactly once.

Worked example (two tokens per step; request 7 answers "a" "b" "c", its robot alone):

    reply of frame 0: accepted [{id 7}]   updates [{id 7, new_tokens [a, b], text "ab", finished false}]
    reply of frame 1: updates [{id 7, new_tokens [c], text "abc", finished true}]
                      finished [{id 7, text "abc", tokens [a, b, c], ...}]

`LanguageRouter.route` files one step's events (`records.StepOutput`) with the owning robots' outboxes.
Event-loop side only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

REPLACED = "replaced by a newer automatic request (auto mode 'replace')"


@dataclasses.dataclass(eq=False)
class _Live:
    """One live request: the client's tag, whether the server opened it, and its progress."""

    tag: Any
    auto: bool
    text: str = ""  # detokenized so far
    fresh: list[int] | None = None  # token ids emitted since the last reply (None: did not advance)


class LanguageOutbox:
    """One robot's live requests and the language part of its next reply (see the module docstring)."""

    def __init__(self):
        self._live: dict[int, _Live] = {}  # request id -> progress, in acceptance order
        self._updates: dict[int, dict] = {}  # request id -> its update for the next reply
        self.finished: list[dict] = []
        self.failed: list[dict] = []

    @property
    def live(self) -> int:
        """Requests accepted and not yet finished or failed."""
        return len(self._live)

    @property
    def auto_ids(self) -> list[int]:
        """Live automatic requests, oldest first."""
        return [rid for rid, r in self._live.items() if r.auto]

    def accept(self, request_id: int, tag: Any, auto: bool = False) -> None:
        self._live[request_id] = _Live(tag=tag, auto=auto)

    def advance(self, request_id: int, tokens: Sequence[int], text: str) -> None:
        """Tokens (and the text they completed) a step emitted for a live request; unknown ids are ignored."""
        r = self._live.get(request_id)
        if r is None or not tokens:
            return
        r.text += text
        u = self._updates.setdefault(request_id, {"id": request_id, "tag": r.tag, "new_tokens": [], "text": "",
                                                  "finished": False})
        u["new_tokens"] += [int(t) for t in tokens]
        u["text"] = r.text

    def finish(self, done) -> None:
        """A `runtime.engine.FinishedRequest` of this robot: its final result, and its last update."""
        r = self._live.pop(done.request_id, None)
        tag = None if r is None else r.tag
        text = done.text or ""
        self.finished.append({
            "id": done.request_id, "tag": tag, "text": text, "tokens": [int(t) for t in done.tokens],
            "latency_frames": done.latency_frames, "latency_ms": round(done.latency_ms, 3)})
        u = self._updates.setdefault(done.request_id, {"id": done.request_id, "tag": tag, "new_tokens": []})
        u.update(text=text, finished=True)

    def fail(self, request_id: int, reason: str) -> None:
        r = self._live.pop(request_id, None)
        self.failed.append({"id": request_id, "tag": None if r is None else r.tag, "error": reason})

    def take(self) -> dict:
        """{"finished", "failed", "updates"} since the last call; each result and each token is returned once."""
        updates = [u for _, u in sorted(self._updates.items())]
        out = {"finished": self.finished, "failed": self.failed, "updates": updates}
        self.finished, self.failed, self._updates = [], [], {}
        return out


class LanguageRouter:
    """Files each engine step's language events with the outbox of the robot that owns each request."""

    def __init__(self):
        self._owner: dict[int, Any] = {}  # live request id -> its `records.Stream`

    def route(self, frames: Sequence, out) -> None:
        """`frames` and their step's `records.StepOutput`: requests replaced, accepted, advanced, finished, failed."""
        for f, res in zip(frames, out.results):
            for rid in res.replaced:
                self._owner.pop(rid, None)
                f.stream.language.fail(rid, REPLACED)
            for req in res.accepted:
                self._owner[req["id"]] = f.stream
                f.stream.language.accept(req["id"], req["tag"], auto=req.get("auto", False))
        for rid, (tokens, text) in out.emitted.items():
            s = self._owner.get(rid)
            if s is not None and not s.closed:
                s.language.advance(rid, tokens, text)
        for done in out.finished:
            self._owner.pop(done.request_id, None)
            if done.owner is not None and not done.owner.closed:
                done.owner.language.finish(done)
        for err in out.failed:
            self._owner.pop(err.request_id, None)
            if err.owner is not None and not err.owner.closed:
                err.owner.language.fail(err.request_id, err.reason)

    def forget(self, stream) -> None:
        """Drops a closed robot's requests (the engine cancels them: no result will come)."""
        for rid in [rid for rid, s in self._owner.items() if s is stream]:
            del self._owner[rid]
