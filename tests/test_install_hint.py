"""The hint for a missing extra takes the form of the install it is in: ``pip install -e
'.[x]'`` in a checkout, the registry's ``pip install 'hybridflow[x]'`` in site-packages."""

from __future__ import annotations

from pathlib import Path

from hybridflow.cli import unavailable_reason
from hybridflow.install_hint import PACKAGE_DIR, extra_install, source_checkout


def _checkout(root: Path) -> Path:
    (root / "hybridflow").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "hybridflow"\n')
    return root / "hybridflow"


def test_in_a_checkout_the_hint_installs_the_checkout(tmp_path):
    package = _checkout(tmp_path / "src")
    assert extra_install("serve", package, cwd=tmp_path / "src") == "pip install -e '.[serve]'"
    elsewhere = extra_install("serve", package, cwd=tmp_path)
    assert elsewhere == f"pip install -e '{tmp_path / 'src'}[serve]'"


def test_in_site_packages_the_hint_is_the_registry_form(tmp_path):
    package = tmp_path / "site-packages" / "hybridflow"
    package.mkdir(parents=True)
    assert extra_install("ray", package) == "pip install 'hybridflow[ray]'"


def test_another_projects_pyproject_is_not_a_checkout(tmp_path):
    package = _checkout(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert source_checkout(package) is None


def test_these_tests_run_from_a_checkout():
    assert source_checkout(PACKAGE_DIR) == PACKAGE_DIR.parent


def test_a_missing_extra_says_the_checkouts_command():
    error = ModuleNotFoundError("No module named 'aiohttp'", name="aiohttp")
    text = unavailable_reason("serve", "hybridflow.serve.cli", error)
    assert text.endswith(extra_install("serve")) and "pip install -e '" in text
