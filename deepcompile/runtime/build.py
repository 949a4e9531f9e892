"""Build the native runtime (``csrc/``) on first use and cache it.

The wheel never compiles anything (its build must not need torch, see README); the extension is
compiled here with ``torch.utils.cpp_extension`` and ninja the first time a process needs it.

The cache is keyed by content only: a hash of the sources (names and bytes), the torch version
and its C++ ABI and CUDA version, the Python version, the compiler (``CXX``) and the flags. The
sources are copied into ``<cache>/runtime-<key>/src`` and built from there into
``<cache>/runtime-<key>/build``, so ``build.ninja`` names no path of any checkout: two checkouts
with identical sources share one build (before, each rewrote the other's ``build.ninja`` with its
own absolute source paths and ninja rebuilt everything), and different sources never share a
directory. Concurrent builders (the ranks of one job, two jobs) do not corrupt each other: the
source copy is written to a private temporary directory and renamed into place in one step (a
loser of the race finds the winner's identical copy), and the compile itself is serialised by
``cpp_extension``'s lock file in the build directory.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
from pathlib import Path

_MODULE = None

CSRC = Path(__file__).resolve().parents[2] / "csrc"
if not CSRC.is_dir():  # installed as a wheel: the sources ship inside the package
    CSRC = Path(__file__).resolve().parents[1] / "csrc"

SOURCES = ["runtime.cpp", "zero3.cpp", "bindings.cpp"]


class BuildError(RuntimeError):
    pass


def _cache_dir(key: str) -> Path:
    root = os.environ.get("DEEPCOMPILE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "deepcompile"
    )
    return Path(root) / f"runtime-{key}"


def _check_toolchain() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        raise BuildError(
            f"deepcompile needs a C++ compiler to build its runtime, and '{cxx}' is not on PATH. "
            "Install one (Debian/Ubuntu: apt-get install g++) or set CXX."
        )
    include = sysconfig.get_paths().get("include")
    if not include or not Path(include, "Python.h").exists():
        raise BuildError(
            f"deepcompile needs the Python headers to build its runtime; Python.h is not in {include}. "
            "Install them (Debian/Ubuntu: apt-get install python3-dev)."
        )
    try:
        import ninja  # noqa: F401
    except ImportError:
        if shutil.which("ninja") is None:
            raise BuildError("deepcompile builds its runtime with ninja: pip install ninja") from None


CFLAGS = ["-O2"]


def cache_key() -> str:
    """The content key of this runtime build (see the module docstring for what goes in)."""
    import platform

    import torch

    h = hashlib.sha256()
    for s in _source_files():
        h.update(s.name.encode() + b"\0")
        data = s.read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    for part in (torch.__version__, str(torch.version.cuda), str(torch.compiled_with_cxx11_abi()), sys.version,
                 platform.machine(), os.environ.get("CXX", ""), " ".join(CFLAGS), " ".join(SOURCES)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _source_files() -> list[Path]:
    return sorted(s for s in CSRC.glob("*") if s.suffix in (".cpp", ".h") and s.is_file())


def _place_sources(key_dir: Path) -> Path:
    """``key_dir/src``: a copy of the sources, written once and atomically (see the docstring)."""
    import tempfile

    src = key_dir / "src"
    if not src.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".src-", dir=key_dir))
        try:
            for s in _source_files():
                shutil.copy2(s, tmp / s.name)
            try:
                os.rename(tmp, src)   # atomic; fails if another builder placed its copy first
            except OSError:
                if not src.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for s in _source_files():   # the key is the content: a differing copy was edited by hand
        c = src / s.name
        if not c.is_file() or c.read_bytes() != s.read_bytes():
            raise BuildError(f"deepcompile: the cached runtime sources in {src} differ from {CSRC} "
                             f"({s.name}); remove {key_dir} to rebuild")
    return src


def load():
    """Return the compiled runtime module, building it if needed (once per process)."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    from torch.utils import cpp_extension

    missing = [str(CSRC / s) for s in SOURCES if not (CSRC / s).exists()]
    if missing:
        raise BuildError(f"deepcompile runtime sources are missing: {missing}")
    key_dir = _cache_dir(cache_key())
    build_dir = key_dir / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    src = _place_sources(key_dir)
    built = any(build_dir.glob("deepcompile_C*.so"))
    if not built:
        _check_toolchain()
        print(f"deepcompile: building the native runtime into {build_dir} (once, ~1 min)...",
              file=sys.stderr, flush=True)
    try:
        _MODULE = cpp_extension.load(
            name="deepcompile_C",
            sources=[str(src / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as e:  # compiler output is in the exception; keep it, add the fix
        raise BuildError(
            f"deepcompile: building the native runtime in {build_dir} failed: {e}\n"
            "Check that a C++17 compiler and the Python headers are installed; remove that "
            "directory to force a clean rebuild."
        ) from e
    return _MODULE
