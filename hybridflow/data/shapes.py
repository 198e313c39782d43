"""The built-in `shapes` task: a small picture of coloured squares and one question about it,
for a tiny vision-language model (the tiny-vl preset) to learn on a CPU.

An image is 32 x 32 pixels, black, with 1 to 4 squares of 8 x 8 pixels in distinct cells of
its 4 x 4 grid, all of one colour. The question is either ``how many squares?`` (answer
``1`` .. ``4``) or ``what colour?`` (``red``, ``green``, ``blue`` or ``white``): the answer is
in the pixels, never in the text. The image rides in the row as PNG bytes under verl's
``images`` column, an ``<image>`` placeholder before the question. Generation is a pure
function of the seed; the test split never repeats a train picture-and-question.
"""

from __future__ import annotations

import io
import random
from typing import Any

SHAPES_DATA_SOURCE = "shapes"
SIDE, CELL = 32, 8
COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (60, 80, 240),
           "white": (235, 235, 235)}  # fmt: skip
QUESTIONS = {"count": "how many squares?", "colour": "what colour?"}


def shapes_problem(rng: random.Random) -> tuple[tuple, str, str]:
    """One (picture, question, answer); a picture is (colour, cells) and draws the same
    every time (draw_picture)."""
    count = rng.randint(1, 4)
    colour = rng.choice(sorted(COLOURS))
    cells = tuple(sorted(rng.sample(range((SIDE // CELL) ** 2), count)))
    kind = rng.choice(sorted(QUESTIONS))
    answer = str(count) if kind == "count" else colour
    return (colour, cells), QUESTIONS[kind], answer


def draw_picture(picture: tuple) -> bytes:
    """The PNG bytes of a (colour, cells) picture."""
    from PIL import Image, ImageDraw

    colour, cells = picture
    image = Image.new("RGB", (SIDE, SIDE))
    draw = ImageDraw.Draw(image)
    per_row = SIDE // CELL
    for cell in cells:
        x, y = (cell % per_row) * CELL, (cell // per_row) * CELL
        draw.rectangle([x, y, x + CELL - 1, y + CELL - 1], fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def shapes_problems(size: int, seed: int, exclude: frozenset = frozenset()) -> list[tuple]:
    """``size`` distinct (picture, question, answer) drawn with random.Random(seed), none
    whose (picture, question) is in ``exclude``."""
    rng = random.Random(seed)
    problems, seen = [], set(exclude)
    while len(problems) < size:
        picture, question, answer = shapes_problem(rng)
        if (picture, question) not in seen:
            seen.add((picture, question))
            problems.append((picture, question, answer))
    return problems


def shapes_splits(train_size: int, val_size: int, seed: int = 0) -> dict[str, list[tuple]]:
    """Disjoint train and test problems (the test split drawn first, then excluded)."""
    test = shapes_problems(val_size, seed + 1)
    held_out = frozenset((picture, question) for picture, question, _ in test)
    return {"train": shapes_problems(train_size, seed, held_out), "test": test}


def shapes_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "<image>" + question}]


def shapes_row(picture: tuple, question: str, answer: str, split: str,
               index: int) -> dict[str, Any]:  # fmt: skip
    """The verl-schema row of one problem, its image as PNG bytes under ``images``."""
    return {
        "data_source": SHAPES_DATA_SOURCE,
        "prompt": shapes_messages(question),
        "images": [{"bytes": draw_picture(picture), "path": None}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }
