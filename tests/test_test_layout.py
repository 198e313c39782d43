"""The test tree itself: pytest imports test files by their basename (rootdir-relative
packages are not used), so two files of one name in different folders make the second fail
to collect ("import file mismatch") in whichever process meets both."""

from collections import Counter
from pathlib import Path


def test_no_two_test_files_share_a_name():
    names = Counter(path.name for path in Path(__file__).parent.rglob("*.py"))
    assert not [name for name, count in names.items() if count > 1 and name != "conftest.py"]
