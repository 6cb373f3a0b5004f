"""π0-FAST chunks as per-robot token streams in one decode pool, against openpi's lockstep decoding (issue 40).

    python -m eval.bench.fast --robots 1 4 8 --frames 6 --out eval/results/cpu_bench_fast
    python -m eval.bench.fast --size full --robots 1 4 8 --frames 5 --out results/gpu_bench_fast   # a GPU

Same weights (random), same frames (observations and chunk lengths) for every setting, in one process:

    ours              `runtime.action_streams`: one prefix pass, each robot's stream admitted into the pool, language
                      requests beside it, bursts of k steps until every robot's chunk has ended (each row stops on
                      its own and frees its slot); the engine's programs
    lockstep          openpi's `sample_actions` rule (`pi0_fast_decode`): right-aligned prefill, one loop over every
                      row until all rows emit EOS in the same step or `--max-tokens` steps pass; no language
    lockstep_longest  the same loop stopped when the frame's longest chunk ends: the best a lockstep loop can do

Random weights write no "Action: ... |" and no EOS, so a frame's chunk lengths are drawn per robot from
[`--min-tokens`, `--max-tokens`] (FAST chunks vary with the motion) and `ours` ends row i after its length (a
row's token budget: the same device work as its EOS at that step); lockstep rows never stop early, exactly as with
openpi's rule when rows end at different steps. Chunks are therefore not decoded to actions here (their tokens are
random); `eval.parity` and tests/test_pi0_fast_streams check the tokens and the chunks.

Per (setting, N robots), over the measured frames after one warm-up frame: chunk latency p50 / p90 (ms: the
frame's observation in to every chunk of the frame on the host; all of a frame's chunks arrive together),
actions Hz (N x Ha actions per median frame), decode steps per frame, language tokens / s (ours: `--language`
requests of `--language-tokens` tokens per frame, greedy, continuing the robots' prefixes), and the programs
compiled after warm-up (must be 0). Compile time is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np

from oxygen_jax.models.decoded_actions import ActionStream
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.pi05 import pi0_fast, pi0_fast_decode
from oxygen_jax.models.pi05.config import ExpertConfig, Pi0FastConfig, fast_config
from oxygen_jax.models.pi05.params import for_backend, init_params
from oxygen_jax.models.vision.siglip import SiglipConfig
from oxygen_jax.runtime import action_streams, decode
from oxygen_jax.runtime.scheduler import Scheduler, Ticket

SETTINGS = ("ours", "lockstep", "lockstep_longest")
CAMERAS, PROMPT_LEN, HORIZON, ACTION_DIM = 3, 48, 10, 8  # openpi's π0-FAST inputs; DROID's chunk (10 x 8)


def model_config(size: str) -> Pi0FastConfig:
    """'bench': a CPU-sized PaliGemma (512 x 6 Gemma, 384 x 4 SigLIP at 112 px, 16k vocabulary); 'full': openpi's."""
    if size == "full":
        return fast_config("pi0_fast")
    return Pi0FastConfig(vlm=ExpertConfig(width=512, depth=6, mlp_dim=2048, num_heads=8, num_kv_heads=1, head_dim=64),
                         siglip=SiglipConfig(width=384, depth=4, mlp_dim=1536, num_heads=6, image_size=112),
                         vocab_size=16384)


def _frames(config: Pi0FastConfig, n: int, count: int, args, rng) -> list[tuple[Observation, np.ndarray]]:
    """`count` frames of n robots: (observation, chunk length per robot)."""
    s, out = config.siglip.image_size, []
    for _ in range(count):
        tokens = np.zeros((n, PROMPT_LEN), np.int32)
        for i in range(n):
            k = int(rng.integers(PROMPT_LEN * 2 // 3, PROMPT_LEN + 1))
            tokens[i, :k] = rng.integers(3, config.vocab_size, k)
            tokens[i, 0] = 2
        obs = Observation(images=rng.uniform(-1, 1, (n, CAMERAS, s, s, 3)).astype(np.float32),
                          image_masks=np.ones((n, CAMERAS), bool), tokens=tokens, token_mask=tokens > 0)
        out.append((jax.device_put(obs), rng.integers(args.min_tokens, args.max_tokens + 1, n)))
    return out


def _unread(tokens):  # never called with budget-ended rows (no stop id): their tokens are random
    raise ValueError("random weights write no FAST chunk")


class _Ours:
    """The engine's stream frames on one pool, language requests queued beside the robots (`action_streams`)."""

    def __init__(self, vla, n: int, args):
        self.vla, self.n, self.args = vla, n, args
        slots = n + args.language
        self.streams = action_streams.Streams(vla.action_stream, action_streams.StreamConfig(slots=n), num_slots=slots,
                                              max_new_tokens=max(args.max_tokens, args.language_tokens),
                                              prompt_capacity=1, tokens_per_frame=args.k)
        self.sched = Scheduler(slots, max(args.language, 1), 1, reserved=n)
        self.pool = decode.init_pool(vla.language(), slots, CAMERAS * (vla.spec.backbone.vision.image_size // 14) ** 2
                                     + PROMPT_LEN, self.streams.max_tokens, 1)
        self.next_id, self.frame = 0, 0

    def run(self, obs, lengths) -> dict:
        for i in range(self.args.language):  # this frame's language requests, on the robots in turn
            self.sched.enqueue(Ticket.make(self.next_id, budget=self.args.language_tokens, row=i % self.n, prompt=[2]))
            self.next_id += 1
        rows = list(range(self.n))
        requests, evict = self.sched.offer(rows)
        streams = decode.make_requests(self.n, 1, [action_streams.STREAM_ID_BASE + i for i in rows], rows=rows,
                                       budgets=[int(x) for x in lengths])
        start = time.perf_counter()
        self.pool, out, chunks = self.streams.run(self.vla, self.pool, obs, rows, requests, evict, streams=streams)
        ms = (time.perf_counter() - start) * 1e3
        events = self.sched.absorb(out, self.frame)
        self.frame += 1
        done = [len(chunks.tokens.get(i, ())) == lengths[i] for i in rows]  # every chunk ended at its own length
        return dict(ms=ms, steps=chunks.steps, language_tokens=sum(len(t) for t in events.emitted.values()),
                    chunks_ended=int(sum(done)))


def _lockstep(params, obs, cap: int, steps: int) -> dict:
    start = time.perf_counter()
    out = pi0_fast_decode.decode(params, pi0_fast_decode.prefill(params, obs, cap), steps)
    jax.block_until_ready(out.tokens)
    return dict(ms=(time.perf_counter() - start) * 1e3, steps=int(out.num_steps), language_tokens=0,
                chunks_ended=obs.tokens.shape[0])


def _compiled() -> int:
    fns = (action_streams.stream_frame, action_streams.close_frame, decode.decode_burst, pi0_fast_decode.prefill,
           pi0_fast_decode.decode)
    return sum(fn._cache_size() for fn in fns)


def _summary(setting: str, n: int, runs: list[dict], compile_s: float, compiled_after: int) -> dict:
    ms = np.asarray([r["ms"] for r in runs])
    med = float(np.median(ms))
    return dict(setting=setting, robots=n, frames=len(runs), chunk_ms_p50=round(med, 1),
                chunk_ms_p90=round(float(np.percentile(ms, 90)), 1), actions_hz=round(n * HORIZON * 1e3 / med, 1),
                steps_per_frame=float(np.mean([r["steps"] for r in runs])),
                language_tokens_per_s=round(sum(r["language_tokens"] for r in runs) / (ms.sum() / 1e3), 1),
                chunks_ended=sum(r["chunks_ended"] for r in runs), compile_s=round(compile_s, 2),
                compiles_after_warmup=compiled_after)


def run(args) -> list[dict]:
    config = model_config(args.size)
    params = for_backend(init_params(config, seed=args.seed))
    stream = ActionStream(horizon=HORIZON, action_dim=ACTION_DIM, stop_ids=(1,), max_tokens=args.max_tokens,
                          decode=_unread)
    vla = pi0_fast.as_vla(params, stream)
    rng = np.random.default_rng(args.seed)
    records = []
    for n in args.robots:
        frames = _frames(config, n, args.frames + 1, args, rng)
        ours = _Ours(vla, n, args)
        runners = {"ours": ours.run,
                   "lockstep": lambda obs, lengths: _lockstep(params, obs, args.max_tokens, args.max_tokens),
                   "lockstep_longest": lambda obs, lengths: _lockstep(params, obs, args.max_tokens, int(max(lengths)))}
        compile_s = {}
        for name, fn in runners.items():  # warm-up frame: compiles (timed apart)
            start = time.perf_counter()
            fn(*frames[0])
            compile_s[name] = time.perf_counter() - start
        before = _compiled()
        runs = {name: [] for name in runners}
        for obs, lengths in frames[1:]:  # settings interleaved per frame: the same machine state for each
            for name, fn in runners.items():
                runs[name].append(fn(obs, lengths))
        after = _compiled() - before
        for name in runners:
            records.append(_summary(name, n, runs[name], compile_s[name], after))
            print(json.dumps(records[-1]), flush=True)
    return records


def _environment(args) -> dict:
    return dict(args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                cpus=os.cpu_count(), load_avg=os.getloadavg(), jax=jax.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%d %H:%M"))


def _table(records: list[dict]) -> str:
    head = "| N | setting | chunk p50 ms | p90 ms | actions Hz | steps / frame | language tok/s | compiles after warm-up |"
    rows = [head, "|" + "---|" * 8]
    for r in records:
        rows.append(f"| {r['robots']} | {r['setting']} | {r['chunk_ms_p50']} | {r['chunk_ms_p90']} | {r['actions_hz']} | "
                    f"{r['steps_per_frame']:.1f} | {r['language_tokens_per_s']} | {r['compiles_after_warmup']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.bench.fast", description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("bench", "full"), default="bench")
    ap.add_argument("--robots", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--frames", type=int, default=6, help="measured frames per N (after one warm-up frame)")
    ap.add_argument("--min-tokens", type=int, default=16, help="shortest chunk (tokens) a frame draws")
    ap.add_argument("--max-tokens", type=int, default=64, help="longest chunk, and lockstep's step cap")
    ap.add_argument("--k", type=int, default=8, help="decode steps per burst")
    ap.add_argument("--language", type=int, default=2, help="language requests per frame (ours)")
    ap.add_argument("--language-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not 1 <= args.min_tokens <= args.max_tokens:
        ap.error("need 1 <= --min-tokens <= --max-tokens")
    records = run(args)
    table = _table(records)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        env = _environment(args)
        (args.out / "records.json").write_text(json.dumps(records, indent=1) + "\n")
        (args.out / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
        (args.out / "table.md").write_text(table + "\n")
    return 0 if all(r["compiles_after_warmup"] == 0 for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
