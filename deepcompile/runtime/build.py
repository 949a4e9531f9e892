"""Build the native runtime (``csrc/``) on first use and cache it.

The wheel never compiles anything (its build must not need torch, see README); the extension is
compiled here with ``torch.utils.cpp_extension`` and ninja the first time a process needs it.
The cache directory is keyed by the sources, the torch version and the Python version, so a
torch upgrade or an edited source rebuilds instead of loading a stale binary.
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


def load():
    """Return the compiled runtime module, building it if needed (once per process)."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    import torch
    from torch.utils import cpp_extension

    srcs = [CSRC / s for s in SOURCES]
    missing = [str(s) for s in srcs if not s.exists()]
    if missing:
        raise BuildError(f"deepcompile runtime sources are missing: {missing}")
    h = hashlib.sha256()
    for s in sorted(CSRC.glob("*")):
        if s.suffix in (".cpp", ".h"):
            h.update(s.name.encode())
            h.update(s.read_bytes())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    key = h.hexdigest()[:16]
    build_dir = _cache_dir(key)
    build_dir.mkdir(parents=True, exist_ok=True)
    built = any(build_dir.glob("deepcompile_C*.so"))
    if not built:
        _check_toolchain()
        print(f"deepcompile: building the native runtime into {build_dir} (once, ~1 min)...",
              file=sys.stderr, flush=True)
    try:
        _MODULE = cpp_extension.load(
            name="deepcompile_C",
            sources=[str(s) for s in srcs],
            extra_cflags=["-O2"],
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
