"""The ``pip install`` command for one of hybridflow's optional extras, in the form this
copy of hybridflow was installed in.

A checkout (``pip install -e .``, or the sources on PYTHONPATH) needs ``pip install -e
'.[serve]'`` run in the checkout: ``pip install 'hybridflow[serve]'`` would fetch a second
hybridflow from the registry over it. An install from the registry needs the registry form.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def source_checkout(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The checkout this package is imported from (the folder whose pyproject.toml names
    the project hybridflow), or None for an install into site-packages."""
    root = package_dir.parent
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if 'name = "hybridflow"' in text else None


def extra_install(extra: str, package_dir: Path = PACKAGE_DIR, cwd: Path | None = None) -> str:
    """``pip install -e '.[extra]'`` in a checkout (its path when the current directory is
    elsewhere), ``pip install 'hybridflow[extra]'`` otherwise."""
    root = source_checkout(package_dir)
    if root is None:
        return f"pip install 'hybridflow[{extra}]'"
    here = (cwd or Path.cwd()).resolve()
    where = "." if here == root else str(root)
    return f"pip install -e '{where}[{extra}]'"
