"""Host-side engine for online use: a robot loop or a server steps it once per control frame.

    engine = Engine(vla, EngineConfig(num_slots=8, max_new_tokens=30, tokens_per_frame=5))
    rid = engine.submit(prompt_tokens=[...], max_tokens=20)       # any time, from the host
    result = engine.step(observation)                            # one compiled frame
    result.actions          # [B, Ha, Ad] this frame's chunk of the primary head (never waits for text)
    result.head_actions     # head name -> [B, Ha, Ad], every head of the model
    result.finished         # list of FinishedRequest (tokens, text, latency in frames and ms)

Any model: `vla` is a `models.vla.MultiHead(params, spec)`: π0.5 (`pi05.model.as_vla(params, num_steps)`,
one head "actions" on `Observation`s), or a backbone with several heads, e.g. XR0 + StarVLA + language on
Qwen3-VL (`ckpts.load_model(...).vla`; observations are then `mot.PrefixInputs`, and heads with a state
token take `states`). A request stops at the model's stop ids (`MultiHead.stop_ids`: a checkpoint's
`eos_token_id`s) unless it names its own.

Requests wait in a FIFO queue (`scheduler.Scheduler`) while every slot is busy; none is dropped, and
memory is bounded by the pool. One device→host transfer per frame brings back actions, new tokens and
finish flags.

Nothing a caller sends can stop the actions: every request field is checked at `submit` (one-line
`RequestError`), a request that still cannot run at `step` is dropped and reported in
`StepResult.errors` while that frame's actions are returned, `cancel` frees a request's slot, and noise
and the returned actions are checked (shape, dtype, finite values).

Several robots (streams) can share one engine: `step(observation, rows=[...])` names the stream of
each batch row, and a request submitted with `row=stream` is admitted in a frame where that stream
has a row, continuing that robot's observation. Streams are isolated from each other: a row whose
actions come back non-finite is reported in `StepResult.row_errors` (the other rows are served as
usual, and that row's requests admitted in the frame are dropped), `validate` finds the row whose
inputs `step` would refuse, and a state is bounded by `MAX_STATE_ABS`.

A model whose decoder writes the chunks (`MultiHead.action_stream`, π0-FAST) runs `runtime.action_streams`
frames instead: one action stream per robot row in the same pool as the language requests, each stopping on
its own, bounded by a deadline (`StreamConfig`); a chunk that fails is that row's `row_errors` entry.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from oxygen_jax.runtime import action_streams, decode, slot_mesh
from oxygen_jax.models.lora import LoraBank
from oxygen_jax.models.vla import MultiHead
from oxygen_jax.nn import kv_quant
from oxygen_jax.runtime import rtc as rtc_mod
from oxygen_jax.runtime.frame import FrameOutput, frame_step
from oxygen_jax.runtime.request_limits import (  # noqa: F401 - MAX_SEED, RequestError: part of this API
    MAX_SEED, MAX_STREAM, CheckedRequest, RequestError, RequestLimits, is_int, show_value)
from oxygen_jax.runtime.scheduler import Scheduler, Ticket

MAX_STATE_ABS = 1e4
"""Bound on |state| a head's state token reads (the normalised state: trained states lie within a few units).

A state projector multiplies the state into the residual stream, where a float32-finite 3e38 becomes inf;
1e4 is far beyond any trained range and far below where a projector or a norm's square overflows."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    num_slots: int = 8  # Ns: concurrent language requests
    max_new_tokens: int = 32  # M: a slot's room for new tokens (a language request's cap unless the next is set)
    request_max_tokens: int | None = None  # a language request's cap when slots are wider (decoded action chunks)
    prompt_capacity: int = 0  # Q: max request-prompt tokens written after the shared prefix
    admissions_per_frame: int = 4  # J: requests admitted per frame at most
    tokens_per_frame: int = 5  # k: decode steps per frame (verify steps under speculation)
    speculate: int = 0  # γ: draft tokens checked per verify step (0: plain decoding; runtime.speculative)
    verify_cost: float = 1.0  # under speculation k is a budget in decode steps; a verify step with drafts costs this
    action_horizon: int = 10  # π0.5's Ha, for the noise the engine draws when step() gets none
    seed: int = 0  # noise seed (frame f uses fold_in(seed, f))
    kv_cache: str = "float"  # the slots' K/V storage: "float" (the decoder's dtype), "int8" or "fp8" (nn.kv_quant)

    def __post_init__(self):
        for f in ("num_slots", "max_new_tokens", "admissions_per_frame", "tokens_per_frame", "action_horizon"):
            if getattr(self, f) < 1:
                raise ValueError(f"EngineConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.prompt_capacity < 0:
            raise ValueError("EngineConfig.prompt_capacity must be >= 0")
        if self.request_max_tokens is not None and not 1 <= self.request_max_tokens <= self.max_new_tokens:
            raise ValueError(f"EngineConfig.request_max_tokens must be in [1, max_new_tokens = {self.max_new_tokens}], "
                             f"got {self.request_max_tokens}")
        if self.speculate < 0:
            raise ValueError(f"EngineConfig.speculate must be >= 0 (0 = no speculative decoding), got {self.speculate}")
        if self.kv_cache not in kv_quant.KV_CACHES:
            raise ValueError(f"EngineConfig.kv_cache must be one of {', '.join(kv_quant.KV_CACHES)}, got {self.kv_cache!r}")
        if not 1 <= self.verify_cost < float("inf"):  # NaN fails this too
            raise ValueError(f"EngineConfig.verify_cost must be a finite number >= 1 (decode steps a verify step costs), got {self.verify_cost}")


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
    request_id: int
    tokens: list[int]
    text: str | None
    arrival_frame: int
    admit_frame: int
    finish_frame: int
    latency_frames: int  # finish frame - arrival frame + 1 (a request finished in its arrival frame took 1)
    latency_ms: float  # arrival (submit) to the end of the frame that emitted its last token
    row: int = 0  # the stream (robot) the request continued
    owner: object = None  # what the caller passed to submit(owner=...)


@dataclasses.dataclass(frozen=True)
class FailedRequest:
    request_id: int
    reason: str
    owner: object = None


@dataclasses.dataclass(frozen=True)
class StepResult:
    actions: np.ndarray  # [B, Ha, Ad] of the primary head ([B, 0, 0]: a model without a head)
    finished: list[FinishedRequest]
    new_text: dict[int, str]  # request id -> text completed this frame (with a tokenizer)
    frame: int
    frame_ms: float
    batch: int  # active slots in this frame's decode burst
    queued: int  # requests still waiting for a slot after this frame
    errors: list[FailedRequest] = dataclasses.field(default_factory=list)  # dropped this frame
    head_actions: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # every head: name -> [B, Ha, Ad]
    row_errors: dict[int, str] = dataclasses.field(default_factory=dict)  # batch row -> why its actions are unusable
    new_tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # request id -> ids emitted this frame
    steps: int = 0  # decode (or verify) steps this frame's burst ran
    tokens_per_step: float = 0.0  # burst tokens per (slot, step) that emitted: 1 plain, up to γ + 1 speculative
    fallbacks: dict[int, str] = dataclasses.field(default_factory=dict)  # batch row -> why its chunk is openpi's zeros
    drafts_proposed: int = 0  # speculation: draft tokens this frame's verify steps checked (`speculative.draft_counts`)
    drafts_accepted: int = 0  # of which emitted


def _float32_finite(x) -> bool:
    """Every value finite once cast to float32 (a float64 1e300 is finite, but inf on the device)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.asarray(x, np.float32)).all())


def _nonfinite_rows(actions: dict[str, np.ndarray], rows: Sequence[int]) -> dict[int, str]:
    """Batch row -> reason, for every non-padding row (rows[i] >= 0) with a non-finite action of any head."""
    bad = {}
    for name, a in actions.items():
        finite = np.isfinite(np.asarray(a)).reshape(len(rows), -1).all(axis=1)
        for i in np.flatnonzero(~finite):
            if rows[i] >= 0 and i not in bad:
                bad[int(i)] = f"the model returned non-finite actions (NaN/inf) of head {name!r} for this row"
    return bad


def _check_rows(rows, b: int) -> list[int]:
    """The stream id of each of the b batch rows, as ints; ValueError naming what to pass otherwise."""
    want = f"pass rows= as a list of {b} integer stream ids in [0, {MAX_STREAM}] (-1 = padding row)"
    if isinstance(rows, np.ndarray):
        rows = rows.tolist() if rows.ndim == 1 and np.issubdtype(rows.dtype, np.integer) else None
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)):
        raise ValueError(f"rows must be a sequence of stream ids, got {show_value(rows)}: {want}")
    if len(rows) != b:
        raise ValueError(f"rows names {len(rows)} streams but the observation has {b} rows: {want}")
    bad = next((r for r in rows if not (is_int(r) and -1 <= r <= MAX_STREAM)), None)
    if bad is not None:
        raise ValueError(f"rows holds {show_value(bad)}: {want}")
    rows = [int(r) for r in rows]
    real = [r for r in rows if r >= 0]
    if len(set(real)) != len(real):
        raise ValueError(f"rows names a stream twice ({show_value(rows)}): each stream has at most one batch row per frame")
    return rows


class Engine:
    """Continuous-batching engine over `runtime.frame.frame_step` (one compiled program per frame shape)."""

    def __init__(self, vla: MultiHead, config: EngineConfig = EngineConfig(), tokenizer=None, *,
                 bank: LoraBank | None = None, adapter_names: Sequence[str] = (), mesh=None,
                 streams: action_streams.StreamConfig | None = None):
        """Args:
          vla: a `models.vla.MultiHead` with a language decoder (π0.5 `Params`: `pi05.model.as_vla(params,
            num_steps)`); `for_backend` weights recommended.
          config: pool and frame sizes.
          tokenizer: for text prompts and detokenised results (optional).
          bank: language adapters of the VLM expert (`lora.LoraBank`; `qwen35.HybridBank` for a Qwen3.5
            model; E stored adapters), served per request on the suffix path only; actions and the
            prefix cache never see them.
          adapter_names: names of the bank's adapters 1..E (id 0 is "base", the model's own weights).
          mesh: a `runtime.slot_mesh.serving_mesh` to split the slot pool over (its `robots` axis; num_slots a
            multiple of it); `vla` placed on it (`slot_mesh.place_model`). None: one device.
          streams: action streams of a model whose decoder writes the chunks (`vla.action_stream`; default
            `StreamConfig()`): kept slots, max tokens per chunk, the frame's deadline, the failure rule.
        """
        if not isinstance(vla, MultiHead):
            raise ValueError(f"Engine runs a models.vla.MultiHead, got {type(vla).__name__} (π0.5 Params: pass "
                             "pi05.model.as_vla(params, num_steps); a checkpoint: load_model(...).vla)")
        self.vla: MultiHead = vla
        self.config, self.tokenizer, self.bank, self.mesh = config, tokenizer, bank, mesh
        slot_mesh.check_slots(config.num_slots, mesh)
        if mesh is not None and bank is not None:  # replicated beside the weights, as every device's slots read it
            self.bank = jax.device_put(bank, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        if not self.vla.has_language:
            raise ValueError("Engine decodes language from the shared prefix: build the ModelSpec with language=True")
        self.vla.language().check_kv_cache(config.kv_cache)
        self._unk = None if tokenizer is None else tokenizer.unk_id
        stored = 0 if bank is None else bank.num_adapters
        if len(adapter_names) != stored:
            raise ValueError(f"adapter_names names {len(adapter_names)} adapters but the bank stores {stored}")
        if len({"base", *adapter_names}) != len(adapter_names) + 1:  # ids and names: `self.limits.adapters`
            raise ValueError(f"adapter names must be unique and not 'base', got {list(adapter_names)}")
        self.limits = RequestLimits(max_new_tokens=config.request_max_tokens or config.max_new_tokens,
                                    prompt_capacity=config.prompt_capacity,
                                    vocab_size=self.vla.vocab_size, adapters=("base", *adapter_names),
                                    stop_ids=tuple(self.vla.stop_ids))
        self.streams = self._streams(streams)
        self._sched = Scheduler(config.num_slots, config.admissions_per_frame, config.prompt_capacity,
                                speculate=config.speculate, max_new_tokens=config.max_new_tokens,
                                reserved=0 if self.streams is None else self.streams.slots)
        self._pool: decode.DecodePool | None = None
        self._prefix_key: tuple | None = None
        self._detok: dict[int, object] = {}
        self._next_id = 0
        self._frame = 0
        self._base_key = jax.random.key(config.seed)

    def _streams(self, config: action_streams.StreamConfig | None) -> action_streams.Streams | None:
        stream, cfg = self.vla.action_stream, self.config
        if stream is None:
            if config is not None:
                raise ValueError("streams= configures action streams, but this model's actions come from its heads")
            return None
        if cfg.speculate or self.mesh is not None:
            raise ValueError("action streams run on a plain one-device pool: drop speculate / mesh for this model")
        if cfg.kv_cache != "float":  # the chunks decode in the pool: quantized K/V would change the actions
            raise ValueError(f"this model decodes its action chunks in the slot pool, whose K/V stay float: drop "
                             f"kv_cache={cfg.kv_cache!r}")
        return action_streams.Streams(stream, config or action_streams.StreamConfig(), num_slots=cfg.num_slots,
                                      max_new_tokens=cfg.max_new_tokens, prompt_capacity=cfg.prompt_capacity,
                                      tokens_per_frame=cfg.tokens_per_frame)

    # -- requests -------------------------------------------------------------------------------

    def submit(
        self,
        prompt_tokens=None,
        *,
        prompt: str | None = None,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | int | None = None,
        seed: int | None = None,
        row: int = 0,
        adapter: str | int | None = None,
        owner: object = None,
    ) -> int:
        """Queues a language request on stream `row`; returns its id.

        The request continues the prefix of that stream's observation in the frame that admits it.
        Its own prompt (`prompt_tokens`, or `prompt` text with a tokenizer) is written after that
        prefix. It stops at any of `stop_ids` (None: the model's own, `MultiHead.stop_ids`; () decodes exactly
        `max_tokens` tokens; at most 8 ids). `adapter` is a name given to
        the engine, "base", an adapter id, or None (the base weights). Every field is checked against
        `self.limits` (`runtime.request_limits`).

        Raises:
          RequestError: naming the first invalid field; nothing is queued.
        """
        if prompt is not None and prompt_tokens is not None:
            raise RequestError("give either prompt (text) or prompt_tokens, not both", "prompt_tokens")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise RequestError(f"prompt must be a string, got {type(prompt).__name__}", "prompt_tokens")
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer, so prompts are token ids: send prompt_tokens "
                                   "(a list of ints), or give the engine the checkpoint's tokenizer", "prompt_tokens")
            prompt_tokens = self.tokenizer.encode(prompt)
        request = self.limits.check(
            prompt_tokens=[] if prompt_tokens is None else prompt_tokens, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, stop_ids=stop_ids, seed=seed, row=row, adapter=adapter)
        return self.enqueue(request, owner=owner)

    def enqueue(self, request: CheckedRequest, *, owner: object = None) -> int:
        """Queues a request `self.limits.check` accepted (no second check: the policy server checks on its
        prep thread); returns its id. `owner` is any object, given back with the request's results."""
        rid = self._next_id
        self._next_id += 1
        self._sched.enqueue(Ticket.make(
            rid, budget=request.max_tokens, row=request.row, prompt=list(request.prompt),
            stop_ids=request.stop_ids,
            temperature=request.temperature, top_p=request.top_p, seed=request.seed, adapter=request.adapter,
            arrival_frame=self._frame, owner=owner,
        ))
        return rid

    def adapter_id(self, adapter: str | int | None) -> int:
        """The id of an adapter name or id (None = the base weights); RequestError for unknown ones."""
        return self.limits.adapter_id(adapter)

    def cancel(self, request_id: int) -> bool:
        """Drops a queued request, or frees a running one's slot at the next step. False if unknown/finished."""
        self._detok.pop(request_id, None)
        return self._sched.cancel(request_id)

    @property
    def num_queued(self) -> int:
        return self._sched.num_queued

    @property
    def num_active(self) -> int:
        return self._sched.num_live

    @property
    def frame(self) -> int:
        """Index of the next frame."""
        return self._frame

    # -- frames ---------------------------------------------------------------------------------

    def _check_noise(self, noise, b: int) -> dict[str, jax.Array]:
        """head name -> noise [B, Ha, Ad]; an array is the noise of a one-head model (π0.5)."""
        heads = self.vla.heads
        if noise is None:
            # Head 0 draws fold_in(seed, frame) exactly as a one-head engine always has; others fold in their index.
            key = jax.random.fold_in(self._base_key, self._frame)
            return {n: jax.random.normal(key if i == 0 else jax.random.fold_in(key, i), self._noise_shape(n, b))
                    for i, n in enumerate(heads)}
        if not isinstance(noise, dict):
            if len(heads) != 1:
                raise ValueError(f"this model has heads {heads}: pass noise as a dict head name -> [B, Ha, Ad]")
            noise = {heads[0]: noise}
        if set(noise) != set(heads):
            raise ValueError(f"noise must name exactly the heads {heads}, got {tuple(noise)}")
        for n, x in noise.items():
            shape = self._noise_shape(n, b)
            if tuple(x.shape) != shape:
                raise ValueError(f"noise must have shape [B, Ha, Ad] = {shape}, got {tuple(x.shape)}"
                                 + (f" (head {n!r})" if len(heads) > 1 else ""))
            if not np.issubdtype(np.dtype(x.dtype), np.floating):
                raise ValueError(f"noise must be floating point, got dtype {x.dtype}")
            if not isinstance(x, jax.core.Tracer) and not _float32_finite(x):
                raise ValueError("noise holds NaN, inf or values beyond float32")
        return noise

    def _noise_shape(self, name: str, b: int) -> tuple[int, int, int]:
        return (b, *self.vla.action_shape(name, self.config.action_horizon))

    def _check_states(self, states, b: int) -> dict[str, jax.Array] | None:
        """head name -> state [B, Ds] for exactly the heads with a state token (None when no head has one)."""
        want = self.vla.state_dims()
        got = dict(states or {})
        if set(got) != set(want):
            raise ValueError(f"states must name exactly the heads with a state token {tuple(want)}, got {tuple(got)}")
        for n, x in got.items():
            if tuple(x.shape) != (b, want[n]):
                raise ValueError(f"states[{n!r}] must have shape [B, Ds] = {(b, want[n])}, got {tuple(x.shape)}")
            if not np.issubdtype(np.dtype(x.dtype), np.number) or np.issubdtype(np.dtype(x.dtype), np.complexfloating):
                raise ValueError(f"states[{n!r}] must be real numbers, got dtype {x.dtype}")
            if not isinstance(x, jax.core.Tracer) and not _float32_finite(x):
                raise ValueError(f"states[{n!r}] holds NaN, inf or values beyond float32 (|x| > 3.4e38); "
                                 "send the robot's normalised state")
            if not isinstance(x, jax.core.Tracer) and np.abs(np.asarray(x, np.float32)).max(initial=0) > MAX_STATE_ABS:
                raise ValueError(f"states[{n!r}] holds values beyond +-{MAX_STATE_ABS:g} (engine.MAX_STATE_ABS); "
                                 "send the robot's normalised state")
        return got or None

    def _ensure_pool(self, inputs) -> None:
        key = self.vla.shape_key(inputs)
        if self._pool is not None and key == self._prefix_key:
            return
        prefix_len = decode.prefix_length(jax.eval_shape(lambda v, x: v.prefix(x), self.vla, inputs))
        if self._pool is not None and prefix_len != self._pool.prefix_len:
            raise ValueError(
                f"observation prefix length changed from {self._pool.prefix_len} to {prefix_len} tokens "
                "(cameras or prompt length); in-flight requests hold caches of the old length. Keep the camera "
                "set and the prompt length (or its bucket) fixed for an engine."
            )
        if self._pool is None:
            cfg = self.config
            self._pool = self._new_pool(cfg.num_slots, prefix_len, cfg.max_new_tokens, cfg.prompt_capacity)
        self._prefix_key = key

    def _new_pool(self, num_slots: int, prefix_len: int, max_new_tokens: int, prompt_len: int) -> decode.DecodePool:
        return decode.init_pool(self.vla.language(), num_slots, prefix_len, max_new_tokens, prompt_len,
                                speculate=self.config.speculate, verify_cost=self.config.verify_cost, mesh=self.mesh,
                                kv_cache=self.config.kv_cache)

    def warmup(self, observation, states=None, rtc=None) -> float:
        """Compiles the frame program for this observation's shapes without touching any request.

        Runs one frame on a scratch pool (no requests, nothing emitted), so a server can compile every
        batch bucket before it reports healthy. With `rtc` (as `step` takes it; e.g. `rtc.off(...)`) the
        real-time-chunking program is compiled instead (its values never recompile). Returns the seconds it took.
        """
        start = time.perf_counter()
        self.vla.check_inputs(observation)
        self._ensure_pool(observation)
        p, b = self._pool, self.vla.batch_size(observation)
        states = self._check_states(states if states is not None else self._zero_states(b), b)
        scratch = self._new_pool(p.num_slots, p.prefix_len, p.max_new_tokens, p.prompt_len)
        requests, _ = Scheduler(p.num_slots, self.config.admissions_per_frame, p.prompt_len,
                                speculate=self.config.speculate, max_new_tokens=p.max_new_tokens).offer(b)
        noises = {n: jax.random.normal(jax.random.key(0), self._noise_shape(n, b)) for n in self.vla.heads}
        rtc = rtc_mod.for_heads(self.vla, rtc, noises)
        if self.streams is not None:
            self.streams.warmup(self.vla, scratch, observation, requests, self.bank)
            return time.perf_counter() - start
        _, out = frame_step(self.vla, scratch, observation, noises, requests, np.zeros((p.num_slots,), bool),
                            self.bank, states, tokens_per_frame=self.config.tokens_per_frame,
                            **({} if rtc is None else {"rtc": rtc}))
        jax.block_until_ready(out)
        return time.perf_counter() - start

    def _zero_states(self, b: int) -> dict[str, np.ndarray]:
        return {n: np.zeros((b, d), np.float32) for n, d in self.vla.state_dims().items()}

    def _drop_unservable(self, rows: Sequence[int] | None, b: int) -> list[FailedRequest]:
        """Without explicit streams, row r means batch row r: requests beyond the batch cannot run."""
        if rows is not None:
            return []
        errors = []
        for t in self._sched.queued():
            if t.row >= b:
                self._sched.cancel(t.request_id)
                self._detok.pop(t.request_id, None)
                errors.append(FailedRequest(t.request_id, f"observation row {t.row} is not in this frame's batch of {b}",
                                            t.owner))
        return errors

    def validate(self, observation, noise=None, *, rows: Sequence[int] | None = None, states: dict | None = None,
                 rtc=None) -> None:
        """Raises ValueError naming what `step` would refuse in these inputs; runs nothing and changes nothing.

        A server that batches several robots calls it on one robot's row alone to find the row at fault
        when `step` refused a whole batch. Arguments as `step` (noise None is not drawn, only allowed).
        """
        self._checked(observation, noise, rows, states, rtc, draw=False)

    def _checked(self, observation, noise, rows, states, rtc, *, draw: bool = True):
        """(B, rows, noise, states, rtc) as `step` runs them: every input check, nothing changed."""
        self.vla.check_inputs(observation)
        b = self.vla.batch_size(observation)
        if rows is not None:
            rows = _check_rows(rows, b)
        noise = self._check_noise(noise, b) if draw or noise is not None else None
        states = self._check_states(states, b)
        rtc = rtc_mod.for_heads(self.vla, rtc, noise) if noise is not None else rtc
        return b, rows, noise, states, rtc

    def step(self, observation, noise=None, *, rows: Sequence[int] | None = None,
             states: dict | None = None, rtc=None) -> StepResult:
        """Runs one control frame with this frame's observation; returns actions and finished texts.

        Args:
          observation: B rows (robots): an `Observation` (π0.5) or `mot.PrefixInputs` (a ModelSpec).
          noise: float [B, Ha, Ad] (one-head models) or head name -> [B, Ha, Ad], finite; default drawn
            from the engine's seed and frame index.
          rows: stream id of each batch row (-1 = padding); default rows 0..B-1. With `rows`, rows are
            isolated: a row whose actions are not finite is named in `StepResult.row_errors` (its requests
            admitted this frame are dropped, into `errors`) and the other rows are served; without `rows`,
            non-finite actions raise FloatingPointError.
          states: head name -> robot state [B, Ds] for the heads with a state token (|x| <= MAX_STATE_ABS).
          rtc: optional real-time chunking per row: a `runtime.rtc.RtcInputs` for the primary head, or head
            name -> `RtcInputs` (previous chunk, d, s, schedule, β, mode as arrays: no recompile when they change).
        """
        b, rows, noise, states, rtc = self._checked(observation, noise, rows, states, rtc)
        rtc_kw = {} if rtc is None else {"rtc": rtc}  # omitted when off: the same compiled program as before
        self._ensure_pool(observation)
        errors = self._drop_unservable(rows, b)
        cfg = self.config
        requests, evict = self._sched.offer(b if rows is None else rows)
        if self.streams is not None:
            return self._step_streams(observation, list(range(b)) if rows is None else rows, requests, evict, errors)
        start = time.perf_counter()
        try:
            pool, out = frame_step(self.vla, self._pool, observation, noise, requests, evict, self.bank, states,
                                   tokens_per_frame=cfg.tokens_per_frame, **rtc_kw)
            out: FrameOutput = jax.device_get(out)  # the frame's single host sync
        except Exception as e:  # noqa: BLE001 - the actions must survive a failing request
            if not np.any(requests.valid):
                raise
            errors += self._retry_without_requests(e)
            requests, evict = self._sched.offer([])
            pool, out = frame_step(self.vla, self._pool, observation, noise, requests, evict, self.bank, states,
                                   tokens_per_frame=cfg.tokens_per_frame, **rtc_kw)
            out = jax.device_get(out)
        self._pool = pool
        end = time.perf_counter()
        bad = _nonfinite_rows(out.actions, range(b) if rows is None else rows)
        if bad and rows is None:  # one caller's frame: nothing to isolate
            raise FloatingPointError(
                f"frame {self._frame}: the model returned non-finite actions (NaN/inf) in rows {sorted(bad)}; check "
                "the parameters and the observation (images in [-1, 1], normalised state)")
        offered = self._sched.offered()
        result = self._absorb(out, b, start, end, errors)
        return self._isolate(result, bad, rows, offered) if bad else result

    def _step_streams(self, observation, rows: list[int], requests, evict, errors) -> StepResult:
        """A frame of a model whose decoder writes the chunks (`runtime.action_streams`)."""
        start = time.perf_counter()
        try:
            self._pool, out, chunks = self.streams.run(self.vla, self._pool, observation, rows, requests, evict, self.bank)
        except Exception as e:  # noqa: BLE001 - the chunks must survive a failing request
            if not np.any(requests.valid):
                raise
            errors += self._retry_without_requests(e)
            requests, evict = self._sched.offer([])
            self._pool, out, chunks = self.streams.run(self.vla, self._pool, observation, rows, requests, evict, self.bank)
        result = self._absorb(out, len(rows), start, time.perf_counter(), errors)
        return dataclasses.replace(result, actions=chunks.actions, head_actions={self.streams.stream.name: chunks.actions},
                                   row_errors=chunks.errors, fallbacks=chunks.fallbacks, steps=chunks.steps)

    def _isolate(self, result: StepResult, bad: dict[int, str], rows: list[int],
                 offered: list[Ticket]) -> StepResult:
        """`result` with rows `bad` (batch row -> reason) named in `row_errors`, and the requests admitted
        this frame on those rows (they continued a non-finite prefix) dropped into `errors`."""
        streams = {rows[i]: why for i, why in bad.items()}
        dropped = {t.request_id: t for t in offered if t.admit_frame == result.frame and t.row in streams}
        for rid, t in dropped.items():
            self.cancel(rid)
        errors = result.errors + [FailedRequest(rid, f"dropped with its robot's frame: {streams[t.row]}", t.owner)
                                  for rid, t in dropped.items()]
        return dataclasses.replace(
            result, finished=[f for f in result.finished if f.request_id not in dropped],
            new_text={rid: x for rid, x in result.new_text.items() if rid not in dropped}, errors=errors,
            new_tokens={rid: x for rid, x in result.new_tokens.items() if rid not in dropped},
            row_errors=dict(bad))

    def _retry_without_requests(self, error: Exception) -> list[FailedRequest]:
        """Drops the offered requests after a failed frame; rebuilds the pool if donation consumed it."""
        offered = self._sched.offered()
        errors = []
        for t in offered:
            self._sched.cancel(t.request_id)
            self._detok.pop(t.request_id, None)
            errors.append(FailedRequest(t.request_id, f"{type(error).__name__}: {error}", t.owner))
        if any(x.is_deleted() for x in jax.tree.leaves(self._pool) if isinstance(x, jax.Array)):
            for t in self._sched.reset_live():
                errors.append(FailedRequest(t.request_id, "decode state lost after a failed frame", t.owner))
            p = self._pool
            self._pool = self._new_pool(p.num_slots, p.prefix_len, p.max_new_tokens, p.prompt_len)
        return errors

    def _text(self, ticket: Ticket, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        detok = self._detok.get(ticket.request_id)
        if detok is None:
            detok = self._detok[ticket.request_id] = self.tokenizer.stream()
        # A model whose vocabulary exceeds the tokenizer's can emit ids the tokenizer cannot decode: show
        # them as unknown pieces (or nothing) rather than fail the frame (the raw ids stay in FinishedRequest.tokens).
        vocab = self.tokenizer.vocab_size
        if self._unk is None:
            return detok.push([t for t in tokens if 0 <= t < vocab])
        return detok.push([t if 0 <= t < vocab else self._unk for t in tokens])

    def _absorb(self, out: FrameOutput, b: int, start: float, end: float, errors: list[FailedRequest]) -> StepResult:
        frame = self._frame
        events = self._sched.absorb(out, frame)
        new_text: dict[int, str] = {}
        by_id = {t.request_id: t for t in self._sched.live() + events.finished}
        for rid, toks in events.emitted.items():
            if self.tokenizer is not None:
                new_text[rid] = self._text(by_id[rid], toks)
        finished = []
        for t in events.finished:
            text = None
            if self.tokenizer is not None:
                detok = self._detok.pop(t.request_id, None)
                if detok is not None:
                    tail = detok.flush()
                    if tail:
                        new_text[t.request_id] = new_text.get(t.request_id, "") + tail
                    text = detok.text
                else:
                    text = ""
            finished.append(FinishedRequest(
                request_id=t.request_id, tokens=t.tokens, text=text, arrival_frame=t.arrival_frame,
                admit_frame=t.admit_frame, finish_frame=frame, latency_frames=frame - t.arrival_frame + 1,
                latency_ms=(end - t.arrival_time) * 1e3, row=t.row, owner=t.owner,
            ))
        self._frame += 1
        return StepResult(
            actions=self.vla.primary_chunk(out.actions, b), finished=finished, new_text=new_text, frame=frame,
            frame_ms=(end - start) * 1e3, batch=events.batch, queued=self._sched.num_queued, errors=errors,
            head_actions={n: np.asarray(a) for n, a in out.actions.items()}, steps=events.steps,
            new_tokens={rid: [int(t) for t in toks] for rid, toks in events.emitted.items()},
            tokens_per_step=events.burst_tokens / max(events.slot_steps, 1),
            drafts_proposed=events.drafts[0], drafts_accepted=events.drafts[1],
        )

    def requests_of(self, owner: object) -> list[int]:
        """Ids of the queued and running requests submitted with `owner` (e.g. to cancel a robot's)."""
        return [t.request_id for t in self._sched.queued() + self._sched.live() if t.owner is owner]

