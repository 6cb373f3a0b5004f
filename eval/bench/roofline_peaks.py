"""Device peaks: the current device's matmul rate and memory bandwidth measured as JAX programs, and a table
of datasheet peaks for the GPUs the predictions are made for.

Measured (`probes`: timed in the same rounds as the components, interleaved with them, so under the same load;
`measure`: the probes alone):

    matmul     C = A B, square, in the compute dtype (float32 on CPUs, bfloat16 elsewhere), at two sizes;
               FLOP/s = 2 n^3 / t, the larger of the two
    sum        one read of a large array (a reduction): bytes / t
    copy       y = x * c into a donated buffer of the same size: read + write, 2 bytes / t
    gemv       one row times a large matrix ([1, K] @ [K, N]): what a batch-1 decode step's layers do
               (weight bytes / t)

Each is the median of several warm, waited-for runs, the arrays several times larger than the last-level
cache; `bandwidth` is the larger of the two read streams (sum, gemv), the roofline's; the copy (its reads and
writes counted) shows what reading and writing at once reach.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from eval.bench import roofline_measure


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """A device's peaks (dense, no sparsity) and where each figure comes from."""

    name: str
    bf16_flops: float  # FLOP/s, dense 16-bit tensor-core matmul with float32 accumulation
    fp32_flops: float | None  # FLOP/s, float32 without tensor cores (TF32 not counted); None: no published figure
    bandwidth: float  # bytes/s, device memory
    memory_gb: float
    source: str  # the document the figures are read from; "derived" marks arithmetic on it


_SHEETS = (  # name, dense BF16 TFLOP/s, FP32 TFLOP/s, GB/s, GB, source
    ("RTX 4090", 165.2, 82.6, 1008, 24,
     "NVIDIA Ada Lovelace GPU architecture whitepaper (AD102 / RTX 4090 table: FP16/BF16 tensor TFLOPS with FP32 "
     "accumulate 165.2 dense, FP32 82.6; 21 Gbps GDDR6X on 384 bits = 1,008 GB/s)"),
    ("H100 SXM", 989.4, 66.9, 3350, 80,
     "NVIDIA H100 Tensor Core GPU datasheet (SXM: BF16 1,979 TFLOPS with sparsity, i.e. 989.4 dense; FP32 67 TFLOPS; "
     "HBM3 3.35 TB/s)"),
    ("H100 PCIe", 756.5, 51.2, 2000, 80,
     "NVIDIA H100 Tensor Core GPU datasheet (PCIe: BF16 1,513 TFLOPS with sparsity, 756 dense; FP32 51 TFLOPS; HBM2e "
     "2 TB/s)"),
    ("H200 SXM", 989.4, 66.9, 4800, 141,
     "NVIDIA H200 Tensor Core GPU datasheet (BF16 1,979 TFLOPS with sparsity, 989 dense; FP32 67 TFLOPS; HBM3e "
     "4.8 TB/s, 141 GB)"),
    ("Jetson AGX Thor", 258.75, None, 273, 128,
     "NVIDIA Jetson AGX Thor / T5000 module data (2,070 FP4 TFLOPS with sparsity; 128 GB LPDDR5X at 273 GB/s); BF16 "
     "derived: 2,070 / 2 (dense) / 4 (FP4 -> 16-bit rate), not a datasheet figure"),
    ("Jetson AGX Orin 64GB", 42.5, 5.3, 204.8, 64,
     "NVIDIA Jetson AGX Orin series technical brief (GPU 170 sparse INT8 TOPS, 5.3 FP32 TFLOPS; LPDDR5 204.8 GB/s); "
     "FP16/BF16 tensor derived: 170 / 2 (dense) / 2 (INT8 -> 16-bit rate)"),
)

DATASHEETS: tuple[Device, ...] = tuple(
    Device(name=n, bf16_flops=bf16 * 1e12, fp32_flops=None if fp32 is None else fp32 * 1e12, bandwidth=gbs * 1e9,
           memory_gb=gb, source=src) for n, bf16, fp32, gbs, gb, src in _SHEETS)
"""The devices `eval.roofline` predicts for. Peaks are what the hardware could do at best; the predictions
built on them are lower bounds on time (upper bounds on rates)."""


def datasheet(name: str) -> Device:
    for d in DATASHEETS:
        if d.name == name:
            return d
    raise ValueError(f"no datasheet for {name!r}; known: {', '.join(d.name for d in DATASHEETS)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Peaks:
    """What `measure` found on the current device."""

    device: str  # JAX's device kind
    backend: str
    dtype: str  # of the matmul probe
    matmul_flops: float  # FLOP/s
    matmul_by_size: dict  # n -> FLOP/s
    sum_bandwidth: float  # bytes/s
    copy_bandwidth: float
    gemv_bandwidth: float
    probe_bytes: int  # size of each streaming probe's array
    loadavg: tuple[float, float, float]  # os.getloadavg() when the probes started

    @property
    def bandwidth(self) -> float:
        """The best read stream a JAX program reached (sum, gemv): what the components mostly do, reading weights
        and K/V. The copy's rate (reads and writes at once) is reported beside it."""
        return max(self.sum_bandwidth, self.gemv_bandwidth)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "bandwidth": self.bandwidth}


@dataclasses.dataclass(frozen=True)
class Probe:
    """One peak probe: a factory of its call and the work one call does."""

    factory: Callable[[], Callable]  # returns the call (arrays made once, outside the timing)
    work: float  # FLOPs (matmul) or bytes moved (streams) per call


def probes(dtype: str | None = None, *, probe_bytes: int | None = None,
           sizes: tuple[int, ...] | None = None) -> tuple[str, int, dict[str, Probe]]:
    """(dtype, probe bytes, name -> `Probe`) of the default device: 'matmul:<n>' per size, 'sum', 'copy', 'gemv'.

    Args:
      dtype: of the probes; default float32 on CPUs, bfloat16 elsewhere (what the models run in).
      probe_bytes: array size of the streaming probes; default 512 MiB on CPUs, 2 GiB elsewhere.
      sizes: matmul sides; default (1024, 2048) on CPUs, (4096, 8192) elsewhere.
    """
    cpu = jax.default_backend() == "cpu"
    dtype = dtype or ("float32" if cpu else "bfloat16")
    sizes = sizes or ((1024, 2048) if cpu else (4096, 8192))
    probe_bytes = probe_bytes or ((512 if cpu else 2048) << 20)
    dt = jnp.dtype(dtype)
    n = probe_bytes // dt.itemsize
    arrays: dict = {}  # made on first use, kept for the run

    def array(key, make):
        if key not in arrays:
            arrays[key] = make()
        return arrays[key]

    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=dt))
    total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    scale = jax.jit(lambda x: x * jnp.asarray(1.0001, x.dtype), donate_argnums=0)
    gemv = jax.jit(lambda v, w: v @ w)
    k = 4096

    def copy_call():
        held = [array("copy", lambda: jnp.ones((n,), dt))]

        def run():
            held[0] = arrays["copy"] = scale(held[0])
            return held[0]
        return run

    out = {f"matmul:{m}": Probe(lambda m=m: (lambda a=array(m, lambda: jax.random.normal(jax.random.key(m), (m, m), dt)):
                                             mm(a, a)), 2.0 * m ** 3) for m in sizes}
    out["sum"] = Probe(lambda: (lambda x=array("sum", lambda: jnp.ones((n,), dt)): total(x)), n * dt.itemsize)
    out["copy"] = Probe(copy_call, 2 * n * dt.itemsize)
    out["gemv"] = Probe(lambda: (lambda w=array("gemv", lambda: jnp.ones((k, n // k), dt)), v=jnp.ones((1, k), dt):
                                 gemv(v, w)), (n // k) * k * dt.itemsize)
    return dtype, int(probe_bytes), out


def from_times(dtype: str, probe_bytes: int, found: dict[str, Probe], ms: dict[str, float],
               loadavg: tuple[float, float, float]) -> Peaks:
    """`Peaks` from the probes' median times (ms)."""
    rate = {name: p.work / (ms[name] * 1e-3) for name, p in found.items()}
    by_size = {int(name.split(":")[1]): r for name, r in rate.items() if name.startswith("matmul:")}
    return Peaks(device=jax.devices()[0].device_kind, backend=jax.default_backend(), dtype=dtype,
                 matmul_flops=max(by_size.values()), matmul_by_size=by_size, sum_bandwidth=rate["sum"],
                 copy_bandwidth=rate["copy"], gemv_bandwidth=rate["gemv"], probe_bytes=probe_bytes, loadavg=loadavg)


def measure(dtype: str | None = None, *, probe_bytes: int | None = None, sizes: tuple[int, ...] | None = None,
            repeats: int = 7) -> Peaks:
    """Matmul rate and streaming bandwidth of the default device, the probes alone (`probes`; warm medians)."""
    dtype, size, found = probes(dtype, probe_bytes=probe_bytes, sizes=sizes)
    load = tuple(os.getloadavg())
    ms, _ = roofline_measure.measure({name: p.factory for name, p in found.items()}, repeats)
    return from_times(dtype, size, found, ms, load)
