"""Serving on several local devices: the slot pool split over a `robots` mesh axis, tensor parallelism over `model`.

The device tests run in one subprocess on 8 simulated CPU devices (`--xla_force_host_platform_device_count`
must be set before jax starts), which runs the same schedule of language requests (arriving, queueing and
finishing over 8 frames, 4 robots) through three engines and reports what the assertions below read:

    one device                 the reference
    robots = 4                 slots and observation rows split over 4 devices, speculative decoding (γ = 2)
    robots = 2 x model = 2     slots over 2 devices, weights (heads, MLP columns) and the pool's K/V over 2 more (TP = 2)

Actions agree to float32 reduction order, not bit for bit: a device multiplies a quarter of the batch (another
blocking of the same sums) and TP splits each attention-output and MLP-down sum into two partial sums added by an
all-reduce. Those reorderings move an action by tens of float32 ulps of its magnitude (measured: at most 9.5e-6
on actions of max |a| 5.4, about 20 ulps there); the bound is 1e-4 * max |a| (about 1,100 ulps), itself far below
how much actions differ between rows (asserted, so the comparison is not vacuous).
Greedy tokens must be identical (an argmax flip would need a logit gap below that rounding, absent here:
`diverse_text_params`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from oxygen_jax.models.partition import param_specs
from oxygen_jax.runtime import slot_mesh

REPO = Path(__file__).resolve().parents[1]
ACTION_RTOL = 1e-4  # of max |actions|: float32 reduction order (module docstring)

_SCRIPT = textwrap.dedent("""
    import collections, dataclasses, json, sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from helpers import diverse_text_params, make_obs
    from oxygen_jax.models.pi05.config import model_config
    from oxygen_jax.models.pi05.model import as_vla
    from oxygen_jax.models.pi05.params import init_params
    from oxygen_jax.runtime import slot_mesh
    from oxygen_jax.runtime.engine import Engine, EngineConfig

    assert jax.device_count() == 8, jax.devices()
    compiles = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *a, **k: compiles.update([event == "/jax/core/compile/backend_compile_duration"]))
    params = diverse_text_params(init_params(model_config("tiny"), 0))
    obs = make_obs(params.config, batch=4, cameras=2, lengths=[6, 9, 7, 5], seed=3)
    cfg = EngineConfig(num_slots=8, max_new_tokens=6, prompt_capacity=2, admissions_per_frame=3, tokens_per_frame=2,
                       action_horizon=4)
    # frame -> (row, budget, prompt): 12 requests on 8 slots, so some queue, and slots are reused
    arrivals = {0: [(0, 6, [3]), (1, 5, []), (2, 4, [5, 6]), (3, 6, [])], 1: [(1, 3, []), (0, 6, [7])],
                3: [(2, 6, [1, 2]), (3, 2, [])], 4: [(0, 5, []), (1, 5, []), (2, 5, []), (3, 5, [])]}

    def serve(mesh, speculate=0):
        vla = as_vla(params, 2)
        if mesh is not None:
            vla = slot_mesh.place_model(vla, mesh)
        eng = Engine(vla, dataclasses.replace(cfg, speculate=speculate), mesh=mesh)
        o = obs if mesh is None else jax.device_put(obs, NamedSharding(mesh, P("robots")))
        tokens, actions, per_frame = {}, [], []
        for f in range(8):
            for row, n, prompt in arrivals.get(f, []):
                eng.submit(prompt_tokens=prompt, max_tokens=n, stop_ids=(), row=row)
            before = compiles[True]
            res = eng.step(o)
            per_frame.append(compiles[True] - before)
            actions.append(res.actions)
            tokens.update({str(r.request_id): r.tokens for r in res.finished})
        pool = eng._pool
        leaves = jax.tree.leaves(pool)
        device = jax.devices()[0]
        on_device = {name: sum(s.data.nbytes for s in getattr(pool, name).addressable_shards if s.device == device)
                     for name in ("k", "request_id", "tokens")}
        out = dict(tokens=tokens, actions=np.stack(actions).tolist(), compiles=per_frame,
                   total=sum(x.nbytes for x in leaves), kv_total=pool.k.nbytes + pool.v.nbytes,
                   device0=sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device),
                   on_device=on_device, k_total=pool.k.nbytes, tokens_total=pool.tokens.nbytes,
                   request_id_total=pool.request_id.nbytes,
                   devices=len(pool.k.sharding.device_set),
                   split_weights=sum("model" in tuple(getattr(x.sharding, "spec", ())) for x in jax.tree.leaves(vla)))
        try:
            Engine(vla, dataclasses.replace(cfg, num_slots=7), mesh=mesh)
            out["odd_slots"] = None
        except ValueError as e:
            out["odd_slots"] = str(e)
        return out

    from oxygen_jax import serve as command
    built = {}
    for argv in (["--tensor-parallel", "2"], ["--tensor-parallel", "2", "--slots", "6"]):
        try:
            engine, _, _, _, mesh, _ = command.build(command._parser().parse_args(["--preset", "tiny", *argv]))
            built[" ".join(argv)] = dict(mesh=dict(mesh.shape), engine_mesh=engine.mesh is mesh, split=sum(
                "model" in tuple(x.sharding.spec) for x in jax.tree.leaves(engine.vla)))
        except ValueError as e:
            built[" ".join(argv)] = str(e)

    runs = {"serve": built, "one": serve(None), "robots4": serve(slot_mesh.serving_mesh(jax.devices()[:4]), speculate=2),
            "tp2": serve(slot_mesh.serving_mesh(jax.devices()[:4], tensor_parallel=2))}
    json.dump(runs, open(sys.argv[1], "w"))
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh") / "runs.json"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_pool_bytes_per_device_are_the_total_over_the_devices_that_split_it(runs):
    four = runs["robots4"]
    assert four["devices"] == 4 and four["device0"] * 4 == four["total"]  # every leaf split by slot, nothing replicated
    tp = runs["tp2"]  # 2 slot groups x 2 KV-head halves: K/V over all 4 devices, bookkeeping over the 2 slot groups
    assert tp["devices"] == 4 and tp["on_device"]["k"] * 4 == tp["k_total"]
    assert tp["on_device"]["tokens"] * 2 == tp["tokens_total"] and tp["on_device"]["request_id"] * 2 == tp["request_id_total"]
    assert four["total"] > runs["one"]["total"]  # speculation's draft references [Ns, R] are split by slot too


def test_greedy_tokens_on_split_slots_and_tensor_parallel_weights_equal_one_devices(runs):
    one = runs["one"]["tokens"]
    assert len(one) == 12 and len({tuple(t) for t in one.values()}) > 6  # every request finished, answers differ
    assert runs["robots4"]["tokens"] == one  # speculative greedy on 4 devices: the plain tokens of one device
    assert runs["tp2"]["tokens"] == one
    assert runs["tp2"]["split_weights"] >= 20 and runs["robots4"]["split_weights"] == 0  # TP really split the weights


def test_actions_on_several_devices_agree_with_one_device_to_float32_reduction_order(runs):
    one = np.asarray(runs["one"]["actions"])
    scale = np.abs(one).max()
    assert np.ptp(one, axis=1).min() > 100 * ACTION_RTOL * scale  # rows differ far beyond the bound: not vacuous
    for name in ("robots4", "tp2"):
        np.testing.assert_allclose(np.asarray(runs[name]["actions"]), one, rtol=0, atol=ACTION_RTOL * scale, err_msg=name)


def test_no_frame_compiles_after_the_first_while_requests_arrive_queue_and_finish(runs):
    for name, run in runs.items():
        if name == "serve":
            continue
        assert run["compiles"][0] >= 1 and run["compiles"][1:] == [0] * 7, (name, run["compiles"])


def test_a_pool_that_does_not_split_evenly_over_the_devices_is_refused_naming_the_fix(runs):
    assert runs["one"]["odd_slots"] is None
    for name in ("robots4", "tp2"):
        msg = runs[name]["odd_slots"]
        assert msg is not None and "num_slots = 7" in msg and "multiple" in msg and "\n" not in msg


def test_route_hands_each_device_the_requests_in_its_own_slots_in_order():
    """The worked example of `slot_mesh`: Ns = 8 over 2 devices, requests in slots [1, 5, 2] and one not admitted."""
    index, local = slot_mesh.route(jnp.array([1, 5, 2, 8], jnp.int32), num_slots=8, devices=2)
    index, local = np.asarray(index).reshape(2, 4), np.asarray(local).reshape(2, 4)
    assert index[0, :2].tolist() == [0, 2] and local[0].tolist() == [1, 2, 4, 4]  # 4 = n: dropped
    assert index[1, :1].tolist() == [1] and local[1].tolist() == [1, 4, 4, 4]


def test_tensor_parallel_rules_split_heads_and_mlp_columns_and_replicate_what_does_not_divide():
    tree = {"layers": {"q": jnp.zeros((3, 8, 64, 16)), "kv": jnp.zeros((3, 2, 1, 64, 16)),
                       "gating": jnp.zeros((3, 2, 64, 256)), "linear": jnp.zeros((3, 256, 64)),
                       "attn_norm": {"scale": jnp.zeros((3, 64))}}, "embedding": jnp.zeros((1000, 64))}
    specs = param_specs(tree, "model", 2)
    assert specs["layers"]["q"] == P(None, "model", None, None)  # heads, after the stacked layer axis
    assert specs["layers"]["kv"] == P()  # one KV head (MQA) does not split
    assert specs["layers"]["gating"] == P(None, None, None, "model") and specs["layers"]["linear"] == P(None, "model", None)
    assert specs["layers"]["attn_norm"]["scale"] == P() and specs["embedding"] == P("model", None)
    assert jax.tree.leaves(param_specs(tree, "model", 1), is_leaf=lambda x: isinstance(x, P)) == [P()] * 6


def test_serving_mesh_refuses_a_tensor_parallel_degree_that_does_not_divide_the_devices():
    with pytest.raises(ValueError, match="--tensor-parallel 3 must be >= 1 and divide the 2 devices"):
        slot_mesh.serving_mesh([jax.devices()[0]] * 2, tensor_parallel=3)


def test_serve_tensor_parallel_builds_a_robots_by_model_mesh_and_refuses_slots_that_do_not_divide_in_one_line(runs):
    built = runs["serve"]  # `serve.build` on 8 devices, tiny preset
    tp = built["--tensor-parallel 2"]
    assert tp["mesh"] == {"robots": 4, "model": 2} and tp["engine_mesh"] and tp["split"] >= 20
    assert "--slots 6 must be a multiple of the 4 devices" in built["--tensor-parallel 2 --slots 6"]
