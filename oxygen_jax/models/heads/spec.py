"""`HeadSpec`: what every action head kind shares (name, dims, Euler steps) and answers; `DitSpec`: the
step-index flow of the DiT kinds. Each kind's own spec lives beside its maths and checks only its fields:

| spec type (module)                | kind           | model                          |
|-----------------------------------|----------------|--------------------------------|
| `JointKvSpec` (`heads.joint`)     | `joint_kv`     | XR0                            |
| `CrossHiddenSpec` (`heads.cross`) | `cross_hidden` | StarVLA QwenPI_v3              |
| `CrossLastSpec` (`heads.cross`)   | `cross_last`   | StarVLA QwenGR00T              |
| `AdaRmsSpec` (`heads.adarms`)     | `adarms_joint` | π0.5's action expert           |
| `TimeMlpSpec` (`heads.time_mlp`)  | `time_mlp_joint` | π0's action expert           |

Every kind answers, beside the fields below: `kind` (its label), `kv_layers` (backbone layers whose K/V it
reads), `hidden_layers` (HF hidden-state indices it reads), `extra_tokens` / `state_dim` (its tokens before
the actions; a "state" token takes a robot state [B, Ds]), `t_direction` / `direction` and `clock_start`
(its flow clock), `per_token_time` (one flow time per action token: training-time RTC), and the methods
`check_backbone`, `head_tree`, `prepare`, `velocity`, `denoise` (run by `models.heads`).

Axes (`oxygen_jax.axes`, plus the heads' own of `models.heads`): Da head width, N heads, H head dim,
F head MLP, Ha horizon, Ad action dim, Ds state dim, Dt time features.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Literal

import jax

from oxygen_jax.models import flow
from oxygen_jax.models.backbone import BackboneSpec

Kind = Literal["joint_kv", "cross_hidden", "cross_last", "adarms_joint", "time_mlp_joint"]


def require(cond: bool, msg: str) -> None:
    """Raises ValueError(msg) unless `cond` (the kinds' one-line field checks)."""
    if not cond:
        raise ValueError(msg)


def check_kv_heads(name: str, num_heads: int, num_kv_heads: int) -> None:
    """A head that reads the backbone's K/V: its N query heads share the K heads, N / K each."""
    require(num_kv_heads > 0 and num_heads % num_kv_heads == 0,
            f"{name}: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def check_reads_kv(head: HeadSpec, spec: BackboneSpec) -> None:
    """A head whose attention reads the backbone's K/V: same head dim and KV head count; kv_layers exist."""
    name = f"head {head.name!r}"
    require(head.head_dim == spec.head_dim,
            f"{name}: head_dim {head.head_dim} must equal the backbone's {spec.head_dim} (it attends to the backbone's K/V)")
    require(head.num_kv_heads == spec.num_kv_heads,
            f"{name}: num_kv_heads {head.num_kv_heads} must equal the backbone's {spec.num_kv_heads} (its K/V are "
            "concatenated to the backbone's)")
    require(all(0 <= l < spec.depth for l in head.kv_layers),
            f"{name}: kv_layers {head.kv_layers} must be backbone layers in [0, {spec.depth})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadSpec(abc.ABC):
    """One action head: its dims and flow, and what it reads from the prefix. Hashable and static.

    Abstract: build a kind's spec (table above). Checked on its own in `__post_init__` and against a
    backbone by `check_backbone` (called when a `mot.ModelSpec` is built).
    """

    name: str  # key of the head in a model and in `sample_all`'s outputs
    width: int  # Da
    depth: int  # blocks (joint layers, or DiT blocks)
    num_heads: int  # N
    head_dim: int  # H
    mlp_dim: int  # F
    action_dim: int  # Ad
    horizon: int  # Ha (0, the caller's chunk length, only where a kind allows it)
    num_steps: int  # Euler steps (static)

    kind: ClassVar[Kind]
    per_token_time: ClassVar[bool] = False  # the network takes one flow time per action token (adaRMS)
    clock_start: ClassVar[float | None] = None  # None: t from the step index (t = k / S exactly); else
    #   the accumulated float32 clock from this t (openpi's `t += dt` from 1.0)

    def __post_init__(self):
        self._check(f"{type(self).__name__} {self.name!r}")

    def _check(self, name: str) -> None:
        """The field checks of this kind (subclasses extend it)."""
        require(bool(self.name), f"{type(self).__name__}.name must be a non-empty string")
        for f in ("width", "depth", "num_heads", "head_dim", "mlp_dim", "action_dim", "num_steps"):
            require(getattr(self, f) > 0, f"{name}: {f} must be positive, got {getattr(self, f)}")
        require(self.horizon >= 0, f"{name}: horizon must be >= 0, got {self.horizon}")

    @property
    def direction(self) -> float:
        """+1.0 for a 0_to_1 clock (t = 0 noise -> 1 actions), -1.0 for 1_to_0."""
        return 1.0 if self.t_direction == "0_to_1" else -1.0

    @abc.abstractmethod
    def check_backbone(self, spec: BackboneSpec) -> None:
        """Raises ValueError naming the field when this head cannot read `spec`'s prefix."""

    @abc.abstractmethod
    def params_type(self) -> type:
        """The class of this kind's weights."""

    @abc.abstractmethod
    def head_tree(self, draw) -> Any:
        """The parameters with every leaf from `draw` (`backbone.decoder_tree`)."""

    @abc.abstractmethod
    def prepare(self, params, prefix, state: jax.Array | None) -> Any:
        """Once per frame: what every denoise step reads (see `models.heads.prepare`)."""

    @abc.abstractmethod
    def velocity(self, params, st, x_t: jax.Array, step: jax.Array) -> jax.Array:
        """v(x_t) float32 [B, Ha, Ad] at an Euler step (see `models.heads.velocity`)."""

    @abc.abstractmethod
    def denoise(self, params, st, noise: jax.Array) -> jax.Array:
        """`num_steps` Euler steps from `noise` on this kind's clock (see `models.heads.denoise`)."""

    def check_params(self, params) -> None:
        want = self.params_type()
        require(isinstance(params, want),
                f"head {self.name!r} is {self.kind} and needs {want.__name__} weights, got {type(params).__name__}")

    def check_noise(self, noise: jax.Array, b: int) -> None:
        """Noise must be [B, Ha, Ad] (horizon 0: any Ha >= 1)."""
        if self.horizon == 0:
            if noise.ndim != 3 or noise.shape[0] != b or noise.shape[2] != self.action_dim or noise.shape[1] < 1:
                raise ValueError(f"head {self.name!r} needs noise [B, Ha, Ad] = ({b}, Ha >= 1, {self.action_dim}), got {noise.shape}")
            return
        want = (b, self.horizon, self.action_dim)
        if noise.shape != want:
            raise ValueError(f"head {self.name!r} needs noise [B, Ha, Ad] = {want}, got {noise.shape}")

    def replace(self, **changes) -> HeadSpec:
        """A copy with `changes` (checked again); a field this kind does not have is a one-line ValueError."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        require(not unknown, f"{type(self).__name__} ({self.kind}) has no field {', '.join(map(repr, unknown))}; "
                             f"its fields are {sorted(fields)}")
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DitSpec(HeadSpec):
    """A DiT head on the step-index clock (XR0, StarVLA): step k feeds t = k / S (0_to_1) or 1 - k / S,
    as t * time_scale or its integer bucket, through Dt sinusoid features."""

    t_direction: Literal["0_to_1", "1_to_0"] = "0_to_1"  # 0_to_1: t = 0 noise -> 1 actions (XR0, StarVLA)
    time_input: Literal["continuous", "bucket"]  # the network sees t * time_scale, or floor(t * time_scale)
    time_scale: int = 1000
    time_embed_dim: int = 256  # Dt
    state_dim: int = 0  # Ds of the state token's encoder (0: no state token)

    def _check(self, name: str) -> None:
        super()._check(name)
        require(self.horizon > 0, f"{name}: horizon must be positive, got {self.horizon}")
        for f in ("time_scale", "time_embed_dim"):
            require(getattr(self, f) > 0, f"{name}: {f} must be positive, got {getattr(self, f)}")
        require(self.state_dim >= 0, f"{name}: state_dim must be >= 0, got {self.state_dim}")
        require(self.time_embed_dim % 2 == 0, f"{name}: time_embed_dim must be even, got {self.time_embed_dim}")
        require(self.t_direction in ("0_to_1", "1_to_0"), f"{name}: t_direction must be '0_to_1' or '1_to_0', got {self.t_direction!r}")
        require(self.time_input in ("continuous", "bucket"), f"{name}: time_input must be 'continuous' or 'bucket', got {self.time_input!r}")

    @property
    def num_tokens(self) -> int:
        """T = Ne + Ha."""
        return self.num_extra + self.horizon

    def denoise(self, params, st, noise: jax.Array) -> jax.Array:
        """`flow.integrate` without `t0`: the time of step k is k / S exactly."""
        return flow.integrate(lambda x, k: self.velocity(params, st, x, k), noise, self.num_steps, self.direction)
