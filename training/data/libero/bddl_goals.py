"""LIBERO BDDL goal predicates and the text labels built from them (pure Python, no simulator).

A LIBERO task's goal is a conjunction of predicates, as the simulator parses it
(`env.env.parsed_problem["goal_state"]`):

    [['in', 'alphabet_soup_1', 'basket_1_contain_region'], ['in', 'tomato_sauce_1', 'basket_1_contain_region']]

This module turns such lists into `Predicate`s, names the objects the way the task instructions do
("porcelain_mug_1" -> "white mug", "basket_1_contain_region" -> "basket"), and writes the two labels
of a memory frame:

    memory_label(satisfied, names)  -> "Done: alphabet soup in basket; tomato sauce in basket."
    scene_label(supports, names)    -> "Scene: ketchup, milk, basket on table; alphabet soup in basket."

`names` is the instance -> phrase map of one task, from `display_names(parsed_problem["objects"],
parsed_problem["fixtures"])`.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence

# Predicates satisfied by putting a free-joint object somewhere (what the memory generator teleports).
PLACEMENT_PREDICATES = ("in", "on")
# Predicates on a joint or switch state of a fixture (not generated here).
ARTICULATION_PREDICATES = ("open", "close", "turnon", "turnoff")
_ARITY = {"in": 2, "on": 2, "open": 1, "close": 1, "turnon": 1, "turnoff": 1}

# Category names as the libero_10 instructions say them ("put the white mug on the left plate").
CATEGORY_ALIASES: Mapping[str, str] = {
    "porcelain_mug": "white mug",
    "white_yellow_mug": "yellow and white mug",
    "cream_cheese": "cream cheese box",
    "akita_black_bowl": "black bowl",
    "black_book": "book",
    "flat_stove": "stove",
    "desk_caddy": "caddy",
    "white_cabinet": "cabinet",
    "chefmate_8_frypan": "frying pan",
}
# Instance names used only when a category has several instances in a scene (libero_10 task 4:
# "the white mug on the left plate" is `On porcelain_mug_1 plate_1`).
INSTANCE_ALIASES: Mapping[str, str] = {"plate_1": "left plate", "plate_2": "right plate"}

_DIRECTIONS = ("left", "right", "front", "behind", "back")
# Region-name words that say what a region is for, not where it is.
_REGION_FUNCTION_WORDS = ("contain", "cook", "heating", "init")
_INSTANCE = re.compile(r"^(?P<category>.+)_(?P<index>\d+)$")


@dataclasses.dataclass(frozen=True)
class Predicate:
    """One atomic BDDL predicate, e.g. `Predicate("in", ("alphabet_soup_1", "basket_1_contain_region"))`."""

    name: str  # lower case: "in", "on", "open", "close", "turnon", "turnoff"
    args: tuple[str, ...]  # instance or region names, as in the BDDL file

    def __str__(self) -> str:
        return f"({self.name} {' '.join(self.args)})"

    def as_list(self) -> list[str]:
        """The simulator's form, for `env.env._eval_predicate`."""
        return [self.name, *self.args]

    @property
    def is_placement(self) -> bool:
        return self.name in PLACEMENT_PREDICATES


def parse_goal(goal_state: Sequence[Sequence[str]]) -> tuple[Predicate, ...]:
    """`parsed_problem["goal_state"]` (a list of `[name, *args]`) -> predicates, validated."""
    predicates = []
    for item in goal_state:
        if isinstance(item, str) or not item:
            raise ValueError(f"goal predicate {item!r} is not a [name, *args] list; pass parsed_problem['goal_state']")
        name, *args = (str(x) for x in item)
        name = name.lower()
        if name not in _ARITY:
            raise ValueError(f"unknown BDDL goal predicate {name!r} in {list(item)}; known: {sorted(_ARITY)}")
        if len(args) != _ARITY[name]:
            raise ValueError(f"goal predicate {list(item)} has {len(args)} arguments; {name!r} takes {_ARITY[name]}")
        predicates.append(Predicate(name, tuple(args)))
    return tuple(predicates)


def placement_predicates(goal: Sequence[Predicate], free_objects: Iterable[str]) -> tuple[Predicate, ...]:
    """The goal's `In`/`On` predicates whose first argument is a free-joint object (teleportable)."""
    free = set(free_objects)
    return tuple(p for p in goal if p.is_placement and p.args[0] in free)


def goal_subsets(k: int) -> list[tuple[int, ...]]:
    """All 2^k subsets of k predicate indices, smallest first: k=2 -> [(), (0,), (1,), (0, 1)]."""
    if k < 0:
        raise ValueError(f"goal_subsets needs k >= 0, got {k}")
    return [c for r in range(k + 1) for c in itertools.combinations(range(k), r)]


def display_names(
    objects: Mapping[str, Sequence[str]], fixtures: Mapping[str, Sequence[str]] = {}
) -> dict[str, str]:
    """Instance name -> the phrase instructions use, from `parsed_problem["objects"/"fixtures"]`.

    Both arguments map a category to its instances, e.g. `{"plate": ["plate_1", "plate_2"]}`. The
    phrase is the category alias (else the category with underscores as spaces); a category with
    several instances uses `INSTANCE_ALIASES`, else keeps the index ("moka pot 2"); any table
    fixture is "table".
    """
    names = {}
    for category, instances in itertools.chain(objects.items(), fixtures.items()):
        base = "table" if category.endswith("table") else CATEGORY_ALIASES.get(category, category.replace("_", " "))
        for instance in instances:
            if len(instances) == 1:
                names[instance] = base
            else:
                match = _INSTANCE.match(instance)
                index = match["index"] if match else instance
                names[instance] = INSTANCE_ALIASES.get(instance, f"{base} {index}")
    return names


def _split_region(region: str, names: Mapping[str, str]) -> tuple[str, list[str]]:
    """`desk_caddy_1_back_contain_region` -> ("desk_caddy_1", ["back", "contain"]): longest known owner prefix."""
    owners = [n for n in names if region.startswith(n + "_")]
    if not owners:
        return "", region.removesuffix("_region").split("_")
    owner = max(owners, key=len)
    return owner, region[len(owner) + 1 :].removesuffix("_region").split("_")


def place_phrase(target: str, names: Mapping[str, str]) -> tuple[str, str]:
    """(relation, place) for the second argument of `In`/`On`, e.g. ("in", "basket").

    - an instance: ("", its name) — the caller's relation applies ("on plate");
    - `<owner>_contain_region` / `_cook_region` / `_heating_region`: ("", owner's name) ("in basket",
      "on stove", "in microwave");
    - `<owner>_<part>_contain_region`: ("", "<part> compartment of <owner>");
    - `<table>_<object>_<direction>_region`: ("<direction> of", that object's name) — replaces "on";
    - `<owner>_<part>_region` otherwise: ("", "<part> of <owner>"), with "drawer" for cabinets.
    """
    if target in names:
        return "", names[target]
    owner, words = _split_region(target, names)
    function = [w for w in words if w in _REGION_FUNCTION_WORDS]
    part = [w for w in words if w not in _REGION_FUNCTION_WORDS]
    owner_name = names.get(owner, owner.replace("_", " "))
    if owner and owner_name == "table" and len(part) >= 2 and part[-1] in _DIRECTIONS:
        reference = "_".join(part[:-1])
        referent = next((names[n] for n in names if _INSTANCE.sub(r"\g<category>", n) == reference), None)
        return f"{part[-1]} of", referent or reference.replace("_", " ")
    if not part:
        return "", owner_name
    part_text = " ".join(part)
    if "contain" in function:
        return "", f"{part_text} compartment of {owner_name}"
    if "cabinet" in owner_name:
        return "", f"{part_text} drawer of {owner_name}"
    return "", f"{part_text} of {owner_name}" if owner else part_text


def predicate_phrase(predicate: Predicate, names: Mapping[str, str]) -> str:
    """One predicate in words: "alphabet soup in basket", "chocolate pudding right of plate", "stove on"."""
    if predicate.is_placement:
        subject = names.get(predicate.args[0], predicate.args[0].replace("_", " "))
        relation, place = place_phrase(predicate.args[1], names)
        return f"{subject} {relation or predicate.name} {place}"
    _, thing = place_phrase(predicate.args[0], names)
    state = {"open": "open", "close": "closed", "turnon": "on", "turnoff": "off"}[predicate.name]
    return f"{thing} {state}"


def memory_label(satisfied: Sequence[Predicate], names: Mapping[str, str]) -> str:
    """The memory text for the goal predicates that hold, in goal order: "Done: a in b; c on d." or "Done: nothing."."""
    if not satisfied:
        return "Done: nothing."
    return "Done: " + "; ".join(predicate_phrase(p, names) for p in satisfied) + "."


def scene_label(supports: Sequence[tuple[str, str, str]], names: Mapping[str, str]) -> str:
    """A scene description from (object, relation, support) triples, grouped by support.

    The table's group comes first, the others in first-seen order: `[("alphabet_soup_1", "in",
    "basket_1_contain_region"), ("ketchup_1", "on", "living_room_table"), ("milk_1", "on",
    "living_room_table")]` -> "Scene: ketchup, milk on table; alphabet soup in basket."
    """
    if not supports:
        raise ValueError("scene_label needs at least one (object, relation, support) triple")
    groups: dict[tuple[str, str], list[str]] = {}
    for obj, relation, support in supports:
        if relation not in PLACEMENT_PREDICATES:
            raise ValueError(f"scene relation {relation!r} for {obj!r}; expected one of {PLACEMENT_PREDICATES}")
        rel, place = place_phrase(support, names)
        groups.setdefault((rel or relation, place), []).append(names.get(obj, obj.replace("_", " ")))
    ordered = sorted(groups.items(), key=lambda item: item[0][1] != "table")  # stable: first-seen otherwise
    return "Scene: " + "; ".join(f"{', '.join(objs)} {rel} {place}" for (rel, place), objs in ordered) + "."


def truth_table(goal: Sequence[Predicate], values: Sequence[bool]) -> dict[str, bool]:
    """{"(in alphabet_soup_1 basket_1_contain_region)": True, ...} for every goal predicate."""
    if len(goal) != len(values):
        raise ValueError(f"truth_table got {len(values)} values for {len(goal)} goal predicates")
    return {str(p): bool(v) for p, v in zip(goal, values)}


def parse_index_ranges(text: str) -> list[int]:
    """"0-39,45" -> [0, 1, ..., 39, 45] (inclusive ranges, sorted, unique); "" -> []."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            start, stop = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"bad index range {part!r} in {text!r}; write e.g. '0-39,45'") from None
        if start < 0 or stop < start:
            raise ValueError(f"bad index range {part!r} in {text!r}; need 0 <= start <= stop")
        out.update(range(start, stop + 1))
    return sorted(out)
