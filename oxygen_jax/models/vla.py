"""What the runtime drives: a vision-language-action model as one prefix pass, named action heads and a
language decoder that continues the same prefix.

Every program of `runtime.frame`, `Engine` and the server take a `MultiHead` and call only the methods below,
so any model family runs through one frame program, one engine and one server:

    inputs ──prefix(inputs)──► prefix ─┬─► actions(prefix, noises, states): head name -> [B, Ha, Ad]
                                       └─► language(): the `decoder.LanguageDecoder` the slot pool admits from

`MultiHead(params, spec)`: a `models.mot.ModelSpec` (a backbone, its heads, optionally a language decoder)
with its weights. Its inputs follow the backbone (`ModelSpec.input_kind`): an `Observation` for a SigLIP
backbone (π0.5), `mot.PrefixInputs` for Qwen3 / Qwen3-VL / Qwen3.5. π0.5 is one: `pi05.model.as_vla(params,
num_steps)` is `MultiHead` of `as_model(params, num_steps)` over the same arrays; its head takes the chunk
length from the caller (`action_shape(name, horizon)`).

A registered pytree: the weights are leaves, the spec static, so a `MultiHead` is passed to jitted programs
like any params tree and compiles once per (spec, shapes).

Axes (`oxygen_jax.axes`): B batch rows, Ha action horizon, Ad action dim, Ds state dim.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from oxygen_jax.models import mot
from oxygen_jax.models.decoder import LanguageDecoder
from oxygen_jax.models.mot import ModelParams, ModelSpec, PrefixInputs
from oxygen_jax.models.observation import Observation

_STATIC = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MultiHead:
    """A `ModelSpec` with its weights: the backbone's prefix pass keeps the union of what every reader needs."""

    params: ModelParams
    spec: ModelSpec = dataclasses.field(metadata=_STATIC)

    @property
    def heads(self) -> tuple[str, ...]:
        return self.spec.names

    @property
    def primary(self) -> str:
        """The first head: its chunk is what a robot executes (the others are returned beside it)."""
        if not self.spec.heads:
            raise ValueError("this model has no action head")
        return self.spec.names[0]

    def primary_chunk(self, actions: dict, batch: int) -> np.ndarray:
        """The primary head's chunk [B, Ha, Ad] of `actions` (head name -> chunk, as `actions()` returns them).

        A model without a head (a language-only backbone) has an empty chunk: float32 [B, 0, 0].
        """
        if not self.spec.heads:
            return np.zeros((batch, 0, 0), np.float32)
        return np.asarray(actions[self.primary])

    @property
    def vocab_size(self) -> int:
        return self.spec.backbone.vocab_size

    @property
    def has_language(self) -> bool:
        return self.spec.language

    def action_shape(self, name: str, horizon: int | None = None) -> tuple[int, int]:
        """(Ha, Ad) of a head's chunk: fixed by the head, or `horizon` for a head without one
        (`HeadSpec.horizon == 0`: π0.5's expert is position-free in the horizon)."""
        h = self.spec.head(name)
        if h.horizon:
            return (h.horizon, h.action_dim)
        if horizon is None or horizon < 1:
            raise ValueError(f"head {name!r} takes its chunk length from the caller: pass horizon >= 1, got {horizon}")
        return (horizon, h.action_dim)

    def state_dims(self) -> dict[str, int]:
        """Heads that read a robot state vector -> Ds."""
        return {h.name: h.state_dim for h in self.spec.heads if "state" in h.extra_tokens}

    def check_inputs(self, inputs) -> None:
        """Raises ValueError naming what is wrong with `inputs` for this backbone (`mot.check_inputs`)."""
        mot.check_inputs(self.spec, inputs)

    def batch_size(self, inputs: PrefixInputs | Observation) -> int:
        return inputs.batch_size if self.spec.input_kind == "observation" else inputs.input_ids.shape[0]

    def shape_key(self, inputs: PrefixInputs | Observation) -> tuple:
        """What fixes the prefix length: cameras and prompt length (observations), or P and the image grids."""
        if self.spec.input_kind == "observation":
            return (inputs.num_cameras, inputs.tokens.shape[1])
        return (inputs.input_ids.shape[1], inputs.grid)

    def prefix(self, inputs: PrefixInputs | Observation):
        return mot.prefix_pass(self.spec, self.params, inputs)

    def actions(self, prefix, noises: dict[str, jax.Array], states: dict[str, jax.Array] | None = None):
        return mot.run_heads(self.spec, self.params, prefix, noises, states)

    @property
    def action_stream(self):
        """How the language decoder writes action chunks (`decoded_actions.ActionStream`, π0-FAST), or None: the
        heads give them."""
        return None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The language decoder's default stop set (`ModelSpec.stop_ids`)."""
        return self.spec.stop_ids

    def language(self) -> LanguageDecoder:
        if not self.spec.language:
            raise ValueError("this model has no language decoder: build its ModelSpec with language=True")
        return mot.language_model(self.spec, self.params)

    def only(self, *names: str, language: bool = False) -> MultiHead:
        """The model with only the named heads (their weights and reads), with or without language."""
        return MultiHead(self.params.only(*names), self.spec.only(*names, language=language))

    def without_heads(self) -> MultiHead:
        """The language decoder alone: a prefix pass keeping K/V and the last hidden state only."""
        return self.only(language=True)
