"""π0.5 as a bench family (`python -m eval.bench` without --heads): a random-weight preset or a checkpoint.

The settings (`oxygen_jax.runtime.frame`):

    isolated    action program, then a text program with its own prefill (each waited for)
    shared_kv   one program: one prefill, actions, the frame's requests decoded to completion
    parallel    action and text programs dispatched concurrently from two host threads
    continuous  `schedule.frame_step` on a persistent decode pool: k tokens per active request per frame
    actions_only  prefill + denoise, no language (reference)

π0.5 runs as a `MultiHead` (`as_vla(params, S)`, one head "actions") through the harness's runners, the same
ones as `eval.bench.heads`. Frames without arrivals run the action program alone in the non-batched settings.
Observations are synthetic
client samples of the workload's robot (224 px cameras, prompts by the demo tokenizer or --tokenizer). With
--adapter-rank, a random language-adapter bank serves --adapter-share of the requests in a second continuous
run, and its decode steps are timed with every slot / half the slots on it.

Components (`components.json`, measured alone, warm medians): prefill, S denoise steps (each S of the grid),
one decode step t(B) at each B.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import metrics
from eval.bench import harness
from eval.bench.grid import WORKLOADS, Group
from oxygen_jax.models.pi05.config import ModelConfig
from oxygen_jax.models.pi05.model import denoise, prefill, prefix_length
from oxygen_jax.models.pi05.observation import trim_prompt_padding
from oxygen_jax.robots.tokenizer import Tokenizer, train_demo_tokenizer
from oxygen_jax.robots.transforms import make_observation, synthetic_sample
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
    # π0.5's one head, no robot-state input (its state is in the prompt)
    noise = [({HEAD: jax.random.normal(jax.random.fold_in(base, f), shape)}, None) for f in range(total)]
    prefix_len = prefix_length(ctx.params, stream[0])  # from the cache itself (prompt buckets included)
    return harness.GroupInputs(group=group, num_frames=total, warmup=warmup, measured_end=warmup + args.frames,
                               vla=as_vla(ctx.params, group.num_steps), observations=stream[:total], noise=noise,
                               arrivals=arrivals, table=table, frame_requests=frame_requests, prefix_len=prefix_len,
                               action_horizon=robot.action_horizon)


# --- runners --------------------------------------------------------------------------------------


def runners(ctx: harness.RunContext, group: Group, inputs: harness.GroupInputs) -> list[harness.Runner]:
    """`harness.runners`; continuous again on the language-adapter bank when there is one (--adapter-rank)."""
    return harness.runners(ctx, group, inputs, ctx.model.bank, ctx.args.adapter_share)


# --- components and summaries ---------------------------------------------------------------------


def measure_components(params, obs, noise, *, steps: Sequence[int], batches: Sequence[int], max_new_tokens: int,
                       repeats: int, bank=None) -> metrics.Components:
    """Warm medians of prefill, S denoise steps (each S) and one decode step with B active requests (each B).

    Decode steps: `harness.decode_components` (also on the language-adapter `bank`, when there is one).
    """
    prefill_ms = harness.median_ms(lambda: prefill(params, obs), repeats)
    cache = prefill(params, obs)
    denoise_ms = {s: harness.median_ms(lambda s=s: denoise(params, cache, noise, s), repeats) for s in sorted(set(steps))}
    decode_ms, adapter_ms, mixed_ms = harness.decode_components(language_model(params), cache, batches,
                                                                max_new_tokens, repeats, bank)
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
