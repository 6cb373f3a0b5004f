"""One memory-adapter training step at any model size, timed: compile apart, then a few steps.

    python -m eval.memory_train_bench --preset pi05 --dtype bfloat16 --rank 16 --batch-size 2 --out DIR
    python -m eval.memory_train_bench --ckpt BASE ...        # a saved base (ours or openpi's), as training.memory

The step is `training.memory.model.make_train_step` in adapter mode, what `python -m training.memory` runs: the
frozen base in `--dtype` (bfloat16 at full size), a float32 LoRA bank on every VLM target, AdamW. Inputs are
random (B rows, Nc cameras at the SigLIP's image size, Tp prompt tokens, a T-token suffix whose answer part is
in the loss): the cost of a step does not depend on the values. Writes DIR/summary.json: load, compile and
first-run seconds, every measured step's milliseconds (the state is donated, each step waits for its metrics),
the median, the losses (finite), trainable parameter count, peak device memory when the backend reports it.

Axes (`oxygen_jax.axes`): B batch rows, Nc cameras, Px image side, Tp prompt tokens, T suffix tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.cli import OneLineParser, int_at_least
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import for_backend, init_params
from training.memory.config import TrainConfig
from training.memory.model import init_state, load_base, make_train_step
from training.memory.data import MemoryBatch, random_batch


def measure(params, batch: MemoryBatch, config: TrainConfig, steps: int) -> dict:
    """Compile (timed apart), one unmeasured run, then `steps` timed steps of the adapter train step."""
    step = make_train_step(config)
    state = init_state(config, params, step.optimizer)
    t0 = time.perf_counter()
    compiled = step.fn.lower(state, params, batch).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, metrics = compiled(state, params, batch)
    jax.block_until_ready(metrics)
    first_s = time.perf_counter() - t0
    times, losses = [], [float(metrics["loss"])]
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, params, batch)
        jax.block_until_ready(metrics)
        times.append(1e3 * (time.perf_counter() - t0))
        losses.append(float(metrics["loss"]))
    trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.trainable))
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(state.trainable)})
    return {"compile_s": compile_s, "first_run_s": first_s, "step_ms": times, "step_ms_median": float(np.median(times)),
            "losses": losses, "finite": bool(np.all(np.isfinite(losses))), "trainable_params": trainable,
            "adapter_dtypes": dtypes}


def _peak_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None
    return stats.get("peak_bytes_in_use")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m eval.memory_train_bench", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", default="tiny", choices=["tiny", "bench", "pi05"], help="random weights (seed 0)")
    model.add_argument("--ckpt", type=Path, help="a base checkpoint instead (ours or openpi's)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="the frozen base's dtype")
    p.add_argument("--rank", type=int_at_least(1), default=16, help="LoRA rank (alpha = rank)")
    p.add_argument("--batch-size", type=int_at_least(1), default=2, help="B (OxyGen's recipe: 2)")
    p.add_argument("--cameras", type=int_at_least(1), default=3, help="Nc")
    p.add_argument("--prompt-len", type=int_at_least(1), default=100, help="Tp (OxyGen: 100)")
    p.add_argument("--suffix-len", type=int_at_least(2), default=29, help="T (OxyGen: 28 inputs + 1)")
    p.add_argument("--steps", type=int_at_least(1), default=5, help="measured steps after the first run")
    p.add_argument("--out", type=Path, required=True, help="folder for summary.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    if args.ckpt is not None:
        params, what, _ = load_base(args.ckpt, args.dtype)
    else:
        params = for_backend(init_params(model_config(args.preset, dtype=args.dtype), 0))
        what = f"random '{args.preset}' weights"
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    cfg = params.config
    config = TrainConfig(steps=1000, batch_size=args.batch_size, suffix_len=args.suffix_len, rank=args.rank,
                         peak_lr=1e-4, final_lr=1e-5, warmup_steps=0)  # lr > 0 from the first step: losses move
    batch = jax.tree.map(jnp.asarray, random_batch(cfg, args.batch_size, args.cameras, args.prompt_len, args.suffix_len))
    result = measure(params, batch, config, args.steps)
    dev = jax.devices()[0]
    summary = {"model": what, "dtype": cfg.dtype, "rank": args.rank, "batch_size": args.batch_size,
               "cameras": args.cameras, "prompt_len": args.prompt_len, "suffix_len": args.suffix_len, "load_s": load_s,
               **result, "peak_bytes": _peak_bytes(), "backend": jax.default_backend(), "device_kind": dev.device_kind,
               "jax": jax.__version__, "python": platform.python_version(),
               "command": " ".join(["python", "-m", "eval.memory_train_bench", *sys.argv[1:]]),
               "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{what} in {cfg.dtype}, float32 rank-{args.rank} adapter, B={args.batch_size}: load {load_s:.1f} s, "
          f"compile {result['compile_s']:.1f} s, step {result['step_ms_median']:.1f} ms (median of {args.steps}); "
          f"losses finite: {result['finite']}")
    return 0 if result["finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
