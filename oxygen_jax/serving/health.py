"""What a load balancer needs of one replica: `GET /healthz` as JSON, and the same numbers as gauges.

A balancer in front of N replicas sends each *new* robot to a replica that can take it and leaves every
robot it has already placed where it is (a robot is one websocket connection for its whole session).
`/healthz` answers 200 when this replica takes another robot and 503 when it does not (still compiling,
draining, or full), always with the JSON body below, so an HTTP health check marks a full replica down
for new connections while the robots it serves keep their connections (HAProxy leaves established
connections on a server it marks down).

Body (every field is always present; counts are integers):

    {"status": "ok",             # ok | full | warming_up | draining; HTTP 200 only for "ok"
     "ready": true,              # every batch size compiled and not draining
     "draining": false,          # SIGTERM received: answering the frames it has, then closing
     "robots": 3,                # connections that have sent a frame (each holds a robot slot)
     "robot_slots": 64,          # --max-robots
     "robot_slots_free": 61,     # robots this replica takes now: free robot slots, at most free connections
     "connections": 3,           # open websocket connections, handshakes included
     "connection_slots": 256,    # --max-connections
     "language_active": 2,       # language requests holding a decode slot
     "language_slots": 8,        # decode slots of the engine (EngineConfig.num_slots)
     "language_slots_free": 6,
     "language_queued": 0,       # language requests waiting for a decode slot
     "queue_depth": 0}           # frames waiting for a step

An engine that decodes speculatively adds "speculative": {"draft_tokens": γ, "drafter": ..., "drafts_proposed",
"drafts_accepted", "acceptance_rate"} (`metrics.Speculation`); without speculation the key is absent.

"full" is `robot_slots_free == 0`: every robot slot or every connection is taken. A connection takes
its robot slot with its first frame, so open handshakes count as connections, not robots (an idle
handshake cannot lock robots out; it is closed after --first-frame-timeout).
"""

from __future__ import annotations

import dataclasses
import json

_FIELDS = ("status", "ready", "draining", "robots", "robot_slots", "robot_slots_free", "connections",
           "connection_slots", "language_active", "language_slots", "language_slots_free", "language_queued",
           "queue_depth")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Health:
    """One replica's state as a balancer sees it (see the module docstring for each field)."""

    ready: bool  # warm and not draining
    draining: bool
    robots: int
    robot_slots: int
    connections: int
    connection_slots: int
    language_active: int
    language_slots: int
    language_queued: int
    queue_depth: int
    speculative: dict | None = None  # drafts so far when the engine decodes speculatively (`metrics.Speculation`)

    @property
    def robot_slots_free(self) -> int:
        """New robots this replica takes now, e.g. 64 slots, 3 robots, 256 connections of which 255 open: 1."""
        return max(0, min(self.robot_slots - self.robots, self.connection_slots - self.connections))

    @property
    def language_slots_free(self) -> int:
        return max(0, self.language_slots - self.language_active)

    @property
    def status(self) -> str:
        """One of draining, warming_up, full, ok, in that order of precedence."""
        if self.draining:
            return "draining"
        if not self.ready:
            return "warming_up"
        return "ok" if self.robot_slots_free > 0 else "full"

    @property
    def http_status(self) -> int:
        """200 when this replica takes a new robot, else 503."""
        return 200 if self.status == "ok" else 503

    def as_dict(self) -> dict:
        extra = {} if self.speculative is None else {"speculative": self.speculative}
        return {**{name: getattr(self, name) for name in _FIELDS}, **extra}

    def body(self) -> str:
        return json.dumps(self.as_dict()) + "\n"


def of_server(server) -> Health:
    """The health of a running `PolicyServer` (read on its event loop: counts, not a consistent snapshot)."""
    engine, config = server.engine, server.config
    return Health(
        ready=server.healthy, draining=server._draining, robots=len(server._robots), robot_slots=config.max_robots,
        connections=len(server._streams), connection_slots=config.max_connections,
        language_active=int(engine.num_active), language_slots=int(engine.config.num_slots),
        language_queued=int(engine.num_queued), queue_depth=server.batcher.queue_depth,
        speculative=None if server.metrics.speculation is None else server.metrics.speculation.summary())


def respond(connection, health: Health):
    """The `/healthz` HTTP response of a websockets `process_request` hook: JSON, 200 or 503."""
    response = connection.respond(health.http_status, health.body())
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = "application/json"
    return response


def add_gauges(registry, server) -> None:
    """Registers the gauges a balancer or an autoscaler reads from `/metrics` (read when scraped)."""
    from prometheus_client import Gauge

    def gauge(name: str, doc: str, read) -> None:
        Gauge(name, doc, registry=registry).set_function(lambda: float(read(of_server(server))))

    gauge("oxygen_robot_slots", "Robot slots of this replica (--max-robots)", lambda h: h.robot_slots)
    gauge("oxygen_robot_slots_free", "Robots this replica takes now (/healthz is 503 at 0)", lambda h: h.robot_slots_free)
    gauge("oxygen_language_slots_free", "Decode slots free for language requests", lambda h: h.language_slots_free)
    gauge("oxygen_accepting", "1 when /healthz answers 200 (this replica takes a new robot)",
          lambda h: h.http_status == 200)
    gauge("oxygen_draining", "1 while shutting down", lambda h: h.draining)
