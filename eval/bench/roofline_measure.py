"""The components of a frame, each timed alone on the current device, for the roofline report (`eval.roofline`).

Axes (`oxygen_jax.axes`): Nc cameras, P prefix tokens, Ha horizon, Ns slots, C slot length, γ draft tokens.

What is timed, for a `models.vla.MultiHead` (every family) on one synthetic frame:

    vision          the vision encoder on the frame's images
    prefix          the prefix pass (vision + backbone, what every head and the decoder read)
    step1:<head>    the head's prepare and one Euler step;   denoise:<head>  prepare and S steps
    decode          one decode step of an Ns-slot pool, every slot busy (a burst of 4 steps / 4, as the bench);
                    decode1 the same with one slot (when Ns > 1)
    verify          one verify step, every slot drafting γ tokens (the full [Ns, γ + 1] block)
    speculative     k verify steps of the same pool (verify cost 1)
    frame           one continuous-batching frame (`runtime.frame.frame_step`): prefix, every head, one
                    admission into a slot freed that frame, k decode steps with all Ns slots busy

Protocol: every program's first call (trace, compile, one run) is timed apart as its compile time; then
`repeats` rounds, each calling every component once, waited for (`block_until_ready`), the order reversed
every other round so no component always follows the same one; a component's time is its median over the
rounds. Pools are built outside the timed calls.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import heads as bench_heads
from eval.bench import roofline_cost as rc
from oxygen_jax.models import heads as hd
from oxygen_jax.models import mot
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.vision import siglip
from oxygen_jax.models.backbone import Qwen3VisionSpec
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.vision.siglip import SiglipConfig
from oxygen_jax.models.vla import MultiHead
from oxygen_jax.runtime import decode, speculative
from oxygen_jax.runtime import frame as frame_lib

BURST = 4  # decode steps per timed decode call (a step alone would carry a dispatch per token)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What to measure: the frame's workload and the language settings."""

    cameras: int  # Nc images per frame
    prompt_tokens: int  # Tp text tokens of the prompt
    image_size: int  # pixels per side
    horizon: int  # Ha of heads that take the caller's (π0.5)
    steps: int | None  # Euler steps of every head (None: each head's own)
    slots: int  # Ns
    max_new_tokens: int  # M of the pools (C = P + M)
    tokens_per_frame: int  # k
    gamma: int  # γ of the verify block (0: no verify components)
    repeats: int = 5
    seed: int = 0


def frame_inputs(vla: MultiHead, plan: Plan):
    """One synthetic frame: (inputs, noises, states). Observations get random pixels and a full prompt of
    random ids (so P = Nc Np + Tp exactly); token inputs get each camera's image tokens then the prompt."""
    spec, rng = vla.spec, np.random.default_rng(plan.seed)
    if spec.input_kind == "observation":
        s = plan.image_size
        inputs = Observation(
            images=jnp.asarray(rng.uniform(-1, 1, (1, plan.cameras, s, s, 3)), vla.params.decoder.embedding.dtype),
            image_masks=jnp.ones((1, plan.cameras), bool),
            tokens=jnp.asarray(rng.integers(3, spec.backbone.vocab_size, (1, plan.prompt_tokens)), jnp.int32),
            token_mask=jnp.ones((1, plan.prompt_tokens), bool))
    else:
        ids = bench_heads.prompt_ids(spec, plan.cameras, plan.image_size, plan.prompt_tokens, rng)[None]
        images = [rng.integers(0, 256, (plan.image_size, plan.image_size, 3), dtype=np.uint8) for _ in range(plan.cameras)]
        inputs = mot.make_inputs(spec, ids, np.ones(ids.shape, bool), images if plan.cameras else ())
    noises = {n: jnp.asarray(rng.standard_normal((1, *vla.action_shape(n, plan.horizon))), jnp.float32) for n in vla.heads}
    states = {n: jnp.asarray(rng.standard_normal((1, d)), jnp.float32) for n, d in vla.state_dims().items()} or None
    return jax.device_put(inputs), noises, states


def _siglip_call(vla: MultiHead, inputs: Observation) -> Callable:
    images = inputs.images.reshape((-1,) + inputs.images.shape[2:])
    dtype = vla.params.decoder.embedding.dtype
    fn = jax.jit(siglip.encode, static_argnums=2)
    return lambda: fn(vla.params.vision, images, dtype)


def _qwen_vit_call(vla: MultiHead, inputs) -> Callable:
    fn = jax.jit(qwen3_vl.encode, static_argnums=(0, 3))
    pixels = inputs.pixel_values.astype(vla.params.decoder.embedding.dtype)
    return lambda: fn(vla.spec.backbone.vision, vla.params.vision, pixels, inputs.grid)


_VISION_CALLS = {SiglipConfig: _siglip_call, Qwen3VisionSpec: _qwen_vit_call}
"""Vision spec type -> the encoder alone on a frame's images (beside `roofline_cost.VISION_COSTS`)."""


def prefix_len(vla: MultiHead, inputs) -> int:
    """P of the prefix `inputs` give (read off the traced prefix)."""
    return int(jax.eval_shape(vla.prefix, inputs).mask.shape[-1])


def busy_pool(lm, prefix, slots: int, m: int, gamma: int = 0) -> decode.DecodePool:
    """A pool whose every slot is busy on the frame's prefix, budgets of M tokens, no stop id; with γ > 0 every
    slot drafts γ tokens at each verify step (its draft reference repeats one token after token 0)."""
    pool = decode.init_pool(lm, slots, int(prefix.mask.shape[-1]), m, 0, speculate=gamma)
    req = decode.make_requests(slots, 0, list(range(slots)), budgets=[m] * slots, stop_ids=[-1] * slots)
    pool, _, _ = decode.admit(lm, pool, prefix, req)
    if gamma:
        pool = dataclasses.replace(pool, draft_ref=pool.draft_ref.at[:, 1:].set(7).at[:, 0].set(pool.tokens[:, 0]))
    return jax.block_until_ready(pool)


def calls(vla: MultiHead, plan: Plan, inputs, noises, states) -> tuple[dict[str, Callable[[], Callable]], float]:
    """(component name -> a factory that prepares what the call needs (pools, not timed) and returns the call,
    the prefix program's first call in s: it runs here, as the other components read its prefix)."""
    spec = vla.spec
    prefix_fn = jax.jit(lambda v, x: v.prefix(x))
    start = time.perf_counter()
    prefix = jax.block_until_ready(prefix_fn(vla, inputs))
    prefix_s = time.perf_counter() - start
    out: dict[str, Callable[[], Callable]] = {}
    if spec.backbone.vision is not None and plan.cameras:
        call = _VISION_CALLS[type(spec.backbone.vision)](vla, inputs)
        out["vision"] = lambda: call
    out["prefix"] = lambda: functools.partial(prefix_fn, vla, inputs)
    sample = jax.jit(hd.sample, static_argnums=1)
    for h in spec.heads:
        state = None if states is None else states.get(h.name)
        for key, s in ((f"step1:{h.name}", 1), (f"denoise:{h.name}", plan.steps or h.num_steps)):
            out[key] = lambda h=h, s=s, state=state: functools.partial(
                sample, vla.params.heads[h.name], h.replace(num_steps=s), prefix, noises[h.name], state)
    if not spec.language:
        return out, prefix_s
    lm = vla.language()
    m, ns, k = plan.max_new_tokens, plan.slots, plan.tokens_per_frame
    pool = [busy_pool(lm, prefix, ns, m)]

    def decode_call():  # the pool carries on across rounds (donated); its budget covers every burst
        def run():
            pool[0], toks = decode.decode_burst(lm, pool[0], BURST)
            return toks
        return run

    out["decode"] = decode_call
    if ns > 1:  # batch 1 as well: a robot's lone request
        one = [busy_pool(lm, prefix, 1, m)]

        def decode1_call():
            def run():
                one[0], toks = decode.decode_burst(lm, one[0], BURST)
                return toks
            return run

        out["decode1"] = decode1_call
    if plan.gamma:
        out["verify"] = lambda: functools.partial(speculative.verify_burst, lm, busy_pool(lm, prefix, ns, m, plan.gamma), 1)
        out["speculative"] = lambda: functools.partial(speculative.verify_burst, lm,
                                                       busy_pool(lm, prefix, ns, m, plan.gamma), k)
    req = jax.device_put(decode.make_requests(1, 0, [ns], budgets=[m], stop_ids=[-1]))
    frame_pool, turn = [busy_pool(lm, prefix, ns, m)], [0]

    def frame_call():  # each frame frees one slot (round robin) and admits one request into it: Ns busy slots
        def run():
            evict = np.arange(ns) == turn[0] % ns
            turn[0] += 1
            frame_pool[0], fo = frame_lib.frame_step(vla, frame_pool[0], inputs, noises, req, jnp.asarray(evict), None,
                                                     states, tokens_per_frame=k)
            return fo
        return run

    out["frame"] = frame_call
    return out, prefix_s


def needed_tokens(plan: Plan) -> int:
    """M that keeps every slot busy through all timed calls: the decode pool's bursts and a frame slot's lifetime."""
    return max(plan.max_new_tokens, BURST * (plan.repeats + 2) + 1, plan.tokens_per_frame * (plan.slots + 1) + 1)


def costs(m: rc.Model, plan: Plan, p: int, prec: rc.Precision) -> dict[str, rc.Cost]:
    """The cost of every component `calls` times, at the shapes it times them (slot length P + M)."""
    c = p + plan.max_new_tokens
    out = {"vision": rc.vision(m, plan.cameras, prec, plan.image_size),
           "prefix": rc.prefix_pass(m, p, plan.cameras, prec, image_size=plan.image_size)}
    for h in m.spec.heads:
        out[f"step1:{h.name}"] = rc.denoise(m, h.name, p, prec, 1, horizon=plan.horizon)
        out[f"denoise:{h.name}"] = rc.denoise(m, h.name, p, prec, plan.steps, horizon=plan.horizon)
    if m.spec.language:
        out["decode"] = rc.decode_step(m, plan.slots, c, prec)
        out["decode1"] = rc.decode_step(m, 1, c, prec)
        if plan.gamma:
            out["verify"] = rc.verify_block(m, plan.slots, c, plan.gamma, prec)
            out["speculative"] = rc.speculative_burst(m, plan.slots, c, plan.gamma, plan.tokens_per_frame, prec)
        fp = rc.FramePlan(prefix_len=p, images=plan.cameras, horizon=plan.horizon, steps=plan.steps, slots=plan.slots,
                          capacity=c, tokens_per_frame=plan.tokens_per_frame, image_size=plan.image_size)
        out["frame"] = rc.continuous_frame(m, fp, prec)
    return out


def measure(factories: dict[str, Callable[[], Callable]], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """(component -> median ms, component -> first-call s) over interleaved rounds (module docstring)."""
    names = list(factories)
    times: dict[str, list[float]] = {n: [] for n in names}
    compile_s: dict[str, float] = {}
    for r in range(repeats + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            call = factories[name]()
            start = time.perf_counter()
            jax.block_until_ready(call())
            dt = time.perf_counter() - start
            if r == 0:
                compile_s[name] = dt
            else:
                times[name].append(dt * 1e3 / (BURST if name in ("decode", "decode1") else 1))
    return {n: float(np.median(t)) for n, t in times.items()}, compile_s


def load() -> tuple[float, float, float]:
    return tuple(os.getloadavg())
