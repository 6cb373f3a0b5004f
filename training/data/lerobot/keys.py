"""The key map: which dataset feature feeds each of the project's frame fields.

LeRobot datasets name the same things differently: openpi's LIBERO conversion writes `image`, `wrist_image`,
`state`, `actions`; LeRobot's own re-exports write `observation.images.image`, `observation.images.image2`,
`observation.state`, `action`; other conversions use still other names. A `KeyMap` lists, per field, the
candidate feature names in order of preference; `resolve(features)` picks the first one the dataset has:

    KeyMap().resolve({"observation.images.image": ..., "observation.state": ..., "action": ...})
      -> {"image": "observation.images.image", "state": "observation.state", "actions": "action"}

Override a field with your dataset's name: `KeyMap(wrist_image=("observation.images.hand",))`, or on the
command line of `training.memory` / `eval.memory_eval`: `--key-map wrist_image=observation.images.hand`
(`KeyMap.parse`). Fields the dataset lacks are
left out of the result (a frame without a wrist camera has no `wrist_image`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

FIELDS = ("image", "wrist_image", "state", "actions")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyMap:
    """Candidate dataset feature names per frame field (first present wins).

    Attributes:
      image: the main (third-person) camera.
      wrist_image: the wrist camera.
      state: the proprioceptive state vector.
      actions: the action vector (chunked with delta timestamps when asked).
    """

    image: tuple[str, ...] = ("image", "observation.images.image", "observation.images.agentview",
                              "observation.images.front", "agentview_image")
    wrist_image: tuple[str, ...] = ("wrist_image", "observation.images.image2", "observation.images.wrist_image",
                                    "observation.images.wrist", "eye_in_hand_image")
    state: tuple[str, ...] = ("state", "observation.state")
    actions: tuple[str, ...] = ("actions", "action")

    def __post_init__(self):
        for f in FIELDS:
            value = getattr(self, f)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"KeyMap.{f} must be a tuple of feature names, got {value!r}; e.g. "
                                 f"KeyMap({f}=('observation.state',))")

    def resolve(self, features: Mapping[str, Mapping]) -> dict[str, str]:
        """{field: dataset feature name} for every field one of whose candidates the dataset has."""
        out = {}
        for f in FIELDS:
            hit = next((k for k in getattr(self, f) if k in features), None)
            if hit is not None:
                out[f] = hit
        return out

    @classmethod
    def parse(cls, items: Sequence[str]) -> "KeyMap":
        """From 'field=feature' strings (the command line); each names the only candidate of its field."""
        over = {}
        for item in items:
            field, sep, feature = item.partition("=")
            if not sep or field not in FIELDS or not feature:
                raise ValueError(f"key map entry {item!r} must be FIELD=FEATURE with FIELD one of {', '.join(FIELDS)}")
            over[field] = (feature,)
        return cls(**over)
