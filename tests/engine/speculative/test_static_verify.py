"""The static verify step's host side (speculative/static_verify.py): the keep grid that
maps each (row, offset) of a pass to its token, the option's checks, and the refusal of
engines whose verify passes it does not cover (the torch backend). CPU, no Triton."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from hybridflow.bench.speculative import with_speculation
from hybridflow.engine import Engine, EngineOptions
from hybridflow.engine.speculative.static_verify import keep_grid


def test_keep_grid_indexes_each_row_then_its_drafts_packed_after_the_rows():
    # 4 rows of a bucket of 4, drafts 2, 0, 3 (the fourth row is padding), k + 1 = 4 columns:
    # the drafts are tokens 4, 5 (row 0), 6, 7, 8 (row 2); the rest index the row itself
    grid = keep_grid(np.array([2, 0, 3]), bucket=4, width=4).reshape(4, 4)
    assert grid.tolist() == [[0, 4, 5, 0], [1, 1, 1, 1], [2, 6, 7, 8], [3, 3, 3, 3]]
    assert keep_grid(np.zeros(0, dtype=np.int64), 2, 3).tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    ("fields", "message"),
    [(dict(graph_verify_steps=True),
      "graph_verify_steps=true captures verify passes: set speculative to ngram or draft too"),
     (dict(graph_verify_steps="yes", speculative="ngram"),
      "graph_verify_steps='yes': must be true or false")],
)  # fmt: skip
def test_graph_verify_steps_is_checked(fields, message):
    assert EngineOptions(**fields).validate() == [message]
    assert EngineOptions(graph_verify_steps=True, speculative="ngram").validate() == []


def test_the_torch_backend_is_refused_naming_the_key(model):
    options = EngineOptions(decode_backend="torch", speculative="ngram", graph_verify_steps=True)
    with pytest.raises(
        ValueError,
        match="graph_verify_steps=true runs verify passes on the "
        "fused .triton. backend.*set graph_verify_steps=false",
    ):
        Engine(model, 2, 32, options=options)


def test_the_benchmark_s_run_without_speculation_drops_the_key():
    args = argparse.Namespace(engine=["graph_verify_steps=true", "kv_block_size=16"])
    assert with_speculation(args, "off").engine == ["kv_block_size=16", "speculative=off"]
    assert with_speculation(args, "ngram").engine == ["graph_verify_steps=true",
                                                      "kv_block_size=16", "speculative=ngram"]  # fmt: skip
