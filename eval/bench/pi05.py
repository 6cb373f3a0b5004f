"""π0.5 as a bench family (`python -m eval.bench` without --heads): a random-weight preset or a checkpoint.

The settings (`oxygen_jax.runtime.frame`):

    isolated    action program, then a text program with its own prefill (each waited for)
    shared_kv   one program: one prefill, actions, the frame's requests decoded to completion
    parallel    action and text programs dispatched concurrently from two host threads
    continuous  `schedule.frame_step` on a persistent decode pool: k tokens per active request per frame
    actions_only  prefill + denoise, no language (reference)

Frames without arrivals run the action program alone in the non-batched settings. Observations are synthetic
client samples of the workload's robot (224 px cameras, prompts by the demo tokenizer or --tokenizer). With
--adapter-rank, a random language-adapter bank serves --adapter-share of the requests in a second continuous
run, and its decode steps are timed with every slot / half the slots on it.

Components (`components.json`, measured alone, warm medians): prefill, S denoise steps (each S of the grid),
one decode step t(B) at each B.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval import metrics
from eval.bench import harness
from eval.bench.grid import WORKLOADS, Group
from oxygen_jax.models.pi05.config import ModelConfig
from oxygen_jax.models.pi05.model import denoise, prefill, prefix_length
from oxygen_jax.models.pi05.observation import trim_prompt_padding
from oxygen_jax.robots.tokenizer import Tokenizer, train_demo_tokenizer
from oxygen_jax.robots.transforms import make_observation, synthetic_sample
from oxygen_jax.runtime import decode
from oxygen_jax.runtime import frame as schedule
from oxygen_jax.models.pi05.model import HEAD, as_vla, language_model


@dataclasses.dataclass(frozen=True)
class Model:
    """What a π0.5 run measures besides its params (`RunContext.params`)."""

    cfg: ModelConfig
    tokenizer: Tokenizer  # encodes the synthetic prompts
    bank: object = None  # language-adapter bank (--adapter-rank), or None


def _adapter_bank(args: argparse.Namespace, model_cfg):
    """One random language adapter of --adapter-rank (B drawn like a trained adapter's), or None."""
    if not args.adapter_rank:
        return None
    from oxygen_jax.models.pi05 import lora as pi05_lora

    bank = pi05_lora.init_bank(model_cfg, 1, rank=args.adapter_rank, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    # init_bank sets B = 0 (an exact identity); a served adapter has non-zero B, so draw it.
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype)
        if getattr(path[-1], "name", None) == "b" else x, bank)


def _tokenizer(args: argparse.Namespace) -> Tokenizer:
    return Tokenizer.from_file(args.tokenizer.expanduser()) if args.tokenizer else train_demo_tokenizer()


def load_model(args: argparse.Namespace, dtype: str) -> tuple[Model, object, str]:
    """(model, params for this backend, preset name): --ckpt (openpi's or ours), else --preset's random weights.

    Through `ckpts.load.load_model`, as run and serve: the layer loop per backend (scan on accelerators,
    unrolled on CPU), the same for every setting; a tokenizer.model beside the checkpoint encodes the prompts
    unless --tokenizer names one.
    """
    from oxygen_jax.ckpts import load

    loaded = load.load_model(args.ckpt, preset=None if args.ckpt is not None else args.preset, family="pi05",
                             dtype=dtype, seed=args.seed)
    tokenizer = Tokenizer.from_file(loaded.tokenizer) if loaded.tokenizer and not args.tokenizer else _tokenizer(args)
    preset = "ckpt" if args.ckpt is not None else args.preset
    return Model(loaded.config, tokenizer, _adapter_bank(args, loaded.config)), loaded.params, preset


def environment(args: argparse.Namespace) -> dict:
    """No facts besides the harness's (preset or --ckpt, dtype, ...)."""
    return {}


# --- inputs ---------------------------------------------------------------------------------------


def _observation_stream(robot, model_cfg, tokenizer, count: int, seed: int, reuse: bool, prompt_bucket: int = 0) -> list:
    """`count` synthetic client samples (seeded) converted to device observations.

    `prompt_bucket` > 0 trims prompt padding to that bucket (`trim_prompt_padding`); 0 keeps the
    workload's full max_token_len as the paper does.
    """
    rng = np.random.default_rng([seed, 1 + WORKLOADS.index(robot.name)])
    out = []
    for _ in range(1 if reuse else count):
        sample = synthetic_sample(robot, rng, image_size=224)
        obs = make_observation(robot, model_cfg, tokenizer, [sample])
        if prompt_bucket:
            obs = trim_prompt_padding(obs, prompt_bucket)
        out.append(jax.device_put(obs))
    return out * count if reuse else out


def group_inputs(ctx: harness.RunContext, group: Group, robot) -> harness.GroupInputs:
    """The group's observations (shared by the workload's groups), per-frame noise and requests, on the device."""
    args, model = ctx.args, ctx.model
    warmup, drain = harness.warmup_and_drain(args, group)
    total = warmup + args.frames + drain
    stream = ctx.observations[group.workload]
    if len(stream) < total:
        stream[:] = _observation_stream(robot, model.cfg, model.tokenizer, total, args.seed, args.reuse_observation,
                                        args.prompt_bucket)
    arrivals, table, frame_requests = harness.group_requests(group, total, ctx.fixed_length)
    base = jax.random.key(args.seed)
    shape = (1, robot.action_horizon, model.cfg.action_dim)
    noise = [jax.random.normal(jax.random.fold_in(base, f), shape) for f in range(total)]
    prefix_len = prefix_length(ctx.params, stream[0])  # from the cache itself (prompt buckets included)
    return harness.GroupInputs(group=group, num_frames=total, warmup=warmup, measured_end=warmup + args.frames,
                               observations=stream[:total], noise=noise, arrivals=arrivals, table=table,
                               frame_requests=frame_requests, prefix_len=prefix_len,
                               action_horizon=robot.action_horizon)


# --- runners --------------------------------------------------------------------------------------


def _noises(noise):
    return {HEAD: noise}


class _ToCompletionRunner(harness.Runner):
    """isolated, shared_kv, parallel and actions_only: each frame decodes its own arrivals to completion."""

    def __init__(self, setting: str, params, inputs: harness.GroupInputs):
        super().__init__(setting)
        self.params, self.x = params, inputs

    def _call(self, f: int):
        g, x, params = self.x.group, self.x, self.params
        steps, n = g.num_steps, g.decode_len
        obs, noise, req = x.observations[f], _noises(x.noise[f]), x.frame_requests[f]
        vla = as_vla(params, steps)
        if req is None or self.setting == "actions_only":
            return jax.device_get(schedule.head_program(vla, HEAD, obs, noise)), None
        if self.setting == "isolated":
            # The action task finishes (on the host) before the text task starts.
            actions = jax.device_get(schedule.head_program(vla, HEAD, obs, noise))
            _, generated = jax.device_get(schedule.text_program(vla, obs, req, max_new_tokens=n))
            return actions, generated
        run = schedule.shared_kv_program if self.setting == "shared_kv" else schedule.run_parallel
        actions, _, generated = jax.device_get(run(vla, obs, noise, req, max_new_tokens=n))
        return actions, generated

    def compile(self, log: dict[str, float]) -> None:
        """First calls of every program shape this runner will use (arrival counts differ per frame)."""
        g, x, params = self.x.group, self.x, self.params
        steps, n = g.num_steps, g.decode_len
        sizes = sorted({len(a) for a in x.arrivals})
        wl = g.workload
        keys: list[tuple[str, Callable]] = []
        obs, noise, vla = x.observations[0], _noises(x.noise[0]), as_vla(params, steps)
        if 0 in sizes or self.setting in ("isolated", "parallel", "actions_only"):
            keys.append((f"action/{wl}/S={steps}",
                         lambda: schedule.head_program(vla, HEAD, obs, noise)))
        for j in (s for s in sizes if s > 0 and self.setting != "actions_only"):
            req = x.table.batch([], j)  # shapes are all that matter here
            if self.setting == "shared_kv":
                keys.append((f"shared_kv/{wl}/S={steps}/N={n}/J={j}", lambda req=req: schedule.shared_kv_program(
                    vla, obs, noise, req, max_new_tokens=n)))
            else:  # isolated and parallel run the same action and text executables
                keys.append((f"text/{wl}/N={n}/J={j}",
                             lambda req=req: schedule.text_program(vla, obs, req, max_new_tokens=n)))
        for key, thunk in keys:
            harness.first_call(log, key, thunk)
            self.program_keys.append(key)
        if self.setting == "parallel":  # start the dispatch threads outside the timed frames
            j = next((s for s in sizes if s > 0), None)
            if j is not None:
                schedule.run_parallel(vla, obs, noise, x.table.batch([], j), max_new_tokens=n)

    def frame(self, f: int) -> None:
        start = time.perf_counter()
        _, generated = self._call(f)
        self._record_to_completion(f, (time.perf_counter() - start) * 1e3, generated)


class _FrameStepRunner(harness.ContinuousRunner):
    """continuous: `schedule.frame_step` on the pool; with a `bank`, `adapter_share` of the requests on adapter 1."""

    def __init__(self, k: int, params, inputs: harness.GroupInputs, slots: int, bank=None, adapter_share: float = 0.0):
        super().__init__(k, params, inputs, slots)
        if bank is not None:
            self.label = f"continuous[k={k},adapter={adapter_share:g}]"
        self.bank, self.adapter_share = bank, adapter_share

    def _new_pool(self):
        return decode.init_pool(language_model(self.params), self.slots, self.x.prefix_len, self.x.group.decode_len, 0)

    def compile(self, log: dict[str, float]) -> None:
        g, x = self.x.group, self.x
        key = (f"frame_step/{g.workload}/S={g.num_steps}/k={self.k}/N={g.decode_len}/slots={self.slots}"
               f"/J={self.admissions}")
        if self.bank is not None:
            key += "/adapter_bank"

        def thunk():
            # A throwaway pool with one admitted request, so the compiled program also ran its decode path.
            req = x.table.batch([0] if x.table.budgets else [], self.admissions)
            _, out = schedule.frame_step(as_vla(self.params, g.num_steps), self._new_pool(), x.observations[0],
                                         _noises(x.noise[0]), req, np.zeros((self.slots,), bool), self.bank,
                                         tokens_per_frame=self.k)
            return jax.device_get(out)

        harness.first_call(log, key, thunk)
        self.program_keys.append(key)
        self.pool = self._new_pool()
        self.tickets = x.table.tickets()
        for t in self.tickets:  # exactly a share of the requests (spread evenly) use adapter 1
            t.adapter = int(int((t.request_id + 1) * self.adapter_share) > int(t.request_id * self.adapter_share))

    def _step(self, pool, f: int, req, evict):
        """One frame program on `pool` with frame f's inputs (donates the pool)."""
        x = self.x
        return schedule.frame_step(as_vla(self.params, x.group.num_steps), pool, x.observations[f], _noises(x.noise[f]),
                                   req, evict, self.bank, tokens_per_frame=self.k)


def runners(ctx: harness.RunContext, group: Group, inputs: harness.GroupInputs) -> list[harness.Runner]:
    """One runner per selected setting; continuous once per k, and again on the adapter bank when there is one."""
    out: list[harness.Runner] = []
    for setting in ctx.args.settings:
        if setting == "continuous":
            for k in group.ks:
                slots = harness.pool_slots(ctx.args, inputs, k)
                out.append(_FrameStepRunner(k, ctx.params, inputs, slots))
                if ctx.model.bank is not None:  # the same requests, a share of them on the language adapter
                    out.append(_FrameStepRunner(k, ctx.params, inputs, slots, ctx.model.bank, ctx.args.adapter_share))
        else:
            out.append(_ToCompletionRunner(setting, ctx.params, inputs))
    return out


# --- components and summaries ---------------------------------------------------------------------


def measure_components(params, obs, noise, *, steps: Sequence[int], batches: Sequence[int], max_new_tokens: int,
                       repeats: int, bank=None) -> metrics.Components:
    """Warm medians of prefill, S denoise steps (each S) and one decode step with B active requests (each B).

    A decode step is timed inside a burst (`harness.decode_step_ms`). With a language-adapter `bank`, the
    decode step is also timed with every slot on adapter 1 and with half the slots on it, interleaved with
    the base measurement per B.
    """
    prefill_ms = harness.median_ms(lambda: prefill(params, obs), repeats)
    cache = prefill(params, obs)
    denoise_ms = {s: harness.median_ms(lambda s=s: denoise(params, cache, noise, s), repeats) for s in sorted(set(steps))}
    g = max(max_new_tokens, (repeats + 2) * harness.BURST + 2)  # room for the compile burst and every timed burst
    decode_ms, adapter_ms, mixed_ms = {}, {}, {}
    for b in sorted(set(batches)):
        decode_ms[b] = harness.decode_step_ms(language_model(params), cache, b, g, repeats)
        if bank is not None:
            adapter_ms[b] = harness.decode_step_ms(language_model(params), cache, b, g, repeats, bank, [1] * b)
            mixed_ms[b] = harness.decode_step_ms(language_model(params), cache, b, g, repeats, bank, [i % 2 for i in range(b)])
    return metrics.Components(prefill_ms=prefill_ms, denoise_ms=denoise_ms, decode_step_ms=decode_ms,
                              adapter_step_ms=adapter_ms, mixed_step_ms=mixed_ms)


def components(ctx: harness.RunContext, robot, groups: Sequence[Group]) -> metrics.Components:
    """`measure_components` on one synthetic observation of `robot`, for every S and the longest N of `groups`."""
    args, model = ctx.args, ctx.model
    obs = _observation_stream(robot, model.cfg, model.tokenizer, 1, args.seed, True)[0]
    noise = jax.random.normal(jax.random.key(args.seed), (1, robot.action_horizon, model.cfg.action_dim))
    return measure_components(ctx.params, obs, noise, steps=sorted({g.num_steps for g in groups}),
                              batches=args.component_batches, max_new_tokens=max(g.decode_len for g in groups),
                              repeats=args.component_repeats, bank=model.bank)


def summary_fields(ctx: harness.RunContext, runner: harness.Runner, iso_frames) -> dict:
    """None: the harness's record covers π0.5 (its adapter share and rank included)."""
    return {}
