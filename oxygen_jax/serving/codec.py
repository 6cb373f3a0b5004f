"""What the server needs of a model family: client samples to model rows, rows to a step, chunks back.

One codec per served model; the batcher and the server call only these methods, so π0.5 and a backbone
with several heads are served by the same code:

    sample ──prepare──► row (batch 1) ──batch(rows, bucket)──► (inputs, states) ──Engine.step──► head chunks
    head chunks [B, Ha, Ad] ──outputs(i)──► "actions" (primary head, robot units) + per-head extras

* `ObservationCodec`: a SigLIP backbone (the π family): rows are `Observation`s made with the checkpoint's own
  conventions (`robots.io.observation_rows` with its `RobotIO`: openpi's or LeRobot's normalisation, resize and
  prompt), plus the normalised state for a head that reads it as a token (π0); one head, so a response is
  exactly openpi's. A model whose decoder writes the chunk (`MultiHead.action_stream`, π0-FAST) has no head and
  no noise: "actions" is that robot's decoded chunk, in robot units (a chunk that failed is the engine's
  `row_errors`, answered as that robot's BadRequest naming why, and `failure_advice`: openpi's zeros are
  `serve --chunk-on-failure zeros`). Its camera inputs are the checkpoint's (`RobotIO.cameras`: openpi's π0-FAST
  feeds DROID's and LIBERO's padding camera as an unmasked black image).
* `HeadsCodec`: rows are `prompt_rows.PromptRows` (image tokens + prompt, left-padded to a fixed length;
  a text-only backbone's rows are the prompt alone); the primary head's chunk is "actions" (a model without
  a head, a language-only backbone, answers an empty [0, Da] chunk and metadata "action_horizon": 0; its
  language results come as for any model), and every head's chunk is under "heads": {name: [Ha, Da]} —
  in robot units (unnormalised, sliced to the robot's action dim) when the head has at least the robot's
  action dims, else as the head emits it. A head restored with its own un-normalisation (StarVLA's
  `dataset_statistics.json`) is mapped by that function instead (`outputs=`). With a chat tokenizer (a
  checkpoint's `tokenizer.json`, `native_prompts.QwenTokenizer`) the rows are the native prompts of the
  model's family (`robots.native_prompts`: XR0's deploy prompt, StarVLA's chat template), left-padded
  to the same fixed length, every camera slot an `image_size` square.

Noise is deterministic per (seed, stream, frame, head): `frame_noise`.

Every row is bounded before it is batched (`prepare`, on a prep thread): images are uint8 pixels, prompt
ids the tokenizer's (client text is plain text: `native_prompts`), and a state that a head's state token
reads (XR0, GR00T) lies within +-`runtime.engine.MAX_STATE_ABS` as the model reads it (normalised); a
row beyond it is refused naming the client's state field (`state_field`); π0's state token likewise. π0.5 and
QwenPI_v3 read the state as 256 prompt bins, so any finite state is bounded there by construction.

Axes: B rows of a step, Ha horizon, Ad model (head) action dim, Da robot action dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from oxygen_jax.models.observation import Observation
from oxygen_jax.robots import io as robot_io
from oxygen_jax.robots import native_prompts, prompt_rows, transforms
from oxygen_jax.robots.config import RobotConfig
from oxygen_jax.robots.io import RobotIO
from oxygen_jax.runtime.engine import MAX_STATE_ABS

STATE_FIELDS = {"libero": "observation/state", "droid": "observation/joint_position and observation/gripper_position",
                "aloha": "state"}  # the client fields that make up the state, per robot format


def frame_noise(seed: int, stream: int, frame: int, horizon: int, action_dim: int, head: int = 0) -> np.ndarray:
    """Noise [horizon, action_dim] of one row: frame `frame` of stream `stream`, head number `head`.

    Standard normal from `np.random.default_rng([seed, stream, frame])` for head 0 (so a one-head server
    draws what it always drew) and `default_rng([seed, stream, frame, head])` for the others: reproducible
    from the server seed, the stream id in the metadata and the `frame` index of the response.
    """
    key = [seed, stream, frame] + ([head] if head else [])
    return np.random.default_rng(key).standard_normal((horizon, action_dim)).astype(np.float32)


def _stack_rows(parts: Sequence, rows: int) -> np.ndarray:
    """Concatenates batch-1 arrays and pads to `rows` by repeating the first row."""
    x = np.concatenate([np.asarray(p) for p in parts], axis=0)
    return np.concatenate([x, np.repeat(x[:1], rows - len(x), axis=0)], axis=0) if rows > len(x) else x


def _stack_observations(observations: Sequence[Observation], rows: int) -> Observation:
    """Concatenates batch-1 observations and pads to `rows` by repeating the first one."""
    return Observation(*(_stack_rows(parts, rows) for parts in zip(*(dataclasses.astuple(o) for o in observations))))


class _Codec:
    """What both input kinds share: the robot, its tokenizer and I/O facts, noise and the output transform."""

    def __init__(self, engine, robot: RobotConfig, tokenizer, io: RobotIO, default_prompt: str | None = None):
        self.engine, self.robot, self.tokenizer = engine, robot, tokenizer
        self.io, self.norm_stats, self.default_prompt = io, io.norm_stats, default_prompt
        self.vla = engine.vla
        self.heads = self.vla.heads
        self.shapes = {n: self.vla.action_shape(n, engine.config.action_horizon) for n in self.heads}
        self.stream = self.vla.action_stream  # None: the heads give the chunks

    @property
    def primary(self) -> str:
        return self.vla.primary

    @property
    def state_field(self) -> str:
        """The client's state field(s), for refusals."""
        return STATE_FIELDS.get(self.robot.name, "the state")

    @property
    def failure_advice(self) -> str:
        """What a robot whose row failed is told after the reason: a decoded chunk's failure is the model's, not the
        robot's input (the reason names it: no "Action: ", a FAST decode, the deadline), so it names openpi's
        fallback; a head's non-finite chunk points at the inputs."""
        if self.stream is not None:
            return "openpi's all-zero chunk instead: serve --chunk-on-failure zeros"
        return f"check {self.state_field} and the images"

    def _bound_state(self, state) -> None:
        """ValueError naming the state field when a head's state token would read |x| > MAX_STATE_ABS."""
        dims = self.vla.state_dims()
        if not dims or state is None:
            return
        peak = float(np.abs(np.asarray(state, np.float64)[..., : max(dims.values())]).max(initial=0.0))
        if peak > MAX_STATE_ABS:
            raise ValueError(f"{self.state_field}: the state as the model reads it reaches {peak:.3g}, beyond "
                             f"+-{MAX_STATE_ABS:g} (engine.MAX_STATE_ABS); send the robot's normalised state")

    def example(self):
        """A row from a synthetic sample (warm-up compiles every bucket with it)."""
        return self.prepare(transforms.synthetic_sample(self.robot, np.random.default_rng(0)))

    def noise(self, seed: int, streams: Sequence[int], frames: Sequence[int], bucket: int) -> dict[str, np.ndarray]:
        """head name -> [bucket, Ha, Ad]: row i is `frame_noise` of (streams[i], frames[i]); padding rows zero."""
        out = {}
        for h, name in enumerate(self.heads):
            x = np.zeros((bucket, *self.shapes[name]), np.float32)
            for i, (s, f) in enumerate(zip(streams, frames)):
                x[i] = frame_noise(seed, s, f, *self.shapes[name], head=h)
            out[name] = x
        return out

    def prompt_full(self, row) -> bool:
        """Whether a row's prompt fills every prompt token (families that refuse over-long prompts: False)."""
        return False

    def _robot_chunk(self, chunk: np.ndarray, state: np.ndarray) -> np.ndarray:
        return transforms.robot_outputs(self.robot, chunk, state, self.norm_stats)

    def metadata(self) -> dict:
        if self.stream is not None:
            return {"action_horizon": self.stream.horizon, "noise": {"rule": "none: the chunk is decoded tokens (greedy)"}}
        if not self.heads:  # a language-only model: every reply's "actions" is an empty chunk
            return {"action_horizon": 0, "primary_head": None, "noise": {"rule": "none: the model has no action head"}}
        ha, ad = self.shapes[self.primary]
        meta = {"action_horizon": ha, "noise": {"rule": "np.random.default_rng([seed, stream, frame]).standard_normal("
                                                        f"({ha}, {ad})).astype(np.float32)"}}
        if len(self.heads) > 1:
            meta["heads"] = {n: {"action_horizon": s[0], "model_action_dim": s[1]} for n, s in self.shapes.items()}
            meta["primary_head"] = self.primary
            meta["noise"]["heads"] = "head number h > 0 (in the order of 'heads') uses default_rng([seed, stream, frame, h])"
        return meta


@dataclasses.dataclass(frozen=True)
class ObservationRow:
    """One robot's row for a SigLIP backbone (batch 1): the observation, and the state token's input [1, Ds]
    (the normalised state, zero-padded) or None when no head reads the state as a token."""

    observation: Observation
    state: np.ndarray | None = None


class ObservationCodec(_Codec):
    """A SigLIP backbone (the π family): rows are `ObservationRow`s made with the checkpoint's conventions
    (`robots.io.observation_rows`); the response is openpi's ("actions" only)."""

    def __init__(self, engine, robot: RobotConfig, tokenizer, io: RobotIO, default_prompt: str | None = None):
        super().__init__(engine, robot, tokenizer, io, default_prompt)
        self.image_size = self.vla.spec.backbone.vision.image_size
        self.state_dims = self.vla.state_dims()  # head name -> Ds of heads reading the state as a token (π0)
        if len(set(self.state_dims.values())) > 1:
            raise ValueError(f"heads read states of different dims {self.state_dims}: one robot state cannot feed them")

    def prepare(self, sample: Mapping) -> ObservationRow:
        dim = max(self.state_dims.values(), default=0)
        obs, state = robot_io.observation_rows(self.io, self.robot, self.image_size, self.vla.vocab_size,
                                               self.tokenizer, [sample], state_dim=dim,
                                               default_prompt=self.default_prompt)
        self._bound_state(state)
        return ObservationRow(obs, state)

    def batch(self, rows: Sequence[ObservationRow], bucket: int):
        obs = _stack_observations([r.observation for r in rows], bucket)
        if not self.state_dims:
            return obs, None
        states = _stack_rows([r.state for r in rows], bucket)
        return obs, {name: states for name in self.state_dims}

    def prompt_full(self, row) -> bool:
        """The row's prompt fills every prompt token (a longer one was cut to fit)."""
        return bool(np.asarray(row.observation.token_mask)[0, -1])

    def _robot_chunk(self, chunk: np.ndarray, state: np.ndarray) -> np.ndarray:
        return robot_io.robot_chunk(self.io, self.robot, chunk, state)

    def outputs(self, head_actions: Mapping[str, np.ndarray], i: int, state: np.ndarray) -> tuple[np.ndarray, dict]:
        name = self.primary if self.stream is None else self.stream.name
        return self._robot_chunk(head_actions[name][i], state), {}


class HeadsCodec(_Codec):
    """A `ModelSpec` (Qwen3-VL backbone, several heads): rows are `PromptRows`; every head's chunk is returned."""

    def __init__(self, engine, robot: RobotConfig, tokenizer, io: RobotIO, default_prompt: str | None = None, *,
                 image_size: int, prompt_len: int,
                 outputs: Mapping[str, Callable[[np.ndarray], np.ndarray]] | None = None):
        super().__init__(engine, robot, tokenizer, io, default_prompt)
        self.spec, self.image_size, self.prompt_len = self.vla.spec, image_size, prompt_len
        self.transforms = dict(outputs or {})  # head name -> chunk [Ha, Ad] -> robot units
        if set(self.transforms) - set(self.heads):
            raise ValueError(f"outputs names heads {sorted(set(self.transforms) - set(self.heads))} this model does "
                             f"not have (it has {list(self.heads)})")
        prompt_rows.image_tokens(self.spec, image_size)  # fails early on an image size the ViT cannot patch
        self.native = native_family(self.spec, tokenizer)

    def prepare(self, sample: Mapping) -> prompt_rows.PromptRows:
        if self.native:
            rows, views = native_prompts.client_rows(self.robot, [sample], image_size=self.image_size,
                                                     default_prompt=self.default_prompt)
            built = native_prompts.build_rows(self.native, self.spec, self.tokenizer, rows, prompt_len=self.prompt_len,
                                              views=views)
            row = prompt_rows.PromptRows(ids=built.ids, mask=built.mask, images=np.stack(built.images)[None],
                                         state=built.state)
        else:
            row = prompt_rows.make_rows(self.robot, self.spec, self.tokenizer, [sample], self.norm_stats,
                                        image_size=self.image_size, prompt_len=self.prompt_len,
                                        default_prompt=self.default_prompt)
        self._bound_state(row.state)
        return row

    def batch(self, rows: Sequence[prompt_rows.PromptRows], bucket: int):
        inputs, states = prompt_rows.model_inputs(self.spec, prompt_rows.stack_rows(rows, bucket))
        return inputs, states or None

    def outputs(self, head_actions: Mapping[str, np.ndarray], i: int, state: np.ndarray) -> tuple[np.ndarray, dict]:
        if not self.heads:
            return np.zeros((0, self.robot.action_dim), np.float32), {}
        heads = {}
        for name in self.heads:
            chunk = np.asarray(head_actions[name][i], np.float32)
            if name in self.transforms:
                heads[name] = np.asarray(self.transforms[name](chunk), np.float32)
            else:
                heads[name] = self._robot_chunk(chunk, state) if chunk.shape[-1] >= self.robot.action_dim else chunk
        return heads[self.primary], {"heads": heads}


def native_family(spec, tokenizer) -> str | None:
    """The native prompt family (`native_prompts.family_of`) the rows of a `HeadsCodec` use, or None: plain
    prompt rows. Native rows need a chat tokenizer (a `tokenizer.json`), a first head of an XR0 / StarVLA kind
    and a vision backbone; a language-only model or a text-only backbone gets plain rows."""
    if not hasattr(tokenizer, "special_id") or not spec.heads or spec.backbone.vision is None:
        return None
    return native_prompts.family_of(spec)


def make_codec(engine, robot: RobotConfig, tokenizer, norm_stats=None, default_prompt: str | None = None, *,
               image_size: int | None = None, prompt_len: int | None = None, outputs=None,
               io: RobotIO | None = None) -> _Codec:
    """The codec of the engine's model, by its input kind: `Observation` rows for a SigLIP backbone (the π family),
    or prompt rows of `image_size` px images and `prompt_len` tokens (`outputs`: head name -> its own
    chunk-to-robot transform).

    `io`: the checkpoint's robot I/O facts (`ckpts.load.LoadedModel.io`); without it, openpi's conventions with
    `norm_stats` (quantile; the statistics of a model with heads).
    """
    if io is None:
        io = RobotIO(preprocess=robot_io.OpenpiPreprocess(norm_stats), norm_stats=norm_stats)
    elif norm_stats is not None:
        raise ValueError("give the statistics inside io (RobotIO), not beside it as norm_stats=")
    outputs = outputs if outputs is not None else (dict(io.outputs) or None)
    if engine.vla.spec.input_kind == "observation":
        if outputs:
            raise ValueError("outputs= maps the chunks of a model with heads; a π model un-normalises with its RobotIO")
        return ObservationCodec(engine, robot, tokenizer, io, default_prompt)
    if image_size is None or prompt_len is None:
        raise ValueError("serving a backbone with heads needs image_size (px) and prompt_len (tokens per row)")
    return HeadsCodec(engine, robot, tokenizer, io, default_prompt, image_size=image_size, prompt_len=prompt_len,
                      outputs=outputs)
