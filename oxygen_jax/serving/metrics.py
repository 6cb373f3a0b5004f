"""Prometheus metrics of one policy server (`GET /metrics`), in the server's own registry.

Counters and histograms are updated by the server (frames by outcome, refused connections by reason)
and by `on_step` after every engine step; gauges read the server's state when scraped. An engine that
decodes speculatively (`EngineConfig.speculate` = γ > 0) adds its drafts (`Speculation`):

    oxygen_speculative_drafts_proposed_total 120.0   # draft tokens its verify steps checked
    oxygen_speculative_drafts_accepted_total 84.0    # of which emitted
    oxygen_speculative_acceptance_rate 0.7           # accepted / proposed since start (0 before any draft)

They come from each step's results (`StepOutput.drafts_proposed`), read with the step's tokens: no
transfer of their own.
"""

from __future__ import annotations

from oxygen_jax.runtime.speculative import DRAFTER
from oxygen_jax.serving import health
from oxygen_jax.serving.records import StepOutput


class Speculation:
    """Drafts proposed and accepted since start, as Prometheus counters and as numbers (`/healthz`)."""

    def __init__(self, gamma: int, registry=None):
        """`gamma`: draft tokens per verify step (`EngineConfig.speculate`); `registry`: where the counters go."""
        from prometheus_client import Counter, Gauge

        self.gamma, self.proposed, self.accepted = gamma, 0, 0
        self._proposed = Counter("oxygen_speculative_drafts_proposed", "Draft tokens verify steps checked",
                                 registry=registry)
        self._accepted = Counter("oxygen_speculative_drafts_accepted", "Draft tokens accepted (emitted)",
                                 registry=registry)
        Gauge("oxygen_speculative_acceptance_rate", "Drafts accepted / proposed since start",
              registry=registry).set_function(lambda: self.acceptance_rate)

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (0.0 before any draft): e.g. 84 of 120 -> 0.7."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self._proposed.inc(proposed)
        self._accepted.inc(accepted)

    def describe(self, verify_cost: float) -> str:
        """The server's start-up line, e.g. "speculative decoding on: γ = 4 draft tokens per verify step ..."."""
        return (f"speculative decoding on: γ = {self.gamma} draft tokens per verify step (drafter: {DRAFTER}; a "
                f"verify step costs {verify_cost:g} decode steps); drafts proposed / accepted in /metrics "
                "(oxygen_speculative_*) and /healthz")

    def summary(self) -> dict:
        """What `/healthz` and the metadata say of it."""
        return {"draft_tokens": self.gamma, "drafter": DRAFTER, "drafts_proposed": self.proposed,
                "drafts_accepted": self.accepted, "acceptance_rate": round(self.acceptance_rate, 4)}


class Metrics:
    """Prometheus metrics of one server (its own registry, so several servers can share a process)."""

    def __init__(self, server):
        """`server`: the `PolicyServer` whose connections, robots, queue and readiness the gauges read."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        ms = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        self.frames = Counter("oxygen_frames", "Observation frames by outcome", ["outcome"], registry=r)
        self.steps = Counter("oxygen_steps", "Engine steps", registry=r)
        self.rows = Histogram("oxygen_step_rows", "Robots per engine step", buckets=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16),
                              registry=r)
        self.bucket = Histogram("oxygen_step_bucket", "Padded batch size per step", buckets=(1, 2, 4, 8, 16),
                                registry=r)
        self.step_s = Histogram("oxygen_step_seconds", "Engine.step wall time", buckets=ms, registry=r)
        self.queue_s = Histogram("oxygen_queue_seconds", "Frame wait before its step", buckets=ms, registry=r)
        self.total_s = Histogram("oxygen_frame_seconds", "Frame received to reply sent", buckets=ms, registry=r)
        self.language = Counter("oxygen_language_requests", "Language requests by event", ["event"], registry=r)
        self.tokens = Counter("oxygen_language_tokens", "Tokens of finished language requests", registry=r)
        Gauge("oxygen_connections", "Open websocket connections (handshakes included)", registry=r).set_function(
            lambda: len(server._streams))
        Gauge("oxygen_robots", "Streaming robots (connections that have sent a frame)", registry=r).set_function(
            lambda: len(server._robots))
        self.refused = Counter("oxygen_connections_refused", "Connections refused, dropped or throttled, by reason",
                               ["reason"], registry=r)
        Gauge("oxygen_queue_depth", "Frames waiting for a step", registry=r).set_function(
            lambda: server.batcher.queue_depth)
        Gauge("oxygen_ready", "1 when warm and not draining", registry=r).set_function(lambda: float(server.healthy))
        Gauge("oxygen_compiles_after_warmup", "XLA compilations on the engine thread after warm-up",
              registry=r).set_function(lambda: server.compiles_after_warmup)
        health.add_gauges(r, server)  # slots free, accepting, draining: what a load balancer reads
        self.lang_active = Gauge("oxygen_language_active", "Language requests decoding", registry=r)
        self.lang_queued = Gauge("oxygen_language_queued", "Language requests waiting for a slot", registry=r)
        gamma = getattr(server.engine.config, "speculate", 0)
        self.speculation = Speculation(gamma, r) if gamma else None

    def on_step(self, out: StepOutput) -> None:
        if out.rows:
            self.steps.inc()
            self.rows.observe(out.rows)
            self.bucket.observe(out.bucket)
            self.step_s.observe(out.step_ms / 1e3)
            for res in out.results:
                if res.error is None:
                    self.queue_s.observe(max(res.queue_ms, 0.0) / 1e3)
        self.language.labels("accepted").inc(sum(len(r.accepted) for r in out.results))
        self.language.labels("finished").inc(len(out.finished))
        self.language.labels("failed").inc(len(out.failed))
        self.tokens.inc(sum(len(f.tokens) for f in out.finished))
        self.lang_active.set(out.language_active)
        self.lang_queued.set(out.language_queued)
        if self.speculation is not None:
            self.speculation.add(out.drafts_proposed, out.drafts_accepted)

    def render(self) -> tuple[str, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry).decode(), CONTENT_TYPE_LATEST
