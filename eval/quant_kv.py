"""The cost of quantized K/V in the decode slot pool (`init_pool(..., kv_cache="int8" | "fp8")`, `nn.kv_quant`).

    python -m eval.quant kv --out eval/results/quant_kv [--fixtures qwen3_tiny ...] [--skip-demo] [--skip-time]
    (the same as python -m eval.quant_kv ...)

Against the same model's pool with float K/V, same prefix, requests and greedy sampling:

* every family's public fixture (`LoadedModel.vla()`, float32; 4 prefix rows of random inputs, 4 requests
  with a 3-token random prompt each, 12 greedy tokens): tokens identical (share, per request, first
  divergence) and the logits' max |Δ| over the first 3 decode steps relative to the float logits' RMS;
* the embedded demo: the same on its held-out frames' prefixes, and through the `Engine` (`EngineConfig.kv_cache`)
  the memory adapter's answers (exact match against the labels, tokens against float K/V's) and the base model's
  "Scene: " answers, with each frame's actions compared bit for bit (the heads read the float prefix, never the
  pool);
* slot bytes of the full-size π0.5 (`pi05` preset in bfloat16, LIBERO's prefix, Ns = 30), from shapes alone
  (`decode.slot_bytes`);
* CPU decode-step time at the `bench` preset, int8 and fp8 over float, interleaved in one run (compile apart,
  `block_until_ready`): XLA:CPU has no int8 / fp8 attention, so each step dequantizes the slots' K/V in float.

Writes OUT/summary.json, OUT/report.md and OUT/kv.png.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from eval.quant import FIXTURES, _load_options, _vla_inputs, token_agreement, write_outputs
from eval.restore_memory import REPO
from oxygen_jax.cli import OneLineParser
from oxygen_jax.runtime import decode

KINDS = ("int8", "fp8")
_ROWS, _PROMPT, _NEW, _LOGIT_STEPS = 4, 3, 12, 3  # requests (one per prefix row), prompt tokens, new tokens, steps
_FULL = dict(preset="pi05", dtype="bfloat16", slots=30, prompt_capacity=16, max_new_tokens=32)  # serve's defaults


def pool_run(lm, prefix, kv_cache: str, prompts: np.ndarray, new_tokens: int = _NEW):
    """Greedy decoding of one request per prefix row (prompt int32 [J, Q]) in a pool with `kv_cache` K/V:
    (tokens int32 [J, new_tokens], logits float32 [new_tokens - 1, J, V] of the decode steps)."""
    j, q = prompts.shape
    pool = decode.init_pool(lm, j, decode.prefix_length(prefix), new_tokens, q, kv_cache=kv_cache)
    req = decode.make_requests(j, q, list(range(j)), rows=list(range(j)), prompts=prompts.tolist(),
                               budgets=[new_tokens] * j, stop_ids=[-1] * j)
    pool, _, _ = decode.admit(lm, pool, prefix, req)
    logits = []
    for _ in range(new_tokens - 1):
        pool, _, lg = decode.decode_step(lm, pool)
        logits.append(np.asarray(lg))
    return np.asarray(pool.tokens), np.stack(logits)


def compare_pools(lm, prefix, prompts: np.ndarray) -> dict:
    """`pool_run` with float, int8 and fp8 K/V: each quantized storage against float."""
    ref_tok, ref_lg = pool_run(lm, prefix, "float", prompts)
    out = {"float_tokens": ref_tok.tolist()}
    for kind in KINDS:
        tok, lg = pool_run(lm, prefix, kind, prompts)
        out[kind] = {"tokens_identical_share": float((tok == ref_tok).mean()),
                     "requests": token_agreement(ref_tok.tolist(), tok.tolist()), **logits_error(ref_tok, ref_lg, tok, lg)}
    return out


def logits_error(ref_tok, ref_lg, tok, lg, steps: int = _LOGIT_STEPS) -> dict:
    """max / mean |Δ| of the first `steps` decode steps' logits [steps, J, V] relative to the reference logits' RMS,
    over the (step, request) pairs whose fed tokens so far are the reference's (step i feeds token i: after a
    divergence two different sequences would be compared); `compared` counts them."""
    same = np.cumprod(tok[:, :steps] == ref_tok[:, :steps], axis=1).astype(bool).T  # [steps, J]
    rms = float(np.sqrt(np.mean(ref_lg[:steps] ** 2)))
    err = (np.abs(lg[:steps] - ref_lg[:steps]) / rms)[same]
    return {"compared": int(same.sum()), "of": int(same.size),
            "logits_max_rel": float(err.max()) if err.size else None,
            "logits_mean_rel": float(err.mean()) if err.size else None}


def _prompts(vocab: int, rng) -> np.ndarray:
    return rng.integers(3, min(vocab, 400), (_ROWS, _PROMPT)).astype(np.int32)


def family_kv(path: Path, seed: int = 0) -> dict:
    """One fixture through the runtime's model (`LoadedModel.vla()`): its prefix pass on random inputs, then
    `compare_pools` on its language decoder."""
    import jax

    from oxygen_jax.ckpts.load import load_model
    model = load_model(path, dtype="float32", backend="cpu", **_load_options(path))
    vla = model.vla().without_heads()
    rng = np.random.default_rng(seed)
    prefix = jax.jit(lambda v, x: v.prefix(x))(vla, jax.device_put(_vla_inputs(vla, _ROWS, rng)))
    lm = vla.language()
    hi = vla.vocab_size if vla.spec.image_token_id is None else min(vla.vocab_size, vla.spec.image_token_id - 3)
    kv = _slot_kv_bytes(lm, decode.prefix_length(prefix))
    prompts = _prompts(hi, rng)
    return {"what": model.what, "family": model.family, "kv_layers": len(lm.kv_layers), "kv_heads": lm.num_kv_heads,
            "head_dim": lm.head_dim, "slot_kv_bytes": kv, **compare_pools(lm, prefix, prompts),
            "int8_step_noise": step_noise(lm, prefix, prompts)}


def step_noise(lm, prefix, prompts, draws: int = 3) -> list[dict]:
    """The model's own sensitivity, for scale: float K/V decoding from a prefix whose K/V carry uniform noise of
    int8's step (±absmax / 254 per head, the prefix only), against the clean prefix (`logits_error`, tokens)."""
    import dataclasses

    import jax.numpy as jnp

    ref_tok, ref_lg = pool_run(lm, prefix, "float", prompts)
    out = []
    for seed in range(draws):
        rng = np.random.default_rng(100 + seed)

        def noisy(x):
            x = np.asarray(x)
            return jnp.asarray(x + rng.uniform(-0.5, 0.5, x.shape) * np.abs(x).max(-1, keepdims=True) / 127, x.dtype)
        tok, lg = pool_run(lm, dataclasses.replace(prefix, k=noisy(prefix.k), v=noisy(prefix.v)), "float", prompts)
        out.append({"tokens_identical_share": float((tok == ref_tok).mean()), **logits_error(ref_tok, ref_lg, tok, lg)})
    return out


def _slot_kv_bytes(lm, prefix_len: int) -> dict:
    return {k: decode.slot_bytes(lm, prefix_len, _NEW, _PROMPT, kv_cache=k)["kv"] for k in ("float",) + KINDS}


def run_families(names) -> dict:
    shared = REPO.parent / "shared" / "fixtures"
    out = {}
    for name in names:
        t0 = time.perf_counter()
        if not (shared / name).is_dir():
            out[name] = {"what": f"{FIXTURES.get(name, name)}: fixture not found in {shared}"}
            continue
        try:
            out[name] = family_kv(shared / name)
        except Exception as e:  # noqa: BLE001 - reported in the table, not skipped
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        out[name]["label"] = FIXTURES.get(name, name)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def _answers(engine, observations, prompt: str, adapter: str, max_tokens: int, actions: dict):
    """Each frame's greedy answer (one request at a time, stepped to its end); each step's actions go to
    `actions[(frame number, observation index)]` (the same key: the same observation and noise)."""
    done = []
    for i, obs in enumerate(observations):
        engine.submit(prompt=prompt, adapter=adapter, max_tokens=max_tokens)
        for _ in range(40):
            step = engine.step(obs)
            actions[step.frame, i] = np.asarray(step.actions)
            if step.finished:
                done.append(step.finished[0])
                break
        else:
            raise RuntimeError("a demo request did not finish in 40 frames")
    return done


def demo_kv() -> dict:
    """The embedded demo: `compare_pools` on its held-out frames' prefixes, then answers through the Engine."""
    import jax

    from oxygen_jax.demo import load_demo, normalize_answer
    from oxygen_jax.models.pi05.model import as_vla
    from oxygen_jax.models.pi05.params import for_backend
    from oxygen_jax.robots.transforms import make_observation
    from oxygen_jax.runtime.engine import Engine, EngineConfig

    demo = load_demo()
    vla = as_vla(for_backend(demo.params, "cpu"))
    samples = demo.samples()
    batch = make_observation(demo.robot, demo.config, demo.tokenizer, samples[:_ROWS])
    prefix = jax.jit(lambda v, x: v.prefix(x))(vla, jax.tree.map(jax.numpy.asarray, batch))
    lm = vla.language()
    rec = {"frames": len(samples), "pool": compare_pools(lm, prefix, _prompts(demo.config.vocab_size, np.random.default_rng(0)))}
    rec["pool"] |= {"kv_layers": len(lm.kv_layers), "kv_heads": lm.num_kv_heads, "head_dim": lm.head_dim,
                    "slot_kv_bytes": _slot_kv_bytes(lm, decode.prefix_length(prefix))}
    observations = [make_observation(demo.robot, demo.config, demo.tokenizer, [s]) for s in samples]
    labels = [normalize_answer(f["memory"]) for f in demo.frames]
    runs = {}
    for kind in ("float",) + KINDS:
        cfg = EngineConfig(num_slots=2, max_new_tokens=demo.max_new_tokens, prompt_capacity=8, tokens_per_frame=4,
                           kv_cache=kind)
        engine = Engine(vla, cfg, tokenizer=demo.tokenizer, bank=demo.bank, adapter_names=demo.adapter_names)
        actions = {}
        memory = _answers(engine, observations, demo.prompt, demo.adapter_names[0], demo.max_new_tokens, actions)
        scene = _answers(engine, observations, "Scene: ", "base", demo.max_new_tokens, actions)
        runs[kind] = {"memory": [r.tokens for r in memory], "memory_text": [r.text for r in memory],
                      "scene": [r.tokens for r in scene], "actions": actions}
    base = runs["float"]
    exact = lambda texts: sum(normalize_answer(t or "") == y for t, y in zip(texts, labels))  # noqa: E731
    rec["float"] = {"memory_exact_match": exact(base["memory_text"]), "memory_text": base["memory_text"]}
    for kind in KINDS:
        r = runs[kind]
        rec["pool"][kind] |= {
            "memory_exact_match": exact(r["memory_text"]), "memory_tokens": token_agreement(base["memory"], r["memory"]),
            "scene_tokens": token_agreement(base["scene"], r["scene"]),
            "actions_compared": len(shared := set(r["actions"]) & set(base["actions"])),
            "actions_identical": all(np.array_equal(r["actions"][key], base["actions"][key]) for key in shared)}
    return rec


def full_size_bytes() -> dict:
    """One slot's bytes by part for the full-size π0.5 (LIBERO's prefix), from shapes: no weights allocated."""
    import jax

    from oxygen_jax.models.pi05.config import model_config
    from oxygen_jax.models.pi05.model import as_vla
    from oxygen_jax.models.pi05.params import abstract_params
    from oxygen_jax.robots.config import robot_config
    config = model_config(_FULL["preset"], dtype=_FULL["dtype"])
    lm = as_vla(abstract_params(config)).language()
    robot = robot_config("libero")
    per_image = (config.siglip.image_size // config.siglip.patch_size) ** 2
    p = robot.num_cameras * per_image + robot.max_token_len
    out = {"prefix_tokens": p, **{k: v for k, v in _FULL.items()}}
    for kind in ("float",) + KINDS:
        b = decode.slot_bytes(lm, p, _FULL["max_new_tokens"], _FULL["prompt_capacity"], kv_cache=kind)
        out[kind] = {"slot_kv_bytes": b["kv"], "slot_total_bytes": b["total"], "kv_per_token": b["kv_per_token"],
                     "pool_mib": _FULL["slots"] * b["total"] / 2 ** 20}
    jax.clear_caches()
    return out


def decode_step_times(rounds: int = 30, slots: int = 6) -> dict:
    """Median CPU decode-step time per storage at the `bench` preset (float32, `slots` active requests), the
    storages interleaved in rotating order; compile time apart."""
    import jax

    from oxygen_jax.models.pi05.config import model_config
    from oxygen_jax.models.pi05.model import as_vla
    from oxygen_jax.models.pi05.params import for_backend, init_params
    from oxygen_jax.models.observation import Observation
    config = model_config("bench")
    vla = as_vla(for_backend(init_params(config, 0), "cpu"))
    rng = np.random.default_rng(0)
    s, t = config.siglip.image_size, 48  # two cameras and a 48-token prompt: LIBERO's shape at a short prompt
    tokens = rng.integers(3, config.vocab_size, (slots, t)).astype(np.int32)
    obs = Observation(images=rng.uniform(-1, 1, (slots, 2, s, s, 3)).astype(np.float32),
                      image_masks=np.ones((slots, 2), bool), tokens=tokens, token_mask=np.ones((slots, t), bool))
    prefix = jax.jit(lambda v, x: v.prefix(x))(vla, jax.tree.map(jax.numpy.asarray, obs))
    lm = vla.language()
    new = rounds + 2
    prompts = _prompts(config.vocab_size, rng)[:1].repeat(slots, 0)
    pools, compile_s = {}, {}
    for kind in ("float",) + KINDS:
        pool = decode.init_pool(lm, slots, decode.prefix_length(prefix), new, _PROMPT, kv_cache=kind)
        req = decode.make_requests(slots, _PROMPT, list(range(slots)), rows=list(range(slots)), prompts=prompts.tolist(),
                                   budgets=[new] * slots, stop_ids=[-1] * slots)
        pool, _, _ = decode.admit(lm, pool, prefix, req)
        t0 = time.perf_counter()
        pool, tok, _ = decode.decode_step(lm, pool)
        jax.block_until_ready(tok)
        compile_s[kind], pools[kind] = time.perf_counter() - t0, pool
    times = {k: [] for k in pools}
    names = list(pools)
    for i in range(rounds):
        for kind in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            pools[kind], tok, _ = decode.decode_step(lm, pools[kind])
            jax.block_until_ready(tok)
            times[kind].append(time.perf_counter() - t0)
    med = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    return {"preset": "bench", "dtype": "float32", "slots": slots, "capacity": pools["float"].capacity,
            "rounds": rounds, "step_ms": med, "first_step_s": compile_s,
            "ratio": {k: med[k] / med["float"] for k in KINDS}}


def _f(x, spec=".3f") -> str:
    return "–" if x is None else format(x, spec)


def _div(a: dict) -> str:
    """`token_agreement`'s record as "identical / all (first divergence at i)"."""
    firsts = [f for f in a["first_divergence"] if f is not None]
    n = len(a["first_divergence"])
    return f"{n - len(firsts)} / {n}" + (f" (first at {min(firsts)})" if firsts else "")


def _table(intro: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table after a blank line and its introducing sentence."""
    return ["", intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def report(s: dict) -> str:
    env = s["environment"]
    lines = [f"# Quantized K/V in the slot pool: the cost\n",
             f"`{env['command']}` at `{env['commit']}`, {env['timestamp']}, {env['platform']}, {env['cpu_count']} CPUs, "
             f"load average {env['load_average']} before, {env.get('load_average_after')} after.\n",
             f"Greedy decoding, {_ROWS} requests of a {_PROMPT}-token random prompt, {_NEW} tokens each, float32 "
             f"weights; logits |Δ| over the first {_LOGIT_STEPS} decode steps relative to float K/V's logits RMS, where the tokens "
             f"fed so far are float K/V's (compared / all (step, request) pairs).\n",
             "| source | K/V layers × heads × dim | int8 requests identical | int8 tokens | int8 logits max / mean | "
             "fp8 requests identical | fp8 tokens | fp8 logits max / mean | int8-step noise: tokens, logits max | "
             "slot K/V bytes int8 / float |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = dict(s.get("families", {}))
    if "demo" in s:
        rows = {"demo": dict(s["demo"]["pool"], label="embedded demo (held-out frames)")} | rows
    for name, r in rows.items():
        if "int8" not in r:
            lines.append(f"| {r.get('label', name)} | {r.get('error') or r.get('what')} ||||||||")
            continue
        cells = [r.get("label", name), f"{r.get('kv_layers')} × {r.get('kv_heads')} × {r.get('head_dim')}"]
        for kind in KINDS:
            k = r[kind]
            cells += [_div(k["requests"]), _f(k["tokens_identical_share"], ".2f"),
                      f"{_f(k['logits_max_rel'])} / {_f(k['logits_mean_rel'], '.4f')} ({k['compared']} / {k['of']})"]
        noise = r.get("int8_step_noise")
        cells.append("–" if not noise else ", ".join(_f(n["tokens_identical_share"], ".2f") for n in noise) + "; "
                     + ", ".join(_f(n["logits_max_rel"]) for n in noise))
        kv = r.get("slot_kv_bytes")
        cells.append(_f(kv["int8"] / kv["float"]) if kv else "–")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if "demo" in s:
        d = s["demo"]
        lines += _table(f"**Demo through the Engine** ({d['frames']} held-out frames, the memory adapter per slot): "
                        f"float K/V {d['float']['memory_exact_match']} / {d['frames']} memory answers exact.",
                        ["K/V", "memory exact", "memory answers identical to float K/V", "scene answers identical",
                         "actions"],
                        [[kind, f"{d['pool'][kind]['memory_exact_match']} / {d['frames']}",
                          _div(d["pool"][kind]["memory_tokens"]), _div(d["pool"][kind]["scene_tokens"]),
                          ("identical" if d["pool"][kind]["actions_identical"] else "DIFFER")
                          + f" ({d['pool'][kind]['actions_compared']} frames)"] for kind in KINDS])
    if "full_size" in s:
        f = s["full_size"]
        lines += _table(f"**Full size** (π0.5 `{f['preset']}` in {f['dtype']}, P = {f['prefix_tokens']} LIBERO prefix "
                        f"tokens, Q = {f['prompt_capacity']}, M = {f['max_new_tokens']}, from shapes):",
                        ["K/V", "K/V bytes per entry", "slot K/V MiB", "slot MiB (all)", "pool of 30 slots MiB", "/ float"],
                        [[kind, f"{f[kind]['kv_per_token']:,}", f"{f[kind]['slot_kv_bytes'] / 2 ** 20:.2f}",
                          f"{f[kind]['slot_total_bytes'] / 2 ** 20:.2f}", f"{f[kind]['pool_mib']:.0f}",
                          f"{f[kind]['slot_total_bytes'] / f['float']['slot_total_bytes']:.3f}"]
                         for kind in ("float",) + KINDS])
    if "time" in s:
        t = s["time"]
        lines += ["", f"**CPU decode step** (`{t['preset']}` preset, {t['dtype']}, {t['slots']} active slots, "
                      f"C = {t['capacity']}, median of {t['rounds']} interleaved steps): float "
                      f"{t['step_ms']['float']:.1f} ms, int8 {t['step_ms']['int8']:.1f} ms "
                      f"({t['ratio']['int8']:.2f}x), fp8 {t['step_ms']['fp8']:.1f} ms ({t['ratio']['fp8']:.2f}x)."]
    return "\n".join(lines)


def plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {n: r for n, r in s.get("families", {}).items() if "int8" in r}
    if "demo" in s:
        rows = {"demo": s["demo"]["pool"]} | rows
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    x = np.arange(len(rows))
    for i, kind in enumerate(KINDS):
        ax[0].bar(x + 0.4 * i, [r[kind]["logits_max_rel"] or np.nan for r in rows.values()], 0.4, label=kind)
        ax[1].bar(x + 0.4 * i, [r[kind]["tokens_identical_share"] for r in rows.values()], 0.4, label=kind)
    for a, title in zip(ax, (f"logits max |Δ| / RMS, first {_LOGIT_STEPS} steps", f"greedy tokens identical ({_NEW})")):
        a.set_xticks(x + 0.2, [r.get("label", n) for n, r in rows.items()], rotation=60, ha="right", fontsize=7)
        a.set_title(title, fontsize=10)
        a.legend()
    ax[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m eval.quant kv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fixtures", nargs="+", choices=tuple(FIXTURES), default=None, help="only these fixtures")
    ap.add_argument("--skip-demo", action="store_true", help="the families only")
    ap.add_argument("--skip-time", action="store_true", help="no CPU decode-step timing")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    s = {"environment": {"command": " ".join(["python -m eval.quant kv", *(sys.argv[1:] if argv is None else argv)]),
                         "commit": commit, "timestamp": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "platform": platform.platform(), "cpu_count": os.cpu_count(),
                         "load_average": [round(x, 2) for x in os.getloadavg()]}}
    s["full_size"] = full_size_bytes()
    if not args.skip_demo:
        s["demo"] = demo_kv()
    s["families"] = run_families(tuple(args.fixtures or FIXTURES))
    if not args.skip_time:
        s["time"] = decode_step_times()
    s["environment"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    write_outputs(args.out, s, report, plot, "kv.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
