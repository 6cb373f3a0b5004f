"""The policy server: openpi's websocket protocol, many robots on one engine, actions and language together.

Any model an `Engine` runs is served (π0.5, or a backbone with several heads: see `serving.codec`); the
command line is `oxygen_jax.serve`.

Protocol (openpi's `WebsocketPolicyServer`, so an unmodified `openpi_client.WebsocketClientPolicy` works):

1. On connect the server sends one binary msgpack frame: the metadata map (below).
2. Each binary msgpack frame from the client is one observation in the robot's openpi format (e.g. LIBERO:
   "observation/image", "observation/wrist_image" uint8 [224, 224, 3], "observation/state" [8], "prompt"),
   answered by exactly one binary frame {"actions": float32 [Ha, Da], "server_timing": {...},
   "policy_timing": {...}, ...}. Arrays use openpi's msgpack-numpy form (`oxygen_jax.serving.wire`).
3. A malformed frame (bad msgpack, a text frame, missing/mis-shaped/non-finite fields, non-uint8 images,
   a bad language request, a string over its cap, nesting too deep) is answered with a text frame
   "BadRequest: ..." (at most `MAX_REPLY_CHARS` characters, whatever the frame carried) and the
   connection stays usable (openpi's client raises RuntimeError with that text). A full queue answers
   "busy: ...". An internal error is logged with its traceback under an error id; the client gets
   "Internal server error (id ...)" as text, then a 1011 close (openpi sends the traceback itself: we
   do not send source paths to a client). A frame larger than --max-message-mb closes with 1009.
4. `GET /healthz`: JSON (`serving.health`: robots, slots free, ready, draining); 200 once every batch
   size is compiled and a robot can connect, 503 while warming up, draining, or full (every robot slot
   or connection taken). `GET /metrics`: Prometheus.

Connections (`ServeConfig`): a connection takes a robot slot (`max_robots`) with its first frame, so
open handshakes lock nobody out; a connection that sends no frame for `first_frame_timeout_s` (before
its first) or `idle_timeout_s` (after) is closed with 1008; at most `max_connections` connections in
all and `max_connections_per_peer` per client address (HTTP 503 beyond); frames are read one at a
time (websockets `max_queue=1`: reading pauses once 2 frames wait, and the kernel's receive buffer is
fixed at `recv_buffer_bytes`, under one LIBERO frame, instead of growing to megabytes, so a client
that sends without reading is back-pressured by TCP with at most about 2 frames held for it; the
kernel's send buffer is fixed at `send_buffer_bytes`), a reply that cannot be written within
`send_timeout_s` drops the connection, and a connection whose frames keep being refused is read at
most `max_refusals_per_s` frames per second. A client that does not take its replies is read at most
two frames ahead: a frame is answered only once every reply before the previous one has left the server
(websockets' write buffer empty, and the kernel's send queue, unsent and unacknowledged bytes, no larger
than the previous reply), so the server's buffers never hold replies for it beyond that one and the
frame in progress; one that stays so for `send_timeout_s` is dropped.

Extensions, ignored by clients that do not use them (openpi's client passes extra keys through):

* Observation fields: "language_requests": [{"prompt": str, "max_tokens": int, "temperature": float,
  "top_p": float, "seed": int, "adapter": str, "stop_at_eos": bool, "stop": [int], "id": <client tag>}, ...]
  ("prompt" text with the model's tokenizer, or token ids as "prompt_tokens": [int]; "stop_at_eos" (default
  true) stops at the model's own stop ids, its checkpoint's `eos_token_id`s, and "stop" adds up to 8 more;
  the metadata's "language" says which prompts and stop ids this server takes) and "deadline_ms": the robot's round-trip budget, kept for the connection
  (capped at `ServeConfig.max_deadline_ms`; the effective value is `server_timing.deadline_ms`).
* Response fields: "stream", "frame" (see the noise rule), and "language": {"accepted": [{"id", "tag"}],
  "updates": [{"id", "tag", "new_tokens", "text", "finished"}], "finished": [{"id", "tag", "text", "tokens",
  "latency_frames", "latency_ms"}], "failed": [{"id", "tag", "error"}]} — lists and strings only, because
  openpi's ActionChunkBroker slices every ndarray of a response per step. "updates" has one entry per
  request of this robot that advanced since its last response: the tokens emitted since then and the
  text so far (`serving.outbox`). A finished request is delivered once, in the owning robot's next
  response; a robot's live requests are cancelled when its connection closes. openpi's
  ActionChunkBroker copies these non-array values into every step of its chunk: `serving.dedup` keeps
  each result once.
* Automatic requests (`ServeConfig.auto_language`, `serving.auto_language`): the server opens a language
  request for each observation, unasked ("accepted" entry with "auto": true), answered as above.
* Metadata: {"server": "oxygen_jax", "stream", "robot", "action_horizon", "action_dim", "batch_sizes",
  "devices", "weights" ({"quantized": None}, or its dtype and each matmul mode's leaf count: `nn.quant.weights_info`),
  "step_ms" (steady step time per batch size, measured at warm-up), "deadline_ms",
  "max_message_bytes", "language": {...limits}, "noise": {"seed", "rule"}}, plus "reset_pose" for
  ALOHA (what openpi's ALOHA configs send) and "speculative": {"draft_tokens", "drafter", "verify_cost"}
  when the engine decodes speculatively (its drafts so far: `/healthz`, `/metrics`).
* Real-time chunking (`ServeConfig.rtc`): an observation's "rtc" map names the chunk the robot is executing,
  how many of its actions it has executed and its delay in actions; the response's "rtc" map says which
  actions are new (`serving.rtc_session`, docs/rtc.md). Frames without it are served as before.
* Noise: frame f of stream s uses `batcher.frame_noise(seed, s, f)`, so `Engine.step(observation,
  noise)` reproduces a served chunk.

SIGTERM: /healthz turns 503, new frames get "unavailable: ...", frames already received are stepped and
answered, then every connection closes with 1001 and the process exits 0.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import fcntl
import logging
import socket
import struct
import termios
import threading
import time
import uuid
import warnings
from collections.abc import Mapping

import numpy as np

from oxygen_jax.nn import quant
from oxygen_jax.robots.config import RobotConfig
from oxygen_jax.runtime.speculative import DRAFTER
from oxygen_jax.serving import auto_language, health, requests, rtc_session, wire
from oxygen_jax.serving.auto_language import AutoLanguage
from oxygen_jax.serving.batcher import BUCKETS, Batcher, Busy
from oxygen_jax.serving.codec import make_codec
from oxygen_jax.serving.engine_worker import EngineWorker
from oxygen_jax.serving.metrics import Metrics
from oxygen_jax.serving.records import Frame, FrameResult, Stream
from oxygen_jax.serving.refusal_log import RefusalLog
from oxygen_jax.serving.requests import BadRequest, parse_language_requests  # noqa: F401 - part of this API

log = logging.getLogger("oxygen_jax.serve")

_ALOHA_RESET_POSE = [0, -1.5, 1.5, 0, 0, 0]  # openpi's ALOHA policy metadata
_INTERNAL_ERROR = "Internal server error; the server log has the details under the id in the previous frame."
MAX_REPLY_CHARS = 1000  # a text reply (BadRequest, busy, ...) is cut to this length
# Bytes beyond the last reply still in flight: its frame header (<= 14) and a ping or pong (<= 131). Less than any
# reply (a 7-dim LIBERO chunk is 516 bytes), or one more reply could hide in it: 1024 let 3 frames run ahead.
_FRAME_SLACK = 160
_TAKEN_POLL_S = 0.005  # how often a client that has not taken its replies is looked at again
_TRUNCATION_WARNING_S = 60.0  # at most one "prompt fills every token" warning per this many seconds


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Everything about serving that is not the model."""

    host: str = "127.0.0.1"  # this machine only; "0.0.0.0" accepts robots from other machines
    port: int = 8000  # 0 picks a free port (see PolicyServer.port)
    buckets: tuple[int, ...] = BUCKETS  # robots per step, each compiled at start-up
    deadline_ms: float = 100.0  # default round-trip budget of a robot that declares none
    max_deadline_ms: float = 1000.0  # cap on a declared deadline_ms (how long others may wait for a robot)
    max_pending: int = 16  # frames queued before "busy"
    max_robots: int = 64  # streaming robots (connections that have sent a frame); more get "busy"
    max_connections: int = 256  # open connections of any kind (handshakes included); more get HTTP 503
    max_connections_per_peer: int = 32  # open connections from one client address; more get HTTP 503
    first_frame_timeout_s: float | None = 30.0  # close a connection that sends no first frame in this time
    idle_timeout_s: float | None = 600.0  # close a robot that sends no frame for this long
    send_timeout_s: float = 10.0  # drop a connection whose reply cannot be written in this time
    max_queue: int = 1  # websockets pauses reading a connection once more frames than this wait (1 or 2: lock-step)
    recv_buffer_bytes: int = 256 << 10  # the kernel's receive buffer per connection (SO_RCVBUF; not autotuned to MBs)
    write_limit: int = 64 << 10  # bytes websockets buffers for writing before send() waits
    send_buffer_bytes: int = 64 << 10  # the kernel's send buffer per connection (SO_SNDBUF; replies are a few kB)
    max_requests_per_robot: int = 8  # live language requests per connection
    max_refusals_per_s: float = 20.0  # refused frames read per connection and second, after a burst of as many
    max_message_bytes: int = 4 << 20
    max_prompt_chars: int = 1024  # the observation "prompt" and each language request's prompt
    ping_interval: float | None = 20.0  # websockets keepalive (openpi's defaults)
    ping_timeout: float | None = 20.0
    seed: int = 0  # noise seed (see batcher.frame_noise)
    default_prompt: str | None = None  # for robots that send no "prompt" (openpi's --default_prompt)
    api_key: str | None = None  # when set, require "Authorization: Api-Key <key>" (openpi-client's header)
    rtc: bool = False  # per-robot real-time chunking ("rtc" field, serving.rtc_session); 2 programs per bucket
    auto_language: AutoLanguage | None = None  # a language request opened for every observation (auto_language)

    def __post_init__(self):
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"ServeConfig.buckets must be increasing positive sizes, got {list(self.buckets)}")
        for f in ("max_pending", "max_robots", "max_connections", "max_connections_per_peer", "max_queue",
                  "write_limit", "send_buffer_bytes", "recv_buffer_bytes", "max_requests_per_robot",
                  "max_message_bytes", "max_prompt_chars"):
            if getattr(self, f) < 1:
                raise ValueError(f"ServeConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.max_queue > 2:
            raise ValueError(f"ServeConfig.max_queue must be 1 or 2 frames (the protocol is lock-step), got {self.max_queue}")
        if not self.max_refusals_per_s > 0:
            raise ValueError(f"ServeConfig.max_refusals_per_s must be > 0, got {self.max_refusals_per_s}")
        if not 0 < self.max_deadline_ms <= 3.6e6:
            raise ValueError(f"ServeConfig.max_deadline_ms must be in (0, 3.6e6], got {self.max_deadline_ms}")
        if not 0 < self.deadline_ms <= self.max_deadline_ms:
            raise ValueError(f"ServeConfig.deadline_ms must be in (0, max_deadline_ms={self.max_deadline_ms}], "
                             f"got {self.deadline_ms}")
        for f in ("first_frame_timeout_s", "idle_timeout_s", "send_timeout_s"):
            value = getattr(self, f)
            if value is not None and not value > 0:
                raise ValueError(f"ServeConfig.{f} must be > 0 seconds (or None for no limit), got {value}")


# -------------------------------------------------------------------------------------------------
# The server
# -------------------------------------------------------------------------------------------------


class PolicyServer:
    """One engine behind a websocket endpoint; see the module docstring for the protocol.

    Args:
      engine: an `Engine` (or an object with its interface: submit, step, cancel, requests_of, warmup,
        num_active, num_queued, config.action_horizon, params.config).
      tokenizer: the tokenizer the observations' prompts are encoded with.
      robot: the client format (one per server: the prefix length is fixed per engine).
      config: serving limits and policy.
      norm_stats: openpi normalisation statistics (None for random presets), when `io` is not given.
      io: the checkpoint's robot I/O facts (`ckpts.load.LoadedModel.io`: its tokenizer, normalisation, prompt
        and image conventions, output transforms).
      mesh: a 1-D `jax.sharding.Mesh` with axis "robots" to shard steps over several devices.
      image_size, prompt_len, outputs: a model with heads (`codec.HeadsCodec`): square image side, row
        length, and head name -> its chunk's own transform to robot units (e.g. StarVLA's un-normalisation).
    """

    def __init__(self, engine, tokenizer, robot: RobotConfig, config: ServeConfig = ServeConfig(), *,
                 norm_stats=None, mesh=None, image_size: int | None = None, prompt_len: int | None = None,
                 outputs=None, io=None):
        self.engine, self.tokenizer, self.robot, self.config = engine, tokenizer, robot, config
        self.norm_stats = norm_stats
        self._weights = quant.weights_info(engine.vla.params)  # the metadata's, once: the weights never change
        # Checked before anything starts: a bad automatic request is a one-line ValueError, not a refused frame.
        self.auto = auto_language.prepare(config.auto_language, engine, max_prompt_chars=config.max_prompt_chars)
        self.codec = make_codec(engine, robot, tokenizer, norm_stats, config.default_prompt,
                                image_size=image_size, prompt_len=prompt_len, outputs=outputs, io=io)
        self.limits = wire.Limits(max_message_bytes=config.max_message_bytes, max_array_bytes=config.max_message_bytes,
                                  max_str_bytes=min(64 << 10, 4 * config.max_prompt_chars))
        self.rtc = rtc_session.RtcSessions.for_engine(engine, robot.name) if config.rtc else None
        worker_engine = engine if self.rtc is None else rtc_session.RtcEngine(engine, self.rtc)
        self.worker = EngineWorker(worker_engine, self.codec, seed=config.seed, mesh=mesh)
        self.metrics = Metrics(self)
        self.batcher = Batcher(self.worker, buckets=config.buckets, max_pending=config.max_pending,
                               on_step=self.metrics.on_step)
        self._prep = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="oxygen-prep")
        self._streams: dict[int, Stream] = {}  # every open connection
        self._robots: set[int] = set()  # streams holding a robot slot (they have sent a frame)
        self._peers: collections.Counter = collections.Counter()  # client address -> open connections
        self._next_stream = 0
        self._truncation_warned = -float("inf")  # perf_counter time of the last "prompt fills every token" warning
        self._truncation_quiet = 0  # such prompts since that warning
        self._refusals = RefusalLog()  # one warning per refused frame, rate-limited
        _quiet_tokenizer_truncation_warning()
        self._preparing = 0  # frames received and being decoded (not yet queued)
        self._replying = 0  # frames whose reply is being sent
        self._draining = False
        self._ws = None
        self._warm_task: asyncio.Task | None = None
        self._compiles_at_warm: int | None = None

    # -- state ----------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Warm, not draining (a full server is healthy but takes no new robot: see `full`)."""
        return self.batcher.ready and not self._draining

    @property
    def compiles_after_warmup(self) -> int:
        if self._compiles_at_warm is None:
            return 0
        return self.worker.compiles - self._compiles_at_warm

    @property
    def port(self) -> int:
        return self._ws.sockets[0].getsockname()[1]

    def metadata(self, stream: Stream) -> dict:
        e, r = self.engine.config, self.robot
        meta = {
            "server": "oxygen_jax", "protocol": 1, "stream": stream.id, "robot": r.name,
            "action_dim": r.action_dim, "batch_sizes": list(self.config.buckets),
            "devices": self.worker.num_devices, "weights": self._weights,
            "step_ms": {str(b): round(ms, 3) for b, ms in self.batcher.warmup_ms.items()},  # warm-up, per batch size
            "deadline_ms": self.config.deadline_ms, "max_message_bytes": self.config.max_message_bytes,
            "language": {"field": "language_requests", "max_tokens": self.engine.limits.max_new_tokens,
                         "prompt_capacity": e.prompt_capacity, "max_requests": self.config.max_requests_per_robot,
                         "adapters": sorted(self.engine.limits.adapters),
                         "text_prompts": getattr(self.engine, "tokenizer", None) is not None,
                         "stop_ids": list(self.engine.vla.stop_ids)},
        }
        codec = self.codec.metadata()
        codec["noise"] = {"seed": self.config.seed, **codec["noise"]}
        meta.update(codec)
        if self.auto is not None:
            a = self.auto.auto
            prompt = {"prompt": a.prompt} if a.prompt_tokens is None else {"prompt_tokens": list(a.prompt_tokens)}
            meta["language"]["auto"] = {**prompt, "max_tokens": self.auto.request.max_tokens,
                                        "temperature": a.temperature, "seed": a.seed, "adapter": a.adapter,
                                        "mode": a.mode, "tag": a.tag}
        if self.metrics.speculation is not None:
            meta["speculative"] = {"draft_tokens": e.speculate, "drafter": DRAFTER, "verify_cost": e.verify_cost}
        if self.rtc is not None:
            meta["rtc"] = self.rtc.metadata()
        if r.name == "aloha":
            meta["reset_pose"] = list(_ALOHA_RESET_POSE)
        return meta

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, sock=None) -> None:
        """Binds the port (healthz answers 503 at once), then compiles every batch size in the background.

        `sock`: an already bound and listening socket to serve on instead of `config.host`/`config.port`
        (the CLI binds before loading the model, so a port in use fails in a second).
        """
        from websockets.asyncio.server import serve

        c = self.config
        where = dict(sock=sock) if sock is not None else dict(host=c.host, port=c.port)
        self._ws = await serve(
            self._handle, **where, process_request=self._http, max_size=c.max_message_bytes,
            max_queue=c.max_queue, write_limit=c.write_limit, compression=None, ping_interval=c.ping_interval,
            ping_timeout=c.ping_timeout)
        for listening in self._ws.sockets:  # accepted sockets inherit it (and the window they advertise)
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, c.recv_buffer_bytes)
        self._warm_task = asyncio.create_task(self._warm(), name="oxygen-warmup")

    async def _warm(self) -> None:
        try:
            await self.batcher.start(self.codec.example())
            self._compiles_at_warm = self.worker.compiles
        except Exception:  # noqa: BLE001 - re-raised by wait_ready (the CLI reports it in one line)
            log.exception("warm-up failed")
            raise

    async def wait_ready(self) -> None:
        """Returns once every batch size is compiled; raises what warm-up raised."""
        await asyncio.shield(self._warm_task)

    async def shutdown(self) -> None:
        """Graceful stop: refuse new work, answer every frame already received, close all with 1001."""
        if self._draining:
            return
        self._draining = True
        log.info("shutting down: answering %d queued frames", self.batcher.outstanding)
        self.batcher.cancel_warmup()  # the engine thread stops after the compile in progress
        if self._warm_task is not None and not self._warm_task.done():
            self._warm_task.cancel()
        while self._preparing:  # frames received before the signal reach the queue first (prep is bounded)
            await asyncio.sleep(0.005)
        await self.batcher.drain()
        for _ in range(1000):  # replies already computed are being written
            if self._replying == 0:
                break
            await asyncio.sleep(0.005)
        if self._ws is not None:
            self._ws.close(close_connections=True)  # 1001 going away
            await self._ws.wait_closed()
        await asyncio.get_running_loop().run_in_executor(None, self._stop_threads)

    def _stop_threads(self) -> None:
        self.worker.close()
        self._prep.shutdown(wait=True)

    # -- HTTP -----------------------------------------------------------------------------------

    def _http(self, connection, request):
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            return health.respond(connection, health.of_server(self))
        if path == "/metrics":
            text, content_type = self.metrics.render()
            response = connection.respond(200, text)
            del response.headers["Content-Type"]
            response.headers["Content-Type"] = content_type
            return response
        if self._draining:
            return connection.respond(503, "server is shutting down\n")
        key = self.config.api_key
        if key is not None and request.headers.get("Authorization") != f"Api-Key {key}":
            return connection.respond(401, "missing or wrong Authorization: Api-Key header\n")
        c = self.config
        if len(self._streams) >= c.max_connections:
            self.metrics.refused.labels("connections").inc()
            return connection.respond(503, f"too many connections open (limit {c.max_connections})\n")
        if self._peers[_peer(connection)] >= c.max_connections_per_peer:
            self.metrics.refused.labels("per_peer").inc()
            return connection.respond(503, f"too many connections from {_peer(connection)} (limit "
                                           f"{c.max_connections_per_peer} per address)\n")
        if len(self._robots) >= c.max_robots:
            self.metrics.refused.labels("robots").inc()
            return connection.respond(503, f"too many robots streaming (limit {c.max_robots})\n")
        return None

    # -- websocket ------------------------------------------------------------------------------

    async def _send(self, ws, stream: Stream, reply) -> bool:
        """Sends one reply within `send_timeout_s`; a peer that does not read is dropped (returns False)."""
        try:
            await asyncio.wait_for(ws.send(reply), self.config.send_timeout_s)
            return True
        except TimeoutError:
            log.warning("stream %d (%s): reply not written within %.0f s (the client is not reading); dropping "
                        "the connection", stream.id, _peer(ws), self.config.send_timeout_s)
            self.metrics.refused.labels("send_timeout").inc()
            ws.transport.abort()
            return False

    async def _taken(self, ws, stream: Stream, last: int) -> bool:
        """Waits until the replies before the last one (`last` bytes) have left the server (module docstring:
        two frames ahead at most); False (the connection dropped) when they have not within `send_timeout_s`."""
        deadline = time.perf_counter() + self.config.send_timeout_s
        while _unsent_bytes(ws) > last + _FRAME_SLACK:
            if time.perf_counter() > deadline:
                log.warning("stream %d (%s): replies not taken within %.0f s (the client is not reading); dropping "
                            "the connection", stream.id, _peer(ws), self.config.send_timeout_s)
                self.metrics.refused.labels("send_timeout").inc()
                ws.transport.abort()
                return False
            await asyncio.sleep(_TAKEN_POLL_S)
        return True

    async def _receive(self, ws, stream: Stream):
        """The next frame, or None when the connection has been silent too long (it is then closed, 1008)."""
        c = self.config
        first = stream.id not in self._robots
        timeout = c.first_frame_timeout_s if first else c.idle_timeout_s
        try:
            return await asyncio.wait_for(ws.recv(), timeout)
        except TimeoutError:
            what = "no first frame" if first else "no frame"
            self.metrics.refused.labels("idle").inc()
            log.info("stream %d (%s): %s for %.0f s; closing", stream.id, _peer(ws), what, timeout)
            await ws.close(1008, f"{what} for {timeout:.0f} s; reconnect when the robot is ready")
            return None

    async def _handle(self, ws) -> None:
        from websockets.exceptions import ConnectionClosed

        stream = Stream(id=self._next_stream, deadline_s=self.config.deadline_ms / 1e3)
        self._next_stream += 1
        self._streams[stream.id] = stream
        peer = _peer(ws)
        self._peers[peer] += 1
        self.batcher.add_stream(stream)
        refusals = requests.RefusalBudget(self.config.max_refusals_per_s)
        sock = ws.transport.get_extra_info("socket")
        if sock is not None:  # fixed, not autotuned to megabytes: a client that never reads pins this much there
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.send_buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.config.recv_buffer_bytes)
        try:
            if not await self._send(ws, stream, wire.pack(self.metadata(stream))):
                return
            last = 0  # bytes of the last reply sent
            while (message := await self._receive(ws, stream)) is not None:
                if not await self._taken(ws, stream, last):
                    return
                received = time.perf_counter()
                stream.observe_arrival(received)
                reply = await self._answer(stream, message)
                if isinstance(reply, str):  # logged before it is sent: the client never sees one the log has not
                    self._refusals.note(stream.id, peer, reply)
                self._replying += 1
                try:
                    sent = await self._send(ws, stream, reply)
                finally:
                    self._replying -= 1
                if not sent:
                    return
                last = len(reply) if isinstance(reply, bytes) else len(reply.encode())
                if isinstance(reply, bytes):  # a robot that got actions is expected back within its period
                    stream.last_reply = time.perf_counter()
                    self.metrics.total_s.observe(stream.last_reply - received)
                elif reply.startswith("BadRequest") and (wait := refusals.charge(time.perf_counter())) > 0:
                    self.metrics.refused.labels("throttled").inc()  # its next frame waits in TCP meanwhile
                    await asyncio.sleep(wait)
        except ConnectionClosed:
            pass
        except Exception:  # noqa: BLE001 - logged with an id; the client gets the id, not the traceback
            error_id = uuid.uuid4().hex[:12]
            log.exception("internal error %s on stream %d (%s)", error_id, stream.id, peer)
            self.metrics.frames.labels("error").inc()
            try:
                await self._send(ws, stream, f"Internal server error (id {error_id}); the server log has the details")
                await ws.close(1011, _INTERNAL_ERROR)
            except ConnectionClosed:
                pass
        finally:
            self._streams.pop(stream.id, None)
            if self.rtc is not None:
                self.rtc.forget(stream.id)
            self._robots.discard(stream.id)
            self._peers[peer] -= 1
            if self._peers[peer] <= 0:
                del self._peers[peer]
            cancelled = self.batcher.remove_stream(stream)
            cancelled.add_done_callback(self._count_cancelled)

    def _count_cancelled(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result():
            self.metrics.language.labels("cancelled").inc(fut.result())

    async def _answer(self, stream: Stream, message) -> bytes | str:
        """One reply: the response bytes, or a text frame (at most MAX_REPLY_CHARS). Internal errors raise."""
        reply = await self._reply(stream, message)
        if isinstance(reply, str) and len(reply) > MAX_REPLY_CHARS:
            reply = reply[:MAX_REPLY_CHARS - 1] + "…"
        return reply

    def _take_robot_slot(self, stream: Stream) -> str | None:
        """A stream becomes a robot with its first frame; None, or the "busy" text when every slot is taken."""
        if stream.id in self._robots:
            return None
        if len(self._robots) >= self.config.max_robots:
            self.metrics.frames.labels("busy").inc()
            return (f"busy: {len(self._robots)} robots are streaming (limit {self.config.max_robots}); retry "
                    "on this connection later")
        self._robots.add(stream.id)
        return None

    async def _reply(self, stream: Stream, message) -> bytes | str:
        if self._draining:
            self.metrics.frames.labels("unavailable").inc()
            return "unavailable: the server is shutting down; reconnect to another server"
        if isinstance(message, str):
            self.metrics.frames.labels("bad_request").inc()
            return "BadRequest: text frames are not observations; send the observation as a binary msgpack frame"
        if (full := self._take_robot_slot(stream)) is not None:
            return full
        loop = asyncio.get_running_loop()
        self._preparing += 1
        try:
            observation, state, language, deadline, rtc = await loop.run_in_executor(self._prep, self._prepare, message)
            if deadline is not None:
                stream.deadline_s = deadline
            live, cap = stream.language.live, self.config.max_requests_per_robot
            if live + len(language) > cap:
                raise BadRequest(
                    f"language_requests: this robot has {live} requests in flight and asks for "
                    f"{len(language)} more (limit {cap}); wait for some to finish")
            auto = (auto_language.Plan(None) if self.auto is None else
                    self.auto.plan(stream.language.auto_ids, live, len(language), cap))
            frame = Frame(stream=stream, observation=observation, state=state,
                          language=language + ([auto.request] if auto.request is not None else []),
                          arrival=time.perf_counter(), future=loop.create_future(), replace=auto.replace)
            if self.rtc is not None:
                self.rtc.on_frame(stream.id, rtc)
            self.batcher.submit(frame)
        except BadRequest as e:
            self.metrics.frames.labels("bad_request").inc()
            return f"BadRequest: {e}"
        except Busy as e:
            self.metrics.frames.labels("busy").inc()
            return str(e)
        finally:
            self._preparing -= 1
        try:
            result: FrameResult = await frame.future
        except Busy as e:  # shut down before warm-up finished
            self.metrics.frames.labels("unavailable").inc()
            return str(e)
        if result.error is not None:
            self.metrics.frames.labels("bad_request").inc()
            return result.error
        self.metrics.frames.labels("ok").inc()
        if auto.skipped is not None:
            self.metrics.language.labels("auto_skipped").inc()
        return wire.pack(self._response(stream, result, auto.skipped))

    def _prepare(self, message: bytes):
        """Decodes and validates one observation frame (prep thread). Raises BadRequest.

        Order: caps and cheap checks first (wire limits, string lengths, request fields), then the
        language prompts' tokens against the engine's capacity, then the model row (images, state,
        prompt tokens): nothing costly runs for a frame that a cheap check refuses.
        """
        from oxygen_jax.robots import transforms

        c = self.config
        try:
            sample = wire.unpack(message, self.limits)
        except wire.WireError as err:
            raise BadRequest(str(err)) from None
        if not isinstance(sample, Mapping):
            raise BadRequest(f"an observation must be a msgpack map of named fields, got {type(sample).__name__}")
        sample = requests.prompt_of(sample, max_chars=c.max_prompt_chars)
        requests.check_images_uint8(sample)
        deadline = requests.deadline_s(sample, max_ms=c.max_deadline_ms)
        language = requests.parse_language_requests(
            sample.get("language_requests"), max_requests=c.max_requests_per_robot,
            default_max_tokens=self.engine.limits.max_new_tokens, max_prompt_chars=c.max_prompt_chars)
        language = requests.check_requests(language, getattr(self.engine, "tokenizer", None), limits=self.engine.limits)
        try:
            observation = self.codec.prepare(sample)
            state = transforms.client_state(self.robot, sample)
        except (ValueError, TypeError) as err:
            raise BadRequest(str(err).removeprefix("sample 0: ")) from None
        if self.codec.prompt_full(observation):
            self._note_full_prompt()
        return observation, state, language, deadline, (None if self.rtc is None else self.rtc.parse(sample))

    def _note_full_prompt(self) -> None:
        """One warning per `_TRUNCATION_WARNING_S` for prompts that fill every prompt token (longer ones are cut)."""
        now = time.perf_counter()
        self._truncation_quiet += 1
        if now - self._truncation_warned >= _TRUNCATION_WARNING_S:
            log.warning("%d observation prompt(s) filled all %d prompt tokens (longer prompts are cut; the next "
                        "such warning in %.0f s at the earliest); raise --prompt-len if robots need longer prompts",
                        self._truncation_quiet, self.robot.max_token_len, _TRUNCATION_WARNING_S)
            self._truncation_warned, self._truncation_quiet = now, 0

    def _response(self, stream: Stream, result: FrameResult, auto_skipped: str | None = None) -> dict:
        language = {"accepted": result.accepted, **stream.language.take()}
        if auto_skipped is not None:
            language["auto_skipped"] = auto_skipped
        return {
            "actions": np.asarray(result.actions, np.float32),
            **result.extras,
            **({} if self.rtc is None else self.rtc.reply(stream.id)),
            "stream": stream.id,
            "frame": result.index,
            "server_timing": {"infer_ms": result.step_ms, "queue_ms": max(result.queue_ms, 0.0),
                              "batch": result.rows, "bucket": result.bucket,
                              "deadline_ms": round(stream.deadline_s * 1e3, 3)},
            "policy_timing": {"infer_ms": result.step_ms},
            "language": language,
        }


def _unsent_bytes(ws) -> int:
    """Reply bytes not yet taken by the client's TCP: websockets' write buffer plus the kernel's send queue
    (unsent and unacknowledged: SIOCOUTQ; 0 where the platform has no such query)."""
    pending = ws.transport.get_write_buffer_size()
    sock = ws.transport.get_extra_info("socket")
    if sock is not None and sock.fileno() >= 0:  # -1: closed (the next send or receive says so)
        try:
            pending += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        except OSError:
            pass
    return pending


def _peer(connection) -> str:
    """The client's address (host only: one machine's connections share a cap whatever their ports)."""
    address = getattr(connection, "remote_address", None)
    return str(address[0]) if address else "unknown"


def _quiet_tokenizer_truncation_warning() -> None:
    """The tokenizer warns (two lines) for every distinct over-long prompt length; the server rate-limits its own."""
    warnings.filterwarnings("ignore", message=r"prompt has \d+ tokens, more than max_len", category=UserWarning)


# -------------------------------------------------------------------------------------------------
# Running a server: in a background thread (tests, benchmarks) or as the CLI
# -------------------------------------------------------------------------------------------------


class ServerThread:
    """Runs a `PolicyServer` on its own event loop in a daemon thread.

        with ServerThread(server) as handle:   # returns once the port is bound
            handle.wait_ready()                # every batch size compiled
            ... connect to ws://127.0.0.1:{handle.port} ...
    """

    def __init__(self, server: PolicyServer):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="oxygen-serve", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        try:
            await self.server.start()
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            self._error = e
            self._started.set()
            return
        self._started.set()
        await self._stop.wait()
        await self.server.shutdown()

    def start(self) -> "ServerThread":
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    @property
    def port(self) -> int:
        return self.server.port

    def call(self, coro, timeout: float | None = None):
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self, timeout: float | None = None) -> None:
        self.call(self.server.wait_ready(), timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful shutdown (what SIGTERM does in the CLI), then joins the thread.

        Raises TimeoutError if the server has not stopped after `timeout` seconds.
        """
        if self._thread.is_alive() and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the policy server did not stop within {timeout:.0f} s")

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
