"""Build the native runtime on first use and cache it.

The C++ sources ship inside the package as ``deepcompile._csrc`` (the top-level ``csrc/`` folder,
mapped in ``pyproject.toml``, which also says why the wheel compiles nothing); they are read
through ``importlib.resources`` and compiled here with ``torch.utils.cpp_extension`` and ninja.

The cache is keyed by content only: a hash of the sources (names and bytes), the torch version
and its C++ ABI and CUDA version, the Python version, the machine, the compiler (``CXX``) and the
flags. The sources are copied into ``<cache>/runtime-<key>/src`` and built from there into
``<cache>/runtime-<key>/build``, so ``build.ninja`` names no path of any checkout or environment:
two checkouts, or a virtual environment and the system, with the same sources and torch share one
build, and different sources never share a directory. The source copy is written to a private
temporary directory and renamed into place in one step (a loser of the race finds the winner's
identical copy).

One build per machine, announced once: a process that finds no finished build takes an exclusive
lock on ``<cache>/runtime-<key>/build.lock`` (``flock``, released by the kernel if the holder
dies), builds, writes ``build/complete`` naming the module file, and releases the lock. Every
other process (the other ranks of the job, other jobs) waits on that lock, bounded by
``BUILD_WAIT_S``, then loads the finished module silently. A finished build is imported directly
rather than through ``cpp_extension.load``, which would rewrite ``build.ninja`` with the calling
environment's torch paths and make two environments with the same torch rebuild each other's
module; everything the module depends on is in the key.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path

_MODULE = None
_LOAD_LOCK = threading.Lock()



def _sources():
    """The installed ``deepcompile._csrc``; in a source checkout put on ``sys.path`` without
    ``pip install`` (the mapping exists only once installed), the checkout's own ``csrc/``."""
    try:
        return importlib.resources.files("deepcompile._csrc")
    except ModuleNotFoundError:
        tree = Path(__file__).resolve().parents[2] / "csrc"
        if (tree / "runtime.cpp").is_file():
            return tree
        raise


CSRC = _sources()
SOURCES = ["runtime.cpp", "zero3.cpp", "bindings.cpp"]
BUILD_WAIT_S = 1800.0   # how long a process waits for another one's build before giving up


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


def _source_files() -> list:
    return sorted((s for s in CSRC.iterdir() if s.name.endswith((".cpp", ".h")) and s.is_file()),
                  key=lambda s: s.name)


def _place_sources(key_dir: Path) -> Path:
    """``key_dir/src``: a copy of the sources, written once and atomically (see the docstring)."""
    import tempfile

    src = key_dir / "src"
    if not src.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".src-", dir=key_dir))
        try:
            for s in _source_files():
                (tmp / s.name).write_bytes(s.read_bytes())
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


class _BuildLock:
    """An exclusive ``flock`` on ``path``, waited for at most ``BUILD_WAIT_S`` seconds. Where the
    file system has no locks the build goes ahead unlocked (``cpp_extension`` still serialises
    the compile itself with its own lock file)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:   # not a POSIX system
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    os.close(self.fd)
                    self.fd = None
                    raise BuildError(f"deepcompile: waited {BUILD_WAIT_S:.0f} s for another process (pid "
                                     f"{holder}) building the native runtime under {self.path.parent}; "
                                     "stop it, or remove that directory to rebuild") from None
                time.sleep(0.2)
            except OSError:   # no locks on this file system
                os.close(self.fd)
                self.fd = None
                return self
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)   # closing the descriptor releases the lock
            self.fd = None


def _import_built(so: Path):
    """Import the extension module ``so`` (what ``cpp_extension.load`` does once it has built)."""
    spec = importlib.util.spec_from_file_location("deepcompile_C", so)
    if spec is None or spec.loader is None:
        raise BuildError(f"deepcompile: {so} is not a loadable extension module; remove {so.parent} to rebuild")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _finished(build_dir: Path) -> Path | None:
    """The module file of a finished build in ``build_dir``, or None."""
    try:
        name = (build_dir / "complete").read_text().strip()
    except OSError:
        return None
    so = build_dir / name
    return so if name and so.is_file() else None


def load():
    """Return the compiled runtime module, building it if needed (once per process, and once per
    machine for a given key: see the module docstring)."""
    global _MODULE
    with _LOAD_LOCK:
        if _MODULE is None:
            _MODULE = _load()
        return _MODULE


def _load():
    missing = [f"{CSRC}/{s}" for s in SOURCES if not (CSRC / s).is_file()]
    if missing:
        raise BuildError(f"deepcompile runtime sources are missing: {missing}")
    key_dir = _cache_dir(cache_key())
    build_dir = key_dir / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    so = _finished(build_dir)
    if so is not None:
        return _import_built(so)
    with _BuildLock(key_dir / "build.lock"):
        so = _finished(build_dir)   # built by the process that held the lock before us
        if so is not None:
            return _import_built(so)
        return _build(key_dir, build_dir)


def _build(key_dir: Path, build_dir: Path):
    from torch.utils import cpp_extension

    src = _place_sources(key_dir)
    if not any(build_dir.glob("deepcompile_C*.so")):
        _check_toolchain()
        print(f"deepcompile: building the native runtime into {build_dir} (once per machine, ~1 min)...",
              file=sys.stderr, flush=True)
    try:
        module = cpp_extension.load(
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
    done = build_dir / f".complete-{os.getpid()}"
    done.write_text(Path(module.__file__).name + "\n")
    os.replace(done, build_dir / "complete")
    return module
