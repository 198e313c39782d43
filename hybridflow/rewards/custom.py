"""Loading scoring functions: built-in `module:function` targets and user files
(`reward.custom_fn=path/to/file.py:function`), with errors that say what to fix."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from hybridflow.errors import UserError

_CACHE: dict[str, Callable] = {}


class CustomRewardError(UserError, ValueError):
    """`reward.custom_fn` cannot be loaded; the message names the file and function."""


def split_target(target: str) -> tuple[str, str]:
    """`"a/b.py:fn"` -> `("a/b.py", "fn")`; the last colon splits (Windows drive letters)."""
    location, _, function_name = target.rpartition(":")
    if not location or not function_name:
        raise CustomRewardError(
            f"reward.custom_fn={target!r} must look like path/to/file.py:function_name"
        )
    return location, function_name


def _load_file_module(path: Path):
    # One module name per absolute path, so two files named reward.py do not collide.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"hybridflow_custom_reward_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:  # Ctrl-C while it imports
        raise
    except BaseException as error:  # sys.exit at import is the file's error too
        what = (f"it called sys.exit({error.code!r})" if isinstance(error, SystemExit)
                else f"{type(error).__name__}: {error}")  # fmt: skip
        raise CustomRewardError(
            f"reward.custom_fn: importing {path} failed: {what}",
            f"fix that file (python {path} shows the full error)",
        ) from error
    sys.modules[module_name] = module
    return module


def load_function(target: str) -> Callable:
    """Resolve `path/to/file.py:function` or `package.module:function` (cached per process)."""
    if target in _CACHE:
        return _CACHE[target]
    location, function_name = split_target(target)
    if location.endswith(".py") or "/" in location or "\\" in location:
        path = Path(location).expanduser().resolve()
        if not path.is_file():
            raise CustomRewardError(f"reward.custom_fn: file {location!r} does not exist")
        module = _load_file_module(path)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise CustomRewardError(f"reward scorer module {location!r}: {error}") from error
    function = getattr(module, function_name, None)
    if function is None or not callable(function):
        defined = sorted(
            name
            for name, value in vars(module).items()
            if inspect.isfunction(value) and not name.startswith("_")
        )
        raise CustomRewardError(
            f"reward.custom_fn: {location!r} has no function {function_name!r}; "
            f"functions defined there: {defined}"
        )
    _CACHE[target] = function
    return function
