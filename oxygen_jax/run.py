"""The main job: a robot control loop that acts and talks from one prefix cache per frame.

    python -m oxygen_jax.run                                   # the embedded demo (see below)
    python -m oxygen_jax.run --frames 24 --tokens-per-frame 2  # slower text, more requests in flight
    python -m oxygen_jax.run --preset tiny --prompt "Subtask: "   # random weights, synthetic observations
    python -m oxygen_jax.run --ckpt /path/to/pi05_libero --robot libero --tokenizer paligemma_tokenizer.model

Every frame one observation (two cameras, state, task prompt) goes through the robot's input
transform and is prefilled once; the action expert denoises an action chunk from that prefix cache,
and the language requests in flight (one new request every `--request-every` frames, with the
`--prompt` written after the observation) decode `--tokens-per-frame` tokens each from copies of the
same cache. Requests that do not finish keep their slot and continue next frame.

Embedded default (`checkpoints/demo`): a 2.2 M-parameter π0.5 trained in this repository on rendered
LIBERO frames — a base pre-trained to describe scenes and a suffix-only "Memory: " language adapter
that states which goal predicates are already achieved. The loop replays held-out frames (initial
states never trained on); each frame asks for a memory, and each answer is checked against that
frame's true label. Its action expert was never trained (no demonstrations exist here): the actions
show the timing, not behaviour. `--preset` runs random weights on synthetic observations instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from oxygen_jax.cli import OneLineParser, existing, float_in, int_at_least

_DEMO_LINE = (
    "embedded default: a small pi0.5 trained here on rendered LIBERO frames; a 'Memory: ' language adapter reports\n"
    "which goal predicates each held-out frame already shows, from the same prefix cache the action chunk is denoised\n"
    "from. Its actions are untrained (random): they show the timing, not behaviour.")
_RANDOM_LINE = (
    "random weights on synthetic LIBERO-shaped observations: actions and text are meaningless; the run shows one\n"
    "prefill per frame feeding both the action chunk and the language requests.")


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m oxygen_jax.run", description=__doc__.split("\n\n")[0] + "\n\n" + _DEMO_LINE,
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="Output: one line per frame (see the legend printed before the first frame), a line per "
                        "finished request, then a summary with compile time apart from steady-state frame time.")
    m = ap.add_argument_group("model")
    m.add_argument("--preset", default=None, choices=["tiny", "bench", "pi05"],
                   help="random weights of this size on synthetic observations (default: the embedded demo)")
    m.add_argument("--demo", type=existing("dir"), default=None,
                   help="a demo folder (default: checkpoints/demo, the embedded default)")
    m.add_argument("--ckpt", type=existing("dir"),
                   help="an openpi checkpoint (params dir or its parent) or one saved by oxygen_jax; replaces --preset")
    m.add_argument("--robot", default="libero", choices=["libero", "droid", "aloha"], help="workload (default: libero)")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16 on GPUs")
    m.add_argument("--prompt-attention", default="bidirectional", choices=["bidirectional", "causal"],
                   help="openpi's bidirectional prompt, or OxyGen's causal variant")
    m.add_argument("--tokenizer", type=existing("file"),
                   help="PaliGemma SentencePiece model (default: tokenizer.model beside --ckpt, else a tiny demo "
                        "tokenizer trained offline)")
    r = ap.add_argument_group("loop")
    r.add_argument("--frames", type=int_at_least(1), default=16, help="control frames to run (default: 16)")
    r.add_argument("--steps", type=int_at_least(1), default=10, help="denoising steps per action chunk (default: 10)")
    r.add_argument("--task", default="pick up the black bowl and place it on the plate",
                   help="the task instruction in the observation prompt")
    r.add_argument("--seed", type=int_at_least(0), default=0, help="weights, observations and noise (default: 0)")
    t = ap.add_argument_group("language")
    t.add_argument("--prompt", default=None,
                   help="text written after the observation for each language request (default: the demo's "
                        "'Memory: ', or 'Subtask: ' with random weights)")
    t.add_argument("--request-every", type=int_at_least(0), default=1,
                   help="a new language request every N frames; 0: actions only (default: 1)")
    t.add_argument("--max-new-tokens", type=int_at_least(1), default=None,
                   help="token budget per request (default: the demo's, else 12)")
    t.add_argument("--tokens-per-frame", type=int_at_least(1), default=4,
                   help="k: tokens each running request advances per frame (default: 4)")
    t.add_argument("--slots", type=int_at_least(1), default=4,
                   help="decode slots: requests decoding at once; more wait in a FIFO queue (default: 4)")
    t.add_argument("--temperature", type=float_in(0.0), default=0.0, help="0 = greedy (default)")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="persistent compilation cache (default: $OXYGEN_JAX_CACHE_DIR or ~/.cache/oxygen_jax/xla)")
    ap.add_argument("--no-cache", action="store_true", help="do not use the persistent compilation cache")
    return ap


def _fail(message: str) -> int:
    print(f"python -m oxygen_jax.run: error: {message}", file=sys.stderr)
    return 2


_ACTION_NAMES = {
    "libero": "dx dy dz droll dpitch dyaw grip",
    "droid": "7 joint velocities + gripper",
    "aloha": "14 joints (2 arms x 6 + grippers)",
}


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.demo is not None and (args.preset or args.ckpt):
        parser.error("--demo cannot be combined with --preset or --ckpt")
    if args.preset and args.ckpt:
        parser.error("give --preset or --ckpt, not both")
    demo_mode = args.preset is None and args.ckpt is None
    if demo_mode and args.tokenizer:
        parser.error("--tokenizer applies to --preset / --ckpt; the demo brings its own")
    print(_DEMO_LINE if demo_mode else _RANDOM_LINE if args.preset else f"oxygen_jax main job: checkpoint {args.ckpt}",
          flush=True)

    import jax

    from oxygen_jax.ckpts.load import load_model
    from oxygen_jax.runtime import compile_cache
    from oxygen_jax.robots import transforms
    from oxygen_jax.models.pi05.config import robot_config
    from oxygen_jax.models.pi05.model import as_vla
    from oxygen_jax.runtime.engine import Engine, EngineConfig, RequestError
    from oxygen_jax.nn.layers import param_count
    from oxygen_jax.robots.tokenizer import Tokenizer, train_demo_tokenizer

    cache = None if args.no_cache else compile_cache.enable(args.cache_dir)
    bank, adapter_names, adapter, truths = None, (), 0, None
    if demo_mode:
        from oxygen_jax.demo import DEMO_DIR, load_demo, normalize_answer

        try:
            demo = load_demo(args.demo or DEMO_DIR)
        except (ValueError, OSError) as e:
            return _fail(f"cannot load the embedded demo ({args.demo or DEMO_DIR}): {str(e).splitlines()[0]}")
        cfg, params, tok, robot, norm_stats = demo.config, demo.params, demo.tokenizer, demo.robot, None
        bank, adapter_names, adapter = demo.bank, demo.adapter_names, demo.adapter_names[0]
        samples, truths = demo.samples(), [f["memory"] for f in demo.frames]
        prompt, max_new = args.prompt or demo.prompt, args.max_new_tokens or demo.max_new_tokens
        what = f"embedded demo ({args.demo or DEMO_DIR}), adapter {adapter!r}"
    else:
        robot = robot_config(args.robot)
        try:  # params laid out for the backend: unrolled layer loop on CPU, scanned on accelerators
            model = load_model(args.ckpt, preset=None if args.ckpt else args.preset, family="pi05", dtype=args.dtype,
                               prompt_attention=args.prompt_attention, seed=args.seed)
        except (ValueError, OSError) as e:
            return _fail(f"--ckpt {args.ckpt}: {str(e).splitlines()[0]}")
        cfg, params, norm_stats, what = model.config, model.params, model.norm_stats, model.what
        tok_file = args.tokenizer or model.tokenizer  # else the one found beside the checkpoint
        try:
            tok = Tokenizer.from_file(tok_file) if tok_file else train_demo_tokenizer()
        except (ValueError, OSError) as e:
            return _fail(f"--tokenizer {tok_file}: {e}")
        if tok.vocab_size > cfg.vocab_size:
            return _fail(f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary is {cfg.vocab_size}; "
                         "pass the tokenizer the model was trained with (--tokenizer)")
        prompt, max_new = args.prompt if args.prompt is not None else "Subtask: ", args.max_new_tokens or 12
        rng = np.random.default_rng(args.seed)
        samples = None
    print(f"model: {what}, {param_count(params) / 1e6:.1f} M params, {cfg.dtype}; robot: {robot.name} "
          f"({robot.num_cameras} cameras, {robot.action_horizon} actions per chunk); "
          f"backend {jax.default_backend()} ({jax.devices()[0].device_kind})")

    eng = Engine(as_vla(params, args.steps), EngineConfig(
        num_slots=args.slots, max_new_tokens=max_new, prompt_capacity=max(len(tok.encode(prompt)), 1),
        tokens_per_frame=args.tokens_per_frame, action_horizon=robot.action_horizon,
        seed=args.seed), tokenizer=tok, bank=bank, adapter_names=adapter_names)

    def observation(f: int):
        if samples is not None:  # the demo's held-out frames, in a loop
            sample = samples[f % len(samples)]
        else:
            sample = transforms.synthetic_sample(robot, rng, prompt=args.task)
        return sample, transforms.make_observation(robot, cfg, tok, [sample], norm_stats)

    sample, obs = observation(0)
    print(f"compiling the frame program (prefill + {args.steps} denoise steps + admission + "
          f"{args.tokens_per_frame}-token decode) ...", end=" ", flush=True)
    compile_s = eng.warmup(obs)
    print(f"{compile_s:.1f} s" + (f" (persistent cache: {cache})" if cache else ""), flush=True)

    print("\nlegend: frame = control frame; ms = frame time, observation in -> actions and new tokens on the host;\n"
          "        decoding = language requests that advanced this frame (one batched decode); queued = waiting for a\n"
          f"        slot; action[0] = first action of the chunk ({_ACTION_NAMES[robot.name]}); a finished request\n"
          "        prints the frame whose observation it read, its latency in frames (arrival to last token), its text"
          + (",\n        and the true memory label of that frame." if truths else "."))
    print(f"{'frame':>5} {'ms':>8} {'decoding':>8} {'queued':>6}  action[0]")
    frame_ms, source, correct = [], {}, []
    for f in range(args.frames):
        if f:
            sample, obs = observation(f)
        if args.request_every and f % args.request_every == 0:
            try:
                rid = eng.submit(prompt=prompt, max_tokens=max_new, temperature=args.temperature, adapter=adapter,
                                 stop_ids=() if args.preset else None)
            except RequestError as e:
                return _fail(f"--prompt: {e}")
            source[rid] = f
        res = eng.step(obs)
        actions = transforms.robot_outputs(robot, res.actions, transforms.client_state(robot, sample)[None], norm_stats)
        frame_ms.append(res.frame_ms)
        head = np.array2string(actions[0, 0], precision=3, suppress_small=True, max_line_width=200)
        print(f"{f:5d} {res.frame_ms:8.1f} {res.batch:8d} {res.queued:6d}  {head}")
        for done in res.finished:
            # A request continues the observation of the frame that admitted it.
            seen = done.admit_frame
            line = (f"      request {done.request_id} (observation of frame {seen}) done after {done.latency_frames} "
                    f"frames ({done.latency_ms:.0f} ms): {prompt!r} -> {done.text!r}")
            if truths:
                truth = truths[seen % len(truths)]
                ok = normalize_answer(done.text or "") == normalize_answer(truth)
                correct.append(ok)
                line += f"\n{'':6s}true label: {truth!r} {'(match)' if ok else '(MISMATCH)'}"
            print(line)
        for err in res.errors:
            print(f"      request {err.request_id} dropped: {err.reason}")
    steady = np.asarray(frame_ms)
    med = float(np.median(steady))
    print(f"\ncompile (once, before frame 0): {compile_s:.2f} s; {len(steady)} frames: median {med:.1f} ms, "
          f"p90 {np.percentile(steady, 90):.1f} ms -> {1e3 / med:.1f} action chunks/s, action Hz "
          f"{robot.action_horizon * 1e3 / med:.0f} (= {robot.action_horizon} actions per chunk / frame time)")
    if correct:
        ev = demo.manifest.get("evaluation", {})
        print(f"memory answers matching the true label in this run: {sum(correct)}/{len(correct)}"
              + (f"; over all {ev['n']} held-out frames: {100 * ev['exact_match']:.1f} % "
                 f"(majority-label baseline {100 * ev['majority_baseline']:.1f} %)" if "exact_match" in ev else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
