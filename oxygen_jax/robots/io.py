"""What a checkpoint says about the robot on the other end: `RobotIO`, and the rows it makes from client samples.

`ckpts.load.load_model` returns one `RobotIO` with every model, so the commands (`run`, `serve`) and the server
never ask which family a model is: they read these fields.

| field          | what                                                  | π0.5 (openpi)    | π0 (openpi) | LeRobot π0.5 / π0      |
|----------------|-------------------------------------------------------|------------------|-------------|------------------------|
| `tokenizer`    | the checkpoint's tokenizer file (or None)             | tokenizer.model  | same        | same (`tokenizer/`)    |
| `tokenizer_hint` | what to fetch when none was found (None: a stand-in is fine) | PaliGemma's | same    | same                   |
| `preprocess`   | normalisation, image resize, prompt (`Preprocess`)    | openpi, quantile | openpi, z-score, π0 prompt | LeRobot's own |
| `action_codec` | the codec a decoder-written chunk is read with        | —                | —           | —                      |
| `cameras`      | robot name -> `transforms.CameraLayout` (absent: real slots) | —                | —           | —                      |
| `robots`       | robot name -> the RobotConfig fields its config sets  | —                | —           | —                      |
| `action_horizon`, `prompt_len` | the checkpoint's own, else the robot's | robot's          | robot's     | chunk_size, tokenizer_max_length |
| `outputs`      | head name -> its own chunk-to-robot transform         | none             | none        | none                   |
| `norm_stats`   | statistics for Qwen-backbone rows (`prompt_rows`)     | —                | —           | —                      |
| `stop_ids`     | the language decoder's default stop set               | EOS              | EOS         | EOS                    |
| `notes`        | one-line start-up warnings (e.g. XR0 without a mask)  |                  |             |                        |

A `Preprocess` is one robot-side convention (openpi's: `OpenpiPreprocess`; LeRobot's:
`robots.lerobot.LeRobotPreprocess`) behind four methods: the state as the model reads it, the chunk back in
robot units, a camera image as model pixels, and the prompt ids. `observation_rows` applies it to client samples;
a model whose head reads the state as a token (π0's `state_proj`, `MultiHead.state_dims`) gets the normalised
state zero-padded to that head's dim beside the observation.

π0-FAST (openpi): `FastPreprocess` (quantile statistics, the prompt "Task: …, State: <bins>;\n" of
`robots.fast_prompt`), `action_codec` its FAST codec, `action_horizon` the codec's (openpi's universal
processor names none: then `robots`, openpi's π0-FAST configs `OPENPI_FAST_ROBOTS`: DROID 10 steps and 250
prompt tokens, LIBERO 10 and 180; the chunk's action dim is the robot's), `cameras` openpi's π0-FAST layouts (`OPENPI_FAST_CAMERAS`: the padding camera a black image with its mask True, in the order
openpi's `DroidInputs` / `LiberoInputs` give for `ModelType.PI0_FAST`; ALOHA's inputs do not depend on the model
type, so it keeps its real slots, a missing wrist masked).

Axes (`oxygen_jax.axes`): B rows, Nc cameras, Px image side, Tp prompt tokens, Ha horizon, Ad model action dim,
Ds / Da robot state / action dims.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from oxygen_jax.models.observation import Observation
from oxygen_jax.robots import fast_prompt, transforms
from oxygen_jax.robots.config import RobotConfig
from oxygen_jax.robots.normalize import NormStats
from oxygen_jax.robots.tokenizer import Tokenizer, tokenize_action_prompt


class Preprocess(abc.ABC):
    """One robot-side convention of a checkpoint: how states, actions, images and prompts are mapped."""

    @abc.abstractmethod
    def normalize_state(self, state: np.ndarray) -> np.ndarray:
        """The robot state [Ds] (π convention) as the model reads it (normalised, unpadded)."""

    @abc.abstractmethod
    def unnormalize_actions(self, actions: np.ndarray) -> np.ndarray:
        """Model actions [..., Ha, Ad] (normalised) in the robot's units (every dim; the caller slices)."""

    @abc.abstractmethod
    def pixels(self, image: np.ndarray, size: int) -> np.ndarray:
        """One camera image, uint8 [Hi, Wi, 3], as model pixels float32 [size, size, 3] in [-1, 1]."""

    @abc.abstractmethod
    def prompt(self, tokenizer: Tokenizer, task: str, state: np.ndarray, max_len: int,
               robot: RobotConfig) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [Tp], mask bool [Tp]) of the action prompt for `task` and the normalised state."""


@dataclasses.dataclass(frozen=True, eq=False)
class OpenpiPreprocess(Preprocess):
    """openpi's conventions (`robots.transforms`): quantile (π0.5) or z-score (π0) statistics with its 1e-6,
    PIL's bilinear resize with pad on uint8, and the π0.5 prompt with the state's 256 bins when
    `state_in_prompt` (None: the robot's `discrete_state_input`, as openpi's per-robot configs set it), else the
    π0 prompt (the cleaned task, then "\\n")."""

    norm_stats: Mapping[str, NormStats] | None = None
    quantile: bool = True
    state_in_prompt: bool | None = None

    def normalize_state(self, state: np.ndarray) -> np.ndarray:
        return transforms.normalize_state(state, self.norm_stats, quantile=self.quantile)

    def unnormalize_actions(self, actions: np.ndarray) -> np.ndarray:
        return transforms.unnormalize_actions(actions, self.norm_stats, quantile=self.quantile)

    def pixels(self, image: np.ndarray, size: int) -> np.ndarray:
        return transforms.to_model_pixels(transforms.resize_with_pad(image, size, size))

    def prompt(self, tokenizer, task, state, max_len, robot):
        in_prompt = robot.discrete_state_input if self.state_in_prompt is None else self.state_in_prompt
        return tokenize_action_prompt(tokenizer, task, state if in_prompt else None, max_len)


@dataclasses.dataclass(frozen=True, eq=False)
class FastPreprocess(OpenpiPreprocess):
    """π0-FAST's openpi conventions: quantile statistics, and the prompt with the normalised, unpadded state's bins
    (`robots.fast_prompt.tokenize`: BOS "Task: <prompt>, State: <bins>;\n", 0-padded)."""

    def prompt(self, tokenizer, task, state, max_len, robot):
        row = fast_prompt.tokenize(tokenizer, task, np.asarray(state, np.float64).reshape(-1), max_len)
        return row.tokens, row.mask


_Z = transforms.ZEROS
OPENPI_FAST_CAMERAS = {  # openpi's π0-FAST inputs per client format (policies/droid_policy.py, libero_policy.py)
    "droid": transforms.CameraLayout(("base_0_rgb", _Z, "left_wrist_0_rgb")),  # base_0_rgb, base_1_rgb, wrist_0_rgb
    "libero": transforms.CameraLayout(("base_0_rgb", "left_wrist_0_rgb", _Z)),  # right wrist unmasked
}
OPENPI_FAST_ROBOTS = {  # openpi's π0-FAST configs per client format: the chunk's horizon, the prompt's tokens
    "droid": {"action_horizon": 10, "max_token_len": 250},  # pi0_fast_droid (Pi0FASTConfig's default 250 tokens)
    "libero": {"action_horizon": 10, "max_token_len": 180},  # pi0_fast_libero
}


@dataclasses.dataclass(frozen=True, eq=False)
class RobotIO:
    """A checkpoint's robot I/O facts (module table). Defaults: a model with no facts of its own (a random preset)."""

    tokenizer: Path | None = None
    tokenizer_hint: str | None = None  # the file to fetch when `tokenizer` is None and the model needs its own
    preprocess: Preprocess | None = None  # None: openpi's with no statistics (π0.5 observation rows)
    action_horizon: int | None = None  # the checkpoint's chunk length; None: the robot's
    prompt_len: int | None = None  # the checkpoint's prompt tokens; None: the robot's
    outputs: Mapping[str, Callable[[np.ndarray], np.ndarray]] = dataclasses.field(default_factory=dict)
    norm_stats: Mapping[str, NormStats] | None = None  # statistics of Qwen-backbone rows (`prompt_rows`)
    stop_ids: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    action_codec: object = None  # what reads a decoder-written chunk (π0-FAST: `robots.fast.FastCodec`), or None
    cameras: Mapping[str, transforms.CameraLayout] = dataclasses.field(default_factory=dict)  # robot name -> inputs
    robots: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)  # robot name -> its config's fields

    def robot(self, robot: RobotConfig) -> RobotConfig:
        """`robot` with the fields the checkpoint's config for it sets (`robots`: openpi's π0-FAST horizon and
        prompt tokens), then the checkpoint's own horizon and prompt length where it has them."""
        changes = dict(self.robots.get(robot.name, {}))
        changes.update({k: v for k, v in (("action_horizon", self.action_horizon), ("max_token_len", self.prompt_len))
                        if v})
        return robot.replace(**changes) if changes else robot

    @property
    def rows(self) -> Preprocess:
        return self.preprocess or OpenpiPreprocess()

    def camera_layout(self, robot: RobotConfig) -> transforms.CameraLayout | None:
        """The camera inputs this checkpoint reads from `robot` (None: its real slots, padding dropped)."""
        return self.cameras.get(robot.name)


def observation_rows(io: RobotIO, robot: RobotConfig, image_size: int, vocab_size: int, tokenizer: Tokenizer,
                     samples: Sequence[Mapping], *, state_dim: int = 0,
                     default_prompt: str | None = None) -> tuple[Observation, np.ndarray | None]:
    """Client samples -> (the model's `Observation`, and for a state token the states float32 [B, state_dim]).

    Per sample (`transforms.observation_arrays`; `transforms.robot_inputs` reads the robot's client format):
    the state normalised by `io.rows`, each camera input of `io.camera_layout(robot)` (default: the real slots)
    mapped to model pixels, the prompt tokenized to
    `robot.max_token_len`; the state token's input (`state_dim` > 0) is the normalised state zero-padded.

    Raises:
      ValueError naming the sample index and the key at fault.
    """
    pre = io.rows
    return transforms.observation_arrays(
        robot, image_size, vocab_size, samples, default_prompt=default_prompt, normalize=pre.normalize_state,
        pixels=pre.pixels, prompt=lambda task, state, t: pre.prompt(tokenizer, task, state, t, robot),
        state_dim=state_dim, cameras=io.camera_layout(robot))


def robot_chunk(io: RobotIO, robot: RobotConfig, chunk: np.ndarray, client_state: np.ndarray | None) -> np.ndarray:
    """A model chunk [Ha, Ad] (normalised) -> robot commands [Ha, Da]: `io.rows` un-normalises, then the
    robot's own output transform (`transforms.robot_outputs`: ALOHA's absolute joints, the slice to Da)."""
    return transforms.robot_outputs(robot, io.rows.unnormalize_actions(np.asarray(chunk, np.float64)), client_state)
