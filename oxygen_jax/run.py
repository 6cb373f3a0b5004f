"""The main job: a short robot loop on synthetic observations, actions and language together.

    python -m oxygen_jax.run                       # tiny random model, LIBERO-shaped inputs
    python -m oxygen_jax.run --preset bench --frames 5
    python -m oxygen_jax.run --ckpt /path/to/pi05_libero --robot libero --tokenizer paligemma_tokenizer.model

Every frame: a synthetic client observation (random images and state, a task prompt) goes through
the robot's input transform, is prefilled once, yields an action chunk, and serves the language
requests that are in flight (one new request every `--request-every` frames). Prints actions and
timing per frame, then a summary with compile time kept separate from steady-state frame time.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from oxygen_jax import checkpoint, transforms
from oxygen_jax.config import model_config, robot_config
from oxygen_jax.engine import Engine, EngineConfig
from oxygen_jax.params import for_backend, init_params, param_count
from oxygen_jax.tokenizer import Tokenizer, train_demo_tokenizer


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m oxygen_jax.run", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=["tiny", "bench", "pi05"], help="random-weight model size")
    ap.add_argument("--ckpt", help="openpi checkpoint (params dir or its parent); overrides --preset")
    ap.add_argument("--robot", default="libero", choices=["libero", "droid", "aloha"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16 on GPUs")
    ap.add_argument("--prompt-attention", default="bidirectional", choices=["bidirectional", "causal"])
    ap.add_argument("--frames", type=int, default=8, help="control frames to run")
    ap.add_argument("--steps", type=int, default=10, help="denoising steps per action chunk")
    ap.add_argument("--tokens-per-frame", type=int, default=4, help="k: language tokens per request per frame")
    ap.add_argument("--max-new-tokens", type=int, default=12, help="token budget per language request")
    ap.add_argument("--slots", type=int, default=4, help="decode slots (concurrent language requests)")
    ap.add_argument("--request-every", type=int, default=1, help="a new language request every N frames (0: none)")
    ap.add_argument("--task", default="pick up the black bowl and place it on the plate")
    ap.add_argument("--tokenizer", help="PaliGemma SentencePiece model; default: a tiny demo tokenizer trained offline")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    robot = robot_config(args.robot)
    if args.ckpt:
        cfg, params = checkpoint.load_openpi_params(args.ckpt, dtype=args.dtype, prompt_attention=args.prompt_attention)
        norm_stats = checkpoint.load_openpi_norm_stats(args.ckpt)
    else:
        cfg = model_config(args.preset, dtype=args.dtype, prompt_attention=args.prompt_attention)
        print(f"initialising random '{args.preset}' parameters ...", flush=True)
        params, norm_stats = init_params(cfg, args.seed), None
        print("random weights: actions and text are meaningless; this run shows the pipeline and its timing")
    params = for_backend(params)  # unrolled layer loop on CPU, scanned on accelerators
    tok = Tokenizer.from_file(args.tokenizer) if args.tokenizer else train_demo_tokenizer()
    if tok.vocab_size > cfg.vocab_size:
        raise SystemExit(f"tokenizer has {tok.vocab_size} ids but the model's vocabulary is {cfg.vocab_size}")
    print(f"model: {param_count(params) / 1e6:.1f} M params, {cfg.dtype}, prompt attention {cfg.prompt_attention}; "
          f"robot: {robot.name} ({robot.num_cameras} cameras, Ha={robot.action_horizon}); "
          f"backend {jax.default_backend()} ({jax.devices()[0].device_kind})")

    eng = Engine(params, EngineConfig(
        num_slots=args.slots, max_new_tokens=args.max_new_tokens, tokens_per_frame=args.tokens_per_frame,
        num_steps=args.steps, action_horizon=robot.action_horizon, seed=args.seed), tokenizer=tok)
    rng = np.random.default_rng(args.seed)
    frame_ms = []
    for f in range(args.frames):
        sample = transforms.synthetic_sample(robot, rng, prompt=args.task)
        obs = transforms.make_observation(robot, cfg, tok, [sample], norm_stats)  # host arrays: validated without a device round trip
        if args.request_every and f % args.request_every == 0:
            eng.submit(max_tokens=args.max_new_tokens)
        t0 = time.perf_counter()
        res = eng.step(obs)
        wall = (time.perf_counter() - t0) * 1e3
        actions = transforms.robot_outputs(robot, res.actions, transforms.client_state(robot, sample)[None], norm_stats)
        frame_ms.append(res.frame_ms)
        head = np.array2string(actions[0, 0], precision=3, suppress_small=True, max_line_width=200)
        print(f"frame {f:3d}  {wall:9.1f} ms{'  (includes compile)' if f == 0 else ''}  batch {res.batch}  "
              f"queued {res.queued}  action[0] {head}")
        for done in res.finished:
            print(f"    request {done.request_id} finished after {done.latency_frames} frames "
                  f"({done.latency_ms:.0f} ms): {done.text!r}")
    if len(frame_ms) > 1:
        steady = np.asarray(frame_ms[1:])
        med = float(np.median(steady))
        print(f"\ncompile + first frame {frame_ms[0] / 1e3:.2f} s; steady state over {len(steady)} frames: "
              f"median {med:.1f} ms, p90 {np.percentile(steady, 90):.1f} ms -> "
              f"{robot.action_horizon / med * 1e3:.1f} actions/s (Ha={robot.action_horizon})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
