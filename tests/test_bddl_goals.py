"""LIBERO goal predicates and memory labels (training.data.libero.bddl_goals), and the memory generator's
simulator-free parts (training.data.libero: frame keys, state, shards). No simulator needed.

Goal lists, objects and fixtures are copied from libero_10's BDDL files as the simulator parses them
(`env.env.parsed_problem`).
"""

import json

import numpy as np
import pytest

from oxygen_jax.robots.libero import quat_to_axis_angle
from training.data.libero import bddl_goals as bg
from training.data.libero import config, generate, shards

# libero_10 goals, as parsed_problem["goal_state"].
GOAL_T0 = [["in", "alphabet_soup_1", "basket_1_contain_region"], ["in", "tomato_sauce_1", "basket_1_contain_region"]]
GOAL_T2 = [["turnon", "flat_stove_1"], ["on", "moka_pot_1", "flat_stove_1_cook_region"]]
GOAL_T3 = [["close", "white_cabinet_1_bottom_region"], ["in", "akita_black_bowl_1", "white_cabinet_1_bottom_region"]]
GOAL_T4 = [["on", "porcelain_mug_1", "plate_1"], ["on", "white_yellow_mug_1", "plate_2"]]
GOAL_T5 = [["in", "black_book_1", "desk_caddy_1_back_contain_region"]]
GOAL_T6 = [["on", "porcelain_mug_1", "plate_1"], ["on", "chocolate_pudding_1", "living_room_table_plate_right_region"]]
GOAL_T8 = [
    ["on", "moka_pot_1", "flat_stove_1_cook_region"], ["on", "moka_pot_2", "flat_stove_1_cook_region"],
    ["turnon", "flat_stove_1"],
]
GOAL_T9 = [["in", "white_yellow_mug_1", "microwave_1_heating_region"], ["close", "microwave_1"]]

LIVING_ROOM = {"living_room_table": ["living_room_table"]}
OBJECTS_T0 = {
    "alphabet_soup": ["alphabet_soup_1"], "cream_cheese": ["cream_cheese_1"], "tomato_sauce": ["tomato_sauce_1"],
    "ketchup": ["ketchup_1"], "orange_juice": ["orange_juice_1"], "milk": ["milk_1"], "butter": ["butter_1"],
    "basket": ["basket_1"],
}
OBJECTS_T4 = {
    "porcelain_mug": ["porcelain_mug_1"], "red_coffee_mug": ["red_coffee_mug_1"],
    "white_yellow_mug": ["white_yellow_mug_1"], "plate": ["plate_1", "plate_2"],
}
OBJECTS_T6 = {
    "porcelain_mug": ["porcelain_mug_1"], "red_coffee_mug": ["red_coffee_mug_1"], "plate": ["plate_1"],
    "chocolate_pudding": ["chocolate_pudding_1"],
}


def _label(goal, objects, fixtures, holds):
    preds = bg.parse_goal(goal)
    names = bg.display_names(objects, fixtures)
    return bg.memory_label([p for p, h in zip(preds, holds) if h], names)


# --- parsing -------------------------------------------------------------------------------------


def test_parse_goal_keeps_order_lowercases_names_and_prints_bddl():
    goal = bg.parse_goal([["In", "alphabet_soup_1", "basket_1_contain_region"], ["TurnOn", "flat_stove_1"]])
    assert [p.name for p in goal] == ["in", "turnon"]
    assert str(goal[0]) == "(in alphabet_soup_1 basket_1_contain_region)"
    assert goal[0].as_list() == ["in", "alphabet_soup_1", "basket_1_contain_region"]
    assert goal[0].is_placement and not goal[1].is_placement


@pytest.mark.parametrize(
    "goal, match",
    [
        ([["stack", "a_1", "b_1"]], "unknown BDDL goal predicate 'stack'"),
        ([["in", "a_1"]], "has 1 arguments; 'in' takes 2"),
        ([["open", "a_1", "b_1"]], "has 2 arguments; 'open' takes 1"),
        (["in a_1 b_1"], "not a \\[name, \\*args\\] list"),
    ],
)
def test_parse_goal_rejects_malformed_predicates_with_the_reason(goal, match):
    with pytest.raises(ValueError, match=match):
        bg.parse_goal(goal)


def test_placement_predicates_are_in_and_on_of_free_objects_only():
    assert bg.placement_predicates(bg.parse_goal(GOAL_T2), ["moka_pot_1", "chefmate_8_frypan_1"]) == (
        bg.Predicate("on", ("moka_pot_1", "flat_stove_1_cook_region")),
    )
    assert bg.placement_predicates(bg.parse_goal(GOAL_T2), ["chefmate_8_frypan_1"]) == ()
    assert len(bg.placement_predicates(bg.parse_goal(GOAL_T9), ["white_yellow_mug_1", "porcelain_mug_1"])) == 1


def test_goal_subsets_enumerate_every_subset_once_smallest_first():
    assert bg.goal_subsets(0) == [()]
    assert bg.goal_subsets(2) == [(), (0,), (1,), (0, 1)]
    subsets = bg.goal_subsets(4)
    assert len(subsets) == len(set(subsets)) == 16
    assert [len(s) for s in subsets] == sorted(len(s) for s in subsets)
    with pytest.raises(ValueError, match="k >= 0"):
        bg.goal_subsets(-1)


def test_parse_index_ranges_reads_inclusive_ranges_and_rejects_nonsense():
    assert bg.parse_index_ranges("0-3,7, 5") == [0, 1, 2, 3, 5, 7]
    assert bg.parse_index_ranges("40-49") == list(range(40, 50))
    assert bg.parse_index_ranges("") == []
    for bad in ("3-1", "a-2", "-1"):
        with pytest.raises(ValueError, match="bad index range"):
            bg.parse_index_ranges(bad)


# --- names ---------------------------------------------------------------------------------------


def test_display_names_follow_the_instructions_and_drop_unique_indices():
    names = bg.display_names(OBJECTS_T4, LIVING_ROOM)
    assert names == {
        "porcelain_mug_1": "white mug", "red_coffee_mug_1": "red coffee mug",
        "white_yellow_mug_1": "yellow and white mug",
        "plate_1": "left plate", "plate_2": "right plate", "living_room_table": "table",
    }
    assert bg.display_names(OBJECTS_T0)["cream_cheese_1"] == "cream cheese box"
    assert bg.display_names(OBJECTS_T6)["plate_1"] == "plate"  # one plate: no "left"


def test_display_names_keep_the_index_of_repeated_categories_without_an_alias():
    names = bg.display_names({"moka_pot": ["moka_pot_1", "moka_pot_2"]}, {"kitchen_table": ["kitchen_table"]})
    assert names == {"moka_pot_1": "moka pot 1", "moka_pot_2": "moka pot 2", "kitchen_table": "table"}


@pytest.mark.parametrize(
    "goal, objects, fixtures, phrases",
    [
        (GOAL_T0, OBJECTS_T0, LIVING_ROOM, ["alphabet soup in basket", "tomato sauce in basket"]),
        (GOAL_T2, {"moka_pot": ["moka_pot_1"]}, {"kitchen_table": ["kitchen_table"], "flat_stove": ["flat_stove_1"]},
         ["stove on", "moka pot on stove"]),
        (GOAL_T3, {"akita_black_bowl": ["akita_black_bowl_1"]}, {"white_cabinet": ["white_cabinet_1"]},
         ["bottom drawer of cabinet closed", "black bowl in bottom drawer of cabinet"]),
        (GOAL_T5, {"black_book": ["black_book_1"]}, {"desk_caddy": ["desk_caddy_1"]},
         ["book in back compartment of caddy"]),
        (GOAL_T6, OBJECTS_T6, LIVING_ROOM, ["white mug on plate", "chocolate pudding right of plate"]),
        (GOAL_T9, {"white_yellow_mug": ["white_yellow_mug_1"]}, {"microwave": ["microwave_1"]},
         ["yellow and white mug in microwave", "microwave closed"]),
    ],
)
def test_predicate_phrases_name_regions_by_their_owner(goal, objects, fixtures, phrases):
    names = bg.display_names(objects, fixtures)
    assert [bg.predicate_phrase(p, names) for p in bg.parse_goal(goal)] == phrases


# --- labels --------------------------------------------------------------------------------------


def test_memory_label_lists_what_holds_in_goal_order():
    assert _label(GOAL_T0, OBJECTS_T0, LIVING_ROOM, [False, False]) == "Done: nothing."
    assert _label(GOAL_T0, OBJECTS_T0, LIVING_ROOM, [True, False]) == "Done: alphabet soup in basket."
    assert _label(GOAL_T0, OBJECTS_T0, LIVING_ROOM, [False, True]) == "Done: tomato sauce in basket."
    assert _label(GOAL_T0, OBJECTS_T0, LIVING_ROOM, [True, True]) == (
        "Done: alphabet soup in basket; tomato sauce in basket."
    )
    assert _label(GOAL_T4, OBJECTS_T4, LIVING_ROOM, [True, True]) == (
        "Done: white mug on left plate; yellow and white mug on right plate."
    )
    assert _label(GOAL_T6, OBJECTS_T6, LIVING_ROOM, [False, True]) == "Done: chocolate pudding right of plate."


def test_memory_labels_of_all_subsets_are_distinct():
    for goal, objects in ((GOAL_T0, OBJECTS_T0), (GOAL_T4, OBJECTS_T4), (GOAL_T6, OBJECTS_T6)):
        k = len(goal)
        labels = {_label(goal, objects, LIVING_ROOM, [i in s for i in range(k)]) for s in bg.goal_subsets(k)}
        assert len(labels) == 2**k


def test_scene_label_groups_by_support_with_the_table_first():
    names = bg.display_names(OBJECTS_T4, LIVING_ROOM)
    supports = [
        ("porcelain_mug_1", "on", "plate_1"), ("red_coffee_mug_1", "on", "living_room_table"),
        ("white_yellow_mug_1", "on", "plate_2"), ("plate_1", "on", "living_room_table"),
        ("plate_2", "on", "living_room_table"),
    ]
    assert bg.scene_label(supports, names) == (
        "Scene: red coffee mug, left plate, right plate on table; white mug on left plate; "
        "yellow and white mug on right plate."
    )
    names0 = bg.display_names(OBJECTS_T0, LIVING_ROOM)
    supports0 = [("alphabet_soup_1", "in", "basket_1_contain_region"), ("basket_1", "on", "living_room_table")]
    assert bg.scene_label(supports0, names0) == "Scene: basket on table; alphabet soup in basket."


def test_scene_label_rejects_empty_scenes_and_unknown_relations():
    with pytest.raises(ValueError, match="at least one"):
        bg.scene_label([], {})
    with pytest.raises(ValueError, match="scene relation 'under'"):
        bg.scene_label([("milk_1", "under", "basket_1")], {})


def test_truth_table_names_every_goal_predicate():
    goal = bg.parse_goal(GOAL_T8)
    assert bg.truth_table(goal, [True, False, False]) == {
        "(on moka_pot_1 flat_stove_1_cook_region)": True,
        "(on moka_pot_2 flat_stove_1_cook_region)": False,
        "(turnon flat_stove_1)": False,
    }
    with pytest.raises(ValueError, match="2 values for 3 goal predicates"):
        bg.truth_table(goal, [True, False])


# --- the generator without a simulator -----------------------------------------------------------


def test_frame_key_names_task_init_subset_and_variant():
    assert config.frame_key(0, 7, (0, 1), 2) == "t0-i07-s01-v2"
    assert config.frame_key(6, 41, (), 0) == "t6-i41-s--v0"


def test_quat_to_axis_angle_matches_known_rotations():
    s = np.sqrt(0.5)
    np.testing.assert_allclose(quat_to_axis_angle(np.array([0.0, 0.0, 0.0, 1.0])), [0, 0, 0])
    np.testing.assert_allclose(quat_to_axis_angle(np.array([0.0, 0.0, s, s])), [0, 0, np.pi / 2], atol=1e-6)
    np.testing.assert_allclose(quat_to_axis_angle(np.array([1.0, 0.0, 0.0, 0.0])), [np.pi, 0, 0], atol=1e-6)


def test_gen_config_rejects_bad_settings_with_the_fix():
    with pytest.raises(ValueError, match="use 'jpeg' or 'png'"):
        config.GenConfig(image_format="webp")
    with pytest.raises(ValueError, match="min_settle_steps"):
        config.GenConfig(settle_steps=2, min_settle_steps=3)


def _frame(key, rng):
    row = {"key": key, "split": "train", "memory": "Done: nothing.", "timings": {}}
    images = {k: rng.integers(0, 256, (8, 6, 3), dtype=np.uint8) for k in ("image", "wrist_image")}
    return row, images, rng.standard_normal(8).astype(np.float32)


def test_shards_round_trip_and_a_crash_loses_at_most_the_unindexed_shard(tmp_path):
    cfg = config.GenConfig(image_format="png", shard_size=2)
    rng = np.random.default_rng(0)
    frames = [_frame(f"k{i}", rng) for i in range(5)]
    writer = shards.ShardWriter(tmp_path, cfg)
    for row, images, state in frames:
        writer.add(dict(row), images, state)
    writer.flush()  # 3 shards: 2 + 2 + 1 frames
    back = list(shards.iter_frames(tmp_path))
    assert [f["key"] for f in back] == [f"k{i}" for i in range(5)]
    for f, (_, images, state) in zip(back, frames):
        np.testing.assert_array_equal(f["image"], images["image"])
        np.testing.assert_array_equal(f["wrist_image"], images["wrist_image"])
        np.testing.assert_array_equal(f["state"], state)
    assert all("encode_s" in f["timings"] for f in back)

    # A crash after a shard was written but before its index lines, and mid-way through a line:
    # the next writer deletes the orphan shard and appends after the shards that are indexed.
    (tmp_path / "shards" / "shard_00007.npz").write_bytes(b"partial")
    with (tmp_path / "index.jsonl").open("a") as f:
        f.write('{"key": "cut')
    writer = shards.ShardWriter(tmp_path, cfg)
    assert not (tmp_path / "shards" / "shard_00007.npz").exists()
    assert writer.next_shard == 3
    row, images, state = _frame("k5", rng)
    writer.add(row, images, state)
    writer.flush()
    rows = [json.loads(line) for line in (tmp_path / "index.jsonl").read_text().splitlines()]  # every line parses
    assert [r["shard"] for r in rows] == [f"shard_0000{i}.npz" for i in (0, 0, 1, 1, 2, 3)]
    assert [f["key"] for f in shards.iter_frames(tmp_path)] == [f"k{i}" for i in range(6)]


def test_plan_makes_the_empty_subset_once_and_every_other_subset_per_variant():
    cfg = config.GenConfig(variants=3, reset_variants=2)
    plan = generate._plan(cfg, 2)
    assert plan.count(((), 0)) == 1 and len(plan) == 1 + 3 * 3
    assert {s for s, _ in plan} == set(bg.goal_subsets(2))
    reset_plan = generate._plan(cfg, 2, config.RESET_BASE + 5)  # a reset layout uses reset_variants
    assert reset_plan.count(((), 0)) == 1 and len(reset_plan) == 1 + 3 * 2


def test_reset_layouts_follow_the_stored_inits_and_stay_out_of_the_held_out_split():
    cfg = config.GenConfig(inits=(0, 1, 40), held_out=(40,), resets=3)
    assert generate.layout_inits(cfg) == [0, 1, 40, config.RESET_BASE, config.RESET_BASE + 1, config.RESET_BASE + 2]
    assert config.frame_key(0, config.RESET_BASE + 2, (1,), 0) == f"t0-i{config.RESET_BASE + 2}-s1-v0"
    # How many layouts is not a physics setting: a run can be extended with more resets and resumed.
    assert cfg.physics_key() == config.GenConfig(resets=300, reset_variants=2).physics_key()
    with pytest.raises(ValueError, match="use resets"):
        config.GenConfig(inits=(config.RESET_BASE,))
    with pytest.raises(ValueError, match="resets must be >= 0"):
        config.GenConfig(resets=-1)


def test_summary_counts_labels_reasons_and_the_majority_share(tmp_path):
    def row(task, memory, **extra):
        return {"task": task, "task_name": f"T{task}", "split": "train", "memory": memory, "scene": "Scene: x.",
                "timings": {"settle_s": 0.5, "render_s": 0.25}, **extra}

    ok = [row(0, "Done: nothing."), row(0, "Done: a in b."), row(1, "Done: nothing.")]
    rejected = [row(0, "Done: nothing.", reasons=["tilt basket_1 41deg", "collateral_motion milk_1 0.031m"]),
                row(1, "Done: nothing.", reasons=["tilt basket_1 35deg"])]
    shards.append_jsonl(tmp_path / "index.jsonl", ok)
    shards.append_jsonl(tmp_path / "rejected.jsonl", rejected)
    s = generate.summarize(tmp_path)
    assert (s["accepted"], s["rejected_attempts"]) == (3, 2)
    assert s["accepted_per_task"] == {"0 T0": 2, "1 T1": 1}
    assert s["label_histogram"] == {"Done: nothing.": 2, "Done: a in b.": 1}
    assert s["majority_label_share"] == pytest.approx(2 / 3, abs=1e-4)
    assert s["rejection_reasons"] == {"tilt": 2, "collateral_motion": 1}
    assert s["rejection_details"] == {"tilt basket_1": 2, "collateral_motion milk_1": 1}
    assert s["mean_s_per_accepted_frame"] == pytest.approx(5 * 0.75 / 3)
    assert json.loads((tmp_path / "summary.json").read_text()) == s
