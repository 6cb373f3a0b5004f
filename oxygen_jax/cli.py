"""Command-line helpers shared by the entry points (`oxygen_jax.run`, `oxygen_jax.serve`, `eval.bench`, ...).

The flags both `run` and `serve` take are defined here once (`add_chunk_flags`: π0-FAST's decoded chunks).
Every flag is checked by its argparse `type`, so a bad value is reported by name before anything loads,
and `OneLineParser` reports it in one line (no usage block, no traceback):

    python -m oxygen_jax.run: error: argument --frames: expected an integer >= 1, got 0 (see --help)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits with status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each option's default printed once: "(default: X)" unless its help already states the
    default (it then says what an unset option means); not for unset options (None, an empty list) or
    switches. argparse prints nothing for an option without help text: give every option one."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        unset = d is None or d is False or d == argparse.SUPPRESS or (isinstance(d, list) and not d)
        if "(default" in text or "default:" in text or unset:  # (0 and 0.0 are defaults to show)
            return text
        return super()._get_help_string(action)


def int_at_least(minimum: int, what: str | None = None):
    """An argparse type: an integer >= minimum."""
    what = what or f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


def float_in(low: float, high: float = math.inf, *, low_open: bool = False):
    """An argparse type: a finite number in [low, high] ((low, high] with `low_open`)."""
    what = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else (
        f"a finite number {'>' if low_open else '>='} {low:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def existing(kind: str):
    """An argparse type: a path that exists as a 'file' or a 'dir' (user ~ expanded)."""

    def parse(text: str) -> Path:
        path = Path(text).expanduser()
        if kind == "file" and not path.is_file():
            raise argparse.ArgumentTypeError(f"no such file: {path}")
        if kind == "dir" and not path.is_dir():
            raise argparse.ArgumentTypeError(f"no such directory: {path}")
        return path

    return parse


# Decoded action chunks (π0-FAST): `runtime.action_streams.StreamConfig` from the command line, in one block.
CHUNK_UNSET = {"chunk_slots": None, "chunk_max_tokens": None, "chunk_deadline_steps": None, "chunk_deadline_ms": None,
               "chunk_on_failure": "error"}
"""Each --chunk-* destination and its value when the flag is not given."""


QUANT_MATMULS = ("auto", "weight_only", "fp8", "int8")
"""--quant-matmul's choices: auto and `nn.quant.MATMUL_MODES` (spelled here: --help runs before jax is imported)."""
KV_CACHES = ("float", "int8", "fp8")
"""--kv-cache's choices: `nn.kv_quant.KV_CACHES`."""


def add_quant_matmul_flag(group) -> None:
    """--quant-matmul, as run and serve take it."""
    group.add_argument("--quant-matmul", default="auto", choices=list(QUANT_MATMULS),
                       help="quantized weights: dequantized into float matmuls (weight_only), or int8 / fp8 products "
                            "on activations quantized per row (default auto: by the device, docs/quantization.md)")


def add_vision_heads_flag(group) -> None:
    """--vision-heads, as run, serve and quantize take it."""
    group.add_argument("--vision-heads", type=int_at_least(1), default=None, metavar="N",
                       help="LeRobot checkpoints whose SigLIP is not So400m (which LeRobot itself never writes): its "
                            "attention head count, which no tensor stores")


def add_kv_cache_flag(group) -> None:
    """--kv-cache, as run and serve take it."""
    group.add_argument("--kv-cache", default="float", choices=list(KV_CACHES),
                       help="the decode slots' K/V storage: int8 / fp8 values with a float32 scale per (layer, slot, "
                            "position, KV head), about half the slot bytes; actions read a float prefix (default: float)")


def add_chunk_flags(ap: argparse.ArgumentParser) -> None:
    """The --chunk-* group of `run` and `serve` (both have --slots and --tokens-per-frame)."""
    positive, positive_ms = int_at_least(1, "a positive integer"), float_in(0.0, low_open=True)
    chunk = ap.add_argument_group(
        "decoded action chunks (π0-FAST; docs/serving.md)",
        "a model whose decoder writes its chunks decodes one token stream per robot in the decode pool,\n"
        "each stopping at its own stop id; a model with action heads refuses these flags")
    chunk.add_argument("--chunk-slots", type=positive, metavar="N",
                       help="decode slots kept for the robots' chunks; language holds the rest (default: half of --slots)")
    chunk.add_argument("--chunk-max-tokens", type=positive, metavar="N",
                       help="tokens a chunk may take before it fails (default: the checkpoint's, openpi's 256)")
    chunk.add_argument("--chunk-deadline-steps", type=positive, metavar="N",
                       help="decode steps a frame may run for its chunks, whole bursts of --tokens-per-frame "
                            "(default: --chunk-max-tokens)")
    chunk.add_argument("--chunk-deadline-ms", type=positive_ms, metavar="MS",
                       help="wall time a frame's chunks may take, checked between bursts (default: none)")
    chunk.add_argument("--chunk-on-failure", choices=["error", "zeros"], default="error",
                       help="a chunk that fails (no 'Action: ', FAST decode, deadline): error answers that robot a "
                            "BadRequest naming why; zeros answers openpi's all-zero chunk (default: error)")


def stream_config(args: argparse.Namespace, vla):
    """The `StreamConfig` of --chunk-* (None: the engine's defaults); one-line ValueError for a flag given to a
    model whose actions are not decoded chunks, or more kept slots than --slots."""
    from oxygen_jax.runtime.action_streams import StreamConfig

    given = [f"--{k.replace('_', '-')}" for k, unset in CHUNK_UNSET.items() if getattr(args, k) != unset]
    if vla.action_stream is None:
        if given:
            what = "model's actions come from its action heads" if vla.heads else "model has no actions (language only)"
            raise ValueError(f"argument {given[0]}: it sets how decoded action chunks (π0-FAST) are streamed, and "
                             f"this {what}: drop it")
        return None
    if args.chunk_slots is not None and args.chunk_slots > args.slots:
        raise ValueError(f"argument --chunk-slots: {args.chunk_slots} is more than the pool's --slots {args.slots}")
    return StreamConfig(slots=args.chunk_slots, max_tokens=args.chunk_max_tokens or 0,
                        deadline_steps=args.chunk_deadline_steps or 0, deadline_ms=args.chunk_deadline_ms or 0.0,
                        on_failure=args.chunk_on_failure)


def pool_tokens(vla, max_new_tokens: int, chunk_tokens: int | None = None) -> int:
    """A slot's room for new tokens: --max-new-tokens, or a whole decoded chunk (--chunk-max-tokens, else the
    model's) when the model writes its chunks."""
    if vla.action_stream is None:
        return max_new_tokens
    return max(max_new_tokens, chunk_tokens or vla.action_stream.max_tokens)
