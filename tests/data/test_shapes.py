"""The built-in shapes task: the answer is in the picture (its squares counted from the
pixels), train and test never share a picture-and-question, rows hold their PNG under
verl's images column, and the scorer takes the exact answer only."""

import io

import numpy as np
from PIL import Image

from hybridflow.data.builtin import builtin_rows
from hybridflow.data.shapes import CELL, COLOURS, draw_picture, shapes_splits
from hybridflow.rewards.scorers.shapes import compute_score


def test_the_answer_is_in_the_pixels():
    for picture, question, answer in shapes_splits(40, 10, seed=3)["train"]:
        pixels = np.asarray(Image.open(io.BytesIO(draw_picture(picture))).convert("RGB"))
        lit = pixels.any(-1)
        colour, cells = picture
        assert lit.sum() == len(cells) * CELL * CELL  # distinct cells, whole squares
        assert tuple(pixels[lit][0]) == COLOURS[colour]
        assert answer == (str(len(cells)) if question.startswith("how many") else colour)


def test_splits_are_disjoint_and_rows_carry_their_image():
    splits = shapes_splits(200, 50, seed=0)
    train = {(p, q) for p, q, _ in splits["train"]}
    assert len(train) == 200 and not train & {(p, q) for p, q, _ in splits["test"]}
    row = builtin_rows("shapes", "test", 8, 4)[0]
    assert row["prompt"][0]["content"].startswith("<image>")
    assert Image.open(io.BytesIO(row["images"][0]["bytes"])).size == (32, 32)


def test_the_scorer_takes_the_exact_answer():
    assert compute_score(" Red ", "red") == 1.0 and compute_score("3", "3") == 1.0
    assert compute_score("red square", "red") == 0.0 and compute_score("33", "3") == 0.0
