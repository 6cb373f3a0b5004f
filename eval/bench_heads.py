"""`eval.bench --heads`: several action heads and the language decoder on one Qwen3-VL prefix (fan-out).

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
    continuous  `schedule.mot_frame_step` (the fan-out frame): one prefix pass, every head, admission and a
                k-token burst on the persistent pool
    actions_only  one prefix pass and every head, no language (reference)

Frames without arrivals run the heads alone in the non-batched settings (isolated: the single-head programs;
shared_kv: one prefix pass and every head). The isolated runner times each single-head program on its own, so
every record carries `fanout_ratio` = this setting's median frame / the median over the same run's isolated
frames of the sum of the single-head frames (the acceptance number for `continuous`: the fan-out frame with
language against three separate single-head frames without), `single_head_ms` (median per head) and
`head_action_hz` (actions per second of each head: its horizon per frame). `action_hz` is the chunk rate
(frames per second; every head delivers one chunk per frame). Denoise steps are each head's own
(`head_steps`; XR0 5, the StarVLA heads 4) unless `--S` is given (then every head runs S steps); grid points
record S = 0 for "each head's own".

Components (`components.json`, measured alone, warm medians): the prefix pass of the whole model
(`prefill_ms`), each head's prepare + denoise on that prefix (`heads_ms`), one decode step t(B).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval import arrivals as arrivals_lib
from eval import bench, metrics
from oxygen_jax.runtime import decode
from oxygen_jax.models import mot
from oxygen_jax.runtime import frame as schedule
from oxygen_jax.models import heads as hd

HEADS = {"xr0": "xr0", "starvla": "starvla_qwenpi_v3", "gr00t": "gr00t"}
"""`--heads` names -> head names inside `mot.preset` models (bench and tiny scale alike)."""

def parse_heads(text: str) -> tuple[str, ...]:
    """'xr0,starvla,gr00t' -> the mot head names, in the given order (argparse type)."""
    import argparse

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


def load_model(args, dtype: str):
    """(spec, params for this backend, preset name) for `--heads` (random weights, seeded by --seed)."""
    spec = model_spec(args.preset, args.heads, args.S[0] if args.S else None)
    return spec, mot.for_backend(mot.init_model(spec, args.seed, dtype)), args.preset


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


def group_inputs(ctx, group, robot):
    """The group's frames (prompts with images, per-head noise and states) and requests, on the device."""
    args = ctx.args
    warmup, drain = bench._warmup_and_drain(args, group)
    total = warmup + args.frames + drain
    rng = np.random.default_rng([args.seed, 1 + bench.WORKLOADS.index(robot.name)])
    first = _frame_inputs(ctx.spec, robot, args.image_size, rng)
    inputs = [first] * total if args.reuse_observation else [first] + [
        _frame_inputs(ctx.spec, robot, args.image_size, rng) for _ in range(total - 1)]
    noise = [_frame_noise(ctx.spec, rng) for _ in range(total)]
    caps = arrivals_lib.parse(group.arrival).schedule(total)
    budgets, ids, next_id = [], [], 0
    for frame_caps in caps:
        ids.append(list(range(next_id, next_id + len(frame_caps))))
        budgets += [group.N if cap is None else min(cap, group.N) for cap in frame_caps]
        next_id += len(frame_caps)
    table = bench._RequestTable(budgets, ctx.fixed_length)
    return bench._GroupInputs(group=group, num_frames=total, warmup=warmup, measured_end=warmup + args.frames,
                              observations=inputs, noise=noise, arrivals=ids, table=table,
                              frame_requests=[jax.device_put(table.batch(i, len(i))) if i else None for i in ids],
                              prefix_len=int(first.input_ids.shape[1]))


# --- runners --------------------------------------------------------------------------------------


def _actions_program(params, spec, inputs, noises, states):
    """One prefix pass and every head, no language (shared_kv frames without arrivals, actions_only)."""
    return mot.sample_all(params, spec.replace(language=False), inputs, noises, states)


class _HeadsRunner(bench._Runner):
    """isolated, parallel, shared_kv and actions_only for a multi-head model: a frame's requests to completion."""

    def __init__(self, setting: str, params, spec, inputs):
        super().__init__(setting)
        self.params, self.spec, self.x = params, spec, inputs

    def _call(self, f: int):
        """Runs frame f; returns (num_generated or None, {head: ms} of the single-head programs or None)."""
        x, spec, params, n = self.x, self.spec, self.params, self.x.group.N
        inputs, (noises, states), req = x.observations[f], x.noise[f], x.frame_requests[f]
        if self.setting == "isolated":
            head_ms = {}
            for name in spec.names:  # each head's own frame, timed alone (to the host)
                start = time.perf_counter()
                jax.device_get(schedule.mot_head_program(params, spec, name, inputs, noises, states))
                head_ms[name] = (time.perf_counter() - start) * 1e3
            if req is None:
                return None, head_ms
            _, generated = jax.device_get(schedule.mot_text_program(params.only(), spec, inputs, req, max_new_tokens=n))
            return generated, head_ms
        if self.setting == "parallel":
            _, _, generated = jax.device_get(schedule.run_mot_parallel(params, spec, inputs, noises, states, req,
                                                                       max_new_tokens=n))
            return generated, None
        if req is None or self.setting == "actions_only":
            jax.device_get(_actions_program(params, spec, inputs, noises, states))
            return None, None
        _, _, generated = jax.device_get(schedule.mot_shared_kv_program(params, spec, inputs, noises, states, req,
                                                                        max_new_tokens=n))
        return generated, None

    def compile(self, log: dict[str, float]) -> None:
        x, spec, params = self.x, self.spec, self.params
        g, wl = x.group, x.group.workload
        sizes = sorted({len(a) for a in x.arrivals})
        inputs, (noises, states) = x.observations[0], x.noise[0]
        keys = []
        if self.setting in ("isolated", "parallel"):
            for name in spec.names:
                keys.append((f"head/{wl}/{name}", functools.partial(
                    schedule.mot_head_program, params, spec, name, inputs, noises, states)))
            for j in (s for s in sizes if s > 0):
                req = x.table.batch([], j)
                keys.append((f"mot_text/{wl}/N={g.N}/J={j}", functools.partial(
                    schedule.mot_text_program, params.only(), spec, inputs, req, max_new_tokens=g.N)))
        else:
            if 0 in sizes or self.setting == "actions_only":
                keys.append((f"mot_actions/{wl}",
                             functools.partial(_actions_program, params, spec, inputs, noises, states)))
            for j in (s for s in sizes if s > 0 and self.setting == "shared_kv"):
                req = x.table.batch([], j)
                keys.append((f"mot_shared_kv/{wl}/N={g.N}/J={j}", functools.partial(
                    schedule.mot_shared_kv_program, params, spec, inputs, noises, states, req, max_new_tokens=g.N)))
        for key, thunk in keys:
            bench._first_call(log, key, thunk)
            self.program_keys.append(key)
        if self.setting == "parallel":  # start the dispatch threads outside the timed frames
            j = next((s for s in sizes if s > 0), None)
            schedule.run_mot_parallel(params, spec, inputs, noises, states, x.table.batch([], j) if j else None,
                                      max_new_tokens=g.N)

    def frame(self, f: int) -> None:
        start = time.perf_counter()
        generated, head_ms = self._call(f)
        self._record_to_completion(f, (time.perf_counter() - start) * 1e3, generated)
        if head_ms is not None:
            self.frames[-1]["head_ms"] = head_ms


class _FanoutRunner(bench._ContinuousRunner):
    """continuous: `schedule.mot_frame_step` (the fan-out frame) on a persistent pool, queued by
    `scheduler.Scheduler`; the frame loop and its records are `eval.bench`'s."""

    def __init__(self, k: int, params, spec, inputs, slots: int):
        super().__init__(k, params, inputs, slots)
        self.spec, self.lm = spec, mot.language_model(spec, params)

    def _new_pool(self):
        return decode.init_pool(self.lm, self.slots, self.x.prefix_len, self.x.group.N, 0)

    def _step(self, pool, f: int, req, evict):
        noises, states = self.x.noise[f]
        return schedule.mot_frame_step(self.params, self.spec, pool, self.x.observations[f], noises, states, req, evict,
                                       tokens_per_frame=self.k)

    def compile(self, log: dict[str, float]) -> None:
        x, g = self.x, self.x.group
        key = f"mot_frame_step/{g.workload}/k={self.k}/N={g.N}/slots={self.slots}/J={self.admissions}"

        def thunk():  # a throwaway pool with one admitted request, so the decode path ran too
            req = x.table.batch([0] if x.table.budgets else [], self.admissions)
            return jax.device_get(self._step(self._new_pool(), 0, req, np.zeros((self.slots,), bool))[1])

        bench._first_call(log, key, thunk)
        self.program_keys.append(key)
        self.pool = self._new_pool()
        self.tickets = x.table.tickets()


def runners(ctx, group, inputs) -> list:
    """One runner per selected setting (continuous once per k), in the order of `--settings`."""
    out = []
    for setting in ctx.args.settings:
        if setting == "continuous":
            for k in group.ks:
                budgets = [[inputs.table.budgets[i] for i in ids] for ids in inputs.arrivals]
                slots = bench._peak_slots(budgets, k) if ctx.args.slots == "auto" else ctx.args.slots
                out.append(_FanoutRunner(k, ctx.params, ctx.spec, inputs, slots))
        else:
            out.append(_HeadsRunner(setting, ctx.params, ctx.spec, inputs))
    return out


# --- summaries and components ---------------------------------------------------------------------


def fanout_fields(spec: mot.ModelSpec, runner, iso_frames) -> dict:
    """Per-record fan-out fields: the ratio to the isolated single-head frames, per-head medians and action Hz."""
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
    }


def measure_components(spec, params, inputs, noises, states, *, batches: Sequence[int], max_new_tokens: int,
                       repeats: int) -> metrics.Components:
    """Warm medians, each alone: the whole model's prefix pass, each head's prepare + denoise on it, and one
    decode step with B active requests (each B)."""
    prefix_fn = jax.jit(mot.prefix_pass, static_argnums=0)
    prefix_ms = bench._median_ms(lambda: prefix_fn(spec, params, inputs), repeats)
    prefix = prefix_fn(spec, params, inputs)
    sample = jax.jit(hd.sample)
    heads_ms = {h.name: bench._median_ms(lambda h=h: sample(params.heads[h.name], h, prefix, noises[h.name],
                                                            states.get(h.name)), repeats)
                for h in spec.heads}
    g = max(max_new_tokens, (repeats + 2) * bench._BURST + 2)
    lm = mot.language_model(spec, params)
    decode_ms = {b: bench._decode_step_ms(lm, prefix, b, g, repeats) for b in sorted(set(batches))}
    return metrics.Components(prefill_ms=prefix_ms, denoise_ms={}, decode_step_ms=decode_ms, heads_ms=heads_ms)


def components(ctx, robot, max_new_tokens: int) -> metrics.Components:
    """`measure_components` on one synthetic frame of `robot` (seeded apart from the measured frames)."""
    args = ctx.args
    rng = np.random.default_rng([args.seed, 99])
    inputs = _frame_inputs(ctx.spec, robot, args.image_size, rng)
    noises, states = _frame_noise(ctx.spec, rng)
    return measure_components(ctx.spec, ctx.params, inputs, noises, states, batches=args.component_batches,
                              max_new_tokens=max_new_tokens, repeats=args.component_repeats)
