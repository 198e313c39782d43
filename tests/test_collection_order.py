"""The order of the collected tests that `make test` hands out: long files first."""

from __future__ import annotations

from dataclasses import dataclass

from collection_order import slow_files_first


@dataclass
class _Item:
    path: str
    name: str
    slow: bool = False

    def get_closest_marker(self, name: str):
        return object() if name == "slow" and self.slow else None


def test_files_with_more_slow_tests_come_first_each_in_one_piece_and_in_order():
    items = [_Item("a.py", "a1"), _Item("a.py", "a2"),
             _Item("b.py", "b1", slow=True), _Item("b.py", "b2"),
             _Item("c.py", "c1", slow=True), _Item("c.py", "c2", slow=True),
             _Item("d.py", "d1")]  # fmt: skip
    slow_files_first(items)
    assert [item.name for item in items] == ["c1", "c2", "b1", "b2", "a1", "a2", "d1"]
