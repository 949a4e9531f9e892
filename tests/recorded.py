"""GPU run records kept under ``benchmarks/results`` and the offline planner that reads them
(``benchmarks/plan_offline.py``): real GPU profiles for tests that run on the CPU."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the 953M Llama on 2 H200s (host-bound steps)
LLAMA_953M_2GPU = str(REPO / "benchmarks/results/zero3_h200_2gpu_dc_default_record")
# the Llama-3-8B shape's 8 layers at 8k tokens on one H200 (GPU-bound steps; block costs recorded)
LLAMA3_8B_L8_8K_1GPU = str(REPO / "benchmarks/results/zero3_llama3_8b_L8_seq8192_h200_1gpu_dc_default_record")


def plan_offline():
    """``benchmarks/plan_offline.py`` as a module (``benchmarks`` is a folder of scripts, not a package)."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import plan_offline as module
    finally:
        sys.path.pop(0)
    return module
