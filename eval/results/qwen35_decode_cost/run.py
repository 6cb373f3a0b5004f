"""Decode-step cost of the hybrid (Qwen3.5) vs an attention-only backbone, against batch and context length.

    python -m eval.results.qwen35_decode_cost.run --out eval/results/qwen35_decode_cost

One `runtime.decode.decode_step` (every slot active) on two language models of the same width and depth:
`qwen35.preset("qwen35_bench")` (6 Gated DeltaNet + 2 full-attention layers, 1024 wide) and the Qwen3-VL
bench backbone (`mot.bench_backbone()`, 8 attention layers, 1024 wide, laid out by `mot.for_backend`), both with a 16,384-token
vocabulary here so the LM head does not hide the layers' cost (and the hybrid with `step_sums='four_lanes'`,
transformers' AVX2 decode-step sums). Per (model, slot capacity C, batch B):
compile time apart, then the median of `--reps` warm steps, each waited for (`block_until_ready`), the
two models and every configuration interleaved rep by rep so machine load hits them alike. A hybrid slot
reads its full layers' K/V (2 layers) plus a fixed window and state per linear layer, so its step grows
with C only through 2 layers; the attention-only step through all 8. Also writes each slot's bytes
(`decode.slot_bytes`). Random weights and an all-valid prefix of C - 8 tokens (contents do not change cost).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models import backbone, mot
from oxygen_jax.models.decoder import AttentionDecoder, LanguageDecoder
from oxygen_jax.models.qwen35 import decoder as qwen35_decoder
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.models.stack import AttentionStack
from oxygen_jax.runtime import decode

VOCAB = 16_384
NEW = 8  # generated-token room per slot


def models() -> dict[str, LanguageDecoder]:
    q = qwen35.preset("qwen35_bench")
    q = dataclasses.replace(q, backbone=q.backbone.replace(vocab_size=VOCAB, vision=None))
    a = mot.bench_backbone().replace(vocab_size=VOCAB, vision=None)
    lanes = dataclasses.replace(q, step_sums="four_lanes")  # decode steps summed as transformers' at AVX2 MKL
    return {"qwen35_hybrid": qwen35_decoder.language_model(q, qwen35.init_decoder(q, 0)),
            "qwen35_hybrid_four_lanes": qwen35_decoder.language_model(lanes, qwen35.init_decoder(lanes, 0)),
            "attention_only": AttentionDecoder(decoder=_for_backend(backbone.init_decoder(a, 0), a), spec=a)}


def _for_backend(dec: backbone.Decoder, spec: backbone.BackboneSpec) -> backbone.Decoder:
    """The attention stack as the runtime lays it out (`mot.for_backend`: unrolled on CPU); the hybrid's
    stack is a scan over its layer groups everywhere."""
    return dataclasses.replace(dec, layers=AttentionStack(spec).lay_out(dec.layers, jax.default_backend() == "cpu"))


def _prefix(lm: LanguageDecoder, batch: int, length: int) -> Prefix:
    """An all-valid prefix of `length` tokens with zero K/V (and zero window / state for the hybrid)."""
    hybrid = isinstance(lm.spec, qwen35.Qwen35Spec)
    bspec = lm.spec.backbone if hybrid else lm.spec
    layers = lm.spec.full_layers if hybrid else tuple(range(bspec.depth))
    kv = jnp.zeros((len(layers), batch, length, bspec.num_kv_heads, bspec.head_dim), jnp.float32)
    mask = jnp.ones((batch, length), bool)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    window, state = qwen35.empty_state(lm.spec, batch, jnp.float32) if hybrid else (None, None)
    return Prefix(k=kv, v=kv, hidden=None, mask=mask, positions=positions, next_position=jnp.full((batch,), length, jnp.int32),
                  last_hidden=jnp.zeros((batch, bspec.width), jnp.float32), kv_layers=layers, window=window, state=state)


def _ready_pool(lm, batch: int, capacity: int):
    p = capacity - NEW
    pool = decode.init_pool(lm, batch, p, NEW)
    req = decode.make_requests(batch, 0, list(range(batch)), budgets=[NEW] * batch, stop_ids=[-1] * batch,
                               rows=list(range(batch)))
    pool, _, _ = decode.admit(lm, pool, _prefix(lm, batch, p), req)
    return pool


def measure(batches, capacities, reps: int) -> list[dict]:
    lms = models()
    configs = [(name, c, b) for name in lms for c in capacities for b in batches]
    pools, compile_s, steps = {}, {}, {cfg: [] for cfg in configs}
    for cfg in configs:
        name, c, b = cfg
        pool = _ready_pool(lms[name], b, c)
        t0 = time.perf_counter()
        pool, tok, _ = decode.decode_step(lms[name], pool)
        jax.block_until_ready(tok)
        compile_s[cfg] = time.perf_counter() - t0
        pools[cfg] = pool
    for _ in range(reps):
        for cfg in configs:
            name = cfg[0]
            if not bool(pools[cfg].active.all()):  # keep every slot active: a fresh admission, not timed
                pools[cfg] = _ready_pool(lms[name], cfg[2], cfg[1])
            t0 = time.perf_counter()
            pools[cfg], tok, _ = decode.decode_step(lms[name], pools[cfg])
            jax.block_until_ready(tok)
            steps[cfg].append(time.perf_counter() - t0)
    out = []
    for cfg in configs:
        name, c, b = cfg
        size = decode.slot_bytes(lms[name], c - NEW, NEW)
        out.append(dict(model=name, capacity=c, batch=b, step_ms_median=1e3 * float(np.median(steps[cfg])),
                        step_ms_min=1e3 * float(np.min(steps[cfg])), compile_s=compile_s[cfg], reps=reps,
                        slot_bytes=size["total"], state_bytes=size.get("state", 0) + size.get("window", 0), kv_bytes=size["kv"]))
    return out


def table(records) -> str:
    caps = sorted({r["capacity"] for r in records})
    lines = ["| model | B | " + " | ".join(f"step ms, C = {c}" for c in caps) + " | " + " | ".join(f"slot MB, C = {c}" for c in caps) + " |",
             "|---|---|" + "---|" * (2 * len(caps))]
    by = {(r["model"], r["batch"], r["capacity"]): r for r in records}
    for m in dict.fromkeys(r["model"] for r in records):
        for b in sorted({r["batch"] for r in records}):
            ms = " | ".join(f"{by[(m, b, c)]['step_ms_median']:.1f}" for c in caps)
            mb = " | ".join(f"{by[(m, b, c)]['slot_bytes'] / 1e6:.2f}" for c in caps)
            lines.append(f"| {m} | {b} | {ms} | {mb} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.results.qwen35_decode_cost.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="result directory (results.json, table.md)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 30])
    ap.add_argument("--capacities", type=int, nargs="+", default=[256, 2048], help="slot lengths C (prefix + room)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    load_start = os.getloadavg()
    records = measure(args.batches, args.capacities, args.reps)
    env = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), cpu_count=os.cpu_count(),
               platform=platform.platform(), jax=jax.__version__, vocab=VOCAB, loadavg_start=load_start, loadavg_end=os.getloadavg(),
               timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(dict(environment=env, records=records), indent=1))
    md = table(records) + f"\n\nMachine: {json.dumps(env)}\n"
    (args.out / "table.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
