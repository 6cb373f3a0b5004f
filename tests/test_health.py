"""What a load balancer reads of one replica: `/healthz` JSON, 503 exactly when no new robot fits, the
same numbers in `/metrics`, and the HAProxy configuration shipped for N replicas (`eval/serving/replicas.py`).

The live test uses a model-free `ScriptedEngine` server with one robot slot; the HAProxy template is only
rendered here (`eval/serving/replicas.py` runs `haproxy -c` on it and a real balancer in front of two servers).
"""

from __future__ import annotations

import json
import time

import pytest
from websockets.exceptions import InvalidStatus

from eval.serving import replicas
from oxygen_jax.serving import wire
from oxygen_jax.serving.health import Health
from test_serve import HA, ScriptedEngine, _http, _metrics, _raw, _sample, _scripted_server

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

FIELDS = {"status", "ready", "draining", "robots", "robot_slots", "robot_slots_free", "connections",
          "connection_slots", "language_active", "language_slots", "language_slots_free", "language_queued",
          "queue_depth"}


def _health(**kw) -> Health:
    base = dict(ready=True, draining=False, robots=0, robot_slots=4, connections=0, connection_slots=8,
                language_active=0, language_slots=8, language_queued=0, queue_depth=0)
    return Health(**{**base, **kw})


def test_status_is_ok_only_when_a_new_robot_fits_and_draining_and_warm_up_come_first():
    assert (_health().status, _health().http_status) == ("ok", 200)
    assert _health(robots=3, connections=3).robot_slots_free == 1
    assert _health(robots=4, connections=4).status == "full"
    assert _health(robots=2, connections=8).status == "full"  # handshakes took every connection
    assert _health(robots=2, connections=7).robot_slots_free == 1  # free robot slots, at most free connections
    assert _health(ready=False).status == "warming_up"
    assert _health(ready=False, draining=True, robots=4).status == "draining"
    assert all(_health(**kw).http_status == 503 for kw in ({"robots": 4}, {"ready": False}, {"draining": True}))
    assert _health(language_active=6).language_slots_free == 2


def test_healthz_reports_slots_as_json_and_a_full_server_is_503_while_its_robot_stays_served():
    engine = ScriptedEngine()
    handle = _scripted_server(engine, max_robots=1, max_connections=4)
    try:
        port = handle.port
        status, text = _http(port, "/healthz")
        body = json.loads(text)
        assert status == 200 and set(body) == FIELDS
        assert body | {"connection_slots": 4} == {
            "status": "ok", "ready": True, "draining": False, "robots": 0, "robot_slots": 1, "robot_slots_free": 1,
            "connections": 0, "connection_slots": 4, "language_active": 0, "language_slots": 4,
            "language_slots_free": 4, "language_queued": 0, "queue_depth": 0}

        robot, _ = _raw(port)
        assert _http(port, "/healthz")[0] == 200  # a handshake holds no robot slot
        robot.send(wire.pack(_sample(0)))
        assert wire.unpack(robot.recv(timeout=10))["actions"].shape == (HA, 7)
        status, text = _http(port, "/healthz")
        body = json.loads(text)
        assert status == 503 and body["status"] == "full"
        assert (body["robots"], body["robot_slots_free"], body["connections"]) == (1, 0, 1)
        m = _metrics(port)
        assert (m["oxygen_robots"], m["oxygen_robot_slots_free"], m["oxygen_accepting"]) == (1, 0, 0)
        assert (m["oxygen_robot_slots"], m["oxygen_language_slots_free"], m["oxygen_draining"]) == (1, 4, 0)
        with pytest.raises(InvalidStatus) as refused:  # a second robot is refused at the handshake
            _raw(port)
        assert refused.value.response.status_code == 503

        robot.send(wire.pack(_sample(0)))  # the robot it has keeps being served
        assert wire.unpack(robot.recv(timeout=10))["actions"].shape == (HA, 7)
        robot.close()
        for _ in range(200):  # the slot frees once the server has seen the close
            if _http(port, "/healthz")[0] == 200:
                break
            time.sleep(0.01)
        assert json.loads(_http(port, "/healthz")[1])["robot_slots_free"] == 1
    finally:
        handle.stop()


def test_haproxy_config_renders_one_checked_server_per_replica():
    text = replicas.render_haproxy([("127.0.0.1", 9001), ("10.0.0.2", 9002), ("10.0.0.3", 9003)], bind_port=8000,
                                   stats_port=8404)
    servers = [line.split() for line in text.splitlines() if line.strip().startswith("server ")]
    assert [s[1:3] for s in servers] == [["replica0", "127.0.0.1:9001"], ["replica1", "10.0.0.2:9002"],
                                         ["replica2", "10.0.0.3:9003"]]
    assert all(len(s) == 3 for s in servers)  # each inherits the health check of default-server
    assert "bind 127.0.0.1:8000" in text and "bind 127.0.0.1:8404" in text
    for line in ("default-server check", "balance leastconn", "option httpchk GET /healthz", "http-check expect status 200",
                 "stick on url_param(robot)", "timeout tunnel"):
        assert line in text, line
    assert "${" not in text  # every placeholder filled


def test_a_speculating_server_names_its_drafter_in_metadata_healthz_and_metrics():
    import dataclasses

    from prometheus_client.parser import text_string_to_metric_families

    from oxygen_jax.robots.tokenizer import train_demo_tokenizer
    from oxygen_jax.serving import health
    from oxygen_jax.serving.records import StepOutput, Stream
    from oxygen_jax.serving.server import PolicyServer
    from test_serve import ROBOT

    plain, engine = ScriptedEngine(), ScriptedEngine()
    engine.config = dataclasses.replace(engine.config, speculate=3, verify_cost=1.5)
    servers = [PolicyServer(e, train_demo_tokenizer(), ROBOT) for e in (plain, engine)]  # not started: no compile
    try:
        off, on = servers
        stream = Stream(id=0, deadline_s=0.1)
        assert "speculative" not in off.metadata(stream) and "speculative" not in health.of_server(off).as_dict()
        assert "speculative" not in off.metrics.render()[0]
        assert on.metadata(stream)["speculative"] == {"draft_tokens": 3, "drafter": on.metrics.speculation.summary()[
            "drafter"], "verify_cost": 1.5}
        for proposed, accepted in ((10, 7), (0, 0), (2, 2)):  # three steps' results
            on.metrics.on_step(StepOutput(results=[], finished=[], failed=[], emitted={}, rows=0, bucket=0, step_ms=0.0,
                                          language_active=0, language_queued=0, drafts_proposed=proposed,
                                          drafts_accepted=accepted))
        body = health.of_server(on).as_dict()["speculative"]
        assert (body["draft_tokens"], body["drafts_proposed"], body["drafts_accepted"], body["acceptance_rate"]) == (
            3, 12, 9, 0.75)
        text = on.metrics.render()[0]
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert (got["oxygen_speculative_drafts_proposed_total"], got["oxygen_speculative_drafts_accepted_total"],
                got["oxygen_speculative_acceptance_rate"]) == (12, 9, 0.75)
        assert on.metrics.speculation.describe(1.5).startswith("speculative decoding on: γ = 3 draft tokens")
    finally:
        for s in servers:
            s._stop_threads()
