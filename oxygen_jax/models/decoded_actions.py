"""A model whose action chunk is text its language decoder writes: `DecodedActions`, and how to read it (`ActionStream`).

π0-FAST has no action head: after the prefix its one decoder writes the chunk as tokens ("Action: " FAST ids "|"
EOS). The runtime serves such a model through the same interface as any other (`models.vla.MultiHead`): its
`action_stream` says that actions come from the decoder, with the prompt ids written after the prefix, the stop
ids that end a chunk, the most tokens a chunk may take and the host function that reads the tokens back as a
chunk. `runtime.action_streams` decodes one stream per robot row in the shared slot pool, beside language
requests; nothing above the models floor asks which family a model is.

Axes (`oxygen_jax.axes`): B rows, Ha action horizon, Ad action dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from oxygen_jax.models.vla import MultiHead

_STATIC = dict(static=True)


class ChunkError(ValueError):
    """A robot's decoded tokens are no action chunk (e.g. FAST ids that do not decode); the message says why."""


@dataclasses.dataclass(frozen=True, eq=False)  # identity: holds the host decoder (a static jit field)
class ActionStream:
    """How a decoder's tokens become one robot's chunk.

    Attributes:
      horizon, action_dim: the chunk's shape [Ha, Ad] (normalised, as the model emits it).
      stop_ids: token ids that end a chunk (π0-FAST: EOS and "|").
      max_tokens: the most tokens a chunk may take (openpi: 256); a stream without a stop by then failed.
      decode: tokens (the stream's ids, the stop included) -> float [Ha, Ad]; raises ValueError naming why a
        stream is no chunk.
      prompt_ids: ids written after the prefix before decoding (π0-FAST: none, the model writes "Action: ").
      name: the chunk's name in replies (`StepResult.head_actions`).
    """

    horizon: int
    action_dim: int
    stop_ids: tuple[int, ...]
    max_tokens: int
    decode: Callable[[Sequence[int]], np.ndarray]
    prompt_ids: tuple[int, ...] = ()
    name: str = "actions"

    def __post_init__(self):
        if self.horizon < 1 or self.action_dim < 1:
            raise ValueError(f"ActionStream needs horizon and action_dim >= 1, got {self.horizon}, {self.action_dim}")
        if self.max_tokens < 1:
            raise ValueError(f"ActionStream.max_tokens must be >= 1, got {self.max_tokens}")
        if not self.stop_ids:
            raise ValueError("ActionStream.stop_ids names no stop id: a chunk could never end")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.horizon, self.action_dim)

    def chunk(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 [Ha, Ad] of a finished stream; `ChunkError` naming why when its tokens are no finite chunk."""
        try:
            out = np.asarray(self.decode(list(tokens)), np.float32)
        except ValueError as e:
            raise ChunkError(str(e) or type(e).__name__) from None
        if out.shape != self.shape:
            raise ChunkError(f"the decoded chunk has shape {out.shape}, expected [Ha, Ad] = {self.shape}")
        if not np.isfinite(out).all():
            raise ChunkError("the decoded chunk holds NaN or inf")
        return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodedActions(MultiHead):
    """A `MultiHead` without action heads whose decoder writes the chunks (`action_stream`).

    Attributes:
      stream: the `ActionStream` (static: compiled programs key on it by identity).
      position_skip: RoPE positions left unused after the prefix (openpi's π0-FAST feeds token 0 at
        num_valid + 1, never at num_valid: 1); language requests continue the same prefix.
    """

    stream: ActionStream = dataclasses.field(default=None, metadata=_STATIC)
    position_skip: int = dataclasses.field(default=0, metadata=_STATIC)

    def __post_init__(self):
        if not isinstance(self.stream, ActionStream):
            raise ValueError(f"DecodedActions needs an ActionStream, got {type(self.stream).__name__}")
        if self.spec.heads or not self.spec.language:
            raise ValueError("DecodedActions decodes its chunks: its ModelSpec has no heads and language=True")

    @property
    def action_stream(self) -> ActionStream:
        return self.stream

    def prefix(self, inputs):
        out = super().prefix(inputs)
        if not self.position_skip:
            return out
        return dataclasses.replace(out, next_position=out.next_position + self.position_skip)
