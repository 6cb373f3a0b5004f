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
   a bad language request) is answered with a text frame "BadRequest: ..." and the connection stays
   usable (openpi's client raises RuntimeError with that text). A full queue answers "busy: ...". An
   internal error sends the traceback as text and closes with 1011, as openpi does. A frame larger
   than --max-message-mb closes the connection with 1009.
4. `GET /healthz`: 200 "OK" once every batch size is compiled, 503 while warming up or shutting down.
   `GET /metrics`: Prometheus text format.

Extensions, ignored by clients that do not use them (openpi's client passes extra keys through):

* Observation fields: "language_requests": [{"prompt": str, "max_tokens": int, "temperature": float,
  "top_p": float, "seed": int, "adapter": str, "stop_at_eos": bool, "id": <client tag>}, ...] (only
  "prompt" is required) and "deadline_ms": the robot's round-trip budget, kept for the connection.
* Response fields: "stream", "frame" (see the noise rule), and "language": {"accepted": [{"id", "tag"}],
  "finished": [{"id", "tag", "text", "tokens", "latency_frames", "latency_ms"}], "failed": [{"id", "tag",
  "error"}]} — lists and strings only, because openpi's ActionChunkBroker slices every ndarray of a
  response per step. A finished request is delivered once, in the owning robot's next response; a
  robot's live requests are cancelled when its connection closes.
* Metadata: {"server": "oxygen_jax", "stream", "robot", "action_horizon", "action_dim", "batch_sizes",
  "devices", "step_ms" (steady step time per batch size, measured at warm-up), "deadline_ms",
  "max_message_bytes", "language": {...limits}, "noise": {"seed", "rule"}}, plus "reset_pose" for
  ALOHA (what openpi's ALOHA configs send).
* Noise: frame f of stream s uses `batcher.frame_noise(seed, s, f)`, so `Engine.step(observation,
  noise)` reproduces a served chunk.

SIGTERM: /healthz turns 503, new frames get "unavailable: ...", frames already received are stepped and
answered, then every connection closes with 1001 and the process exits 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import numbers
import threading
import time
import traceback
from collections.abc import Mapping

import numpy as np

from oxygen_jax.models.pi05.config import RobotConfig
from oxygen_jax.serving import wire
from oxygen_jax.serving.batcher import (
    BUCKETS, Batcher, Busy, EngineWorker, Frame, FrameResult, LanguageRequest, StepOutput, Stream,
)
from oxygen_jax.serving.codec import make_codec

log = logging.getLogger("oxygen_jax.serve")

_ALOHA_RESET_POSE = [0, -1.5, 1.5, 0, 0, 0]  # openpi's ALOHA policy metadata
_LANGUAGE_FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "seed", "adapter", "stop_at_eos", "id")
_INTERNAL_ERROR = "Internal server error. Traceback included in previous frame."


class BadRequest(ValueError):
    """A frame the server refuses; the text is sent back and the connection stays open."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Everything about serving that is not the model."""

    host: str = "0.0.0.0"  # openpi's default: robots usually connect from another machine
    port: int = 8000  # 0 picks a free port (see PolicyServer.port)
    buckets: tuple[int, ...] = BUCKETS  # robots per step, each compiled at start-up
    deadline_ms: float = 100.0  # default round-trip budget of a robot that declares none
    max_pending: int = 16  # frames queued before "busy"
    max_robots: int = 64  # connections; more get HTTP 503
    max_requests_per_robot: int = 8  # live language requests per connection
    max_message_bytes: int = 4 << 20
    ping_interval: float | None = 20.0  # websockets keepalive (openpi's defaults)
    ping_timeout: float | None = 20.0
    seed: int = 0  # noise seed (see batcher.frame_noise)
    default_prompt: str | None = None  # for robots that send no "prompt" (openpi's --default_prompt)
    api_key: str | None = None  # when set, require "Authorization: Api-Key <key>" (openpi-client's header)

    def __post_init__(self):
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"ServeConfig.buckets must be increasing positive sizes, got {list(self.buckets)}")
        for f in ("max_pending", "max_robots", "max_requests_per_robot", "max_message_bytes"):
            if getattr(self, f) < 1:
                raise ValueError(f"ServeConfig.{f} must be >= 1, got {getattr(self, f)}")
        if not 0 < self.deadline_ms <= 3.6e6:
            raise ValueError(f"ServeConfig.deadline_ms must be in (0, 3.6e6], got {self.deadline_ms}")


# -------------------------------------------------------------------------------------------------
# Request parsing (runs on a prep thread, never on the event loop)
# -------------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def parse_language_requests(value, *, max_requests: int, default_max_tokens: int) -> list[LanguageRequest]:
    """Reads the optional "language_requests" field: a list of maps (or one map) of request fields.

    Types are checked here; value ranges (token budget, prompt length, sampling, adapter) by `Engine.submit`.
    Raises:
      BadRequest naming the request index and field.
    """
    if value is None:
        return []
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list):
        raise BadRequest(f"language_requests must be a list of maps, got {type(value).__name__}")
    if len(value) > max_requests:
        raise BadRequest(f"language_requests has {len(value)} entries; at most {max_requests} per frame")
    out = []
    for i, req in enumerate(value):
        where = f"language_requests[{i}]"
        if not isinstance(req, Mapping):
            raise BadRequest(f"{where} must be a map with a 'prompt', got {type(req).__name__}")
        unknown = sorted(str(k) for k in req if k not in _LANGUAGE_FIELDS)
        if unknown:
            raise BadRequest(f"{where}: unknown fields {unknown}; known: {list(_LANGUAGE_FIELDS)}")
        prompt = req.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest(f"{where}.prompt must be a string (e.g. 'Subtask: '), got {type(prompt).__name__}")
        max_tokens = req.get("max_tokens", default_max_tokens)
        if not _is_int(max_tokens):
            raise BadRequest(f"{where}.max_tokens must be an integer, got {max_tokens!r}")
        for name, default in (("temperature", 0.0), ("top_p", 1.0)):
            if not _is_real(req.get(name, default)):
                raise BadRequest(f"{where}.{name} must be a number, got {req.get(name)!r}")
        seed = req.get("seed")
        if seed is not None and not _is_int(seed):
            raise BadRequest(f"{where}.seed must be an integer, got {seed!r}")
        adapter = req.get("adapter", "base")
        if not isinstance(adapter, str) and not _is_int(adapter):
            raise BadRequest(f"{where}.adapter must be an adapter name, got {adapter!r}")
        stop = req.get("stop_at_eos", True)
        if not isinstance(stop, (bool, np.bool_)):
            raise BadRequest(f"{where}.stop_at_eos must be true or false, got {stop!r}")
        tag = req.get("id")
        if tag is not None and not isinstance(tag, str) and not _is_int(tag):
            raise BadRequest(f"{where}.id must be a string or an integer, got {type(tag).__name__}")
        out.append(LanguageRequest(
            prompt=prompt, max_tokens=int(max_tokens), temperature=float(req.get("temperature", 0.0)),
            top_p=float(req.get("top_p", 1.0)), seed=None if seed is None else int(seed),
            adapter=adapter if isinstance(adapter, str) else int(adapter), stop_at_eos=bool(stop),
            tag=tag if tag is None or isinstance(tag, str) else int(tag)))
    return out


def _check_images_uint8(sample: Mapping, where: str = "") -> None:
    """Images travel as uint8 pixels (openpi-client converts before sending); anything else is refused."""
    for key, value in sample.items():
        if isinstance(value, Mapping):
            _check_images_uint8(value, f"{where}{key}/")
        elif isinstance(value, np.ndarray) and value.ndim == 3 and value.dtype != np.uint8:
            raise BadRequest(f"{where}{key}: images must be uint8 pixels, got dtype {value.dtype}; "
                             "convert with openpi_client.image_tools.convert_to_uint8")


def _deadline(sample: Mapping) -> float | None:
    value = sample.get("deadline_ms")
    if value is None:
        return None
    if not _is_real(value) or not 0 < float(value) <= 3.6e6:
        raise BadRequest(f"deadline_ms must be a number of milliseconds in (0, 3600000], got {value!r}")
    return float(value) / 1e3


# -------------------------------------------------------------------------------------------------
# Metrics
# -------------------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics of one server (its own registry, so several servers can share a process)."""

    def __init__(self, server: "PolicyServer"):
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
        Gauge("oxygen_connections", "Open robot connections", registry=r).set_function(
            lambda: len(server._streams))
        Gauge("oxygen_queue_depth", "Frames waiting for a step", registry=r).set_function(
            lambda: server.batcher.queue_depth)
        Gauge("oxygen_ready", "1 when warm and not draining", registry=r).set_function(lambda: float(server.healthy))
        Gauge("oxygen_compiles_after_warmup", "XLA compilations on the engine thread after warm-up",
              registry=r).set_function(lambda: server.compiles_after_warmup)
        self.lang_active = Gauge("oxygen_language_active", "Language requests decoding", registry=r)
        self.lang_queued = Gauge("oxygen_language_queued", "Language requests waiting for a slot", registry=r)

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

    def render(self) -> tuple[str, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry).decode(), CONTENT_TYPE_LATEST


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
      norm_stats: the checkpoint's normalisation statistics (None for random presets).
      mesh: a 1-D `jax.sharding.Mesh` with axis "robots" to shard steps over several devices.
    """

    def __init__(self, engine, tokenizer, robot: RobotConfig, config: ServeConfig = ServeConfig(), *,
                 norm_stats=None, mesh=None, image_size: int | None = None, prompt_len: int | None = None):
        self.engine, self.tokenizer, self.robot, self.config = engine, tokenizer, robot, config
        self.norm_stats = norm_stats
        self.codec = make_codec(engine, robot, tokenizer, norm_stats, config.default_prompt,
                                image_size=image_size, prompt_len=prompt_len)
        self.limits = wire.Limits(max_message_bytes=config.max_message_bytes, max_array_bytes=config.max_message_bytes)
        self.worker = EngineWorker(engine, self.codec, seed=config.seed, mesh=mesh)
        self.metrics = Metrics(self)
        self.batcher = Batcher(self.worker, buckets=config.buckets, max_pending=config.max_pending,
                               on_step=self.metrics.on_step)
        self._prep = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="oxygen-prep")
        self._streams: dict[int, Stream] = {}
        self._next_stream = 0
        self._preparing = 0  # frames received and being decoded (not yet queued)
        self._replying = 0  # frames whose reply is being sent
        self._draining = False
        self._ws = None
        self._warm_task: asyncio.Task | None = None
        self._compiles_at_warm: int | None = None

    # -- state ----------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
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
            "devices": self.worker.num_devices,
            "step_ms": {str(b): round(ms, 3) for b, ms in self.batcher.warmup_ms.items()},  # warm-up, per batch size
            "deadline_ms": self.config.deadline_ms, "max_message_bytes": self.config.max_message_bytes,
            "language": {"field": "language_requests", "max_tokens": e.max_new_tokens,
                         "prompt_capacity": e.prompt_capacity, "max_requests": self.config.max_requests_per_robot,
                         "adapters": sorted(getattr(self.engine, "adapters", {"base": 0}))},
        }
        codec = self.codec.metadata()
        codec["noise"] = {"seed": self.config.seed, **codec["noise"]}
        meta.update(codec)
        if r.name == "aloha":
            meta["reset_pose"] = list(_ALOHA_RESET_POSE)
        return meta

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Binds the port (healthz answers 503 at once), then compiles every batch size in the background."""
        from websockets.asyncio.server import serve

        c = self.config
        self._ws = await serve(
            self._handle, c.host, c.port, process_request=self._http, max_size=c.max_message_bytes,
            compression=None, ping_interval=c.ping_interval, ping_timeout=c.ping_timeout)
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
            if self.healthy:
                return connection.respond(200, "OK\n")
            return connection.respond(503, "draining\n" if self._draining else "warming up\n")
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
        if len(self._streams) >= self.config.max_robots:
            return connection.respond(503, f"too many robots connected (limit {self.config.max_robots})\n")
        return None

    # -- websocket ------------------------------------------------------------------------------

    async def _handle(self, ws) -> None:
        from websockets.exceptions import ConnectionClosed

        stream = Stream(id=self._next_stream, deadline_s=self.config.deadline_ms / 1e3)
        self._next_stream += 1
        self._streams[stream.id] = stream
        self.batcher.add_stream(stream)
        try:
            await ws.send(wire.pack(self.metadata(stream)))
            async for message in ws:
                received = time.perf_counter()
                reply = await self._answer(stream, message)
                self._replying += 1
                try:
                    await ws.send(reply)
                finally:
                    self._replying -= 1
                if isinstance(reply, bytes):  # a robot that got actions is expected back within its deadline
                    stream.last_reply = time.perf_counter()
                    self.metrics.total_s.observe(stream.last_reply - received)
        except ConnectionClosed:
            pass
        except Exception:  # noqa: BLE001 - openpi's convention: traceback as text, then 1011
            log.exception("internal error on stream %d", stream.id)
            self.metrics.frames.labels("error").inc()
            try:
                await ws.send(traceback.format_exc())
                await ws.close(1011, _INTERNAL_ERROR)
            except ConnectionClosed:
                pass
        finally:
            self._streams.pop(stream.id, None)
            cancelled = self.batcher.remove_stream(stream)
            cancelled.add_done_callback(self._count_cancelled)

    def _count_cancelled(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result():
            self.metrics.language.labels("cancelled").inc(fut.result())

    async def _answer(self, stream: Stream, message) -> bytes | str:
        """One reply: the response bytes, or a text frame for a refused frame. Internal errors raise."""
        if self._draining:
            self.metrics.frames.labels("unavailable").inc()
            return "unavailable: the server is shutting down; reconnect to another server"
        if isinstance(message, str):
            self.metrics.frames.labels("bad_request").inc()
            return "BadRequest: text frames are not observations; send the observation as a binary msgpack frame"
        loop = asyncio.get_running_loop()
        self._preparing += 1
        try:
            observation, state, language, deadline = await loop.run_in_executor(self._prep, self._prepare, message)
            if deadline is not None:
                stream.deadline_s = deadline
            if len(stream.tags) + len(language) > self.config.max_requests_per_robot:
                raise BadRequest(
                    f"language_requests: this robot has {len(stream.tags)} requests in flight and asks for "
                    f"{len(language)} more (limit {self.config.max_requests_per_robot}); wait for some to finish")
            frame = Frame(stream=stream, observation=observation, state=state, language=language,
                          arrival=time.perf_counter(), future=loop.create_future())
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
        return wire.pack(self._response(stream, result))

    def _prepare(self, message: bytes):
        """Decodes and validates one observation frame (prep thread). Raises BadRequest."""
        from oxygen_jax.robots import transforms

        try:
            sample = wire.unpack(message, self.limits)
        except wire.WireError as e:
            raise BadRequest(str(e)) from None
        if not isinstance(sample, Mapping):
            raise BadRequest(f"an observation must be a msgpack map of named fields, got {type(sample).__name__}")
        _check_images_uint8(sample)
        deadline = _deadline(sample)
        language = parse_language_requests(
            sample.get("language_requests"), max_requests=self.config.max_requests_per_robot,
            default_max_tokens=self.engine.config.max_new_tokens)
        try:
            observation = self.codec.prepare(sample)
            state = transforms.client_state(self.robot, sample)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e).removeprefix("sample 0: ")) from None
        return observation, state, language, deadline

    def _response(self, stream: Stream, result: FrameResult) -> dict:
        finished, failed = stream.take_language()
        return {
            "actions": np.asarray(result.actions, np.float32),
            **result.extras,
            "stream": stream.id,
            "frame": result.index,
            "server_timing": {"infer_ms": result.step_ms, "queue_ms": max(result.queue_ms, 0.0),
                              "batch": result.rows, "bucket": result.bucket},
            "policy_timing": {"infer_ms": result.step_ms},
            "language": {"accepted": result.accepted,
                         "finished": finished, "failed": failed},
        }


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
