"""A generated set of diverse instructions for a real instruct model: the prompts a DFlash drafter of it
is distilled on (the target answers them itself) and measured on.

Every prompt is a task template filled with a topic: 32 templates (explain, list, compare, write a poem,
a story opening, a quiz question, ...) x 100 topics from science, history, everyday life, arts, sport and
technology = 3,200 prompts. The split is by topic, so that held out means held out: the 20 topics
`HELD_OUT_TOPICS` (every fifth topic of the list, in its order) give the `held_out` split (640 prompts),
the other 80 the `train` split (2,560); no training prompt mentions a held-out topic, nor contains one as
a word sequence (a test checks both). Everything is a pure function of the arguments; no download.
"""

from __future__ import annotations

import random
import re
from typing import Literal

TEMPLATES = (
    "Explain {t} to a ten-year-old.",
    "Give three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "What are the main benefits of {t}?",
    "Summarize the history of {t} in two sentences.",
    "List five words that come to mind when you think of {t}.",
    "Write a tweet about {t}.",
    "What is a common misconception about {t}?",
    "Describe {t} in one paragraph.",
    "Write a haiku about {t}.",
    "Write a quiz question about {t} and give its answer.",
    "How would you teach {t} to a beginner?",
    "Write the opening sentence of a story about {t}.",
    "What questions would you ask an expert on {t}?",
    "Compare {t} with something from everyday life.",
    "Why does {t} matter?",
    "Write a short advertisement inspired by {t}.",
    "Tell me a fun fact about {t}.",
    "Write a limerick about {t}.",
    "What are the pros and cons of {t}?",
    "Explain {t} in exactly three sentences.",
    "Make a short study plan for learning about {t}.",
    "Write a motivational quote that mentions {t}.",
    "What is the origin of {t}?",
    "Give a simple definition of {t}.",
    "What would the world be like without {t}?",
    "Write a short dialogue between two friends talking about {t}.",
    "Suggest three books or films related to {t}.",
    "What careers are connected to {t}?",
    "Describe {t} using only simple words.",
    "Write a riddle whose answer is {t}.",
    "What are three questions children often ask about {t}?",
)

TOPICS = (
    "volcanoes", "the water cycle", "photosynthesis", "black holes", "the human heart",
    "honeybees", "the moon landing", "the printing press", "chess", "coffee",
    "the Roman Empire", "electricity", "recycling", "the Great Wall of China", "dinosaurs",
    "rainbows", "the internet", "bicycles", "the Olympic Games", "jazz music",
    "earthquakes", "the immune system", "penguins", "the stock market", "gardening",
    "the Renaissance", "solar panels", "sleep", "the Amazon rainforest", "origami",
    "vaccines", "the periodic table", "trains", "the ocean tides", "meditation",
    "ancient Egypt", "robots", "bread baking", "the French Revolution", "glaciers",
    "friendship", "mathematics", "the violin", "deserts", "airplanes",
    "the solar system", "chocolate", "public libraries", "climate change", "whales",
    "the piano", "democracy", "mushrooms", "lighthouses", "soccer",
    "the telescope", "bridges", "spiders", "tea", "the Industrial Revolution",
    "coral reefs", "video games", "the alphabet", "hurricanes", "yoga",
    "the Vikings", "batteries", "owls", "pizza", "the Silk Road",
    "magnets", "elephants", "photography", "the rain", "castles",
    "gravity", "cheese", "the Moon", "wolves", "ballet",
    "the human brain", "sushi", "rivers", "kites", "the Eiffel Tower",
    "fungi in forests", "sailing", "comets", "the bicycle helmet", "snow",
    "ants", "the Pyramids of Giza", "clocks", "cotton", "the Arctic",
    "dolphins", "paper money", "windmills", "tigers", "the guitar",
)  # fmt: skip

HELD_OUT_TOPICS = TOPICS[4::5]
TRAIN_TOPICS = tuple(t for t in TOPICS if t not in HELD_OUT_TOPICS)

Split = Literal["train", "held_out"]


def topics(split: Split) -> tuple[str, ...]:
    return TRAIN_TOPICS if split == "train" else HELD_OUT_TOPICS


def instructions(split: Split, seed: int = 0) -> list[str]:
    """Every prompt of `split` (templates x its topics), in an order shuffled by `seed`."""
    out = [template.format(t=topic) for topic in topics(split) for template in TEMPLATES]
    random.Random(f"instructions:{split}:{seed}").shuffle(out)
    return out


def mentions(text: str, topic: str) -> bool:
    """Whether `topic` occurs in `text` as whole words (case-insensitive; 'the rain' is not in 'the rainforest')."""
    return re.search(rf"(?<!\w){re.escape(topic.lower())}(?!\w)", text.lower()) is not None
