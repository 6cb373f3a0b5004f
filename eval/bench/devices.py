"""`python -m eval.bench.devices`: the decode burst on a slot pool split over 1, 2, 4, 8 devices, and TP = 2.

    python -m eval.bench.devices --preset tiny --devices 1 2 --repeats 2                # a smoke run
    python -m eval.bench.devices --preset bench --out eval/results/cpu_devices_bench     # the recorded run

On a machine without several accelerators the devices are simulated: XLA's host platform split into
`max(--devices)` CPU devices (`--xla_force_host_platform_device_count`, set here before jax starts), which
share the machine's cores. A simulated device count therefore shows the trend of the per-device work (slots and
pool bytes per device fall as 1 / Dr, every device runs its own burst with no cross-device traffic), not a
speedup: on a 2-core CPU, 8 simulated devices run 8 programs on 2 cores.

Per device count Dr (`runtime.slot_mesh.serving_mesh(devices[:Dr])`; Dr = 1 is the one-device program with no
mesh): a pool of `--slots` slots, every slot admitted with a request of `--decode-len` tokens continuing one of
the `--robots` observation rows, then `decode_burst` of k = `--k` tokens timed warm (median of `--repeats`, each on
a freshly admitted pool), the pool's bytes on device 0 against its total, and the burst's greedy tokens, which must
equal the one-device tokens (checked; `same_tokens`).

Tensor parallelism (`--tensor-parallel T`, default 2): the same burst on a (robots = 1, model = T) mesh, and one
`Engine` frame (actions and language) on it against one device: the largest action difference and whether
the greedy tokens agree. The VLM expert's MLP and attention outputs are scaled (`--text-scale`) so that random
weights do not answer every request with one repeated token (which any equality check would pass).

`--qwen35-check` also runs Qwen3.5's hybrid pool (its conv windows and recurrent states split by slot beside the
K/V) through admissions, bursts and releases on 2 devices, at TP = 2 and with speculative decoding, against one
device (greedy tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval.bench.devices", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench", choices=["tiny", "bench", "pi05"])
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8], help="device counts Dr to measure")
    ap.add_argument("--tensor-parallel", type=int, default=2, help="T of the tensor-parallel check (1: skip it)")
    ap.add_argument("--slots", type=int, default=16, help="decode slots (a multiple of every device count)")
    ap.add_argument("--robots", type=int, default=8, help="observation rows the requests continue")
    ap.add_argument("--k", type=int, default=4, help="tokens per burst")
    ap.add_argument("--decode-len", type=int, default=16, help="each request's token budget")
    ap.add_argument("--repeats", type=int, default=5, help="timed bursts per device count (after one warm-up)")
    ap.add_argument("--text-scale", type=float, default=20.0, help="scale of the VLM expert's MLP output (0: off)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--qwen35-check", action="store_true",
                    help="also check Qwen3.5's hybrid pool (carry split by slot) on 2 devices, TP = 2 and speculative")
    ap.add_argument("--out", type=Path, default=None, help="write devices.json there")
    return ap


def _simulate(count: int) -> None:
    """Splits the host platform into `count` devices; must run before jax is imported."""
    if "jax" in sys.modules:
        raise ValueError("eval.bench.devices must set the simulated device count before jax is imported")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _varied(params, scale: float):
    """π0.5 params whose random VLM expert answers with varied tokens: attention and MLP outputs scaled up."""
    if not scale:
        return params
    layers = params.vlm.layers
    layers = dataclasses.replace(layers, q=layers.q * 3, linear=layers.linear * scale, out=layers.out * (scale / 2))
    return dataclasses.replace(params, vlm=dataclasses.replace(params.vlm, layers=layers))


def _device0_bytes(tree) -> int:
    import jax

    first = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == first)


def _burst(lm, cache, mesh, args) -> dict:
    """Warm median time of one k-token burst on a full pool, the pool's bytes on device 0, the burst's tokens."""
    import jax

    from oxygen_jax.runtime import decode

    n = args.slots
    times, tokens, pool_bytes = [], None, None
    for _ in range(args.repeats + 1):
        pool = decode.init_pool(lm, n, cache.length, args.decode_len, 0, mesh=mesh)
        req = decode.make_requests(n, 0, list(range(n)), rows=[i % args.robots for i in range(n)],
                                   budgets=[args.decode_len] * n, stop_ids=[-1] * n)
        pool, _, _ = decode.admit(lm, pool, cache, req)
        jax.block_until_ready(pool)
        pool_bytes = (_device0_bytes(pool), sum(x.nbytes for x in jax.tree.leaves(pool)))
        start = time.perf_counter()
        pool, toks = jax.block_until_ready(decode.decode_burst(lm, pool, args.k))
        times.append((time.perf_counter() - start) * 1e3)
        tokens = jax.device_get(pool.tokens)
    return dict(burst_ms=statistics.median(times[1:]), burst_ms_all=times[1:], pool_bytes_device0=pool_bytes[0],
                pool_bytes_total=pool_bytes[1], tokens=tokens.tolist())


def _engine_frames(params, obs, mesh, args) -> dict:
    """`Engine` frames with one request per robot until every request finished: actions of each frame and the
    finished tokens."""
    import jax
    import numpy as np

    from oxygen_jax.models.pi05.model import as_vla
    from oxygen_jax.runtime import slot_mesh
    from oxygen_jax.runtime.engine import Engine, EngineConfig

    vla = as_vla(params, 10)
    if mesh is not None:
        vla = slot_mesh.place_model(vla, mesh)
    eng = Engine(vla, EngineConfig(num_slots=args.slots, max_new_tokens=args.decode_len, admissions_per_frame=args.robots,
                                   tokens_per_frame=args.k, action_horizon=10), mesh=mesh)
    for r in range(args.robots):
        eng.submit(max_tokens=args.decode_len, stop_ids=(), row=r)
    actions, tokens = [], {}
    start = time.perf_counter()
    for f in range(-(-(args.decode_len - 1) // args.k) + 1):
        res = eng.step(obs, np.asarray(jax.random.normal(jax.random.key(f), (args.robots, 10, 32)), np.float32))
        actions.append(res.actions)
        tokens.update({r.request_id: r.tokens for r in res.finished})
    return dict(actions=np.stack(actions), tokens=tokens, seconds=time.perf_counter() - start)


def _qwen35_check(devices: list) -> dict:
    """Qwen3.5's hybrid pool (K/V of the full layers plus each linear layer's carry, split by slot) through a schedule
    of admissions, 2-token bursts and releases: greedy tokens on robots = 2, on TP = 2 and speculative (γ = 2) on
    robots = 2, each against one device (`qwen35_tiny`, random weights)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from oxygen_jax.models import backbone
    from oxygen_jax.models.qwen35 import model as qwen35
    from oxygen_jax.models.qwen35 import decoder as qwen35_decoder
    from oxygen_jax.runtime import decode, slot_mesh, speculative

    spec, p, q, m, slots = qwen35.preset("qwen35_tiny"), 12, 3, 8, 4
    dec = qwen35.init_decoder(spec, seed=3)
    ids = np.random.default_rng(0).integers(4, 500, (3, p)).astype(np.int32)
    mask = np.arange(p)[None] >= np.array([0, 3, 6])[:, None]
    pos = np.where(mask, np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    prefix = qwen35.prefix_pass(spec, dec, backbone.embed_tokens(spec.backbone, dec, jnp.asarray(ids)), jnp.asarray(pos),
                                jnp.asarray(mask), language=True)
    lm = qwen35_decoder.language_model(spec, dec)
    asks = {0: [(0, [5, 6], 8), (1, [], 2)], 1: [(2, [7], 8), (0, [9, 10, 11], 6)], 2: [(1, [3], 8)]}

    def run(mesh, gamma=0):
        lm_d = lm if mesh is None else slot_mesh.place_model(lm, mesh)
        pool = decode.init_pool(lm_d, slots, p, m, q, speculate=gamma, mesh=mesh)
        done, rid = {}, 0
        for f in range(8):
            new = asks.get(f, [])
            req = decode.make_requests(slots, q, list(range(rid, rid + len(new))), rows=[r for r, _, _ in new],
                                       prompts=[t for _, t, _ in new], budgets=[n for _, _, n in new],
                                       stop_ids=[-1] * len(new))
            rid += len(new)
            pool, _, _ = decode.admit(lm_d, pool, prefix, req)
            pool, _ = speculative.verify_burst(lm_d, pool, 2) if gamma else decode.decode_burst(lm_d, pool, 2)
            pool, out = decode.release_finished(pool)
            for s in np.flatnonzero(np.asarray(out.done)):
                done[int(out.request_id[s])] = np.asarray(out.tokens[s])[: int(out.num_generated[s])].tolist()
        return done

    one = run(None)
    return dict(requests=len(one), robots2=run(slot_mesh.serving_mesh(devices[:2])) == one,
                tp2=run(slot_mesh.serving_mesh(devices[:2], tensor_parallel=2)) == one,
                robots2_speculative=run(slot_mesh.serving_mesh(devices[:2]), gamma=2) == one)


def _replicated(tree, mesh):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    tp = max(args.tensor_parallel, 1)
    # XLA:CPU runs every simulated device's program on one thread pool; Qwen3.5's nested loops on a mesh that uses
    # every simulated device were seen to starve it (2 of 2 devices hung; 2 of 4 ran), so its check keeps spares.
    _simulate(max(max(args.devices), tp, 4 if args.qwen35_check else 1))

    import jax
    import numpy as np

    from oxygen_jax.ckpts import load
    from oxygen_jax.robots.config import oxygen_benchmark_robot
    from oxygen_jax.models.pi05.model import language_model, prefill
    from oxygen_jax.models.pi05.params import for_backend
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer
    from oxygen_jax.robots.transforms import make_observation, synthetic_sample
    from oxygen_jax.runtime import slot_mesh

    for d in args.devices:
        if args.slots % d:
            raise ValueError(f"--slots {args.slots} must be a multiple of every --devices count, not of {d}")
    loaded = load.load_model(None, preset=args.preset, family="pi05", dtype=args.dtype, seed=args.seed, backend="gpu")
    params = for_backend(_varied(loaded.params, args.text_scale))
    robot = oxygen_benchmark_robot("libero")
    rng = np.random.default_rng(args.seed)
    obs = make_observation(robot, loaded.config, train_demo_tokenizer(),
                           [synthetic_sample(robot, rng, image_size=224) for _ in range(args.robots)])
    cache = prefill(params, obs)
    lm = language_model(params)
    rows = []
    for d in args.devices:
        mesh = None if d == 1 else slot_mesh.serving_mesh(jax.devices()[:d])
        lm_d = lm if mesh is None else slot_mesh.place_model(lm, mesh)
        cache_d = cache if mesh is None else _replicated(cache, mesh)  # every device reads its requests' rows
        rows.append(dict(devices=d, robots_axis=d, model_axis=1, **_burst(lm_d, cache_d, mesh, args)))
    if tp > 1:
        mesh = slot_mesh.serving_mesh(jax.devices()[:tp], tensor_parallel=tp)
        rows.append(dict(devices=tp, robots_axis=1, model_axis=tp,
                         **_burst(slot_mesh.place_model(lm, mesh), _replicated(cache, mesh), mesh, args)))
    base = rows[0]["tokens"]
    for r in rows:
        r["same_tokens"] = r.pop("tokens") == base
        print(f"devices {r['devices']} (robots {r['robots_axis']} x model {r['model_axis']}): burst of {args.k} tokens "
              f"on {args.slots} slots {r['burst_ms']:.1f} ms, pool on device 0 {r['pool_bytes_device0'] / 2**20:.2f} "
              f"of {r['pool_bytes_total'] / 2**20:.2f} MiB, tokens {'equal' if r['same_tokens'] else 'DIFFER'}",
              file=sys.stderr)
    frames = None
    if tp > 1:
        one = _engine_frames(params, obs, None, args)
        split = _engine_frames(params, obs, slot_mesh.serving_mesh(jax.devices()[:tp], tensor_parallel=tp), args)
        frames = dict(tensor_parallel=tp, max_abs_action_diff=float(np.abs(split["actions"] - one["actions"]).max()),
                      max_abs_action=float(np.abs(one["actions"]).max()), same_tokens=split["tokens"] == one["tokens"],
                      tokens_compared=sum(map(len, one["tokens"].values())), seconds_one=one["seconds"],
                      seconds_tp=split["seconds"])
        print(f"TP = {tp} engine frames: max |actions - one device| {frames['max_abs_action_diff']:.2e} "
              f"(max |a| {frames['max_abs_action']:.2f}); {frames['tokens_compared']} greedy tokens "
              f"{'equal' if frames['same_tokens'] else 'DIFFER'}", file=sys.stderr)
    hybrid = None
    if args.qwen35_check:
        hybrid = _qwen35_check(jax.devices())
        print(f"Qwen3.5 hybrid pool, {hybrid['requests']} requests: greedy tokens vs one device: robots 2 "
              f"{hybrid['robots2']}, TP 2 {hybrid['tp2']}, speculative on robots 2 {hybrid['robots2_speculative']}",
              file=sys.stderr)
    record = dict(preset=args.preset, dtype=args.dtype, slots=args.slots, robots=args.robots, k=args.k,
                  decode_len=args.decode_len, text_scale=args.text_scale, backend=jax.default_backend(),
                  simulated_devices=jax.device_count(), cpu_count=os.cpu_count(), loadavg=list(os.getloadavg()),
                  bursts=rows, tensor_parallel_frames=frames, qwen35_check=hybrid)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "devices.json").write_text(json.dumps(record, indent=1) + "\n")
    ok = all(r["same_tokens"] for r in rows) and (frames is None or frames["same_tokens"])
    ok = ok and (hybrid is None or all(v for k, v in hybrid.items() if k != "requests"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
