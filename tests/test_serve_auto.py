"""OxyGen's serving contract as options: automatic language requests and per-frame partial text.

One tiny real-engine server with `--auto-language` on (batch size 1), an unmodified openpi client against
it, and model-free checks of the three automatic modes and of the outbox that turns engine steps into
each robot's "updates" / "finished" / "failed".
"""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
from websockets.sync.client import connect

from oxygen_jax.robots.config import robot_config
from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.robots import transforms
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from oxygen_jax.runtime.engine import Engine, EngineConfig, FinishedRequest
from oxygen_jax.serving import wire
from oxygen_jax.serving.auto_language import AutoLanguage, AutoRequests
from oxygen_jax.serving.records import LanguageRequest
from oxygen_jax.serving.dedup import dedup_language
from oxygen_jax.serving.outbox import REPLACED, LanguageOutbox, LanguageRouter
from oxygen_jax.serving.refusal_log import RefusalLog
from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

ROBOT = robot_config("libero", max_token_len=32)
AUTO = AutoLanguage(prompt="Memory: ", max_tokens=5)  # 5 tokens at k = 2: each request lives two frames


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _server(params, auto: AutoLanguage) -> ServerThread:
    """A tiny π0.5 server of batch size 1 (every server of this module runs the same compiled programs)."""
    tok = train_demo_tokenizer()
    engine = Engine(as_vla(params, 2), EngineConfig(num_slots=8, max_new_tokens=6, prompt_capacity=8,
                                                    tokens_per_frame=2, action_horizon=ROBOT.action_horizon),
                    tokenizer=tok)
    handle = ServerThread(PolicyServer(engine, tok, ROBOT, ServeConfig(
        host="127.0.0.1", port=0, buckets=(1,), deadline_ms=1000, auto_language=auto))).start()
    handle.wait_ready(timeout=600)
    return handle


def _frames(port: int, n: int) -> list[dict]:
    """The "language" of n replies to one robot sending the same observation (openpi's wire format)."""
    sample = transforms.synthetic_sample(ROBOT, np.random.default_rng(3), prompt="put the bowl on the plate")
    with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        ws.recv()
        out = []
        for _ in range(n):
            ws.send(wire.pack(sample))
            out.append(wire.unpack(ws.recv(timeout=60))["language"])
    return out


@pytest.fixture(scope="module")
def served(tiny_params):
    """(server thread, log lines of oxygen_jax.serve): tiny π0.5, automatic 'Memory: ' requests, new_each_call."""
    records, logger = _Records(), logging.getLogger("oxygen_jax.serve")
    logger.addHandler(records)
    level = logger.level
    logger.setLevel(logging.INFO)
    handle = _server(tiny_params, AUTO)
    yield handle, records.lines
    handle.stop()
    logger.removeHandler(records)
    logger.setLevel(level)


def test_an_unmodified_openpi_client_gets_partial_text_every_frame_and_each_final_text_once(served):
    try:
        from openpi_client import websocket_client_policy
    except ImportError:
        pytest.skip("openpi-client not installed: pip install --no-deps -r requirements-test.txt")
    handle, log_lines = served
    assert any(line.startswith("compiling batch size 1 (1 of 1") for line in log_lines)  # warm-up says what
    client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=handle.port)
    assert client.get_server_metadata()["language"]["auto"]["prompt"] == "Memory: "
    sample = transforms.synthetic_sample(ROBOT, np.random.default_rng(3), prompt="put the bowl on the plate")
    replies = []
    for f in range(6):
        obs = dict(sample)
        if f == 2:  # a robot's own request is answered beside the automatic ones
            obs["language_requests"] = [{"prompt": "Sub", "max_tokens": 3, "id": "mine"}]
        replies.append(client.infer(obs)["language"])
    client._ws.close()

    auto_ids = []
    for lang in replies:  # one automatic request per observation, and text on every frame
        auto = [a for a in lang["accepted"] if a.get("auto")]
        assert len(auto) == 1 and auto[0]["tag"] == "auto"
        auto_ids.append(auto[0]["id"])
        assert lang["updates"] and all(isinstance(u["text"], str) for u in lang["updates"])
    assert len(set(auto_ids)) == 6

    finished = [d for lang in replies for d in lang["finished"]]
    assert len(finished) == len({d["id"] for d in finished}) >= 5  # each final result exactly once
    assert "mine" in {d["tag"] for d in finished}
    assert not [d for lang in replies for d in lang["failed"]]
    for done in finished:  # the updates of a request add up to its final result
        updates = [u for lang in replies for u in lang["updates"] if u["id"] == done["id"]]
        assert sum((u["new_tokens"] for u in updates), []) == done["tokens"]
        assert [u["finished"] for u in updates] == [False] * (len(updates) - 1) + [True]
        assert updates[-1]["text"] == done["text"] and all(done["text"].startswith(u["text"]) for u in updates)


def test_a_refused_frame_leaves_one_log_line(served):
    handle, log_lines = served
    with connect(f"ws://127.0.0.1:{handle.port}", compression=None) as ws:
        ws.recv()
        ws.send(wire.pack({"observation/state": np.zeros(8)}))
        assert ws.recv(timeout=30).startswith("BadRequest")
    assert any(" frame refused: BadRequest" in line for line in log_lines)


@pytest.mark.parametrize("mode", ["keep", "replace"])
def test_keep_waits_for_the_running_request_and_replace_cancels_it_each_with_one_final_result(served, tiny_params,
                                                                                              mode):
    handle = _server(tiny_params, AutoLanguage(prompt="Memory: ", max_tokens=5, mode=mode))
    try:
        replies = _frames(handle.port, 4)
    finally:
        handle.stop()
    opened = [[a["id"] for a in lang["accepted"]] for lang in replies]
    finals = [d for lang in replies for d in lang["finished"] + lang["failed"]]
    if mode == "keep":  # a request lives two frames: a new one opens only after it finished
        assert opened == [[0], [], [1], []] and [d["id"] for d in finals] == [0, 1]
        assert all("error" not in d for d in finals)
    else:  # every observation opens one and cancels the one before it
        assert opened == [[0], [1], [2], [3]]
        assert [(d["id"], d.get("error")) for d in finals] == [(0, REPLACED), (1, REPLACED), (2, REPLACED)]


# -------------------------------------------------------------------------------------------------
# The modes, the outbox and the log budget (no model)
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, running, live, asked, opens, replaces", [
    ("new_each_call", [1, 2], 2, 0, True, ()),  # another beside the running ones
    ("new_each_call", [1, 2], 7, 1, False, ()),  # the cap (8) is full: skipped
    ("keep", [1], 1, 0, False, ()),  # the running one is kept, no new one
    ("keep", [], 3, 0, True, ()),
    ("replace", [1], 8, 0, True, (1,)),  # cancelling the running one makes room
])
def test_each_mode_opens_keeps_or_replaces_a_running_automatic_request(mode, running, live, asked, opens, replaces):
    req = LanguageRequest(prompt="Memory: ", max_tokens=5, auto=True, tag="auto")
    plan = AutoRequests(AutoLanguage(prompt="Memory: ", mode=mode), req).plan(running, live, asked, cap=8)
    assert (plan.request is req) == opens and plan.replace == replaces
    assert (plan.skipped is not None) == (not opens and mode != "keep")


def _step(results=(), emitted=None, finished=(), failed=()):
    return types.SimpleNamespace(results=list(results), emitted=emitted or {}, finished=list(finished),
                                 failed=list(failed))


def _done(rid, owner, tokens, text):
    return FinishedRequest(request_id=rid, tokens=tokens, text=text, arrival_frame=0, admit_frame=0, finish_frame=1,
                           latency_frames=2, latency_ms=1.0, owner=owner)


def test_tokens_emitted_in_other_robots_steps_reach_the_owner_once_and_a_replaced_request_fails_once():
    a = types.SimpleNamespace(language=LanguageOutbox(), closed=False)
    router = LanguageRouter()
    accepted = types.SimpleNamespace(accepted=[{"id": 7, "tag": "auto", "auto": True}], replaced=[])
    router.route([types.SimpleNamespace(stream=a)], _step([accepted], {7: ([4, 5], "ab")}))
    router.route([], _step(emitted={7: ([6], "c")}))  # another robot's step advances a's request
    first = a.language.take()
    assert first["updates"] == [{"id": 7, "tag": "auto", "new_tokens": [4, 5, 6], "text": "abc", "finished": False}]
    assert a.language.auto_ids == [7] and a.language.take()["updates"] == []  # nothing twice

    router.route([], _step(emitted={7: ([8], "d")}, finished=[_done(7, a, [4, 5, 6, 8], "abcd")]))
    last = a.language.take()
    assert last["updates"] == [{"id": 7, "tag": "auto", "new_tokens": [8], "text": "abcd", "finished": True}]
    assert [d["id"] for d in last["finished"]] == [7] and a.language.live == 0

    replacing = types.SimpleNamespace(accepted=[{"id": 9, "tag": "auto", "auto": True}], replaced=[8])
    a.language.accept(8, "auto", auto=True)
    router.route([types.SimpleNamespace(stream=a)], _step([replacing]))
    assert a.language.take()["failed"] == [{"id": 8, "tag": "auto", "error": REPLACED}]
    assert a.language.auto_ids == [9]


def test_dedup_keeps_one_update_per_request_and_server_frame_behind_the_chunk_broker():
    u0 = {"id": 3, "new_tokens": [1], "text": "a", "finished": False}
    u1 = {"id": 3, "new_tokens": [2], "text": "ab", "finished": True}
    steps = [{"frame": 0, "language": {"updates": [u0]}}] * 2 + [{"frame": 1, "language": {"updates": [u1]}}] * 2
    assert [s["language"]["updates"] for s in dedup_language(steps)] == [[u0], [], [u1], []]


def test_refusal_lines_are_rate_limited_and_the_next_line_counts_those_left_out(caplog):
    now = [0.0]
    refusals = RefusalLog(rate=1.0, burst=2, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="oxygen_jax.serve"):
        written = [refusals.note(1, "peer", f"BadRequest: {i}\nforged line") for i in range(5)]
        now[0] = 1.0
        written.append(refusals.note(1, "peer", "BadRequest: later"))
    assert written == [True, True, False, False, False, True]
    assert [r.getMessage().count("\n") for r in caplog.records] == [0, 0, 0]
    assert caplog.records[-1].getMessage().endswith("(3 more refused frames not logged)")
