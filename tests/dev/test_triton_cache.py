"""dev/triton_cache.sh and triton_cache_log.py on CPU: after `restore`, a real Triton
compile (sm_90 target, no GPU needed) logs its cache key, and `save` packs only the logged
entries, so stale ones left by edited kernels are not carried to the next job."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter does not compile", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "dev" / "triton_cache.sh"
REPO = SCRIPT.parents[1]

COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def double(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

source = ASTSource(fn=double, signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                   constexprs={(2,): 64})
triton.compile(source, target=GPUTarget("cuda", 90, 32))
"""


def _members(out: Path) -> set[str]:
    parts = sorted(out.glob("triton_cache.t?z.part-*"))  # xz, or gzip where xz is missing
    assert parts, "save wrote no pieces"
    archive = out / "all.tar"
    archive.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(archive) as tar:
        return {m.name.split("/")[1] for m in tar.getmembers() if m.name.count("/") >= 1}


def test_restore_logs_keys_and_save_keeps_only_them(tmp_path):
    stale = tmp_path / ".cache" / "triton" / "STALEKEY"
    stale.mkdir(parents=True)
    (stale / "old.cubin").write_bytes(b"x" * 100)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_CACHE_DIR", None)
    (tmp_path / "compile_one.py").write_text(COMPILE)  # @triton.jit needs a source file
    command = (f"source {SCRIPT} restore && {sys.executable} compile_one.py && "
               f"bash {SCRIPT} save {out}")  # fmt: skip
    subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, check=True, timeout=120)
    logged = set((tmp_path / ".cache" / "triton_used.log").read_text().split())
    assert logged, "the compile looked nothing up through the logging cache manager"
    saved = _members(out)
    assert "STALEKEY" not in saved
    assert saved and saved <= logged
    # without a log (a cache restored by an older script), save keeps everything
    (tmp_path / ".cache" / "triton_used.log").unlink()
    for part in out.iterdir():
        part.unlink()
    subprocess.run(["bash", SCRIPT, "save", str(out)], cwd=tmp_path, check=True, timeout=60)
    assert "STALEKEY" in _members(out)
