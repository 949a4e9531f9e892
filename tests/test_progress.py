"""Compile progress (config ``progress``): rank 0 prints one line for each step that spent time
compiling, profiling or planning, with its phases, the plan chosen and whether more compiles
follow; a re-run that hits the plan cache says so; other ranks and ``progress: false`` print
nothing."""
from __future__ import annotations

import torch  # noqa: F401  (the spawned ranks import it first, as the other tests do)

from tests.dist_utils import run_ranks


def _run(rank, world, progress):
    import contextlib
    import io

    import deepcompile
    from deepcompile import api
    from tests.workloads import make_model, make_optimizer, rank_step

    api.PROGRESS_MIN_S = 0.0   # a tiny model compiles in well under a second on the CPU
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model, opt = deepcompile.initialize(make_model(), make_optimizer,
                                            {"compiler": "aot_eager", "progress": progress})
        for s in range(4):
            rank_step(model, opt, rank, 2, s)
    return [line for line in err.getvalue().splitlines() if line.startswith("deepcompile: step")]


def test_rank0_prints_a_line_per_compiling_step():
    on = run_ranks(_run, 2, True, timeout=240)
    lines = on[0]
    assert on[1] == [], on[1]
    steps = [int(line.split()[2].rstrip(":")) for line in lines]
    assert steps == [0, 1, 2], lines          # step 3 runs the final graphs: nothing to say
    assert "dynamo" in lines[0] and "aot_autograd" in lines[0] and "compiles again at step 2" in lines[0]
    assert "this step is profiled" in lines[1]
    assert "plan:" in lines[2] and "the final graphs run from the next step" in lines[2], lines[2]
    # a re-run of the same job compiles the stored plan at step 0, and nothing after it
    again = run_ranks(_run, 2, True, timeout=240)[0]
    assert len(again) == 1 and again[0].startswith("deepcompile: step 0:"), again
    assert "from the plan cache: plan:" in again[0] and "the final graphs run from the next step" in again[0]
    off = run_ranks(_run, 2, False, timeout=240)
    assert off == [[], []]
