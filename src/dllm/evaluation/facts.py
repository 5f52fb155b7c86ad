"""Chat tasks with verifiable answers for instruct models, built from tables in the project (no download).

- `capitals`: "What is the capital of <country>?" -> the city (right when the answer names it);
- `arithmetic`: "What is a plus / minus / times b?" with operands 2..20 -> the number (the reply's last
  number: a reply that works it out ends with its result);
- `units`: "How many <small unit> are in n <big unit>?" -> the number (the reply's last number);
- `reverse`: "Write the word '<word>' backwards." -> the reversed word (right when it appears as a word);
- `yesno`: a question about an everyday fact -> yes or no (the answer's first yes or no).

Each task is a table of items, every one a user turn decoded through the model's chat template (`Task.chat`).
The split is by item, fixed (not a function of any seed): half of the prompts, by a stable hash
(tasks.py: `in_eval_split`), is the eval split (so that the small tables still give a few dozen eval
items), the rest the train split that training data may be built from, so no eval prompt is ever in a
training set made from the train split (tests/unit/test_facts.py).
`dllm eval tasks --run` also looks every eval question up in the run's training data (overlap.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("United Kingdom", "London"), ("Ireland", "Dublin"), ("Netherlands", "Amsterdam"), ("Belgium", "Brussels"),
    ("Austria", "Vienna"), ("Switzerland", "Bern"), ("Poland", "Warsaw"), ("Czech Republic", "Prague"),
    ("Hungary", "Budapest"), ("Greece", "Athens"), ("Sweden", "Stockholm"), ("Norway", "Oslo"),
    ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Iceland", "Reykjavik"), ("Russia", "Moscow"),
    ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"), ("Turkey", "Ankara"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Nigeria", "Abuja"),
    ("Ghana", "Accra"), ("Ethiopia", "Addis Ababa"), ("Morocco", "Rabat"), ("South Africa", "Pretoria"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("South Korea", "Seoul"), ("India", "New Delhi"),
    ("Pakistan", "Islamabad"), ("Bangladesh", "Dhaka"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"), ("Philippines", "Manila"), ("Malaysia", "Kuala Lumpur"), ("Iran", "Tehran"),
    ("Iraq", "Baghdad"), ("Saudi Arabia", "Riyadh"), ("Israel", "Jerusalem"), ("Afghanistan", "Kabul"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Canada", "Ottawa"),
    ("United States", "Washington"), ("Mexico", "Mexico City"), ("Cuba", "Havana"), ("Brazil", "Brasilia"),
    ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Peru", "Lima"), ("Colombia", "Bogota"),
    ("Venezuela", "Caracas"), ("Nepal", "Kathmandu"), ("Mongolia", "Ulaanbaatar"), ("Singapore", "Singapore"),
)  # fmt: skip

UNITS = (  # (big unit, small unit, small units per big one)
    ("meters", "centimeters", 100), ("kilometers", "meters", 1000), ("hours", "minutes", 60),
    ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7), ("kilograms", "grams", 1000),
    ("liters", "milliliters", 1000), ("years", "months", 12), ("dozens", "items", 12),
)  # fmt: skip

WORDS = (
    "apple", "house", "river", "green", "table", "music", "bread", "cloud", "water", "light", "stone", "plant",
    "horse", "night", "dream", "smile", "ocean", "train", "paper", "chair", "garden", "window", "summer",
    "winter", "yellow", "orange", "purple", "silver", "forest", "market", "animal", "circle", "doctor",
    "friend", "planet", "rocket", "school", "spring", "street", "tiger", "candle", "pencil", "bottle",
    "butter", "castle", "dragon", "flower", "hammer", "island", "kitten", "ladder", "monkey", "number",
    "pepper", "rabbit", "sister", "ticket", "turtle", "violin", "wallet",
)  # fmt: skip

YES_NO = (
    ("Is the sun a star?", "yes"), ("Is the moon a planet?", "no"), ("Do fish live in water?", "yes"),
    ("Can dogs fly?", "no"), ("Is ice cold?", "yes"), ("Is fire cold?", "no"), ("Do cows give milk?", "yes"),
    ("Is a tomato a fruit?", "yes"), ("Do birds have feathers?", "yes"), ("Do snakes have legs?", "no"),
    ("Is the Pacific an ocean?", "yes"), ("Is Paris in Germany?", "no"), ("Is water wet?", "yes"),
    ("Does a week have eight days?", "no"), ("Does a year have twelve months?", "yes"),
    ("Is a whale a fish?", "no"), ("Is a spider an insect?", "no"), ("Do plants need light?", "yes"),
    ("Is gold a metal?", "yes"), ("Is glass a liquid at room temperature?", "no"),
    ("Does the earth orbit the sun?", "yes"), ("Does the sun orbit the moon?", "no"),
    ("Is seven an even number?", "no"), ("Is ten an even number?", "yes"), ("Is a triangle round?", "no"),
    ("Does a square have four sides?", "yes"), ("Do humans breathe oxygen?", "yes"),
    ("Can penguins fly?", "no"), ("Is Mount Everest a mountain?", "yes"), ("Is the Nile a river?", "yes"),
    ("Is the Sahara covered in ice?", "no"), ("Do bees make honey?", "yes"), ("Is milk usually white?", "yes"),
    ("Is grass usually blue?", "no"), ("Do cats bark?", "no"), ("Is a piano a musical instrument?", "yes"),
    ("Is a carrot a vegetable?", "yes"), ("Is the number zero larger than one?", "no"),
    ("Does water boil at 100 degrees Celsius at sea level?", "yes"), ("Do trees have roots?", "yes"),
    ("Is a bicycle an animal?", "no"), ("Is English a language?", "yes"), ("Do elephants have trunks?", "yes"),
    ("Is the sky green on a clear day?", "no"), ("Can a person live without water forever?", "no"),
    ("Is chess a board game?", "yes"), ("Is the Atlantic a desert?", "no"), ("Are diamonds hard?", "yes"),
    ("Do frogs lay eggs?", "yes"), ("Is a kilometer longer than a meter?", "yes"),
)  # fmt: skip

OPERATIONS = (("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b), ("times", lambda a, b: a * b))
_NUMBER = re.compile(r"-?\d+")
_WORD = re.compile(r"[a-z]+")


def last_number_is(output: str, answer: str) -> bool:
    """The output's last number (digits) is the answer: a reply that works it out ("12 + 4 = 16") ends
    with its result."""
    found = _NUMBER.findall(output.replace(",", ""))
    return bool(found) and found[-1] == answer


def names(output: str, answer: str) -> bool:
    """The answer appears in the output as whole words (case and accents of ASCII letters aside)."""
    words, wanted = _WORD.findall(output.lower()), _WORD.findall(answer.lower())
    return any(words[i : i + len(wanted)] == wanted for i in range(len(words) - len(wanted) + 1))


def first_yes_or_no_is(output: str, answer: str) -> bool:
    """The output's first "yes" or "no" (as a word) is the answer."""
    found = next((w for w in _WORD.findall(output.lower()) if w in ("yes", "no")), None)
    return found == answer


Item = tuple[str, str, Callable[[str], bool]]  # prompt, answer, verifier


def capitals() -> list[Item]:
    return [(f"What is the capital of {c}? Answer with the city name only.", city, partial(names, answer=city))
            for c, city in CAPITALS]  # fmt: skip


def arithmetic() -> list[Item]:
    items = []
    for word, op in OPERATIONS:
        for a in range(2, 21):
            for b in range(2, 21):
                if word == "minus" and b > a:
                    continue
                answer = str(op(a, b))
                prompt = f"What is {a} {word} {b}? Answer with the number only."
                items.append((prompt, answer, partial(last_number_is, answer=answer)))
    return items


def units() -> list[Item]:
    items = []
    for big, small, per in UNITS:
        for n in range(2, 10):
            answer = str(n * per)
            prompt = f"How many {small} are in {n} {big}? Answer with the number only."
            items.append((prompt, answer, partial(last_number_is, answer=answer)))
    return items


def reverse() -> list[Item]:
    return [(f"Write the word '{w}' backwards. Answer with the reversed word only.", w[::-1],
             partial(names, answer=w[::-1])) for w in WORDS]  # fmt: skip


def yesno() -> list[Item]:
    return [(f"{q} Answer yes or no.", a, partial(first_yes_or_no_is, answer=a)) for q, a in YES_NO]


TABLES: dict[str, Callable[[], list[Item]]] = {
    "capitals": capitals,
    "arithmetic": arithmetic,
    "units": units,
    "reverse": reverse,
    "yesno": yesno,
}
EVAL_SHARE = 2
"""One prompt in EVAL_SHARE of a table task is in its eval split."""
MAX_NEW_TOKENS = 32
"""A chat task's answer length: a short sentence at most (EOS ends it earlier)."""
