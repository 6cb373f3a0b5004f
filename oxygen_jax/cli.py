"""Command-line helpers shared by the entry points (`oxygen_jax.run`, `oxygen_jax.serve`, `eval.bench`, ...).

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
