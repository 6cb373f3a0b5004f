"""The main job: a robot control loop that acts and talks from one prefix cache per frame.

    python -m oxygen_jax.run                                   # the embedded demo (see below)
    python -m oxygen_jax.run --frames 24 --tokens-per-frame 2  # slower text, more requests in flight
    python -m oxygen_jax.run --preset tiny --prompt "Subtask: "   # random weights, synthetic observations
    python -m oxygen_jax.run --ckpt /path/to/pi05_libero --robot libero --tokenizer paligemma_tokenizer.model
    python -m oxygen_jax.run --ckpt ../shared/fixtures/xr0_tiny --image-size 64   # XR0 / StarVLA: its own head
    python -m oxygen_jax.run --ckpt QWEN3_VL_DIR --heads xr0,gr00t --image-size 64   # bare backbone + random heads
    python -m oxygen_jax.run --ckpt QWEN3_DIR --prompt-tokens 5,6       # bare backbone, no tokenizer: language only

`--ckpt` takes every model a checkpoint directory holds (`command_model`): π0.5, Xiaomi-Robotics-0, StarVLA,
or a bare Qwen3 / Qwen3-VL / Qwen3.5 backbone (language only, or `--heads` kinds sized to it, random weights).
Observations are synthetic client samples turned into model inputs by the server's codec
(`serving.codec.make_codec`); each frame prints every head's first action and each finished request's text
(token ids for a model without a tokenizer, whose requests are `--prompt-tokens`). Requests stop at the
model's own stop ids (random weights: at their token budget).

Every frame one observation (two cameras, state, task prompt) goes through the robot's input
transform and is prefilled once; the action head(s) denoise an action chunk from that prefix cache,
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
import dataclasses
import sys
from pathlib import Path

import numpy as np

from oxygen_jax import command_model as cm
from oxygen_jax.cli import OneLineParser, add_chunk_flags, add_kv_cache_flag, add_quant_matmul_flag, add_vision_heads_flag, \
    existing, float_in, int_at_least, pool_tokens, stream_config
from oxygen_jax.nn import quant

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
    m.add_argument("--preset", default=None, choices=["tiny", "bench", "pi05", "pi0", "pi0_tiny"],
                   help="random weights of this size on synthetic observations (pi0, pi0_tiny: π0 with its state "
                        "token; default: the embedded demo)")
    m.add_argument("--demo", type=existing("dir"), default=None,
                   help="a demo folder (default: checkpoints/demo, the embedded default)")
    m.add_argument("--ckpt", type=existing("dir"),
                   help="any model checkpoint directory: π0.5 (openpi's, params dir or its parent, or one saved by "
                        "oxygen_jax), Xiaomi-Robotics-0 or StarVLA (its own head), or a bare Hugging Face Qwen3 / "
                        "Qwen3-VL / Qwen3.5 backbone (language only, or --heads); replaces --preset")
    m.add_argument("--heads", metavar="KINDS", type=cm.parse_heads,
                   help="random action heads on a bare backbone --ckpt (without --ckpt: a random Qwen3-VL backbone): "
                        "comma-separated xr0, starvla, gr00t (Qwen3.5: starvla, gr00t), sized to the backbone; "
                        "'tiny' / 'bench' = all three at that size")
    m.add_argument("--head-size", choices=list(cm.SIZES), help="--heads KINDS: the heads' own size (default tiny)")
    m.add_argument("--image-size", type=int_at_least(1), default=224,
                   help="Qwen-backbone models: camera images resized to this square size (a multiple of patch x "
                        "merge px; default: 224)")
    m.add_argument("--prompt-len", type=int_at_least(1), default=None,
                   help="Qwen-backbone models: tokens per observation row, image tokens included (default: image "
                        "tokens + 48)")
    m.add_argument("--action-mask", metavar="FILE",
                   help="Xiaomi-Robotics-0: the robot's [Ha, Ad] 0/1 action mask (.npy or .json; see serve --help)")
    add_vision_heads_flag(m)
    m.add_argument("--robot", default="libero", choices=["libero", "droid", "aloha"], help="workload (default: libero)")
    m.add_argument("--dtype", default="auto", choices=list(cm.DTYPES),
                   help="parameters and activations (default auto: bfloat16 on GPUs, float32 on CPUs)")
    add_quant_matmul_flag(m)
    m.add_argument("--prompt-attention", default="bidirectional", choices=["bidirectional", "causal"],
                   help="openpi's bidirectional prompt, or OxyGen's causal variant")
    m.add_argument("--tokenizer", type=_tokenizer_file,
                   help="π models: a PaliGemma SentencePiece model (default: tokenizer.model in or beside --ckpt; a π "
                        "checkpoint without one is refused; random presets use a tiny demo tokenizer trained offline); "
                        "'demo': that demo tokenizer as an explicit stand-in; Qwen backbones: a tokenizer.json "
                        "(default: the one in or beside --ckpt; without one, requests are token ids: --prompt-tokens)")
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
    t.add_argument("--prompt-tokens", type=_token_ids, default=None, metavar="IDS",
                   help="the request's prompt as comma-separated token ids instead of --prompt text (a model without "
                        "a tokenizer: default none, the request continues the observation)")
    t.add_argument("--request-every", type=int_at_least(0), default=1,
                   help="a new language request every N frames; 0: actions only (default: 1)")
    t.add_argument("--max-new-tokens", type=int_at_least(1), default=None,
                   help="token budget per request (default: the demo's, else 12)")
    t.add_argument("--tokens-per-frame", type=int_at_least(1), default=4,
                   help="k: tokens each running request advances per frame (default: 4)")
    t.add_argument("--slots", type=int_at_least(1), default=4,
                   help="decode slots: requests decoding at once; more wait in a FIFO queue (default: 4)")
    t.add_argument("--temperature", type=float_in(0.0), default=0.0, help="0 = greedy (default)")
    t.add_argument("--speculate", type=int_at_least(0), default=0, metavar="GAMMA",
                   help="speculative decoding: up to GAMMA draft tokens checked per step, from each robot's earlier "
                        "answers; --tokens-per-frame then counts verify steps (default: 0, off)")
    t.add_argument("--verify-cost", type=float_in(1.0), default=1.0, metavar="C",
                     help="with --speculate: k counts decode steps and a verify step with drafts costs C of them "
                          "(about 1 on a GPU, 1.5-2 on a CPU: keeps the frame time; default: 1)")
    add_kv_cache_flag(t)
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="persistent compilation cache (default: $OXYGEN_JAX_CACHE_DIR or ~/.cache/oxygen_jax/xla)")
    ap.add_argument("--no-cache", action="store_true", help="do not use the persistent compilation cache")
    add_chunk_flags(ap)
    return ap


def _tokenizer_file(text: str) -> str:
    return text if text == cm.DEMO_TOKENIZER else existing("file")(text)


def _token_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 5,17,9, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {text!r}")
    return ids


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
    if args.demo is not None and (args.preset or args.ckpt or args.heads):
        parser.error("--demo cannot be combined with --preset, --ckpt or --heads")
    if args.preset and (args.ckpt or args.heads):
        parser.error(f"give --preset or {'--ckpt' if args.ckpt else '--heads'}, not both")
    if args.prompt is not None and args.prompt_tokens is not None:
        parser.error("give --prompt (text) or --prompt-tokens (ids), not both")
    demo_mode = args.preset is None and args.ckpt is None and args.heads is None
    if demo_mode and args.tokenizer:
        parser.error("--tokenizer applies to --preset / --ckpt / --heads; the demo brings its own")
    print(_DEMO_LINE if demo_mode else _RANDOM_LINE if args.ckpt is None else
          f"oxygen_jax main job: checkpoint {args.ckpt}", flush=True)

    import jax

    from oxygen_jax.runtime import compile_cache
    from oxygen_jax.robots import transforms
    from oxygen_jax.robots.config import robot_config
    from oxygen_jax.robots.io import RobotIO
    from oxygen_jax.runtime.engine import Engine, EngineConfig, RequestError
    from oxygen_jax.nn.layers import param_count
    from oxygen_jax.serving.codec import make_codec

    cache = None if args.no_cache else compile_cache.enable(args.cache_dir)
    bank, adapter_names, adapter, truths, rows, stops = None, (), 0, None, {}, None
    if demo_mode:
        from oxygen_jax.demo import DEMO_DIR, load_demo, normalize_answer

        try:
            demo = load_demo(args.demo or DEMO_DIR)
        except (ValueError, OSError) as e:
            return _fail(f"cannot load the embedded demo ({args.demo or DEMO_DIR}): {str(e).splitlines()[0]}")
        vla, toks, robot, io = demo.vla(args.steps), cm.Tokenizers(demo.tokenizer, demo.tokenizer), demo.robot, RobotIO()
        bank, adapter_names, adapter = demo.bank, demo.adapter_names, demo.adapter_names[0]
        samples, truths = demo.samples(), [f["memory"] for f in demo.frames]
        prompt, max_new = args.prompt or demo.prompt, args.max_new_tokens or demo.max_new_tokens
        what, dtype = f"embedded demo ({args.demo or DEMO_DIR}), adapter {adapter!r}", demo.config.dtype
    else:
        robot, samples = robot_config(args.robot), None
        try:
            cm.check_flags(args.ckpt, {"--heads": bool(args.heads), "--head-size": bool(args.head_size),
                                       "--action-mask": bool(args.action_mask),
                                       "--vision-heads": args.vision_heads is not None,
                                       "--prompt-attention": args.prompt_attention != "bidirectional"})
            mask = cm.read_action_mask(args.action_mask)
        except ValueError as e:
            return _fail(str(e))
        where, dtype = f"--ckpt {args.ckpt}: " if args.ckpt else "", cm.resolve_dtype(args.dtype)
        try:  # params laid out for the backend: unrolled layer loop on CPU, scanned on accelerators
            model = cm.load(args.ckpt, heads=args.heads, size=args.head_size, preset=args.preset, dtype=dtype,
                            seed=args.seed, prompt_attention=args.prompt_attention, action_mask=mask,
                            vision_heads=args.vision_heads)
        except (ValueError, OSError) as e:
            return _fail(f"{where}{str(e).splitlines()[0]}")
        for note in model.io.notes:
            print(f"note: {note}", flush=True)
        try:
            toks = cm.tokenizers(model, args.tokenizer)
        except (ValueError, OSError) as e:
            where = f"--tokenizer {args.tokenizer}: " if args.tokenizer else ""
            return _fail(f"{where}{str(e).splitlines()[0]}")
        io, what = model.io, model.what
        try:  # the robot's chunk shape (π0-FAST: from openpi's config for this robot) is refused in one line
            vla, robot = model.vla(args.steps, tokenizer=toks.rows, robot=robot), io.robot(robot)
            rows = cm.prompt_rows(model, toks.rows, robot, args.image_size, args.prompt_len)
        except ValueError as e:
            return _fail(str(e).splitlines()[0])
        if not rows and args.prompt_len:  # observation rows: --prompt-len is the prompt's own tokens
            robot = robot.replace(max_token_len=args.prompt_len)
        stops = () if model.source == "preset" else None  # random weights: decode to the budget
        prompt, max_new = args.prompt if args.prompt is not None else "Subtask: ", args.max_new_tokens or 12
        if toks.text is None:
            if args.prompt is not None:
                return _fail("--prompt is text and this model has no tokenizer: pass --tokenizer tokenizer.json, or "
                             "--prompt-tokens ids")
            print(f"note: {toks.note}; requests continue the observation with --prompt-tokens "
                  f"{list(args.prompt_tokens or ())} and print token ids", flush=True)
        rng = np.random.default_rng(args.seed)
    ids = args.prompt_tokens if args.prompt_tokens is not None else None if toks.text is not None else ()
    shown = prompt if ids is None else list(ids)
    heads = {n: vla.action_shape(n, robot.action_horizon) for n in vla.heads}
    if vla.action_stream is not None:  # the decoder writes the chunk (π0-FAST)
        heads = {vla.action_stream.name: vla.action_stream.shape}
    try:  # --chunk-* for a model whose actions are no decoded chunks is refused in one line
        streams = stream_config(args, vla)
    except ValueError as e:
        return _fail(str(e))
    try:  # quantized weights: the matmul mode for this device, or a forced one it has
        params, matmul = quant.start_matmul(vla.params, args.quant_matmul, jax.devices()[0])
    except ValueError as e:
        return _fail(str(e))
    vla = dataclasses.replace(vla, params=params)
    print(f"model: {what}, {param_count(vla.params) / 1e6:.1f} M params, {dtype}{'; ' + matmul if matmul else ''}; "
          f"robot: {robot.name} "
          f"({robot.num_cameras} cameras); heads: "
          + (", ".join(f"{n} [{ha} x {ad}]" for n, (ha, ad) in heads.items()) or "none (language only)")
          + f"; backend {jax.default_backend()} ({jax.devices()[0].device_kind})")

    try:  # e.g. --kv-cache int8 for a model whose action chunks decode in the pool: one line
        eng = Engine(vla, EngineConfig(
            num_slots=args.slots, max_new_tokens=pool_tokens(vla, max_new, args.chunk_max_tokens),
            prompt_capacity=max(len(ids) if ids is not None else len(toks.text.encode(prompt)), 1),
            tokens_per_frame=args.tokens_per_frame, speculate=args.speculate, verify_cost=args.verify_cost,
            action_horizon=robot.action_horizon, kv_cache=args.kv_cache,
            seed=args.seed), tokenizer=toks.text, bank=bank, adapter_names=adapter_names, streams=streams)
    except ValueError as e:
        return _fail(str(e))
    codec = make_codec(eng, robot, toks.rows, io=io, **rows)  # the server's: client sample -> model rows

    def observation(f: int):
        if samples is not None:  # the demo's held-out frames, in a loop
            sample = samples[f % len(samples)]
        else:
            sample = transforms.synthetic_sample(robot, rng, prompt=args.task,
                                                 image_size=rows.get("image_size", 224))
        return sample, codec.batch([codec.prepare(sample)], 1)

    sample, (obs, states) = observation(0)
    denoise = f"{'/'.join(str(n) for n in sorted({vla.spec.head(h).num_steps for h in vla.heads}))} denoise steps"
    if vla.action_stream is not None:
        denoise = "the chunk's tokens decoded in the pool"
    print(f"compiling the frame program (prefill + {denoise if heads else 'no head'} + admission + "
          f"{args.tokens_per_frame}-token decode) ...", end=" ", flush=True)
    compile_s = eng.warmup(obs, states)
    print(f"{compile_s:.1f} s" + (f" (persistent cache: {cache})" if cache else ""), flush=True)

    names = list(heads)
    print("\nlegend: frame = control frame; ms = frame time, observation in -> actions and new tokens on the host;\n"
          "        decoding = language requests that advanced this frame (one batched decode); queued = waiting for a\n"
          f"        slot; action[0] = first action of {'each head' if len(names) > 1 else 'the chunk'} "
          f"({_ACTION_NAMES[robot.name]}, where the head\n        has those dims; '-': no action head); a finished "
          "request prints the frame whose observation it read,\n        its latency in frames (arrival to last token), its "
          + ("text" if toks.text is not None else "token ids")
          + (",\n        and the true memory label of that frame." if truths else "."))
    print(f"{'frame':>5} {'ms':>8} {'decoding':>8} {'queued':>6}  action[0]")
    frame_ms, source, correct = [], {}, []
    for f in range(args.frames):
        if f:
            sample, (obs, states) = observation(f)
        if args.request_every and f % args.request_every == 0:
            try:
                text = dict(prompt=prompt) if ids is None else dict(prompt_tokens=list(ids))
                rid = eng.submit(**text, max_tokens=max_new, temperature=args.temperature, adapter=adapter,
                                 stop_ids=stops)
            except RequestError as e:
                return _fail(f"{'--prompt' if ids is None else '--prompt-tokens'}: {e}")
            source[rid] = f
        res = eng.step(obs, states=states)
        primary, extras = codec.outputs(res.head_actions, 0, transforms.client_state(robot, sample))
        chunks = extras.get("heads") or ({names[0]: primary} if names else {})
        frame_ms.append(res.frame_ms)
        firsts = [(n, np.array2string(np.asarray(c)[0], precision=3, suppress_small=True, max_line_width=200))
                  for n, c in chunks.items()]
        label = (lambda n: f"{n} ") if len(firsts) > 1 else (lambda n: "")
        print(f"{f:5d} {res.frame_ms:8.1f} {res.batch:8d} {res.queued:6d}  "
              + (f"{label(firsts[0][0])}{firsts[0][1]}" if firsts else "-"))
        for n, head in firsts[1:]:
            print(f"{'':33s}{n} {head}")
        for done in res.finished:
            # A request continues the observation of the frame that admitted it.
            seen = done.admit_frame
            said = repr(done.text) if toks.text is not None else f"tokens {list(done.tokens)}"
            line = (f"      request {done.request_id} (observation of frame {seen}) done after {done.latency_frames} "
                    f"frames ({done.latency_ms:.0f} ms): {shown!r} -> {said}")
            if truths:
                truth = truths[seen % len(truths)]
                ok = normalize_answer(done.text or "") == normalize_answer(truth)
                correct.append(ok)
                line += f"\n{'':6s}true label: {truth!r} {'(match)' if ok else '(MISMATCH)'}"
            print(line)
        for err in res.errors:
            print(f"      request {err.request_id} dropped: {err.reason}")
        for why in res.row_errors.values():
            print(f"      no actions this frame: {why}")
        for why in res.fallbacks.values():  # --chunk-on-failure zeros: the printed chunk is openpi's zeros
            print(f"      zero chunk this frame: {why}")
    steady = np.asarray(frame_ms)
    med = float(np.median(steady))
    horizon = heads[names[0]][0] if names else 0
    print(f"\ncompile (once, before frame 0): {compile_s:.2f} s; {len(steady)} frames: median {med:.1f} ms, "
          f"p90 {np.percentile(steady, 90):.1f} ms -> {1e3 / med:.1f} {'action chunks' if names else 'frames'}/s, action Hz "
          f"{horizon * 1e3 / med:.0f} (= {horizon} actions per chunk / frame time)")
    if correct:
        print(f"memory answers matching the true label in this run: {sum(correct)}/{len(correct)}")
        ev = demo.manifest.get("evaluation", {})
        if "exact_match" in ev:  # the figure shipped with the demo, not this run's: say so and where it is from
            when = f" on {ev['date']}" if ev.get("date") else ""
            report = Path(args.demo or DEMO_DIR) / "memory_eval.md"
            print(f"stored with the demo, not measured in this run: {100 * ev['exact_match']:.1f} % exact match over all "
                  f"{ev['n']} held-out frames (majority-label baseline {100 * ev['majority_baseline']:.1f} %),\n  from "
                  f"`python -m eval.memory_eval` when the demo was exported{when} (full report: {report})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
