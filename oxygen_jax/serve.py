"""`python -m oxygen_jax.serve`: the policy server's command line (the server itself is `serving.server`).

    python -m oxygen_jax.serve --preset tiny --robot libero --port 8000
    python -m oxygen_jax.serve --ckpt /path/to/pi05_libero --robot libero --tokenizer paligemma_tokenizer.model
    python -m oxygen_jax.serve --demo --port 8000      # the embedded demo with its "memory" adapter
    python -m oxygen_jax.serve --ckpt ../shared/fixtures/xr0_tiny --image-size 64   # a restored XR0 / StarVLA model
    python -m oxygen_jax.serve --ckpt QWEN3_VL_DIR --heads xr0,starvla,gr00t      # a bare backbone + random heads
    python -m oxygen_jax.serve --ckpt QWEN3_DIR                                   # a bare backbone: language only
    python -m oxygen_jax.serve --heads tiny --image-size 64 --port 8000   # random Qwen3-VL + XR0 / StarVLA / GR00T heads
    python -m oxygen_jax.serve --demo --auto-language "Memory: " --auto-adapter memory   # OxyGen's serving contract

`--ckpt` takes every model a checkpoint directory holds (`command_model` has the table): π0.5 serves its action
expert; a Xiaomi-Robotics-0 or StarVLA directory its own head and a language decoder on the shared prefix (the
XR0 horizon and action mask are the checkpoint's: --action-mask, else config.json `action_mask`, else
`action_length` with a warning; StarVLA's actions are un-normalised with its `dataset_statistics.json` when the
run has one, `ckpts.starvla.unnormalize_actions`); a bare Qwen3 / Qwen3-VL / Qwen3.5 backbone serves language
only (no action head: every reply's "actions" is an empty [0, Da] chunk, the metadata's action_horizon 0), or
with `--heads KINDS` (xr0, starvla, gr00t; Qwen3.5: starvla, gr00t) random heads sized to it. With a
`tokenizer.json` in or beside the directory (or --tokenizer) language requests are text and an XR0 / StarVLA
head's rows are its family's native prompts (`robots.native_prompts`); without one the server logs that
language requests take token ids (`prompt_tokens`) only. Flags a model cannot take are one-line errors.

The protocol (openpi's, with language extensions) is described in `oxygen_jax.serving.server`.

The server listens on 127.0.0.1 unless told otherwise: `--host 0.0.0.0` accepts robots from other
machines (add `--api-key` there). The port is bound before the model loads, so a port in use or a bad
--host is a one-line error in a second; SIGTERM is answered within one batch size's compile during
warm-up, and at once while the model loads.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import socket
import sys
from pathlib import Path

import numpy as np

from oxygen_jax import command_model as cm
from oxygen_jax.cli import DefaultsHelpFormatter, OneLineParser, add_chunk_flags, add_kv_cache_flag, add_quant_matmul_flag, \
    add_vision_heads_flag, float_in, int_at_least, pool_tokens, stream_config
from oxygen_jax.nn import quant
from oxygen_jax.runtime import compile_cache
from oxygen_jax.serving.auto_language import MODES, AutoLanguage
from oxygen_jax.serving.batcher import BUCKETS
from oxygen_jax.serving.server import PolicyServer, ServeConfig

log = logging.getLogger("oxygen_jax.serve")


_positive_int = int_at_least(1, "a positive integer")
_positive_float = float_in(0.0, low_open=True)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {text!r}")
    return value


def _buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes like 1,2,4,8, got {text!r}") from None
    if not values or values[0] < 1 or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"batch sizes must be increasing positive integers, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m oxygen_jax.serve", description=__doc__.split("\n\n")[0],
                        formatter_class=DefaultsHelpFormatter)
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=["tiny", "bench", "pi05", "pi0", "pi0_tiny"],
                       help="random-weight model size (pi0, pi0_tiny: π0 with its state token; default: tiny, without "
                            "--ckpt, --demo and --heads)")
    model.add_argument("--ckpt", help="any model checkpoint directory: π0.5 (openpi's, params dir or its parent, or "
                                      "one saved by oxygen_jax), Xiaomi-Robotics-0 / StarVLA (its own head), or a bare "
                                      "Qwen3 / Qwen3-VL / Qwen3.5 (language only, or --heads)")
    ap.add_argument("--action-mask", metavar="FILE",
                    help="XR0: the robot's [Ha, Ad] 0/1 action mask (.npy or .json), e.g. saved from the released "
                         "processor's get_action_mask(robot_type); sets the horizon (default: config.json's "
                         "action_mask, else action_length and all ones)")
    add_vision_heads_flag(ap)
    model.add_argument("--demo", nargs="?", const="", default=None, metavar="DIR",
                       help="serve the embedded demo (default DIR: checkpoints/demo) with its 'memory' adapter")
    ap.add_argument("--heads", metavar="KINDS", type=cm.parse_heads,
                    help="random action heads on a bare Qwen3 / Qwen3-VL / Qwen3.5 --ckpt (without --ckpt: on a random "
                         "Qwen3-VL backbone): comma-separated kinds xr0, starvla, gr00t (Qwen3.5: starvla, gr00t), "
                         "sized to the backbone; 'tiny' / 'bench' = all three at that size. The first head's chunk is "
                         "'actions', every head's is under 'heads'. Without it a bare backbone serves language only")
    ap.add_argument("--head-size", choices=list(cm.SIZES),
                    help="--heads KINDS: the heads' own width and depth (default: tiny)")
    ap.add_argument("--image-size", type=_positive_int, default=224,
                    help="Qwen3-VL / Qwen3.5 backbones (XR0, StarVLA, bare): camera images are resized to this square "
                         "size (a multiple of patch x merge px)")
    ap.add_argument("--dataset-key", help="StarVLA: the dataset_statistics.json entry to un-normalise with "
                                          "(default: its only entry)")
    ap.add_argument("--adapter", action="append", default=[], metavar="[NAME=]DIR",
                    help="a language adapter served by NAME (default: the name it was saved with; 'memory' for an "
                         "OxyGen folder): a training.memory output or oxygen_adapter import, or OxyGen's released "
                         "folder (adapter_config.json + .npz, imported on load); repeatable")
    ap.add_argument("--robot", default="libero", choices=["libero", "droid", "aloha"], help="client observation format")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on; 127.0.0.1 is this machine only, 0.0.0.0 every interface "
                         "(robots on other machines; consider --api-key)")
    ap.add_argument("--port", type=_port, default=8000, help="0 picks a free port")
    ap.add_argument("--dtype", default="auto", choices=list(cm.DTYPES),
                    help="parameters and activations (default auto: bfloat16 on GPUs, float32 on CPUs)")
    add_quant_matmul_flag(ap)
    ap.add_argument("--prompt-attention", default="bidirectional", choices=["bidirectional", "causal"],
                    help="π0.5: how prompt tokens attend to each other")
    ap.add_argument("--tokenizer", help="PaliGemma SentencePiece model, or an XR0 / StarVLA checkpoint's tokenizer.json; "
                                         "default: tokenizer.model (tokenizer.json for XR0 / StarVLA) in or beside "
                                         "--ckpt (a π checkpoint without one is refused); 'demo': the offline demo "
                                         "tokenizer as a stand-in (random weights, benchmarks)")
    ap.add_argument("--prompt-len", type=_positive_int,
                    help="prompt tokens in the prefix (default: the robot's; with --heads the whole row, image tokens "
                         "included, default image tokens + 48)")
    ap.add_argument("--steps", type=_positive_int, default=10, help="denoising steps per action chunk")
    ap.add_argument("--slots", type=_positive_int, default=16, help="decode slots shared by all robots")
    ap.add_argument("--max-new-tokens", type=_positive_int, default=32, help="token cap per language request")
    ap.add_argument("--prompt-capacity", type=int_at_least(0), default=16, help="request-prompt tokens after the prefix")
    ap.add_argument("--tokens-per-frame", type=_positive_int, default=4, help="k: language tokens per request per step")
    ap.add_argument("--speculate", type=int_at_least(0), default=0, metavar="GAMMA",
                    help="speculative decoding: each of the k steps checks up to GAMMA drafted tokens (drafts from the "
                         "robot's earlier answers; the same text, actions unchanged); 0 = off")
    ap.add_argument("--verify-cost", type=float_in(1.0), default=1.0, metavar="C",
                      help="with --speculate: k counts decode steps and a verify step with drafts costs C of them "
                           "(about 1 on a GPU, 1.5-2 on a CPU: keeps the frame time)")
    add_kv_cache_flag(ap)
    ap.add_argument("--batch-sizes", type=_buckets, default=",".join(map(str, BUCKETS)),
                    help="robots per step, each compiled at start-up (on a CPU each size can take a minute); "
                         "one robot needs only --batch-sizes 1")
    ap.add_argument("--deadline-ms", type=_positive_float, default=100.0, help="default robot round-trip budget")
    ap.add_argument("--max-deadline-ms", type=_positive_float, default=1000.0,
                    help="cap on the deadline_ms a robot declares (how long other robots may wait for it; "
                         "at least --deadline-ms)")
    ap.add_argument("--max-pending", type=_positive_int, default=16, help="queued frames before 'busy'")
    ap.add_argument("--max-robots", type=_positive_int, default=64,
                    help="streaming robots (connections that have sent a frame); more get 'busy'")
    ap.add_argument("--max-connections", type=_positive_int, default=256,
                    help="open connections of any kind; more get HTTP 503")
    ap.add_argument("--max-connections-per-peer", type=_positive_int, default=32,
                    help="open connections from one client address; more get HTTP 503")
    ap.add_argument("--first-frame-timeout", type=_positive_float, default=30.0,
                    help="close a connection that sends no first frame within this many seconds")
    ap.add_argument("--idle-timeout", type=_positive_float, default=600.0,
                    help="close a robot that sends no frame for this many seconds")
    ap.add_argument("--send-timeout", type=_positive_float, default=10.0,
                    help="drop a connection whose reply cannot be written in this many seconds")
    ap.add_argument("--max-prompt-chars", type=_positive_int, default=1024,
                    help="longest observation or language-request prompt (characters), refused before tokenizing")
    ap.add_argument("--max-requests-per-robot", type=_positive_int, default=8, help="live language requests per robot")
    ap.add_argument("--max-refusals-per-s", type=_positive_float, default=20.0,
                    help="refused frames read per connection and second after a burst (the rest wait in TCP)")
    ap.add_argument("--send-buffer-kb", type=_positive_int, default=64,
                    help="kernel send buffer per connection (KiB); replies are a few kB")
    ap.add_argument("--rtc", action="store_true",
                    help="accept per-robot real-time chunking (the request's 'rtc' field, docs/rtc.md); compiles a "
                         "second program per batch size")
    ap.add_argument("--max-message-mb", type=_positive_float, default=4.0, help="larger frames close with 1009")
    ap.add_argument("--ping-interval", type=_positive_float, default=20.0, help="keepalive ping period (s)")
    ap.add_argument("--ping-timeout", type=_positive_float, default=20.0, help="keepalive pong timeout (s)")
    ap.add_argument("--default-prompt", help="prompt for robots that send none")
    ap.add_argument("--api-key", help="require 'Authorization: Api-Key KEY' from clients")
    ap.add_argument("--seed", type=int, default=0, help="parameter (presets) and noise seed")
    ap.add_argument("--compile-cache", default=str(compile_cache.default_dir()),
                    help="persistent XLA compilation cache directory, the one `run` uses ($OXYGEN_JAX_CACHE_DIR, else "
                         "~/.cache/oxygen_jax/xla); 'none' disables")
    ap.add_argument("--no-shard", action="store_true", help="use one device even when several are visible")
    ap.add_argument("--tensor-parallel", type=_positive_int, default=1, metavar="T",
                    help="split each weight over T devices by attention heads / MLP columns (a model larger than one "
                         "device); the devices form a (robots = devices / T, model = T) mesh, --slots a multiple of "
                         "devices / T (docs/serving.md)")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="the server's log lines on stderr (absl / orbax / jax INFO lines only at DEBUG)")
    auto = ap.add_argument_group(
        "automatic language requests (OxyGen's serving contract; docs/serving.md)",
        "open a language request for every observation a robot sends, unasked; every reply carries each "
        "advancing request's new tokens and text so far ('language.updates') and each final text once")
    auto.add_argument("--auto-language", metavar="PROMPT",
                      help="the prompt of the request opened for every observation, e.g. 'Memory: ' (off without it)")
    # A flag of its own, not a prefix of --auto-language: any text (even "ids:1,2") stays a text prompt.
    auto.add_argument("--auto-language-ids", type=_token_ids, metavar="IDS",
                      help="the same prompt as token ids, for a checkpoint without a tokenizer, e.g. 12,34,56 (checked "
                           "against the model's vocabulary at start-up); instead of --auto-language")
    auto.add_argument("--auto-max-tokens", type=_positive_int, metavar="N",
                      help="its token budget (default: --max-new-tokens)")
    auto.add_argument("--auto-temperature", type=float_in(0.0), default=0.0, metavar="T",
                      help="its sampling temperature; 0 is greedy")
    auto.add_argument("--auto-seed", type=int_at_least(0), metavar="S",
                      help="its sampling seed, the same for every automatic request (default: each request's id)")
    auto.add_argument("--auto-adapter", default="base", metavar="NAME",
                      help="the language adapter it decodes with, by name (an --adapter's, or the demo's 'memory')")
    auto.add_argument("--auto-mode", choices=MODES, default="new_each_call",
                      help="a robot's automatic request still running when its next observation arrives: "
                           "new_each_call opens another beside it (OxyGen's), keep opens none until it ends, "
                           "replace cancels it (its result: failed, 'replaced')")
    add_chunk_flags(ap)
    return ap


def _fail(message: str, code: int = 1) -> int:
    print(f"python -m oxygen_jax.serve: error: {message}", file=sys.stderr)
    return code


def build(args: argparse.Namespace):
    """Loads the model and builds (engine, tokenizer, robot, io, mesh, rows) from CLI arguments (io: the
    checkpoint's `robots.io.RobotIO`).

    What each kind of --ckpt serves, --heads and the tokenizers: `command_model`. `tokenizer` encodes the
    observations' prompts; the engine's (`engine.tokenizer`) takes text requests, None when the model has no
    tokenizer of its own (a log line says so; requests then send prompt_tokens). `rows` are the
    `PolicyServer` keywords of a Qwen-backbone model (image_size, prompt_len, outputs); {} for π0.5.
    Raises ValueError / OSError with a one-line message for an unusable checkpoint, tokenizer or flag.
    """
    import jax

    from oxygen_jax.robots.config import robot_config
    from oxygen_jax.robots.io import RobotIO
    from oxygen_jax.runtime.engine import Engine, EngineConfig

    robot = robot_config(args.robot)
    bank, names, rows, io = None, (), {}, RobotIO()
    if args.demo is not None:
        if args.heads:
            raise ValueError("--heads cannot be combined with --demo (the demo is a π0.5 model)")
        from oxygen_jax.demo import DEMO_DIR, load_demo

        demo = load_demo(args.demo or DEMO_DIR)  # the repository's demo wherever the server starts
        vla, toks, bank, names = demo.vla(args.steps), cm.Tokenizers(demo.tokenizer, demo.tokenizer), \
            demo.bank, demo.adapter_names
        robot = demo.robot.replace(max_token_len=args.prompt_len) if args.prompt_len else demo.robot
        if args.adapter:
            raise ValueError("--adapter serves π0.5 language adapters: not with --demo (it brings its own)")
    else:
        cm.check_flags(args.ckpt, {"--heads": bool(args.heads), "--head-size": bool(args.head_size),
                                   "--action-mask": bool(args.action_mask), "--adapter": bool(args.adapter),
                                   "--vision-heads": args.vision_heads is not None,
                                   "--prompt-attention": args.prompt_attention != "bidirectional"})
        model = cm.load(args.ckpt, heads=args.heads, size=args.head_size, preset=args.preset,
                        dtype=cm.resolve_dtype(args.dtype),
                        seed=args.seed, prompt_attention=args.prompt_attention, action_mask=_action_mask(args),
                        dataset_key=args.dataset_key, vision_heads=args.vision_heads)
        log_notes(model)
        toks = cm.tokenizers(model, args.tokenizer)
        if toks.note:
            log.warning(toks.note)
        vla, io, robot = model.vla(args.steps, tokenizer=toks.rows, robot=robot), model.io, model.io.robot(robot)
        rows = cm.prompt_rows(model, toks.rows, robot, args.image_size, args.prompt_len)
        if not rows and args.prompt_len:  # observation rows: --prompt-len is the prompt's own tokens
            robot = robot.replace(max_token_len=args.prompt_len)
        if args.adapter:
            from oxygen_jax.ckpts.oxygen_adapter import load_named_bank

            bank, names = load_named_bank(args.adapter, model.config, base=args.ckpt)
        if vla.action_stream is not None:
            log.info("%s decodes its chunks as tokens: one stream per robot in the decode pool, up to %d tokens each, "
                     "each robot stopping at its own stop id", model.what, vla.action_stream.max_tokens)
        elif not vla.heads:
            log.info("%s has no action head: serving language only; every reply's 'actions' is an empty [0, %d] "
                     "chunk (metadata action_horizon 0)", model.what, robot.action_dim)
    params, matmul = quant.start_matmul(vla.params, args.quant_matmul, jax.devices()[0])  # one-line ValueError
    vla = dataclasses.replace(vla, params=params)
    if matmul:
        log.info("quantized: %s", matmul)
    if args.rtc and not vla.heads:
        raise ValueError("argument --rtc: real-time chunking blends action chunks, and this model has no action head "
                         "(language only): drop --rtc")
    mesh = None
    if args.tensor_parallel > 1 and args.no_shard:
        raise ValueError("--tensor-parallel splits the model over several devices: drop --no-shard")
    if len(jax.devices()) > 1 and not args.no_shard or args.tensor_parallel > 1:
        from oxygen_jax.runtime import slot_mesh

        mesh = slot_mesh.serving_mesh(jax.devices(), args.tensor_parallel)
        if args.slots % slot_mesh.robots_size(mesh):
            raise ValueError(f"--slots {args.slots} must be a multiple of the {slot_mesh.robots_size(mesh)} devices "
                             "the slots are split over (devices / --tensor-parallel), or pass --no-shard")
        vla = slot_mesh.place_model(vla, mesh)
    streams = stream_config(args, vla)
    engine = Engine(vla, EngineConfig(
        num_slots=args.slots, max_new_tokens=pool_tokens(vla, args.max_new_tokens, args.chunk_max_tokens),
        request_max_tokens=args.max_new_tokens,
        prompt_capacity=args.prompt_capacity,
        tokens_per_frame=args.tokens_per_frame, speculate=args.speculate, verify_cost=args.verify_cost, action_horizon=robot.action_horizon,
        kv_cache=args.kv_cache,
        seed=args.seed), tokenizer=toks.text, bank=bank, adapter_names=names, mesh=mesh, streams=streams)
    # With a tokenizer.json the rows of an XR0 / StarVLA head are its native prompts (`serving.codec`), and
    # language requests are text in that tokenizer (or token ids); their answers come back as text and ids.
    return engine, toks.rows, robot, io, mesh, rows


def _action_mask(args) -> np.ndarray | None:
    """--action-mask read from .npy or .json (None without the flag): `command_model.read_action_mask`."""
    return cm.read_action_mask(args.action_mask)


def _check_dataset_key(args) -> None:
    """--dataset-key picks the entry of a StarVLA checkpoint's dataset_statistics.json; any other model has no
    statistics to pick from (it would silently ignore the flag), so it is refused in one line, before loading."""
    from oxygen_jax.ckpts.load import dataset_key_refusal

    if args.dataset_key is None:
        return
    why = dataset_key_refusal(args.ckpt, demo=args.demo is not None, heads=bool(args.heads))
    if why:
        raise ValueError(why)


def log_notes(model) -> None:
    """The checkpoint's start-up warnings (`RobotIO.notes`, e.g. an XR0 head restored without the robot's mask)."""
    for note in model.io.notes:
        log.warning(note)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), bound before anything slow runs.

    Raises:
      ValueError: one line naming the flag and the fix (an unknown host, a port in use, no permission).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"argument --host: cannot resolve {host!r} ({e}); use an address of this machine, "
                         "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno in (98, 48, 10048):  # EADDRINUSE (Linux, macOS, Windows)
            raise ValueError(f"argument --port: port {port} is already in use on {host}; stop the other server or "
                             "pick another port (--port 0 picks a free one)") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; check --host and --port") from None
    sock.setblocking(False)
    return sock


async def _serve_until_signal(server: PolicyServer, sock: socket.socket | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start(sock)
    c = server.config
    log.info("listening on ws://%s:%d (robot %s)%s", c.host, server.port, server.robot.name,
             "; other machines cannot connect: pass --host 0.0.0.0 to listen on every interface"
             if c.host in ("127.0.0.1", "localhost", "::1") else "")
    one = "; one robot needs only --batch-sizes 1" if len(c.buckets) > 1 else ""
    print(f"listening on ws://{c.host}:{server.port} (robot {server.robot.name}); compiling batch sizes "
          f"{list(c.buckets)} ... (/healthz answers 503 until done{one})", flush=True)
    if server.metrics.speculation is not None:
        print(server.metrics.speculation.describe(server.engine.config.verify_cost), flush=True)
    warm = asyncio.ensure_future(server.wait_ready())
    await asyncio.wait([warm, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if warm.done() and warm.exception() is not None:
        await server.shutdown()
        return _fail(f"warm-up failed: {str(warm.exception()).splitlines()[0] if str(warm.exception()) else ''}")
    if warm.done():
        ms = {b: round(v, 1) for b, v in server.batcher.warmup_ms.items()}
        print(f"ready: steady step ms by batch size {ms}", flush=True)
    await stop.wait()
    print("SIGTERM: answering queued frames, then closing connections (1001)", flush=True)
    await server.shutdown()
    return 0


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The server settings the command line asks for (raises ValueError naming a bad value)."""
    return ServeConfig(
        host=args.host, port=args.port, buckets=args.batch_sizes, deadline_ms=args.deadline_ms,
        max_deadline_ms=max(args.max_deadline_ms, args.deadline_ms), max_pending=args.max_pending,
        max_robots=args.max_robots, max_connections=args.max_connections,
        max_connections_per_peer=args.max_connections_per_peer, first_frame_timeout_s=args.first_frame_timeout,
        idle_timeout_s=args.idle_timeout, send_timeout_s=args.send_timeout, max_prompt_chars=args.max_prompt_chars,
        max_requests_per_robot=args.max_requests_per_robot, max_message_bytes=int(args.max_message_mb * (1 << 20)),
        ping_interval=args.ping_interval, ping_timeout=args.ping_timeout, seed=args.seed,
        default_prompt=args.default_prompt, api_key=args.api_key, max_refusals_per_s=args.max_refusals_per_s,
        send_buffer_bytes=args.send_buffer_kb << 10, rtc=args.rtc, auto_language=_auto_language(args))


def _token_ids(text: str) -> tuple[int, ...]:
    """--auto-language-ids: "12,34,56" -> (12, 34, 56); argparse's one-line error otherwise."""
    try:
        ids = tuple(int(t) for t in text.split(","))
    except ValueError:
        ids = ()
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids (integers >= 0), e.g. 12,34,56; "
                                         f"got {text!r:.60}")
    return ids


def _auto_language(args: argparse.Namespace) -> AutoLanguage | None:
    """--auto-language and its options (None without it); ValueError naming an option given without it."""
    if args.auto_language is not None and args.auto_language_ids is not None:
        raise ValueError("argument --auto-language-ids: give the automatic prompt as text (--auto-language) or as "
                         "token ids (--auto-language-ids), not both")
    if args.auto_language is None and args.auto_language_ids is None:
        given = [f"--auto-{n.replace('_', '-')}" for n, unset in (("max_tokens", None), ("temperature", 0.0),
                                                                  ("seed", None), ("adapter", "base"),
                                                                  ("mode", "new_each_call"))
                 if getattr(args, f"auto_{n}") != unset]
        if given:
            raise ValueError(f"argument {given[0]}: it sets the automatic language request: give --auto-language "
                             "PROMPT (or --auto-language-ids IDS) too, or drop it")
        return None
    if args.auto_max_tokens is not None and args.auto_max_tokens > args.max_new_tokens:
        raise ValueError(f"argument --auto-max-tokens: {args.auto_max_tokens} is above --max-new-tokens "
                         f"{args.max_new_tokens}: lower it or raise --max-new-tokens")
    return AutoLanguage(prompt=args.auto_language, prompt_tokens=args.auto_language_ids,
                        max_tokens=args.auto_max_tokens, temperature=args.auto_temperature,
                        seed=args.auto_seed, adapter=args.auto_adapter, mode=args.auto_mode)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.seed < 0:
        return _fail(f"argument --seed: expected an integer >= 0, got {args.seed}", 2)
    if args.tokenizer and args.tokenizer != cm.DEMO_TOKENIZER and not Path(args.tokenizer).is_file():
        return _fail(f"argument --tokenizer: no such file {args.tokenizer!r}", 2)
    try:
        _check_dataset_key(args)
    except ValueError as e:
        return _fail(str(e), 2)
    configure_logging(args.log_level)
    try:
        config = serve_config(args)
    except ValueError as e:
        return _fail(str(e), 2)
    try:
        sock = bind(args.host, args.port)  # before the model: a port in use fails now, not after loading
    except ValueError as e:
        return _fail(str(e), 2)
    log.info("bound %s:%d; loading the model", args.host, sock.getsockname()[1])
    previous = signal.signal(signal.SIGTERM, _exit_while_loading)
    try:
        if args.compile_cache.lower() != "none" and compile_cache.enable(args.compile_cache) is None:
            # The cache only saves start-up time: its absence must not stop the server.
            log.warning("cannot use the compilation cache directory %s: serving without a persistent cache",
                        args.compile_cache)
        engine, tok, robot, io, mesh, rows = build(args)
    except _Terminated:
        sock.close()
        print("SIGTERM while loading the model: exiting", flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint or bad value is one line, not a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        demo = f"cannot load the demo {args.demo or 'checkpoints/demo'}: " if args.demo is not None else ""
        what = f"cannot load checkpoint {args.ckpt}: " if args.ckpt else demo
        sock.close()
        return _fail(f"{what}{type(e).__name__}: {first}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        server = PolicyServer(engine, tok, robot, config, io=io, mesh=mesh, **rows)
    except ValueError as e:  # e.g. --auto-adapter naming an adapter the model does not have
        sock.close()
        return _fail(str(e), 2)
    return asyncio.run(_serve_until_signal(server, sock))


class _Terminated(BaseException):
    """SIGTERM arrived while the model was loading (nothing to drain: exit at once)."""


def _exit_while_loading(signum, frame):
    raise _Terminated()


def configure_logging(level: str) -> None:
    """Timestamped log lines at `level` on stderr, replacing whatever handlers an import installed.

    `force=True`: absl (imported by orbax) configures the root logger first, which would make a plain
    `basicConfig` a no-op (no INFO lines, no timestamps).
    """
    root = logging.getLogger()
    # Handlers of another kind (a test's log capture, a file handler set up by an embedding program) stay.
    keep = [h for h in root.handlers if type(h) is not logging.StreamHandler and "absl" not in type(h).__module__]
    for h in keep:
        root.removeHandler(h)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for h in keep:
        root.addHandler(h)
    logging.getLogger("websockets").setLevel(logging.WARNING)
    # absl (orbax's checkpoint steps) and jax (backend probing) write about a dozen INFO lines while the model
    # loads, which bury the server's own; they are shown at DEBUG.
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "DEBUG" else max(logging.WARNING,
                                                                                     logging.getLevelName(level)))


_CHATTY = ("absl", "jax", "orbax")


if __name__ == "__main__":
    sys.exit(main())
