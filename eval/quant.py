"""The cost of quantized weights (`python -m oxygen_jax.quantize`): actions, text, bytes, memory, CPU time.

    python -m eval.quant cost --out eval/results/quant_cost
    python -m eval.quant cost --sources families --fixtures qwen35_tiny --out eval/results/quant_cost  # those rows
    python -m eval.quant memory --ckpt /tmp/full/ckpt --out eval/results/quant_memory_pi05

`cost --sources demo`: the embedded demo (its held-out frames and memory adapter), for each setting (int8 /
fp8, all layer weights or the MLPs only), against the same weights in float32, same observations and noise:

* actions: max and mean |Δ| over every action chunk (10 denoising steps), relative to the action scale,
  the RMS of the float32 actions;
* text: teacher-forced greedy tokens after every prompt position identical to float32's (fraction); for the
  demo also greedy answers through the slot pool (`Engine`): the memory adapter's answers (exact match
  against the true labels, and tokens identical to float32's with the first divergence) and the base
  model's "Scene: " answers (tokens identical, first divergence);
* weight bytes against float32 and bfloat16;
* for the demo, the CPU frame time of the README's loop (one frame with one memory request), the median of
  interleaved frames, as a ratio to float32 in the same run (compile time apart). The weights are run
  weight-only here (dequantized into float32 matmuls), so expect no speed-up; the dynamic-range modes are timed
  by `eval.quant_matmul`.

`cost --sources families`: the public fixture of every family `load_model` reads (π0.5, π0 and π0-FAST from
openpi, π0.5 and π0 from LeRobot, Qwen3, Qwen3-VL, Qwen3.5, Xiaomi-Robotics-0, StarVLA QwenPI_v3 and GR00T),
through the model the runtime drives (`LoadedModel.vla()`: its prefix pass, heads and language decoder, the
same calls whatever the family), int8 and fp8 on all layer weights: every head's actions, teacher-forced
greedy tokens, the share of the weights quantized, and what stays float where no rule matches.

`memory`: the full-size π0.5 (the `pi05` preset's shapes, a random openpi-layout checkpoint written as
`eval.restore_memory` does, float32 on disk) quantized to int8 and fp8 (all layer weights), then in a fresh
process per (checkpoint, dtype): peak and settled resident memory while `load_model` restores it (the
`run` / `serve` path) and its weight bytes.

Writes OUT/summary.json, OUT/report.md and OUT/quant.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from eval.restore_memory import REPO, PeakRss, rss_mib
from eval.restore_memory import _run_frames as run_frames  # the README's loop, as restore_memory measures it
from oxygen_jax.cli import OneLineParser

SETTINGS = (("int8", ("attn", "mlp")), ("int8", ("mlp",)), ("fp8", ("attn", "mlp")), ("fp8", ("mlp",)))
FAMILY_SETTINGS = (("int8", ("attn", "mlp")), ("fp8", ("attn", "mlp")))
EMBED_SETTINGS = (("int8", ("attn", "mlp", "embed")), ("fp8", ("attn", "mlp", "embed")))  # `cost --embed`: the
# token embedding / LM head quantized too (per vocabulary row), for the demo and the fixtures alike
FIXTURES = {  # the public fixture of every family `load_model` reads: directory -> the family's name
    "openpi_tiny_pi05": "π0.5 (openpi)", "lerobot_tiny_pi05": "π0.5 (LeRobot)", "openpi_tiny_pi0": "π0 (openpi)",
    "lerobot_tiny_pi0": "π0 (LeRobot)", "openpi_tiny_pi0_fast": "π0-FAST (openpi)", "qwen3_tiny": "Qwen3",
    "qwen3vl_tiny": "Qwen3-VL", "qwen35_tiny": "Qwen3.5", "xr0_tiny": "Xiaomi-Robotics-0",
    "starvla_qwenpi_v3_tiny": "StarVLA QwenPI_v3", "starvla_gr00t_tiny": "StarVLA GR00T"}
_BATCH, _REQUEST_TOKENS = 4, 12  # rows per fixture run; teacher-forced request tokens after each row's prefix


def _name(weights: str, kinds) -> str:
    return f"{weights} {'+'.join(kinds)}"


def action_error(ref: np.ndarray, out: np.ndarray) -> dict:
    """max / mean |out - ref| relative to the action scale, the RMS of `ref` (float32 actions [..., Ha, Ad])."""
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    scale = float(np.sqrt(np.mean(ref ** 2)))
    err = np.abs(out - ref) / scale
    return {"action_scale": scale, "max_rel": float(err.max()), "mean_rel": float(err.mean())}


def token_agreement(ref: list[list[int]], out: list[list[int]]) -> dict:
    """Greedy answers against float32's: the share identical, and the first divergence of each that is not."""
    firsts = []
    for a, b in zip(ref, out):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        firsts.append(n if n is not None else (None if len(a) == len(b) else min(len(a), len(b))))
    return {"identical": sum(f is None for f in firsts) / len(firsts), "first_divergence": firsts}


# --------------------------------------------------------------------------------------------------
# cost


def _programs():
    import jax
    import jax.numpy as jnp

    from oxygen_jax.models.pi05 import model

    @jax.jit
    def run(params, obs, noise, state):
        out = model.prefix_forward(params, obs)
        tokens = jnp.argmax(model.lm_logits(params, model.final_norm(params, out["hidden"])), -1)
        state = state if params.config.variant == "pi0" else None
        return model.sample_actions(params, obs, noise, 10, state), tokens

    return run


def _compare(run, float_params, variants, obs, seed: int) -> dict:
    """Actions and teacher-forced tokens of each quantized variant against float32 (same inputs)."""
    import jax

    b = obs.tokens.shape[0]
    cfg = float_params.config
    noise = jax.random.normal(jax.random.key(seed), (b, 10, cfg.action_dim))
    state = jax.random.normal(jax.random.key(seed + 1), (b, cfg.action_dim))
    ref_a, ref_t = map(np.asarray, run(float_params, obs, noise, state))
    mask = np.asarray(obs.token_mask)
    out = {}
    for name, params in variants.items():
        a, t = map(np.asarray, run(params, obs, noise, state))
        out[name] = action_error(ref_a, a) | {
            "tokens_teacher_forced": float((t[:, -mask.shape[1]:] == ref_t[:, -mask.shape[1]:])[mask].mean())}
    return out


def _variants(params, settings=SETTINGS):
    from oxygen_jax.nn import quant

    return {_name(w, k): quant.quantize_tree(params, w, k) for w, k in settings}


def served_bytes(params, itemsize: int) -> int:
    """Weight bytes when served with float leaves and scales in `itemsize` bytes (4 float32, 2 bfloat16)."""
    import jax

    from oxygen_jax.nn import quant

    total = 0
    for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quant.QArray)):
        if isinstance(x, quant.QArray):
            total += int(np.prod(x.shape)) + int(np.prod(x.scale.shape)) * itemsize
        else:
            total += int(np.prod(x.shape)) * itemsize
    return total


def _bytes(float_params, variants) -> dict:
    out = {"float32": {"float32_bytes": served_bytes(float_params, 4), "bfloat16_bytes": served_bytes(float_params, 2)}}
    for name, p in variants.items():
        out[name] = {"float32_bytes": served_bytes(p, 4), "bfloat16_bytes": served_bytes(p, 2)}
    for rec in out.values():
        rec["vs_float32"] = rec["float32_bytes"] / out["float32"]["float32_bytes"]
        rec["vs_bfloat16"] = rec["bfloat16_bytes"] / out["float32"]["bfloat16_bytes"]
    return out


def _demo_text_and_time(demo, variants: dict, frames_timed: int) -> dict:
    """Greedy memory and scene answers through the Engine per frame, and interleaved frame times."""
    import jax

    from oxygen_jax.models.pi05.model import as_vla
    from oxygen_jax.models.pi05.params import for_backend
    from oxygen_jax.runtime.engine import Engine, EngineConfig
    from oxygen_jax.robots.transforms import make_observation

    samples = demo.samples()
    observations = [make_observation(demo.robot, demo.config, demo.tokenizer, [s]) for s in samples]
    cfg = EngineConfig(num_slots=2, max_new_tokens=demo.max_new_tokens, prompt_capacity=8, tokens_per_frame=4)
    engines = {name: Engine(as_vla(for_backend(p, "cpu")), cfg, tokenizer=demo.tokenizer, bank=demo.bank,
                            adapter_names=demo.adapter_names) for name, p in variants.items()}

    def answer(engine, obs, prompt, adapter):
        engine.submit(prompt=prompt, adapter=adapter, max_tokens=demo.max_new_tokens)
        for _ in range(40):
            done = engine.step(obs).finished
            if done:
                return done[0]
        raise RuntimeError("a demo request did not finish in 40 frames")

    out = {}
    for name, engine in engines.items():
        t0 = time.perf_counter()
        mem = [answer(engine, o, demo.prompt, demo.adapter_names[0]) for o in observations]
        scene = [answer(engine, o, "Scene: ", "base") for o in observations]
        out[name] = {"memory": [r.tokens for r in mem], "memory_text": [r.text for r in mem],
                     "scene": [r.tokens for r in scene], "answer_s": time.perf_counter() - t0}
    times = {name: [] for name in engines}
    names = list(engines)
    for i in range(frames_timed + 1):  # interleaved in rotating order, one memory request each; frame 0 is warm-up
        for name in names[i % len(names):] + names[:i % len(names)]:
            engine = engines[name]
            engine.submit(prompt=demo.prompt, adapter=demo.adapter_names[0], max_tokens=demo.max_new_tokens)
            t0 = time.perf_counter()
            jax.block_until_ready(engine.step(observations[i % len(observations)]).actions)
            if i:
                times[name].append(time.perf_counter() - t0)
    for name in engines:
        out[name]["frame_ms"] = 1e3 * float(np.median(times[name]))
    return out


def run_cost(frames_timed: int, settings=SETTINGS) -> dict:
    import jax

    from oxygen_jax.demo import load_demo, normalize_answer
    from oxygen_jax.models.pi05.params import stack_layers
    from oxygen_jax.robots.transforms import make_observation

    run = _programs()
    sources = {}
    demo = load_demo()
    params = stack_layers(demo.params)
    variants = _variants(params, settings)
    obs = make_observation(demo.robot, demo.config, demo.tokenizer, demo.samples())
    rec = {"what": "embedded demo (trained base, held-out frames)", "frames": len(demo.frames),
           "settings": _compare(run, params, variants, jax.tree.map(jax.numpy.asarray, obs), 0),
           "bytes": _bytes(params, variants)}
    text = _demo_text_and_time(demo, {"float32": params} | variants, frames_timed)
    labels = [normalize_answer(f["memory"]) for f in demo.frames]
    base = text["float32"]
    rec["float32"] = {"memory_exact_match": sum(normalize_answer(t or "") == y for t, y in zip(base["memory_text"], labels)),
                      "frame_ms": base["frame_ms"]}
    for name in variants:
        t = text[name]
        rec["settings"][name] |= {
            "memory_exact_match": sum(normalize_answer(a or "") == y for a, y in zip(t["memory_text"], labels)),
            "memory_tokens": token_agreement(base["memory"], t["memory"]),
            "scene_tokens": token_agreement(base["scene"], t["scene"]),
            "frame_ms": t["frame_ms"], "frame_ratio": t["frame_ms"] / base["frame_ms"]}
    sources["demo"] = rec
    return sources


# --------------------------------------------------------------------------------------------------
# cost, every family: through the model the runtime drives (`LoadedModel.vla()`), whatever its family


def _vla_inputs(vla, batch: int, rng):
    """Random inputs of the model's input kind: an `Observation` (SigLIP backbones) or `PrefixInputs` (Qwen
    backbones: random text, and one random image per row where the backbone has a vision encoder)."""
    import jax.numpy as jnp

    from oxygen_jax.models import mot
    from oxygen_jax.models.observation import Observation

    spec = vla.spec
    if spec.input_kind == "observation":
        s, t = spec.backbone.vision.image_size, 16
        tokens = rng.integers(3, spec.backbone.vocab_size, (batch, t)).astype(np.int32)
        tokens[:, t - 3:] = 0  # padding
        return Observation(images=jnp.asarray(rng.uniform(-1, 1, (batch, 2, s, s, 3)), jnp.float32),
                           image_masks=jnp.ones((batch, 2), bool), tokens=jnp.asarray(tokens),
                           token_mask=jnp.asarray(tokens > 0))
    if spec.backbone.vision is None:
        ids = rng.integers(0, spec.backbone.vocab_size, (batch, 16)).astype(np.int32)
        return mot.make_inputs(spec, ids, np.ones(ids.shape, bool))
    from eval.bench.heads import prompt_ids

    side = spec.backbone.vision.patch_size * spec.backbone.vision.spatial_merge_size
    ids = np.stack([prompt_ids(spec, 1, 2 * side, 16, rng) for _ in range(batch)])
    images = [rng.integers(0, 256, (2 * side, 2 * side, 3), dtype=np.uint8) for _ in range(batch)]
    return mot.make_inputs(spec, ids, np.ones(ids.shape, bool), images)


def _vla_program():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(vla, inputs, noises, states, request):
        """Each head's chunk, and the greedy token after every request token teacher-forced after the prefix."""
        prefix = vla.prefix(inputs)
        actions = vla.actions(prefix, noises, states) if vla.heads else {}
        if not vla.has_language:
            return actions, jnp.zeros(request.shape, jnp.int32)
        lm = vla.language()
        b, q = request.shape
        _, _, hidden = lm.suffix_forward(prefix, jnp.arange(b), request)
        logits = lm.logits_vocab_major(lm.final_norm(hidden.reshape(b * q, -1)))  # [V, B Q]
        return actions, jnp.argmax(logits, 0).reshape(b, q)

    return run


def _coverage(params, kinds) -> dict:
    """Which share of the weights `kinds` quantizes (`nn.quant.plan`) and the largest leaves left float."""
    import jax

    from oxygen_jax.nn import quant

    sizes = {quant.path_str(p): int(np.prod(x.shape)) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    chosen = quant.plan(params, kinds)
    left = sorted((k for k in sizes if k not in chosen), key=lambda k: -sizes[k])
    return {"quantized_share": sum(sizes[k] for k in chosen) / sum(sizes.values()), "quantized_leaves": len(chosen),
            "largest_float": [(k, sizes[k]) for k in left[:4]]}


def _load_options(path: Path) -> dict:
    """`load_model` options a fixture's files state: a LeRobot fixture's SigLIP head count (its config.json names
    only the variant; the fixture's generation_config.json records the real sizes)."""
    gen = path / "generation_config.json"
    heads = json.loads(gen.read_text()).get("spec", {}).get("vision", {}).get("num_attention_heads") if gen.is_file() else None
    return {"vision_heads": int(heads)} if heads else {}


def family_cost(path: Path, seed: int = 0, settings=FAMILY_SETTINGS) -> dict:
    """One fixture: int8 and fp8 (all layer weights) against float32 through `LoadedModel.vla()`: every head's
    actions (same inputs and noise; relative to the float32 chunk's RMS, the worst head) and teacher-forced
    greedy tokens (the share identical to float32's and each row's first divergence)."""
    import dataclasses

    import jax

    from oxygen_jax.ckpts.load import load_model

    model = load_model(path, dtype="float32", backend="gpu", **_load_options(path))  # stacked: what `quant.plan` walks
    vla = model.vla()
    rng = np.random.default_rng(seed)
    inputs = jax.device_put(_vla_inputs(vla, _BATCH, rng))
    noises = {h: rng.standard_normal((_BATCH, *vla.action_shape(h, 10))).astype(np.float32) for h in vla.heads}
    states = {h: rng.standard_normal((_BATCH, d)).astype(np.float32) for h, d in vla.state_dims().items()}
    hi = vla.vocab_size if vla.spec.image_token_id is None else min(vla.vocab_size, vla.spec.image_token_id - 3)
    request = rng.integers(0, hi, (_BATCH, _REQUEST_TOKENS)).astype(np.int32)
    run = _vla_program()
    ref_a, ref_t = jax.device_get(run(vla, inputs, noises, states, request))
    cover = _coverage(model.params, tuple(dict.fromkeys(k for _, kinds in settings for k in kinds)))
    rec = {"what": f"{FIXTURES.get(path.name, path.name)}: {model.what}", "family": model.family,
           "heads": list(vla.heads), "language": vla.has_language, "coverage": cover, "settings": {}}
    if not cover["quantized_leaves"]:
        return rec
    for weights, kinds in settings:
        from oxygen_jax.nn import quant

        qparams = quant.quantize_tree(model.params, weights, kinds)
        try:
            acts, tok = jax.device_get(run(dataclasses.replace(model, params=qparams).vla(), inputs, noises, states,
                                           request))
        except Exception as e:  # noqa: BLE001 - a layer loop that cannot take QArray leaves: say which, in the table
            rec["settings"][_name(weights, kinds)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            continue
        errs = [action_error(ref_a[h], acts[h]) for h in vla.heads]
        out = {"max_rel": max((e["max_rel"] for e in errs), default=None),
               "mean_rel": max((e["mean_rel"] for e in errs), default=None),
               "bfloat16_bytes_ratio": served_bytes(qparams, 2) / served_bytes(model.params, 2)}
        if vla.has_language:
            out["tokens_teacher_forced"] = float((tok == ref_t).mean())
            out["tokens"] = token_agreement(ref_t.tolist(), tok.tolist())
        rec["settings"][_name(weights, kinds)] = out
    return rec


def run_family_cost(names=tuple(FIXTURES), settings=FAMILY_SETTINGS) -> dict:
    """`family_cost` of each fixture in ../shared/fixtures (a missing one, or one that fails to load, says so)."""
    shared = REPO.parent / "shared" / "fixtures"
    out = {}
    for name in names:
        path = shared / name
        if not path.is_dir():
            out[name] = {"what": f"{FIXTURES.get(name, name)}: fixture not found in {shared}"}
            continue
        t0 = time.perf_counter()
        try:
            out[name] = family_cost(path, settings=settings)
        except Exception as e:  # noqa: BLE001 - reported in the table, not skipped
            out[name] = {"what": FIXTURES.get(name, name), "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        out[name]["seconds"] = time.perf_counter() - t0
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


# --------------------------------------------------------------------------------------------------
# memory


def measure_load(path: str, dtype: str, frames: int = 0) -> dict:
    """In this (fresh) process: peak and settled RSS above the baseline while `load_model` restores `path`; then
    `frames` steps of the README's robot loop on it (`eval.restore_memory`'s: peak RSS, first and steady step)."""
    import jax
    import jax.numpy as jnp

    from oxygen_jax.ckpts.load import load_model
    from oxygen_jax.nn import quant

    jnp.zeros(4).block_until_ready()
    base = rss_mib()
    with PeakRss() as peak:
        t0 = time.perf_counter()
        model = load_model(path, family="pi05", dtype=dtype, backend="cpu")
        jax.block_until_ready(model.params)
        load_s = time.perf_counter() - t0
    rec = {"path": path, "dtype": dtype, "weights_mib": quant.weight_bytes(model.params) / 2**20, "load_s": load_s,
           "load_peak_mib": peak.peak - base, "after_load_mib": rss_mib() - base}
    if frames:
        rec |= run_frames(model.config, model.params, frames)
        rec["frames_peak_mib"] -= base
    return rec


def _child(args: list[str]) -> str:
    run = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    if run.returncode:
        tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(args[:4])} failed (exit {run.returncode}):\n{tail}")
    return run.stdout.strip().splitlines()[-1]


def run_memory(ckpt: Path, preset: str, dtypes=("float32", "bfloat16"), weights_kinds=("int8", "fp8")) -> list[dict]:
    if not (ckpt / "params").exists():
        _child(["-m", "eval.restore_memory", "--preset", preset, "--write", str(ckpt)])
    records = [json.loads(_child(["-m", "eval.quant", "--measure", str(ckpt), dtype])) for dtype in dtypes]
    for weights in weights_kinds:
        dest = ckpt.parent / f"{ckpt.name}_{weights}"
        if not dest.exists():
            t0 = time.perf_counter()
            _child(["-m", "oxygen_jax.quantize", "--ckpt", str(ckpt), "--out", str(dest), "--weights", weights])
            quantize_s = time.perf_counter() - t0
        else:
            quantize_s = None
        for dtype in dtypes:
            records.append(json.loads(_child(["-m", "eval.quant", "--measure", str(dest), dtype]))
                           | {"weights": weights, "quantize_s": quantize_s})
    return records


# --------------------------------------------------------------------------------------------------
# report


def _f(x, spec=".3f") -> str:
    return "–" if x is None else format(x, spec)


def report(summary: dict) -> str:
    env = summary["environment"]
    lines = ["# Quantized weights: measured cost", "", f"`{env['command']}`; {env['timestamp']} UTC, {env['platform']}, "
             f"{env['cpu_count']} CPUs, load average {env['load_average']}.", ""]
    for r in env.get("reruns", []):
        lines[-1:-1] = ["", f"Re-run since, their rows replaced: {', '.join(r['fixtures'])} (`{r['command']}`; "
                            f"{r['timestamp']} UTC, load average {r['load_average']} -> {r.get('load_average_after')})."]
    for src, rec in summary.get("cost", {}).items():
        lines += [f"## {src}: {rec['what']}", ""]
        if "settings" not in rec:
            continue
        demo = "memory_exact_match" in next(iter(rec["settings"].values()))
        head = "| setting | actions max / scale | mean / scale | teacher-forced tokens | bytes, bf16 serving / bf16 |"
        if demo:
            head += " memory exact (of {n}) | memory tokens identical | scene tokens identical | frame ms | vs float32 |"
            head = head.format(n=rec["frames"])
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        if demo:
            f = rec["float32"]
            lines.append(f"| float32 | 0 | 0 | 1.000 | 1.00 | {f['memory_exact_match']} | 1.00 | 1.00 | {f['frame_ms']:.1f} | 1.00 |")
        for name, s in rec["settings"].items():
            row = (f"| {name} | {s['max_rel']:.4f} | {s['mean_rel']:.4f} | {s['tokens_teacher_forced']:.3f} | "
                   f"{rec['bytes'][name]['vs_bfloat16']:.2f} |")
            if demo:
                row += (f" {s['memory_exact_match']} | {s['memory_tokens']['identical']:.2f} | "
                        f"{s['scene_tokens']['identical']:.2f} | {s['frame_ms']:.1f} | {s['frame_ratio']:.2f} |")
            lines.append(row)
        lines.append("")
    fam = summary.get("families")
    if fam:
        lines += ["## Every family: the public fixtures through `LoadedModel.vla()`", "",
                  f"Random inputs ({_BATCH} rows), the same noise and states; actions: every head's chunk (10 "
                  "denoising steps where the head takes them) against float32, relative to the float32 chunk's RMS, "
                  f"the worst head; text: the greedy token after each of {_REQUEST_TOKENS} random request tokens "
                  "teacher-forced after the prefix (share identical to float32's, rows identical throughout, each "
                  "row's first divergence). Share: the weights (elements) `nn.quant.RULES` quantizes.", "",
                  "| fixture | family | share quantized | setting | actions max / scale | mean / scale | "
                  "teacher-forced tokens | rows identical | first divergence | bytes, bf16 serving / bf16 | note |",
                  "|" + "---|" * 11]
        for name, rec in fam.items():
            what = rec["what"].split(":")[0]
            if "settings" not in rec:
                lines.append(f"| {name} | {what} | – | – | – | – | – | – | – | – | {rec.get('error', rec['what'])} |")
                continue
            share = rec["coverage"]["quantized_share"]
            if not rec["settings"]:
                big = ", ".join(k for k, _ in rec["coverage"]["largest_float"][:3])
                lines.append(f"| {name} | {what} | 0 | – | – | – | – | – | – | 1 | not quantized: no leaf matches "
                             f"`nn.quant.RULES` (largest: {big}) |")
                continue
            for setting, s in rec["settings"].items():
                if "error" in s:
                    lines.append(f"| {name} | {what} | {share:.2f} | {setting} | – | – | – | – | – | – | {s['error']} |")
                    continue
                t = s.get("tokens")
                lines.append(f"| {name} | {what} | {share:.2f} | {setting} | {_f(s['max_rel'], '.4f')} | "
                             f"{_f(s['mean_rel'], '.4f')} | {_f(s.get('tokens_teacher_forced'))} | "
                             f"{_f(t and t['identical'], '.2f')} | {t and t['first_divergence']} | "
                             f"{s['bfloat16_bytes_ratio']:.2f} | "
                             f"{'no heads' if not rec['heads'] else ''}{'' if rec['language'] else 'no language'} |")
        lines.append("")
    mem = summary.get("memory")
    if mem:
        ref = {r["dtype"]: r for r in mem if "weights" not in r}
        lines += ["## Full size: restore memory (`load_model`, the run / serve path)", "",
                  "Peak resident memory above the process baseline while `load_model` restores the checkpoint in a fresh "
                  "process; ratios against the float source restored in the same dtype, and against it in bfloat16.", "",
                  "| checkpoint | dtype | weights MiB | load s | load peak MiB | after load MiB | peak / same dtype float | "
                  "peak / bfloat16 float | quantize s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mem:
            same, bf16 = ref.get(r["dtype"], {}).get("load_peak_mib"), ref.get("bfloat16", {}).get("load_peak_mib")
            lines.append(f"| {r.get('weights', 'float32 (source)')} | {r['dtype']} | {r['weights_mib']:.0f} | "
                         f"{r['load_s']:.1f} | {r['load_peak_mib']:.0f} | {r['after_load_mib']:.0f} | "
                         f"{_f(same and r['load_peak_mib'] / same, '.3f')} | {_f(bf16 and r['load_peak_mib'] / bf16, '.3f')} | "
                         f"{_f(r.get('quantize_s'), '.0f')} |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    """quant.png: per source, the actions' mean error and the teacher-forced token agreement per setting, and the
    weight bytes served in bfloat16 (cost); the full-size restore's peak and weights (memory)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost = {k: v for k, v in summary.get("cost", {}).items() if "settings" in v}
    fam = {k: v for k, v in summary.get("families", {}).items() if v.get("settings")}
    mem = summary.get("memory") or []
    n = 3 * bool(cost) + 2 * bool(fam) + bool(mem)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    axes = list(axes[0])
    if fam:
        names = list(fam)
        x = np.arange(len(names))
        for ax, key, title in zip(axes[3 * bool(cost):], ("mean_rel", "tokens_teacher_forced"),
                                  ("every family: actions mean |Δ| / RMS", "every family: teacher-forced tokens")):
            settings = list(dict.fromkeys(s for f in names for s in fam[f]["settings"]))  # as measured
            for i, setting in enumerate(settings):
                vals = [(fam[f]["settings"].get(setting, {}).get(key) or 0.0) for f in names]
                ax.bar(x + i * 0.8 / len(settings), vals, 0.8 / len(settings), label=setting)
            ax.set_title(title, fontsize=10)
            ax.set_xticks(x + 0.2, names, rotation=60, fontsize=7, ha="right")
            ax.legend(fontsize=7)
    if cost:
        names = list(next(iter(cost.values()))["settings"])  # the settings measured
        x = np.arange(len(names))
        width = 0.8 / len(cost)
        panels = (("mean_rel", "actions: mean |Δ| / action RMS (vs float32)"),
                  ("tokens_teacher_forced", "teacher-forced greedy tokens = float32's"),
                  ("bytes", "weight bytes served in bfloat16 / bfloat16"))
        for ax, (key, title) in zip(axes, panels):
            for i, (src, rec) in enumerate(cost.items()):
                vals = [rec["bytes"][n]["vs_bfloat16"] if key == "bytes" else rec["settings"][n][key] for n in names]
                ax.bar(x + i * width, vals, width, label=src)
            ax.set_title(title, fontsize=10)
            ax.set_xticks(x + width * (len(cost) - 1) / 2, names, rotation=15, fontsize=8)
            ax.legend(fontsize=7)
    if mem:
        ax = axes[-1]
        labels = [f"{r.get('weights', 'float')}\n{r['dtype']}" for r in mem]
        ax.bar(range(len(mem)), [r["load_peak_mib"] / 1024 for r in mem], label="load peak")
        ax.bar(range(len(mem)), [r["weights_mib"] / 1024 for r in mem], alpha=0.6, label="weights")
        ax.set_xticks(range(len(mem)), labels, fontsize=8)
        ax.set_title("full-size π0.5: GiB resident (load_model)", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _merge_rerun(old: dict, new: dict) -> dict:
    """`old` with `new`'s family rows in place of its own and `new`'s environment appended to its `reruns`."""
    merged = dict(old, families={**old.get("families", {}), **new.get("families", {})})
    rerun = dict(new["environment"], fixtures=list(new.get("families", {})))
    merged["environment"] = dict(old["environment"], reruns=[*old["environment"].get("reruns", []), rerun])
    return merged


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["kv"]:  # quantized K/V in the slot pool: its own module and flags (which imports this one)
        return subprocess.call([sys.executable, "-m", "eval.quant_kv", *argv[1:]], cwd=REPO)
    ap = OneLineParser(prog="python -m eval.quant", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=("cost", "memory"), default="cost")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sources", nargs="+", default=["demo", "families"], choices=("demo", "families"),
                    help="cost: the embedded demo and / or every family's public fixture")
    ap.add_argument("--fixtures", nargs="+", choices=tuple(FIXTURES), default=None,
                    help="cost, families: only these fixtures; their rows replace those of an existing OUT/summary.json "
                         "(the other rows are kept as measured, the re-run recorded beside them)")
    ap.add_argument("--frames", type=int, default=8, help="cost: timed demo frames per setting (interleaved)")
    ap.add_argument("--embed", action="store_true", help="cost: int8 / fp8 on attention + MLP + the token embedding "
                    "(the tied LM head) in place of the default settings")
    ap.add_argument("--ckpt", type=Path, default=None, help="memory: the random full-size checkpoint (written if "
                    "absent; its quantized copies go beside it as CKPT_int8, CKPT_fp8)")
    ap.add_argument("--preset", default="pi05", choices=("tiny", "bench", "pi05"), help="memory: the model size")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"),
                    help="memory: the dtypes each checkpoint is restored in")
    ap.add_argument("--weights", nargs="+", default=["int8", "fp8"], choices=("int8", "fp8"),
                    help="memory: the quantized copies measured beside the float source")
    ap.add_argument("--frames-after", type=int, default=0, help="with --measure: robot-loop steps after loading")
    ap.add_argument("--measure", nargs=2, metavar=("CKPT", "DTYPE"), help=argparse.SUPPRESS)  # the child processes
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_load(*args.measure, frames=args.frames_after)), flush=True)
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    if args.embed and args.what != "cost":
        ap.error("--embed chooses the cost settings; memory measures the default kinds")
    if args.fixtures and (args.what != "cost" or args.sources != ["families"]):
        ap.error("--fixtures re-runs family rows only: use it with `cost --sources families`")
    summary = {"environment": {
        "command": " ".join(["python", "-m", "eval.quant", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}}
    if args.what == "cost":
        if "demo" in args.sources:
            summary["cost"] = run_cost(args.frames, EMBED_SETTINGS if args.embed else SETTINGS)
        if "families" in args.sources:
            summary["families"] = run_family_cost(tuple(args.fixtures or FIXTURES),
                                                  EMBED_SETTINGS if args.embed else FAMILY_SETTINGS)
        if args.fixtures and (args.out / "summary.json").is_file():
            summary = _merge_rerun(json.loads((args.out / "summary.json").read_text()), summary)
    else:
        ckpt = args.ckpt or Path(tempfile.mkdtemp(prefix="oxygen-quant-")) / "ckpt"
        summary["memory"] = run_memory(ckpt, args.preset, tuple(args.dtypes), tuple(args.weights))
        summary["environment"]["preset"] = args.preset
    env = summary["environment"]
    (env["reruns"][-1] if env.get("reruns") else env)["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    write_outputs(args.out, summary, report, plot, "quant.png")
    return 0


def write_outputs(out: Path, summary: dict, report_fn, plot_fn, png: str) -> None:
    """OUT/summary.json, OUT/report.md (`report_fn(summary)`, also printed) and OUT/`png` (`plot_fn`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "report.md").write_text(report_fn(summary) + "\n")
    plot_fn(summary, out / png)
    print(report_fn(summary))


if __name__ == "__main__":
    sys.exit(main())
