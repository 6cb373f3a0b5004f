"""Our components beside OxyGen's own code at the same shapes, on the same machine, in the same run (issue 44).

    python -m eval.refs.oxygen_peer --oxygen-src DIR --oxygen-python VENV/bin/python --out eval/results/oxygen_peer_cpu

DIR is a source tree of OxyGen (a fork of openpi: `src/openpi/models/pi05.py`, `src/openpi/policies/policy.py`);
VENV is a side environment with OxyGen's pinned JAX stack (jax/jaxlib 0.5.3, flax 0.10.2, jaxtyping 0.2.36,
beartype 0.19.0, ml-dtypes 0.4.1, numpy < 2, einops, augmax, safetensors). Nothing of OxyGen is copied here: its
modules are imported from DIR and run. What its inference path imports but never calls is stood in: torch
(`openpi_refs.stand_in_torch`), the input transforms (`compose(())` applies nothing, as the stand-in) and the
PaliGemma tokenizer (it downloads a model file; the stand-in's `detokenize` returns "").

The command starts two worker processes, ours (this interpreter) and OxyGen's (VENV with DIR on its path), each
building π0.5 with the dims of our `--preset` (OxyGen's from its own config classes: `gemma_05.Config` for both
experts, SigLIP's variant table, `Pi05Config`), random weights (same shapes, not the same values: timing only),
float32, one synthetic LIBERO-like frame (`--cameras` images, `--prompt-tokens` tokens, Ha, S, N, k). Each worker
calls every component once (trace, compile, one run: reported apart as compile time; OxyGen's frame also runs its
ramp), then the driver asks them in turn, one call at a time, so only one computes at a time: `--rounds` rounds,
each component on both sides back to back (who goes first alternates), the component order reversed every other
round, `block_until_ready` on every result, the load recorded each round. Reported: medians, ours / theirs.

Components (ours: `eval.bench.roofline_measure.calls`; theirs: OxyGen's jitted `Policy` methods):

    prefill     vision + the VLM over the prefix P      | `_prefill(obs, max_decoding_steps=M)` (K/V padded to P + M)
    denoise1    one Euler step on the prefix cache      | `_sample_actions_with_kv(..., num_steps=1)`
    denoise     S steps                                 | `_sample_actions_with_kv(..., num_steps=S)`
    decode1     one decode step, 1 slot (a burst / B)   | `_generate_n_tokens` on 1 request, B tokens, / B
    decode_ns   one decode step, Ns slots               | the same on Ns stacked requests (`_stack_incremental_states`)
    frame       one continuous-batching frame, steady   | `Policy.infer_text_actions_continuous_batch`: 1 new request
                (prefix, actions, 1 admission, k steps) | (prefill, actions, text start) + the Ns - 1 resumed ones, k tokens

Both decode greedily with no stop token (OxyGen's runner leaves its temperature at 0.1; greedy here for both).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

_TAG = "@@ "  # prefix of the workers' protocol lines on stdout (anything else there is passed over)
_COMPONENTS = ("prefill", "denoise1", "denoise", "decode1", "decode_ns", "frame")
_OXYGEN_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")  # openpi's camera slots, in order
_REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
    """What both sides build and time (dims read from our preset; JSON to OxyGen's worker)."""

    vlm: dict  # width, depth, mlp_dim, num_heads, num_kv_heads, head_dim
    action_expert: dict  # the same keys
    siglip: dict  # width, depth, mlp_dim, num_heads, patch_size, image_size
    vocab_size: int
    action_dim: int  # A
    cameras: int  # Nc
    prompt_tokens: int  # Tp
    horizon: int  # Ha
    steps: int  # S
    tokens_per_request: int  # N
    tokens_per_frame: int  # k
    slots: int  # Ns = ceil((N - 1) / k): one request per frame, steady
    slot_budget: int  # M of the decode components' caches (C = P + M); OxyGen's frame reserves N, its runner's
    burst: int  # decode steps per timed decode call
    preset: str  # our `ModelConfig` preset the dims come from (our worker loads it)
    seed: int = 0


def _emit(obj) -> None:
    print(_TAG + json.dumps(obj), flush=True)


def _timed(call) -> float:
    """ms of one call, waited for."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(call())
    return (time.perf_counter() - start) * 1e3


def _serve(factories: dict, per_call: dict, info: dict, compile_s: dict | None = None) -> None:
    """Worker loop: compile every component (one call each, timed apart; `compile_s` holds first calls made
    before), then answer the driver's requests."""
    compile_s = dict(compile_s or {})
    for name in _COMPONENTS:
        compile_s.setdefault(name, _timed(factories[name]()) / 1e3)
    _emit({"ready": True, "compile_s": compile_s, **info})
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            return
        ms = _timed(factories[name]())
        _emit({"name": name, "ms": ms / per_call.get(name, 1)})


# ---------------------------------------------------------------------------------------------------- ours


def _ours(shapes: Shapes) -> None:
    import jax

    from eval.bench import roofline_measure as measure
    from oxygen_jax.ckpts import load

    vla = load.load_model(preset=shapes.preset, dtype="float32", seed=shapes.seed).vla(shapes.steps)
    plan = measure.Plan(cameras=shapes.cameras, prompt_tokens=shapes.prompt_tokens,
                        image_size=shapes.siglip["image_size"], horizon=shapes.horizon, steps=shapes.steps,
                        slots=shapes.slots, max_new_tokens=shapes.slot_budget, tokens_per_frame=shapes.tokens_per_frame,
                        gamma=0, seed=shapes.seed)
    inputs, noises, states = measure.frame_inputs(vla, plan)
    found, prefix_s = measure.calls(vla, plan, inputs, noises, states)  # runs the prefix program once
    (head,) = vla.spec.heads
    names = {"prefix": "prefill", f"step1:{head.name}": "denoise1", f"denoise:{head.name}": "denoise",
             "decode1": "decode1", "decode": "decode_ns", "frame": "frame"}
    factories = {ours: found[theirs] for theirs, ours in names.items()}
    per_call = {"decode1": measure.BURST, "decode_ns": measure.BURST}
    _serve(factories, per_call, {"prefix_len": measure.prefix_len(vla, inputs), "jax": jax.__version__},
           {"prefill": prefix_s})


# ---------------------------------------------------------------------------------------------------- OxyGen's


def _stand_in_host_modules() -> None:
    """OxyGen's policy module imports its input transforms and tokenizer, whose imports reach a downloader,
    sentencepiece and transformers; with no transforms and no detokenized text needed, both are stood in."""
    from eval.refs.openpi_refs import stand_in_torch

    stand_in_torch()
    sys.modules["torch"].nn.Module = type("Module", (), {})  # named in a return annotation of OxyGen's model.py
    transforms = types.ModuleType("openpi.transforms")
    transforms.compose = lambda fns: (lambda data: functools.reduce(lambda d, f: f(d), fns, data))
    transforms.DataTransformFn = object
    tokenizer = types.ModuleType("openpi.models.tokenizer")
    tokenizer.PaligemmaTokenizer = type("PaligemmaTokenizer", (), {"detokenize": lambda self, tokens: ""})
    sys.modules.update({"openpi.transforms": transforms, "openpi.models.tokenizer": tokenizer})


def _oxygen_model(shapes: Shapes):
    """OxyGen's Pi05 at `shapes`, built by its own config classes (random weights, float32)."""
    import jax

    import openpi.models.gemma_05 as gemma
    import openpi.models.model as model_lib
    import openpi.models.siglip as siglip
    from openpi.models import pi05_config

    # Pi05 reads its experts by variant name and SigLIP as "So400m/14": both names are pointed at our dims.
    experts = {"gemma_2b": gemma.Config(**shapes.vlm), "gemma_300m": gemma.Config(**shapes.action_expert)}
    gemma.get_config = experts.__getitem__
    gemma.PALIGEMMA_VOCAB_SIZE = shapes.vocab_size
    s = shapes.siglip
    siglip.decode_variant = lambda variant: {"width": s["width"], "depth": s["depth"], "mlp_dim": s["mlp_dim"],
                                             "num_heads": s["num_heads"], "patch_size": (s["patch_size"],) * 2}
    size = (s["image_size"],) * 2
    model_lib.IMAGE_RESOLUTION = size  # the image SigLIP is initialised on
    # preprocess_observation asks for openpi's three camera slots; the frame has `cameras` of them.
    model_lib.preprocess_observation = functools.partial(
        model_lib.preprocess_observation, image_keys=_OXYGEN_CAMERAS[:shapes.cameras], image_resolution=size)
    config = pi05_config.Pi05Config(dtype="float32", paligemma_variant="gemma_2b", action_expert_variant="gemma_300m",
                                    action_dim=shapes.action_dim, action_horizon=shapes.horizon,
                                    max_token_len=shapes.prompt_tokens)
    return config.create(jax.random.key(shapes.seed))


def _oxygen_obs(shapes: Shapes, rng: np.random.Generator) -> dict:
    """One request's observation in OxyGen's policy format (unbatched; after its input transforms)."""
    size, cams = shapes.siglip["image_size"], _OXYGEN_CAMERAS[:shapes.cameras]
    return {"image": {c: rng.uniform(-1, 1, (size, size, 3)).astype(np.float32) for c in cams},
            "image_mask": {c: np.True_ for c in cams},
            "state": np.zeros((shapes.action_dim,), np.float32),
            "tokenized_prompt": rng.integers(3, shapes.vocab_size, (shapes.prompt_tokens,)).astype(np.int32),
            "tokenized_prompt_mask": np.ones((shapes.prompt_tokens,), bool)}


def _oxygen(shapes: Shapes) -> None:
    _stand_in_host_modules()
    import jax
    import jax.numpy as jnp

    import openpi.models.model as model_lib
    from openpi.policies import policy as policy_lib

    policy = policy_lib.Policy(_oxygen_model(shapes))
    rng = np.random.default_rng(shapes.seed)
    one = jax.tree.map(lambda x: jnp.asarray(x)[None], _oxygen_obs(shapes, rng))
    obs = model_lib.Observation.from_dict(one)
    noise = jnp.asarray(rng.standard_normal((1, shapes.horizon, shapes.action_dim)), jnp.float32)
    start = time.perf_counter()
    prefill = jax.block_until_ready(policy._prefill(obs, align_right=False, max_decoding_steps=shapes.slot_budget))
    prefill_s = time.perf_counter() - start
    state1 = policy._init_incremental_state(prefill, jax.random.key(shapes.seed))
    state_ns = policy_lib._stack_incremental_states([state1] * shapes.slots)
    decode = functools.partial(policy._generate_n_tokens, tokens_to_generate=shapes.burst, PALIGEMMA_EOS_TOKEN=-1,
                               temperature=0.0)
    denoise = functools.partial(policy._sample_actions_with_kv, jax.random.key(1), obs, prefill, noise=noise)

    manager, dummy = policy.init_continuous_batching(), _oxygen_obs(shapes, rng)
    batches = []

    def frame():  # OxyGen's runner, one request per frame: the new one and every active one, k tokens each
        active = manager.get_all_active_requests()
        out = policy.infer_text_actions_continuous_batch(
            [_oxygen_obs(shapes, rng)] + [dummy] * len(active), manager, request_ids=[None] + list(active),
            steps_per_frame=shapes.tokens_per_frame, num_action_steps=shapes.steps,
            max_decoding_steps=shapes.tokens_per_request, temperature=0.0, PALIGEMMA_EOS_TOKEN=-1)
        batches.append(len(out))
        return out

    ramp = math.ceil(shapes.tokens_per_request / shapes.tokens_per_frame) + 2  # steady from frame N / k on
    ramp_s = _timed(lambda: [frame() for _ in range(ramp)]) / 1e3  # every batch size compiles on the way up
    factories = {"prefill": lambda: functools.partial(policy._prefill, obs, align_right=False,
                                                       max_decoding_steps=shapes.slot_budget),
                 "denoise1": lambda: functools.partial(denoise, num_steps=1),
                 "denoise": lambda: functools.partial(denoise, num_steps=shapes.steps),
                 "decode1": lambda: functools.partial(decode, state1),
                 "decode_ns": lambda: functools.partial(decode, state_ns),
                 "frame": lambda: frame}
    per_call = {"decode1": shapes.burst, "decode_ns": shapes.burst}
    info = {"prefix_len": int(prefill[2].shape[-1]), "jax": jax.__version__, "ramp_s": ramp_s,
            "steady_batch": batches[-1], "ramp_batches": batches[:]}
    _serve(factories, per_call, info, {"prefill": prefill_s})


def lm_head_probe(vocab: int, width: int, rows: tuple[int, ...], repeats: int = 3) -> dict:
    """ms (median) of the tied LM head's product as OxyGen writes it, `x @ table.T` (x [B, D], table [V, D]), at each
    B in `rows`: the same program under whichever JAX runs this, so two stacks' XLA:CPU can be set side by side."""
    import jax
    import jax.numpy as jnp

    table = jnp.asarray(np.random.default_rng(0).standard_normal((vocab, width), np.float32))
    head = jax.jit(lambda t, x: jnp.dot(x, t.T))
    out = {}
    for b in rows:
        x = jnp.ones((b, width), jnp.float32)
        jax.block_until_ready(head(table, x))
        out[b] = float(np.median([_timed(functools.partial(head, table, x)) for _ in range(repeats)]))
    return {"jax": jax.__version__, "vocab": vocab, "width": width, "ms": out}


# ---------------------------------------------------------------------------------------------------- driver


def shapes_from_preset(preset: str, args: argparse.Namespace) -> Shapes:
    """The workload at our preset's dims (our venv: reads `ModelConfig` and the benchmark robot)."""
    from eval.bench import roofline_measure as measure
    from oxygen_jax.models.pi05.config import model_config
    from oxygen_jax.robots.config import oxygen_benchmark_robot

    config, robot = model_config(preset), oxygen_benchmark_robot(args.workload)
    slots = max(1, math.ceil((args.N - 1) / args.k))
    # Our decode pools carry on across the rounds: M covers every burst and a frame slot's lifetime.
    plan = measure.Plan(cameras=robot.num_cameras, prompt_tokens=robot.max_token_len, image_size=config.siglip.image_size,
                        horizon=robot.action_horizon, steps=args.S, slots=slots, max_new_tokens=args.N,
                        tokens_per_frame=args.k, gamma=0, repeats=args.rounds)
    return Shapes(vlm=dataclasses.asdict(config.vlm), action_expert=dataclasses.asdict(config.action_expert),
                  siglip=dataclasses.asdict(config.siglip), vocab_size=config.vocab_size, action_dim=config.action_dim,
                  cameras=robot.num_cameras, prompt_tokens=robot.max_token_len, horizon=robot.action_horizon,
                  steps=args.S, tokens_per_request=args.N, tokens_per_frame=args.k, slots=slots,
                  slot_budget=measure.needed_tokens(plan), burst=measure.BURST, preset=preset, seed=args.seed)


class _Worker:
    """One worker process and its protocol lines."""

    def __init__(self, side: str, python: str, shapes: Shapes, env: dict, log):
        cmd = [python, "-m", "eval.refs.oxygen_peer", "--worker", side, "--shapes", json.dumps(dataclasses.asdict(shapes))]
        self.side = side
        self.proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, bufsize=1)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(_TAG):
                return json.loads(line[len(_TAG):])
        raise SystemExit(f"the {self.side} worker exited (code {self.proc.wait()}) before answering; see worker.log")

    def ask(self, name: str) -> float:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self.read()["ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


def _quantiles(xs) -> list[float]:
    return [float(np.percentile(xs, q)) for q in (25, 50, 75)]


def drive(args: argparse.Namespace) -> dict:
    """Start both workers (ours, then OxyGen's, each compiling alone), run the interleaved rounds, summarise."""
    from eval.bench import harness

    shapes = shapes_from_preset(args.preset, args)
    src = args.oxygen_src.resolve()
    theirs_env = {**os.environ, "JAX_PLATFORMS": "cpu",
                  "PYTHONPATH": os.pathsep.join([str(src / "src"), str(src / "packages/openpi-client/src"), str(_REPO)])}
    ours_env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(_REPO)}
    if args.compile_cache:  # a persistent compilation cache per side: a rerun loads its programs instead of compiling
        for side, env in (("ours", ours_env), ("oxygen", theirs_env)):
            env.update(JAX_COMPILATION_CACHE_DIR=str(args.compile_cache.resolve() / side),
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": "python -m eval.refs.oxygen_peer " + " ".join(sys.argv[1:]),
              "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": harness._git_commit(), "oxygen_commit": args.oxygen_commit or _oxygen_commit(src), "cpu_model": harness._cpu_model(),
              "cores": os.cpu_count(), "python": platform.python_version(), "shapes": dataclasses.asdict(shapes),
              "compile_cache": str(args.compile_cache) if args.compile_cache else None,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "loadavg_start": list(os.getloadavg())}
    workers = {}
    with open(args.out / "worker.log", "w") as log:
        try:
            for side, python, env in (("ours", sys.executable, ours_env), ("oxygen", args.oxygen_python, theirs_env)):
                workers[side] = _Worker(side, python, shapes, env, log)
                record[f"{side}_setup"] = workers[side].read()
                print(f"{side} ready: {record[f'{side}_setup']}", file=sys.stderr)
            times = {side: {c: [] for c in _COMPONENTS} for side in workers}
            loads = []
            for r in range(args.rounds):
                order = _COMPONENTS if r % 2 == 0 else _COMPONENTS[::-1]
                for i, name in enumerate(order):
                    pair = ("ours", "oxygen") if (r + i) % 2 == 0 else ("oxygen", "ours")
                    for side in pair:
                        times[side][name].append(workers[side].ask(name))
                loads.append(list(os.getloadavg()))
                print(f"round {r + 1}/{args.rounds}, load {loads[-1][0]:.2f}: " + ", ".join(
                    f"{c} {times['ours'][c][-1]:.0f}/{times['oxygen'][c][-1]:.0f}" for c in _COMPONENTS), file=sys.stderr)
        finally:
            for w in workers.values():
                w.close()
    record |= {"loadavg_rounds": loads, "loadavg_end": list(os.getloadavg()), "times_ms": times,
               "summary": {c: _summary(times["ours"][c], times["oxygen"][c]) for c in _COMPONENTS}}
    return record


def _summary(ours: list[float], theirs: list[float]) -> dict:
    """Medians and the ratio of medians, with the p25-p75 of the per-round ratios (each round's pair ran back to back)."""
    paired = np.asarray(ours) / np.asarray(theirs)
    return {"ours_ms": float(np.median(ours)), "oxygen_ms": float(np.median(theirs)),
            "ratio": float(np.median(ours) / np.median(theirs)), "paired_ratio_p25_p50_p75": _quantiles(paired)}


def _oxygen_commit(src: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True)
    return out.stdout.strip() or "unknown (not a git work tree)"


_LABELS = {"prefill": "prefill (vision + VLM over P)", "denoise1": "one denoise step (+ prepare)",
           "denoise": "denoise, S steps", "decode1": "decode step, 1 slot", "decode_ns": "decode step, Ns slots",
           "frame": "continuous frame"}
_TARGETS = {"frame": 0.5}  # issue 44: every component at most 0.7x the peer's time, the frame under 0.5x


def report_lines(record: dict) -> list[str]:
    """The markdown table of one run."""
    s, lines = record["shapes"], []
    lines += [f"- {record['timestamp']} (UTC); ours at commit `{record['commit']}`, OxyGen at `{record['oxygen_commit']}`",
              f"- {record['cpu_model']}, {record['cores']} cores; load (1 / 5 / 15 min) "
              f"{', '.join(f'{x:.2f}' for x in record['loadavg_start'])} at the start, "
              f"{', '.join(f'{x:.2f}' for x in record['loadavg_end'])} at the end; 1-min load per round: "
              f"{', '.join(f'{x[0]:.1f}' for x in record['loadavg_rounds'])}",
              f"- P = {record['ours_setup']['prefix_len']} (ours) / {record['oxygen_setup']['prefix_len']} (OxyGen), "
              f"S = {s['steps']}, Ha = {s['horizon']}, N = {s['tokens_per_request']}, k = {s['tokens_per_frame']}, "
              f"Ns = {s['slots']}; OxyGen's steady frame batch {record['oxygen_setup']['steady_batch']}; "
              f"{len(record['loadavg_rounds'])} rounds", "",
              "| component | ours ms | OxyGen ms | ours / OxyGen | per-round ratio p25-p75 | target | met |",
              "|---|---|---|---|---|---|---|"]
    for name, v in record["summary"].items():
        target = _TARGETS.get(name, 0.7)
        met = v["ratio"] < target if name in _TARGETS else v["ratio"] <= target
        q = v["paired_ratio_p25_p50_p75"]
        lines.append(f"| {_LABELS[name]} | {v['ours_ms']:.1f} | {v['oxygen_ms']:.1f} | {v['ratio']:.2f} | "
                     f"{q[0]:.2f}-{q[2]:.2f} | {'<' if name in _TARGETS else '≤'} {target} | {'yes' if met else 'no'} |")
    comp = lambda side: ", ".join(f"{c} {record[f'{side}_setup']['compile_s'][c]:.1f}" for c in _COMPONENTS)  # noqa: E731
    lines += ["", f"First calls (trace, compile, one run), s: ours {comp('ours')}; OxyGen {comp('oxygen')}, "
                  f"its frame ramp {record['oxygen_setup']['ramp_s']:.1f} (batches {record['oxygen_setup']['ramp_batches']})."]
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.refs.oxygen_peer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--oxygen-src", type=Path, help="OxyGen's source tree (src/openpi, packages/openpi-client)")
    p.add_argument("--oxygen-python", help="the side environment's python (OxyGen's JAX stack)")
    p.add_argument("--oxygen-commit", help="the commit the tree was exported from (default: git rev-parse in it)")
    p.add_argument("--preset", default="bench", help="our π0.5 preset whose dims both sides build (default bench)")
    p.add_argument("--workload", default="libero", choices=("libero", "droid", "aloha"))
    p.add_argument("--S", type=int, default=10, help="Euler steps")
    p.add_argument("--N", type=int, default=30, help="tokens per request")
    p.add_argument("--k", type=int, default=5, help="decode steps per frame")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-cache", type=Path, help="persistent compilation caches here (DIR/ours, DIR/oxygen); "
                                                      "first calls then measure loading, not compiling")
    p.add_argument("--out", type=Path, help="write oxygen_peer.json and report.md here")
    p.add_argument("--lm-head-probe", metavar="V,D,B1,B2", help="only time x @ table.T (table [V, D], x [B, D]) at "
                                                             "each B under this interpreter's JAX and print it")
    p.add_argument("--worker", choices=("ours", "oxygen"), help=argparse.SUPPRESS)
    p.add_argument("--shapes", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        shapes = Shapes(**json.loads(args.shapes))
        (_ours if args.worker == "ours" else _oxygen)(shapes)
        return 0
    if args.lm_head_probe:
        vocab, width, *rows = (int(v) for v in args.lm_head_probe.split(","))
        print(json.dumps(lm_head_probe(vocab, width, tuple(rows))))
        return 0
    for flag in ("oxygen_src", "oxygen_python", "out"):
        if getattr(args, flag) is None:
            raise SystemExit(f"python -m eval.refs.oxygen_peer: --{flag.replace('_', '-')} is required")
    if not (args.oxygen_src / "src/openpi/models/pi05.py").is_file():
        raise SystemExit(f"--oxygen-src {args.oxygen_src} has no src/openpi/models/pi05.py: pass OxyGen's source tree")
    record = drive(args)
    from eval.bench import harness

    harness.write_json(args.out / "oxygen_peer.json", record)
    text = "\n".join(["# Our components beside OxyGen's code", ""] + report_lines(record)) + "\n"
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
