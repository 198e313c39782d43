"""Compiled artifacts of ``model.compile`` kept under ``trainer.cache_dir``, so only the first
run pays the compile.

Two layers, both under ``<trainer.cache_dir>/torch-compile``:

- ``inductor/``: Inductor's own on-disk caches (FX graph cache, AOTAutograd cache, the
  Triton kernels), pointed there by :func:`use_compile_cache` at the training worker's
  start, before its first compile. A later run on the same machine finds its graphs there.
- ``artifacts-<key>.bin``: torch.compiler's portable "mega-cache"
  (``save_cache_artifacts``): every artifact this process compiled, in one file, saved after
  the first update (:func:`save_artifacts`, atomically) and loaded back into the caches at
  the next start (:func:`load_artifacts`). ``<key>`` names the torch version, the GPU and
  the model, so runs of other models do not overwrite each other's file.

The cache holds compiled code that torch loads and runs, like Inductor's default cache in
/tmp: keep ``trainer.cache_dir`` a directory only you write to. An unreadable file never
stops a run: one warning, and the layers compile again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

COMPILE_CACHE = "torch-compile"
"""Subdirectory of ``trainer.cache_dir`` holding the compiled artifacts."""


def compile_cache_dir(cache_dir: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(cache_dir)) / COMPILE_CACHE


def use_compile_cache(directory: str | os.PathLike) -> None:
    """Point Inductor's caches of this process at ``directory/inductor`` and switch them on.
    Call before the first compile. A ``TORCHINDUCTOR_CACHE_DIR`` set in the environment is
    kept: whoever set it chose where the cache lives."""
    import torch._functorch.config
    import torch._inductor.config

    inductor = Path(directory) / "inductor"
    inductor.mkdir(parents=True, exist_ok=True)
    # Inductor reads its cache directory from this variable only (no config field:
    # torch/_inductor/runtime/cache_dir_utils.py), afresh at every compile; set in the worker
    # process, it holds for this process's compiles.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True


def prepare_compile_cache(cache_dir: str | os.PathLike, model: str, device: str) -> Path:
    """At a training worker's start (``model.compile`` on): Inductor's caches under
    ``cache_dir``, the saved mega-cache loaded; returns the file to save it to."""
    directory = compile_cache_dir(cache_dir)
    use_compile_cache(directory)
    path = artifacts_path(directory, model, device)
    load_artifacts(path)
    return path


def artifacts_path(directory: str | os.PathLike, model: str, device: str) -> Path:
    """The mega-cache file of ``model`` compiled by this torch for ``device``'s GPU."""
    import torch

    gpu = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else "cpu"
    identity = {"torch": torch.__version__, "gpu": gpu, "model": model}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / f"artifacts-{key}.bin"


def mega_cache_available() -> bool:
    """Whether the installed torch has ``torch.compiler.save_cache_artifacts`` (2.7+)."""
    import torch.compiler

    return hasattr(torch.compiler, "save_cache_artifacts")


def load_artifacts(path: str | os.PathLike) -> bool:
    """Load a saved mega-cache into this process's caches; False (with one warning when the
    file is there but unreadable) when nothing was loaded. Never raises."""
    path = Path(path)
    if not mega_cache_available() or not path.is_file():
        return False
    import torch.compiler

    try:
        # torch returns None for bytes it cannot un-pickle (and logs a traceback of its own,
        # silenced here: the warning below says what happens)
        with _quiet_torch_cache_log():
            loaded = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - any failure means: compile again
        loaded, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "its content is not a compile cache of this torch"
    if loaded is None:
        warnings.warn(f"compile cache {path} is unreadable ({why}); the decoder layers compile "
                      "again and the file is replaced after the first step", stacklevel=2)  # fmt: skip
        return False
    return True


def save_artifacts(path: str | os.PathLike) -> bool:
    """Write what this process compiled to ``path`` (atomically: a failed write leaves the old
    file, or none); False when there was nothing to save or the write failed (a warning)."""
    if not mega_cache_available():
        return False
    import torch.compiler

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    try:
        write_atomically(Path(path), saved[0])
    except OSError as e:
        warnings.warn(f"compile cache {path} not written ({e}); the next run compiles again",
                      stacklevel=2)  # fmt: skip
        return False
    return True


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` at ``path`` via a temporary file and a rename: a reader sees the old file or
    the whole new one, and a failed write leaves no partial file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextmanager
def _quiet_torch_cache_log():
    logger = logging.getLogger("torch.compiler._cache")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
