"""Language-request arrival patterns, parsed from short strings (never with `eval`).

A pattern maps a frame index to the list of requests arriving in that frame; each request is given
by its own token cap t_max (None = no cap of its own, the decode length N governs). Semantics follow
the OxyGen paper's reference workloads (docs/benchmarks.md). Every draw is seeded and the generator
is recreated for each `schedule` call, so the same spec always gives the same arrivals.

Grammar (`KIND[:ARGS][:OPTION]...`, OPTION = `tmax=INT` | `seed=INT` | `rate=NUM`):

    none                          no language requests (actions only)
    uniform[:RATE]                RATE is an interval in frames: RATE >= 1 -> one request in every frame
                                  f with f % int(RATE) == 0; RATE < 1 -> round(1/RATE) requests every
                                  frame. Default 1.
    burst[:SIZE/EVERY]            SIZE requests in every frame f with f % EVERY == 0. Default 4/8.
    poisson:LAM                   Poisson(LAM) requests per frame (Knuth's method); seed default 42.
    variable_length:T1,T2,...     uniform arrivals (option rate, default 1) whose t_max cycles T1, T2, ...
    random_length:T1,T2,...@W     uniform arrivals whose t_max is drawn i.i.d.; W is P(last value) for
                                  two values, or a comma list of weights (normalised); no `@` = equal.

Examples:

    >>> parse("uniform:0.5").schedule(3)
    [[None, None], [None, None], [None, None]]
    >>> parse("burst:2/3:tmax=8").schedule(4)
    [[8, 8], [], [], [8, 8]]
    >>> parse("random_length:5,20@0.3").arrivals_per_frame
    1.0
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

KINDS = ("none", "uniform", "burst", "poisson", "variable_length", "random_length")
_OPTIONS = ("tmax", "seed", "rate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArrivalPattern:
    """A parsed arrival pattern. Build it with `parse`; `str()` gives the canonical spec."""

    kind: str
    rate: float = 1.0  # interval in frames (uniform, variable_length, random_length)
    burst_size: int = 4
    burst_every: int = 8
    lam: float = 0.0  # Poisson mean arrivals per frame
    t_max_values: tuple[int | None, ...] = (None,)  # one value, or the cycle/choices of the *_length kinds
    weights: tuple[float, ...] | None = None  # random_length draw probabilities (sum 1)
    seed: int = 42

    def __str__(self) -> str:
        tmax = self.t_max_values[0]
        opt = f":tmax={tmax}" if tmax is not None and self.kind in ("uniform", "burst", "poisson") else ""
        seed = f":seed={self.seed}" if self.kind in ("poisson", "random_length") and self.seed != 42 else ""
        rate = f":rate={_num(self.rate)}" if self.kind.endswith("_length") and self.rate != 1 else ""
        values = ",".join(str(t) for t in self.t_max_values)
        if self.kind == "none":
            return "none"
        if self.kind == "uniform":
            return f"uniform:{_num(self.rate)}{opt}"
        if self.kind == "burst":
            return f"burst:{self.burst_size}/{self.burst_every}{opt}"
        if self.kind == "poisson":
            return f"poisson:{_num(self.lam)}{opt}{seed}"
        if self.kind == "variable_length":
            return f"variable_length:{values}{rate}"
        w = "" if self.weights is None else "@" + ",".join(_num(x) for x in self.weights)
        return f"random_length:{values}{w}{rate}{seed}"

    @property
    def arrivals_per_frame(self) -> float:
        """λ, the mean number of requests per frame (the steady-state CB batch is about λ·N/k)."""
        if self.kind == "none":
            return 0.0
        if self.kind == "burst":
            return self.burst_size / self.burst_every
        if self.kind == "poisson":
            return self.lam
        return 1.0 / int(self.rate) if self.rate >= 1 else float(round(1.0 / self.rate))

    def _uniform_count(self, frame: int) -> int:
        if self.rate >= 1:
            return 1 if frame % int(self.rate) == 0 else 0
        return round(1.0 / self.rate)

    def schedule(self, num_frames: int) -> list[list[int | None]]:
        """The t_max of every request arriving in frames 0..num_frames-1, in arrival order."""
        if num_frames < 0:
            raise ValueError(f"num_frames must be >= 0, got {num_frames}")
        rng = np.random.default_rng(self.seed)  # fresh per call: reproducible schedules
        tmax = self.t_max_values[0]
        out: list[list[int | None]] = []
        cycle = 0
        for f in range(num_frames):
            if self.kind == "none":
                out.append([])
            elif self.kind == "uniform":
                out.append([tmax] * self._uniform_count(f))
            elif self.kind == "burst":
                out.append([tmax] * (self.burst_size if f % self.burst_every == 0 else 0))
            elif self.kind == "poisson":
                out.append([tmax] * _knuth_poisson(rng, self.lam))
            elif self.kind == "variable_length":
                n = self._uniform_count(f)
                vals = self.t_max_values
                out.append([vals[(cycle + j) % len(vals)] for j in range(n)])
                cycle += n
            else:  # random_length
                n = self._uniform_count(f)
                idx = rng.choice(len(self.t_max_values), size=n, p=self.weights)
                out.append([self.t_max_values[i] for i in idx])
        return out


def _num(x: float) -> str:
    return f"{x:g}"


def _knuth_poisson(rng: np.random.Generator, lam: float) -> int:
    """Knuth's multiplication method (exact for the small λ of these workloads)."""
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _positive_float(text: str, what: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"arrival pattern {spec!r}: {what} must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"arrival pattern {spec!r}: {what} must be a positive number, got {text!r}")
    return value


def _positive_int(text: str, what: str, spec: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"arrival pattern {spec!r}: {what} must be an integer, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"arrival pattern {spec!r}: {what} must be >= {minimum}, got {value}")
    return value


def parse(spec: str) -> ArrivalPattern:
    """Parses an arrival spec (see the module docstring for the grammar).

    Raises:
      ValueError: naming the spec and the part at fault.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("arrival pattern must be a non-empty string such as 'uniform:1'")
    parts = spec.strip().split(":")
    kind, rest = parts[0].strip().lower(), [p.strip() for p in parts[1:]]
    if kind not in KINDS:
        raise ValueError(f"arrival pattern {spec!r}: unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    args = [p for p in rest if "=" not in p]
    options: dict[str, str] = {}
    for p in rest:
        if "=" in p:
            key, value = (s.strip() for s in p.split("=", 1))
            if key not in _OPTIONS:
                raise ValueError(f"arrival pattern {spec!r}: unknown option {key!r}; options are {', '.join(_OPTIONS)}")
            options[key] = value
    if len(args) > 1:
        raise ValueError(
            f"arrival pattern {spec!r}: expected KIND:ARGS[:key=value]..., got {len(args)} argument groups")
    arg = args[0] if args else None
    fields: dict = {"kind": kind}
    if "tmax" in options:
        if kind.endswith("_length"):
            raise ValueError(f"arrival pattern {spec!r}: {kind} takes its t_max values as arguments, not tmax=")
        fields["t_max_values"] = (_positive_int(options["tmax"], "tmax", spec),)
    if "seed" in options:
        fields["seed"] = _positive_int(options["seed"], "seed", spec, minimum=0)
    if "rate" in options:
        if not kind.endswith("_length"):
            raise ValueError(f"arrival pattern {spec!r}: rate= applies to variable_length/random_length only")
        fields["rate"] = _positive_float(options["rate"], "rate", spec)

    if kind == "none":
        if arg is not None:
            raise ValueError(f"arrival pattern {spec!r}: 'none' takes no arguments")
    elif kind == "uniform":
        fields["rate"] = _positive_float(arg, "rate", spec) if arg is not None else 1.0
    elif kind == "burst":
        if arg is not None:
            if "/" not in arg:
                raise ValueError(f"arrival pattern {spec!r}: burst takes SIZE/EVERY, e.g. burst:4/8")
            size, every = arg.split("/", 1)
            fields["burst_size"] = _positive_int(size, "burst size", spec)
            fields["burst_every"] = _positive_int(every, "burst interval", spec)
    elif kind == "poisson":
        if arg is None:
            raise ValueError(f"arrival pattern {spec!r}: poisson needs a mean, e.g. poisson:1.5")
        fields["lam"] = _positive_float(arg, "lambda", spec)
        if fields["lam"] > 50:
            raise ValueError(f"arrival pattern {spec!r}: lambda > 50 arrivals per frame is not a useful workload")
    else:  # variable_length / random_length
        if arg is None:
            raise ValueError(f"arrival pattern {spec!r}: {kind} needs t_max values, e.g. {kind}:5,20")
        values_text, _, weights_text = arg.partition("@")
        if weights_text and kind == "variable_length":
            raise ValueError(f"arrival pattern {spec!r}: variable_length cycles its values and takes no weights")
        values = tuple(_positive_int(v, "t_max", spec) for v in values_text.split(","))
        fields["t_max_values"] = values
        if kind == "random_length":
            fields["weights"] = _weights(weights_text, len(values), spec)
    return ArrivalPattern(**fields)


def _weights(text: str, n: int, spec: str) -> tuple[float, ...] | None:
    if not text:
        return None
    raw = [float(_nonnegative(w, spec)) for w in text.split(",")]
    if len(raw) == 1 and n == 2:
        if raw[0] > 1:
            raise ValueError(f"arrival pattern {spec!r}: P(long) must be in [0, 1], got {raw[0]}")
        raw = [1.0 - raw[0], raw[0]]
    if len(raw) != n:
        raise ValueError(f"arrival pattern {spec!r}: {n} t_max values but {len(raw)} weights")
    total = sum(raw)
    if total <= 0:
        raise ValueError(f"arrival pattern {spec!r}: weights must not all be zero")
    return tuple(w / total for w in raw)


def _nonnegative(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"arrival pattern {spec!r}: weight must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"arrival pattern {spec!r}: weights must be >= 0, got {text!r}")
    return value
