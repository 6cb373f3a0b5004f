"""Behind openpi's ActionChunkBroker every language result reaches the robot code exactly once."""

import numpy as np
from openpi_client import action_chunk_broker

from oxygen_jax.serving.dedup import DedupPolicy, LanguageDedup, dedup_language

HA = 4


class _ChunkServer:
    """A policy answering one chunk per call; call i finishes request i (and accepts request i + 1)."""

    def __init__(self):
        self.calls = 0

    def infer(self, obs):
        i, self.calls = self.calls, self.calls + 1
        return {"actions": np.full((HA, 2), i, np.float32),
                "language": {"accepted": [{"id": i + 1, "tag": f"t{i + 1}"}],
                             "finished": [{"id": i, "tag": f"t{i}", "text": f"text {i}"}], "failed": []}}

    def reset(self):
        pass


def test_the_broker_repeats_results_and_the_wrapper_keeps_each_once():
    broker = action_chunk_broker.ActionChunkBroker(_ChunkServer(), action_horizon=HA)
    raw = [broker.infer({}) for _ in range(3 * HA)]
    assert sum(len(r["language"]["finished"]) for r in raw) == 3 * HA  # the broker copies per step
    policy = DedupPolicy(action_chunk_broker.ActionChunkBroker(_ChunkServer(), action_horizon=HA))
    steps = [policy.infer({}) for _ in range(3 * HA)]
    finished = [f["id"] for s in steps for f in s["language"]["finished"]]
    accepted = [a["id"] for s in steps for a in s["language"]["accepted"]]
    assert finished == [0, 1, 2] and accepted == [1, 2, 3]
    for k, s in enumerate(steps):  # actions untouched: step k is action k % HA of chunk k // HA
        np.testing.assert_array_equal(s["actions"], np.full((2,), k // HA, np.float32))


def test_responses_without_language_or_ids_pass_through():
    seen = LanguageDedup()
    assert seen({"actions": 1}) == {"actions": 1}
    no_id = {"language": {"finished": [{"text": "x"}]}}
    assert seen(no_id) == no_id and seen(no_id) == no_id  # nothing to key on: kept every time
    out = dedup_language([{"language": {"failed": [{"id": 3}]}}] * 2)
    assert [len(r["language"]["failed"]) for r in out] == [1, 0]
    seen({"language": {"finished": [{"id": 9}]}})
    seen.forget()
    assert seen({"language": {"finished": [{"id": 9}]}})["language"]["finished"] == [{"id": 9}]
