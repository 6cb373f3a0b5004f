"""Several heads as a bench family (`eval.bench --heads`): action heads and the language decoder on one Qwen3-VL prefix.

    python -m eval.bench --heads xr0,starvla,gr00t --preset bench --workloads libero --N 30 --k 5 \\
        --settings isolated shared_kv continuous --out results/heads

The model is `mot.preset(--preset)` (random weights; `bench`: a Qwen3-VL-shaped 1024 x 8 backbone with a
384 x 6 ViT, and bench-scale XR0-, StarVLA QwenPI_v3- and GR00T-style heads) holding the named heads and a
language decoder. A frame's prompt is one row per robot: for each of the workload's cameras
`<vision_start> image tokens <vision_end>` (a `--image-size` square image: (size / 32)² tokens), then the
workload's 100 prompt tokens. Each head gets its own noise (and robot state, when it has a state token) per
frame. The settings (`schedule`, models with several heads):

    isolated    every head its own program (its own prefix pass, keeping only its reads, + prepare + denoise),
                each waited for, then the text's own prefix pass with the frame's requests to completion
    parallel    the same programs dispatched concurrently, one host thread each
    shared_kv   one program: one prefix pass, every head, the frame's requests to completion
    continuous  `schedule.frame_step` (the fan-out frame): one prefix pass, every head, admission and a
                k-token burst on the persistent pool
    actions_only  one prefix pass and every head, no language (reference)

Frames without arrivals run the heads alone in the non-batched settings (isolated: the single-head programs;
shared_kv: one prefix pass and every head). The isolated runner times each single-head program on its own, so
every record carries `fanout_ratio` = this setting's median frame / the median over the same run's isolated
frames of the sum of the single-head frames (for `continuous`: the fan-out frame with language against
separate single-head frames without), `single_head_ms` (median per head) and
`head_action_hz` (actions per second of each head: its horizon per frame). `action_hz` is the chunk rate
(frames per second; every head delivers one chunk per frame). Denoise steps are each head's own
(`head_steps`; XR0 5, the StarVLA heads 4) unless `--S` is given (then every head runs S steps); grid points
record S = 0 for "each head's own".

Components (`components.json`, measured alone, warm medians): the prefix pass of the whole model
(`prefill_ms`), each head's prepare + denoise on that prefix (`heads_ms`), one decode step t(B).

`environment.json` also records the heads and the image size (the harness records the machine load for every
family).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import metrics
from eval.bench import harness
from eval.bench.grid import WORKLOADS, Group
from oxygen_jax.models import heads as hd
from oxygen_jax.models import mot
from oxygen_jax.models.vla import MultiHead

HEADS = {"xr0": "xr0", "starvla": "starvla_qwenpi_v3", "gr00t": "gr00t"}
"""`--heads` names -> head names inside `mot.preset` models (bench and tiny scale alike)."""


def parse_heads(text: str) -> tuple[str, ...]:
    """'xr0,starvla,gr00t' -> the mot head names, in the given order (argparse type)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in HEADS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"--heads takes distinct comma-separated names from {', '.join(HEADS)}, got {text!r}")
    return tuple(HEADS[n] for n in names)


def model_spec(preset: str, heads: Sequence[str], steps: int | None = None) -> mot.ModelSpec:
    """`mot.preset(preset)` with only `heads` and the language decoder; every head at `steps` when given."""
    spec = mot.preset(preset).only(*heads, language=True)
    if steps:
        spec = spec.replace(heads=tuple(h.replace(num_steps=steps) for h in spec.heads))
    return spec


def check_image_size(preset: str, image_size: int) -> str | None:
    """None if `image_size` fits the preset's ViT (a multiple of patch x merge), else the problem in one line."""
    vspec = mot.preset(preset).backbone.vision
    side = vspec.patch_size * vspec.spatial_merge_size
    if image_size % side:
        return (f"--image-size must be a multiple of {side} (patch {vspec.patch_size} x merge "
                f"{vspec.spatial_merge_size}), got {image_size}")
    return None


def load_model(args: argparse.Namespace, dtype: str) -> tuple[mot.ModelSpec, mot.ModelParams, str]:
    """(spec, params for this backend, preset name) for `--heads` (random weights, seeded by --seed)."""
    from oxygen_jax.ckpts import load

    spec = model_spec(args.preset, args.heads, args.num_steps[0] if args.num_steps else None)
    return spec, load.load_model(preset=spec, dtype=dtype, seed=args.seed).params, args.preset


def environment(args: argparse.Namespace) -> dict:
    """The heads and the image size."""
    return {"heads": list(args.heads), "image_size": args.image_size}


# --- inputs ---------------------------------------------------------------------------------------


def prompt_ids(spec: mot.ModelSpec, cameras: int, image_size: int, prompt_tokens: int, rng) -> np.ndarray:
    """int32 [P]: per camera <vision_start> image tokens <vision_end>, then random prompt tokens.

    With Qwen3-VL's ids, `image_token_id - 3` and `- 2` are <|vision_start|> and <|vision_end|>.
    """
    vspec = spec.backbone.vision
    side = vspec.patch_size * vspec.spatial_merge_size
    if image_size % side:
        raise ValueError(f"image_size must be a multiple of {side} (patch x merge), got {image_size}")
    img = spec.image_token_id
    per_image = (image_size // side) ** 2
    ids = []
    for _ in range(cameras):
        ids += [img - 3] + [img] * per_image + [img - 2]
    vocab = spec.backbone.vocab_size
    text = rng.integers(0, min(vocab, img - 3), prompt_tokens)  # never an image / vision id
    return np.asarray(ids + text.tolist(), np.int32)


def _frame_inputs(spec, robot, image_size, rng) -> mot.PrefixInputs:
    ids = prompt_ids(spec, robot.num_cameras, image_size, robot.max_token_len, rng)[None]
    images = [rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8) for _ in range(robot.num_cameras)]
    return jax.device_put(mot.make_inputs(spec, ids, np.ones(ids.shape, bool), images))


def _frame_noise(spec, rng) -> tuple[dict, dict]:
    noises = {h.name: jnp.asarray(rng.standard_normal((1, h.horizon, h.action_dim)), jnp.float32) for h in spec.heads}
    states = {h.name: jnp.asarray(rng.standard_normal((1, h.state_dim)), jnp.float32)
              for h in spec.heads if h.state_dim}
    return noises, states


def group_inputs(ctx: harness.RunContext, group: Group, robot) -> harness.GroupInputs:
    """The group's frames (prompts with images, per-head noise and states) and requests, on the device."""
    args, spec = ctx.args, ctx.model
    warmup, drain = harness.warmup_and_drain(args, group)
    total = warmup + args.frames + drain
    rng = np.random.default_rng([args.seed, 1 + WORKLOADS.index(robot.name)])
    first = _frame_inputs(spec, robot, args.image_size, rng)
    inputs = [first] * total if args.reuse_observation else [first] + [
        _frame_inputs(spec, robot, args.image_size, rng) for _ in range(total - 1)]
    noise = [_frame_noise(spec, rng) for _ in range(total)]
    arrivals, table, frame_requests = harness.group_requests(group, total, ctx.fixed_length)
    return harness.GroupInputs(group=group, num_frames=total, warmup=warmup, measured_end=warmup + args.frames,
                               vla=MultiHead(ctx.params, spec), observations=inputs, noise=noise, arrivals=arrivals,
                               table=table, frame_requests=frame_requests, prefix_len=int(first.input_ids.shape[1]),
                               action_horizon=None, config={"heads": list(spec.names), "image_size": args.image_size})


# --- runners --------------------------------------------------------------------------------------


def runners(ctx: harness.RunContext, group: Group, inputs: harness.GroupInputs) -> list[harness.Runner]:
    """`harness.runners` (no language-adapter bank)."""
    return harness.runners(ctx, group, inputs)


# --- summaries and components ---------------------------------------------------------------------


def summary_fields(ctx: harness.RunContext, runner: harness.Runner, iso_frames) -> dict:
    """Per-record fan-out fields: the ratio to the isolated single-head frames, per-head medians and action Hz,
    and the image size."""
    spec = ctx.model
    frames = metrics.measured(runner.frames)
    single = [f["head_ms"] for f in metrics.measured(iso_frames or []) if "head_ms" in f]
    sum_single = float(np.median([sum(h.values()) for h in single])) if single else float("nan")
    median = float(np.median([f["frame_ms"] for f in frames])) if frames else float("nan")
    return {
        "heads": list(spec.names), "head_steps": {h.name: h.num_steps for h in spec.heads},
        "head_horizon": {h.name: h.horizon for h in spec.heads},
        "head_action_hz": {h.name: metrics.action_hz(runner.frames, h.horizon) for h in spec.heads},
        "single_head_ms": {n: float(np.median([h[n] for h in single])) for n in spec.names} if single else {},
        "sum_single_head_ms": sum_single,
        "fanout_ratio": median / sum_single if single else float("nan"),
        "image_size": ctx.args.image_size,
    }


def measure_components(spec, params, inputs, noises, states, *, batches: Sequence[int], max_new_tokens: int,
                       repeats: int) -> metrics.Components:
    """Warm medians, each alone: the whole model's prefix pass, each head's prepare + denoise on it, and one
    decode step with B active requests (each B)."""
    prefix_fn = jax.jit(mot.prefix_pass, static_argnums=0)
    prefix_ms = harness.median_ms(lambda: prefix_fn(spec, params, inputs), repeats)
    prefix = prefix_fn(spec, params, inputs)
    sample = jax.jit(hd.sample)
    heads_ms = {h.name: harness.median_ms(lambda h=h: sample(params.heads[h.name], h, prefix, noises[h.name],
                                                            states.get(h.name)), repeats)
                for h in spec.heads}
    decode_ms, _, _ = harness.decode_components(mot.language_model(spec, params), prefix, batches, max_new_tokens,
                                                repeats)
    return metrics.Components(prefill_ms=prefix_ms, denoise_ms={}, decode_step_ms=decode_ms, heads_ms=heads_ms)


def components(ctx: harness.RunContext, robot, groups: Sequence[Group]) -> metrics.Components:
    """`measure_components` on one synthetic frame of `robot` (seeded apart from the measured frames), for the
    longest N of `groups`."""
    args, spec = ctx.args, ctx.model
    rng = np.random.default_rng([args.seed, 99])
    inputs = _frame_inputs(spec, robot, args.image_size, rng)
    noises, states = _frame_noise(spec, rng)
    return measure_components(spec, ctx.params, inputs, noises, states, batches=args.component_batches,
                              max_new_tokens=max(g.decode_len for g in groups), repeats=args.component_repeats)
