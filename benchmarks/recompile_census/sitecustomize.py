"""Where a compile generates Python code for FX graphs, and how long it takes.

Put this folder first on PYTHONPATH and every Python process started with it (the spawned ranks
too) times each ``GraphModule.recompile`` and each real recompile of a ``_LazyGraphModule``, keyed
by the four calling frames, and writes a table to ``$RECOMPILE_CENSUS_DIR/census_<pid>.txt`` at exit:

    RECOMPILE_CENSUS_DIR=/tmp/census PYTHONPATH=benchmarks/recompile_census \\
        python benchmarks/compile_cpu.py --layers 32 --ranks 2 --repeats 1 --out /tmp/census/out.json

A diagnostic only: nothing in deepcompile imports it.
"""
import atexit
import collections
import os
import time
import traceback

_OUT = os.environ.get("RECOMPILE_CENSUS_DIR")
if _OUT:
    import torch.fx.graph_module as _gmod
    from torch.fx import _lazy_graph_module as _lazy

    _stats: dict = collections.defaultdict(lambda: [0, 0.0])

    def _key(prefix: str, depth: int) -> str:
        frames = traceback.extract_stack(limit=depth + 2)[:-2]
        return prefix + " <- ".join(f"{os.path.basename(f.filename)}:{f.name}" for f in reversed(frames))

    def _timed(fn, prefix: str, depth: int):
        def wrapper(self):
            t0 = time.perf_counter()
            try:
                return fn(self)
            finally:
                s = _stats[_key(prefix, depth)]
                s[0] += 1
                s[1] += time.perf_counter() - t0
        return wrapper

    _gmod.GraphModule.recompile = _timed(_gmod.GraphModule.recompile, "", 4)
    _lazy._LazyGraphModule._real_recompile = _timed(_lazy._LazyGraphModule._real_recompile, "LAZY ", 5)

    @atexit.register
    def _dump() -> None:
        if not _stats:
            return
        os.makedirs(_OUT, exist_ok=True)
        with open(os.path.join(_OUT, f"census_{os.getpid()}.txt"), "w") as f:
            f.write("seconds  calls  where (innermost first); a LAZY real recompile also counts under the plain one\n")
            for k, (n, t) in sorted(_stats.items(), key=lambda x: -x[1][1]):
                f.write(f"{t:8.3f} {n:5d}  {k}\n")

    # ranks forked from tests/dist_utils' fork server end in os._exit (multiprocessing's fork
    # path), which skips atexit: their table is written there
    _real_exit = os._exit

    def _exit(code: int) -> None:
        try:
            _dump()
        finally:
            _real_exit(code)

    os._exit = _exit
