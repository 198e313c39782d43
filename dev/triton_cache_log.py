"""A Triton cache manager that logs the key of every cache entry a process looks up, so
dev/triton_cache.sh can carry only the entries the last job used (the restored cache
otherwise grows with every edited kernel's stale versions, to ~70 MB). Selected by
triton_cache.sh restore:

    TRITON_CACHE_MANAGER=triton_cache_log:LoggingCacheManager  (dev/ on PYTHONPATH)
    TRITON_CACHE_LOG=<file>                                    (one key per line, appended)
"""

from __future__ import annotations

import os

from triton.runtime.cache import FileCacheManager


class LoggingCacheManager(FileCacheManager):
    """FileCacheManager, plus one line per lookup of the compile cache (not the dump or
    override folders) in $TRITON_CACHE_LOG."""

    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override=override, dump=dump)
        log = os.environ.get("TRITON_CACHE_LOG")
        if log and not (override or dump):
            with open(log, "a") as f:  # short appends: whole lines even across processes
                f.write(key + "\n")
