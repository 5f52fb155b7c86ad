"""The generated instruction set (data/instructions.py): its size, variety and the held-out split by topic."""

from __future__ import annotations

import json

from dllm.data.instructions import (
    HELD_OUT_TOPICS,
    TEMPLATES,
    TOPICS,
    TRAIN_TOPICS,
    instructions,
    mentions,
)


def test_sizes_and_no_duplicates():
    train, held = instructions("train"), instructions("held_out")
    assert len(TOPICS) == len(set(TOPICS)) == 100 and len(TEMPLATES) == len(set(TEMPLATES))
    assert len(train) == len(TEMPLATES) * len(TRAIN_TOPICS) >= 2000
    assert len(held) == len(TEMPLATES) * len(HELD_OUT_TOPICS) >= 100
    assert len(set(train)) == len(train) and len(set(held)) == len(held)
    assert not set(train) & set(held)


def test_held_out_topics_never_reach_a_training_prompt():
    """Held out by topic: no training prompt names a held-out topic as a word sequence (nor do the templates)."""
    assert set(HELD_OUT_TOPICS).isdisjoint(TRAIN_TOPICS) and set(HELD_OUT_TOPICS) | set(TRAIN_TOPICS) == set(TOPICS)
    for prompt in instructions("train"):
        assert not any(mentions(prompt, topic) for topic in HELD_OUT_TOPICS), prompt
    for template in TEMPLATES:
        assert not any(mentions(template, topic) for topic in TOPICS), template
    # every held-out prompt names its topic, so the check above is the one that matters
    assert all(any(mentions(p, t) for t in HELD_OUT_TOPICS) for p in instructions("held_out"))


def test_mentions_is_whole_words():
    assert mentions("Tell me about the rain today.", "the rain")
    assert not mentions("Tell me about the rainforest.", "the rain")
    assert mentions("SNOW, please", "snow") and not mentions("snowflakes", "snow")


def test_deterministic_and_seeded():
    assert instructions("train") == instructions("train")
    assert instructions("train", seed=1) != instructions("train") and sorted(instructions("train", seed=1)) == sorted(
        instructions("train")
    )


def test_recipe_copy_writes_both_splits(tmp_path):
    from dllm.recipes import HELD_OUT_FILE, PROMPTS_FILE, copy_recipe

    copy_recipe("dflash-smollm2", tmp_path / "r")
    train = [json.loads(line)["prompt"] for line in (tmp_path / "r" / PROMPTS_FILE).read_text().splitlines()]
    held = [json.loads(line)["prompt"] for line in (tmp_path / "r" / HELD_OUT_FILE).read_text().splitlines()]
    assert train == instructions("train") and held == instructions("held_out")
