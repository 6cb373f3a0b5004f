"""Asynchronous chunk execution for openpi-client users: inference in a background thread, chunks spliced by
the actions the robot consumed, real-time chunking when the server is oxygen_jax's.

    from openpi_client import websocket_client_policy
    from oxygen_jax.client import AsyncChunkClient

    policy = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=8000)
    robot = AsyncChunkClient(policy, execution_horizon=5, rtc={"mode": "guided"})
    while running:                      # the robot's control loop, at its control rate
        robot_command(robot.act(observation()))

It also has openpi_client's policy interface (`infer(obs) -> {"actions": [Da]}`, `reset()`), so it replaces
`ActionChunkBroker(policy, action_horizon)` in an openpi_client `Runtime(..., max_hz=...)` loop unchanged.

`act` returns the action for this control step and never waits for the network, except for the very first
chunk (and, with `asynchronous=False`, at every request: synchronous execution). Every `execution_horizon`
actions of a chunk it hands the current observation to a background thread, which calls `policy.infer`;
the robot keeps executing the current chunk meanwhile. When the reply arrives, the number of actions
executed since the request was sent is the delay c, counted in consumed actions (never in wall-clock
time): the new chunk's index 0 is the control step the request was sent at, so execution continues at
the new chunk's index c (no step is repeated or skipped). The delay announced with the next request is the
largest c of the last `delay_window` requests (LeRobot users report jumps when a running maximum never
forgets its warm-up, PR #4223; a window does).

With oxygen_jax's server (metadata "server" == "oxygen_jax" with an "rtc" entry) each request carries
{"chunk", "executed", "delay"} plus the `rtc` parameters, and the server denoises the new chunk so that it
continues the one being executed (`serving.rtc_session`, docs/rtc.md). With any other openpi policy server
no extra field is sent and the chunks are spliced as they are (naive asynchronous execution).

Missed deadline (the reply comes later than the current chunk lasts): the robot holds the chunk's last
action until the reply arrives (counted in c like any other consumed step), then continues the new chunk at
index c (at its last action if c >= Ha) and asks again at once.

This module imports numpy and the standard library only (the policy object is openpi_client's or anything
with `infer(observation) -> {"actions": [Ha, Da], ...}` and `get_server_metadata()`). `import
oxygen_jax.client` loads nothing else of the package (its public names load on first use), so a robot
machine needs no jax: `pip install numpy openpi-client typing-extensions` (openpi-client brings msgpack,
websockets, dm-tree and pillow; its websocket policy also imports typing-extensions, which it does not
declare), then a copy of this repository's `oxygen_jax/` folder or of this one file.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from collections.abc import Mapping

import numpy as np

_STOP = object()


@dataclasses.dataclass
class ClientStats:
    """What the client measured. `delays`: consumed actions per request (c); `holds`: steps that repeated a
    chunk's last action while waiting; `boundary_jumps`: max |a_t - a_{t-1}| at each switch to a new chunk."""

    requests: int = 0
    delays: list[int] = dataclasses.field(default_factory=list)
    holds: int = 0
    boundary_jumps: list[float] = dataclasses.field(default_factory=list)
    fallbacks: list[str] = dataclasses.field(default_factory=list)  # the server's rtc.fallback texts


class AsyncChunkClient:
    """One robot's chunk executor; call `act(observation)` once per control step (one thread).

    Args:
      policy: openpi_client's `WebsocketClientPolicy` (or any object with `infer` and `get_server_metadata`).
      execution_horizon: s, actions of each chunk executed before the next request is sent (>= 1).
      rtc: RTC parameters for oxygen_jax's server ({"mode", "schedule", "max_guidance"}); None: never send RTC.
      asynchronous: False waits for each reply (synchronous execution, the delay is then 0).
      initial_delay: the delay announced before any has been measured (actions).
      delay_window: requests whose measured delays set the announced one (their maximum).
    """

    def __init__(self, policy, *, execution_horizon: int, rtc: Mapping | None = None, asynchronous: bool = True,
                 initial_delay: int = 0, delay_window: int = 5):
        if not isinstance(execution_horizon, int) or execution_horizon < 1:
            raise ValueError(f"execution_horizon must be an integer >= 1 (actions per chunk), got {execution_horizon!r}")
        if not isinstance(initial_delay, int) or initial_delay < 0 or delay_window < 1:
            raise ValueError(f"initial_delay must be an integer >= 0 and delay_window >= 1, got {initial_delay!r}, "
                             f"{delay_window!r}")
        self.policy, self.s, self.asynchronous = policy, execution_horizon, asynchronous
        meta = policy.get_server_metadata() if hasattr(policy, "get_server_metadata") else {}
        meta = meta if isinstance(meta, Mapping) else {}
        self.server_rtc = meta.get("server") == "oxygen_jax" and isinstance(meta.get("rtc"), Mapping)
        self.rtc = dict(rtc) if (rtc is not None and self.server_rtc) else None
        self.stats = ClientStats()
        self._recent = collections.deque([initial_delay], maxlen=delay_window)
        self._chunk: np.ndarray | None = None  # [Ha, Da] being executed
        self._chunk_id: int | None = None  # the server's rtc.chunk of it
        self._index = 0  # next action of the chunk to execute
        self._last: np.ndarray | None = None  # the action returned last step
        self._sent_at: int | None = None  # step count when the request in flight was sent
        self._steps = 0
        self._switched = False  # this step switched to a new chunk
        self._replies: queue.Queue = queue.Queue()
        self._requests: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="oxygen-async-client", daemon=True)
        self._thread.start()

    # -- the background thread ------------------------------------------------------------------

    def _work(self) -> None:
        while (obs := self._requests.get()) is not _STOP:
            try:
                self._replies.put((self.policy.infer(obs), None))
            except Exception as e:  # noqa: BLE001 - re-raised on the control thread at the next act()
                self._replies.put((None, e))

    # -- the control thread ---------------------------------------------------------------------

    @property
    def delay(self) -> int:
        """The delay (actions) announced with the next request: the maximum of the recent measured ones."""
        return max(self._recent)

    def ready(self) -> bool:
        """A requested chunk has arrived: the next `act` switches to it."""
        return not self._replies.empty()

    def _send(self, observation: Mapping) -> None:
        obs = dict(observation)
        if self.rtc is not None:
            fields = dict(self.rtc)
            if self._chunk_id is not None:
                horizon = len(self._chunk)
                fields.update(chunk=self._chunk_id, executed=min(self._index, horizon),
                              delay=min(self.delay, max(horizon - self._index, 0)))
            obs["rtc"] = fields
        self._sent_at = self._steps
        self.stats.requests += 1
        self._requests.put(obs)

    def _receive(self, block: bool) -> None:
        reply, error = self._replies.get(block=block)
        if error is not None:
            self._sent_at = None
            raise error
        actions = np.asarray(reply["actions"])
        if actions.ndim != 2 or len(actions) == 0:
            raise ValueError(f"the policy returned actions of shape {actions.shape}; expected [horizon, action_dim]")
        c = self._steps - self._sent_at  # actions consumed while the request was in flight
        self._sent_at = None
        info = reply.get("rtc") if isinstance(reply.get("rtc"), Mapping) else {}
        if info.get("fallback"):
            self.stats.fallbacks.append(str(info["fallback"]))
        if self._chunk is not None:
            self.stats.delays.append(c)
            self._recent.append(c)
        self._chunk, self._chunk_id = actions, info.get("chunk")
        self._index = min(c, len(actions) - 1) if self._last is not None else 0
        self._switched = True

    def act(self, observation: Mapping) -> np.ndarray:
        """The action for this control step (observation: this step's, in the server's format)."""
        self._switched = False
        if self._chunk is None:  # the first chunk: nothing to execute meanwhile
            if self._sent_at is None:
                self._send(observation)
            self._receive(block=True)
        elif self._sent_at is not None and (not self.asynchronous or self.ready()):
            self._receive(block=not self.asynchronous)
        if self._sent_at is None and self._index >= self.s:
            self._send(observation)
            if not self.asynchronous:
                self._receive(block=True)
        if self._index < len(self._chunk):
            action = self._chunk[self._index]
            self._index += 1
        else:  # the chunk ran out before the reply: hold its last action
            action = self._chunk[-1]
            self.stats.holds += 1
        if self._switched and self._last is not None:
            self.stats.boundary_jumps.append(float(np.max(np.abs(action - self._last))))
        self._last = action
        self._steps += 1
        return action

    # -- openpi_client's policy interface (a drop-in for ActionChunkBroker in openpi_client.runtime) --------

    def infer(self, observation: Mapping) -> dict:
        """{"actions": [Da]}: this control step's action, as openpi's `ActionChunkBroker.infer` returns it."""
        return {"actions": self.act(observation)}

    def reset(self) -> None:
        """A new episode: the chunk in flight (if any) is awaited and dropped; the next step fetches a fresh one."""
        if self._sent_at is not None:
            self._replies.get()
        self._chunk = self._chunk_id = self._last = self._sent_at = None
        self._index = 0

    def close(self) -> None:
        """Stops the background thread (after the request in flight, if any)."""
        self._requests.put(_STOP)
        self._thread.join(timeout=30)

    def __enter__(self) -> "AsyncChunkClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
