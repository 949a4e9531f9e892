"""The first collectives run in a thread while step 0 is traced (runtime/warm.py, issue 18).

On NCCL the group's first all-gather and reduce-scatter each cost about 2 s of host time; the
warm-up pays that while Dynamo traces. On by default with NCCL only, so the CPU suite forces it on
(config ``warm_collectives: true``) over gloo: the thread's collectives and the main thread's
must never interleave (every rank must issue one group's collectives in the same order), the run
must train exactly as without it, and a warm-up that cannot finish must fail step 0 within the
collective timeout, naming the warm-up, instead of hanging.
"""
from __future__ import annotations

import torch

from tests.dist_utils import run_ranks
from tests.workloads import LOCAL_BATCH, global_batch, make_model, make_optimizer

STEPS = 3
SMALL = {"n_layer": 2}


def _train(rank: int, world: int, config: dict):
    import deepcompile
    from deepcompile.runtime import warm

    order: list[str] = []
    real_join = warm.CommWarmup.join

    def join(self):  # records when the main thread took over the group
        order.append("join:" + ("running" if self.thread is not None and self.thread.is_alive() else "done"))
        return real_join(self)
    warm.CommWarmup.join = join

    model, opt = deepcompile.initialize(make_model(**SMALL), make_optimizer, config)
    w = model.dc_backend.comm_warmup
    losses = []
    for s in range(STEPS):
        x, y = global_batch(s, 0, world)
        sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = model(x[sl], y[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": deepcompile.full_state_dict(model),
            "done": list(w.done) if w is not None else None, "thread": w is not None and w.thread is not None,
            "seconds": w.seconds if w is not None else None, "order": order}


def test_warm_up_runs_its_collectives_and_trains_exactly_as_without():
    on = run_ranks(_train, 2, {"warm_collectives": True, "plan_cache": False}, timeout=240)
    off = run_ranks(_train, 2, {"warm_collectives": False, "plan_cache": False}, timeout=240)
    for r in range(2):
        # every shard-group collective ran, small then large, in the same order on both ranks
        assert on[r]["done"] == on[0]["done"] and len(on[r]["done"]) == 4, on[r]["done"]
        assert all(d.startswith("shard:") for d in on[r]["done"])
        assert on[r]["seconds"] is not None and not on[r]["thread"]  # joined: no thread left
        assert on[r]["order"] and all(o.startswith("join:") for o in on[r]["order"])
        assert off[r]["done"] is None  # forced off: no warm-up object at all
        assert on[r]["losses"] == off[r]["losses"]  # bitwise: the warm-up touches no training state
        for k, v in on[r]["state"].items():
            assert torch.equal(v, off[r]["state"][k]), k


def _stuck(rank: int, world: int):
    """Rank 1 does not reach step 0 within the collective timeout (a rank still loading data, or
    dead): rank 0's warm-up thread waits in its first collective, and rank 0's step 0 must fail
    within the timeout, naming the warm-up and the setting that skips it."""
    import time

    import deepcompile

    model, opt = deepcompile.initialize(make_model(**SMALL), make_optimizer,
                                        {"warm_collectives": True, "collective_timeout_s": 4, "plan_cache": False})
    if rank == 1:
        time.sleep(12)
        return "late"
    x, y = global_batch(0, 0, world)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    t0 = time.monotonic()
    try:
        model(x[sl], y[sl])
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e} ({time.monotonic() - t0:.1f} s)"
    return "no error"


def test_a_warm_up_that_cannot_finish_fails_step_0_naming_it():
    out = run_ranks(_stuck, 2, timeout=180)
    assert "warm-up did not finish in 4 s" in out[0] and "warm_collectives: false" in out[0], out[0]
    assert out[1] == "late"
