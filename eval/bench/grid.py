"""What a benchmark run measures: the settings, the workloads, the named grids and their `Group`s.

A *group* is one (workload, denoise steps S, decode length N, arrival pattern) grid point. Every selected
setting runs the group's frames side by side; continuous batching runs once per tokens-per-frame k of the
group. S and N keep their one-letter names in the command line (`--S`, `--N`), in group names
(`libero_S10_N30_uniform-1`) and in the result JSON (`"S"`, `"N"`), as in the paper's tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from eval.bench import arrivals as arrivals_lib
from oxygen_jax.runtime import frame as schedule

SETTINGS = schedule.BENCH_SETTINGS
DEFAULT_SETTINGS = schedule.SETTINGS  # actions_only (prefill + denoise, no text) is an opt-in reference
WORKLOADS = ("libero", "droid", "aloha")
PAPER_K = (1, 2, 3, 5, 6, 10, 15, 30)


def _paper_ks(n: int) -> list[int]:
    return [k for k in PAPER_K if n % k == 0]


def _all_divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _figure_ks(n: int) -> list[int]:
    return [1, 2, 3, 5, 10] if n == 30 else [5]


_WORKLOAD_SWEEP = (
    [f"uniform:{r:g}:tmax=30" for r in (0.25, 0.5, 1, 2, 4)]
    + [f"poisson:{lam:g}:tmax=30" for lam in (0.5, 1, 1.5, 2)]
    + [f"random_length:5,20@{p:g}" for p in (0.1, 0.3, 0.5, 0.7, 0.9)]
)

GRIDS: dict[str, dict] = {
    # The paper's default sweep: all workloads, S x N, k in the paper's set dividing N.
    "paper": dict(workloads=WORKLOADS, S=(5, 10, 15, 20), N=(5, 10, 15, 20, 30), k=_paper_ks,
                  arrivals=("uniform:1",), frames=50),
    # The paper's figures: S = 10, k = 5 over N, and k in {1,2,3,5,10} at N = 30 (LIBERO).
    "figure": dict(workloads=("libero",), S=(10,), N=(5, 10, 15, 20, 30), k=_figure_ks,
                   arrivals=("uniform:1",), frames=30),
    # The paper's workload sweep: LIBERO, S = 10, N = 30, k = 5 under different arrival patterns.
    "workload": dict(workloads=("libero",), S=(10,), N=(30,), k=lambda n: [5], arrivals=tuple(_WORKLOAD_SWEEP),
                     frames=50),
    # Small grid for the tiny preset: enough points for every table and plot.
    "quick": dict(workloads=("libero",), S=(10,), N=(10, 20, 30), k=lambda n: [1, 5, 10],
                  arrivals=("uniform:1",), frames=30),
}


@dataclasses.dataclass(frozen=True)
class Group:
    """One grid point shared by all settings: continuous batching runs once per k in `ks`."""

    workload: str
    num_steps: int  # S: denoise steps (0 with several heads: each head its own)
    decode_len: int  # N: tokens per request (a request's own t_max may cap it)
    arrival: str
    ks: tuple[int, ...]  # tokens per request per frame of the continuous runs

    @property
    def name(self) -> str:
        arrival = re.sub(r"[^A-Za-z0-9.]+", "-", self.arrival).strip("-")
        return f"{self.workload}_S{self.num_steps}_N{self.decode_len}_{arrival}"

    def to_json(self) -> dict:
        """The record of result files (their keys S and N, as the paper writes them)."""
        return {"workload": self.workload, "S": self.num_steps, "N": self.decode_len, "arrival": self.arrival,
                "ks": list(self.ks), "name": self.name}


def build_grid(args: argparse.Namespace) -> list[Group]:
    """Groups from the named grid, with any explicit --workloads/--S/--N/--k/--arrival replacing its lists."""
    grid = GRIDS[args.grid]
    workloads = args.workloads or grid["workloads"]
    steps = args.num_steps or ((0,) if getattr(args, "heads", None) else grid["S"])  # 0: each head's own steps
    lengths = args.decode_len or grid["N"]
    specs = args.arrival or grid["arrivals"]
    if args.k is None:
        k_of = grid["k"]
    elif args.k == ["div"]:
        k_of = _paper_ks
    elif args.k == ["alldiv"]:
        k_of = _all_divisors
    else:
        fixed = [int(k) for k in args.k]
        k_of = lambda n: fixed  # noqa: E731
    groups = []
    for w in workloads:
        for s in steps:
            for n in lengths:
                ks = tuple(sorted(set(k_of(n)))) if "continuous" in args.settings else ()
                if "continuous" in args.settings and not ks:
                    raise SystemExit(f"error: no tokens-per-frame k for N = {n}; pass --k explicitly")
                for spec in specs:
                    groups.append(Group(workload=w, num_steps=s, decode_len=n, arrival=str(arrivals_lib.parse(spec)),
                                        ks=ks))
    return groups
