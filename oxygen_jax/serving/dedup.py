"""Client side: each language result once, also behind openpi's `ActionChunkBroker`.

The server delivers a finished (or failed) language request exactly once, in one response. openpi's
`ActionChunkBroker` calls the server once per chunk and hands out one step per `infer`: it slices
every ndarray of the response by the step index and copies everything else, so the same
`"language": {"finished": [...]}` list reaches the robot code at every step of that chunk
(`action_horizon` times). Results carry the server's request `id`, so keeping the first sighting of
each id restores "exactly once" (a request has one "updates" entry per server response that advanced
it: those are told apart by the response's "frame"):

    broker = action_chunk_broker.ActionChunkBroker(client, action_horizon=10)
    seen = LanguageDedup()
    for step in range(100):
        out = seen(broker.infer(obs))               # same dict, "language" lists without repeats
        for done in out["language"]["finished"]:
            print(done["tag"], done["text"])        # each request once

or wrap the broker: `DedupPolicy(broker).infer(obs)`. `dedup_language(responses)` does the same for a
list of responses already received.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

_KINDS = ("accepted", "updates", "finished", "failed")


class LanguageDedup:
    """Remembers the request ids seen per kind ("accepted", "updates", "finished", "failed"); see the module
    docstring. An update is known by (request id, the response's "frame").

    Ids are unique within one server process (never reused), so call `forget()` after connecting to
    another or a restarted server. Memory: one int per id seen (a robot issuing 10 requests/s keeps
    about 3 MB a day); `forget()` also clears that.
    """

    def __init__(self):
        self._seen: dict[str, set] = {k: set() for k in _KINDS}

    def __call__(self, response: Mapping) -> dict:
        """A shallow copy of `response` whose "language" lists hold only entries not seen before."""
        out = dict(response)
        language = response.get("language")
        if not isinstance(language, Mapping):
            return out
        fresh = dict(language)
        for kind in _KINDS:
            entries = language.get(kind)
            if not isinstance(entries, list):
                continue
            kept = []
            for entry in entries:
                key = entry.get("id") if isinstance(entry, Mapping) else None
                if kind == "updates" and key is not None:
                    key = (key, response.get("frame"))
                if key is None or key not in self._seen[kind]:
                    kept.append(entry)
                    if key is not None:
                        self._seen[kind].add(key)
            fresh[kind] = kept
        out["language"] = fresh
        return out

    def forget(self) -> None:
        for ids in self._seen.values():
            ids.clear()


def dedup_language(responses: Iterable[Mapping]) -> list[dict]:
    """The responses in order, each "language" list without entries an earlier response already had."""
    seen = LanguageDedup()
    return [seen(r) for r in responses]


class DedupPolicy:
    """Wraps any policy with `infer(obs) -> dict` (e.g. openpi's ActionChunkBroker) and de-duplicates its language."""

    def __init__(self, policy):
        self.policy, self.seen = policy, LanguageDedup()

    def infer(self, obs) -> dict:
        return self.seen(self.policy.infer(obs))

    def reset(self) -> None:
        """Resets the wrapped policy; the ids seen are kept (a server never reuses a request id)."""
        self.policy.reset()
