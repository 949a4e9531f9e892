"""Python's cyclic collector is paused while deepcompile compiles (backend.paused_gc): in the
forwards of the compiling steps, with Dynamo's own collection after each frame off, the
compile's heap frozen between them, and one full collection at the end; a loop without optimizer steps (evaluation)
gets it back at its second forward (a step's micro-batches under gradient accumulation do not),
and a user's own ``gc.disable()`` is left alone."""
from __future__ import annotations

import torch  # noqa: F401  (the spawned ranks import it first, as the other tests do)

from tests.dist_utils import run_ranks


def _run(rank, world):
    import gc

    import torch

    import deepcompile
    from tests.workloads import global_batch, make_model, make_optimizer

    full = []  # full collections, by the step they ran in
    step = ["init"]  # (initialize's imports may collect: the collector is on until the first forward)
    gc.callbacks.append(lambda phase, info: full.append(step[0]) if phase == "start" and info["generation"] == 2 else None)
    dynamo_gc = torch._dynamo.config.run_gc_after_compile
    model, opt = deepcompile.initialize(make_model(), make_optimizer, {"compiler": "aot_eager"})
    after_forward, after_step, dynamo_flag = [], [], []
    for s in range(5):
        step[0] = s
        x, y = global_batch(s, 0, world)
        loss = model(x[:2], y[:2])
        after_forward.append(gc.isenabled())
        dynamo_flag.append(torch._dynamo.config.run_gc_after_compile)
        loss.backward()
        opt.step()
        opt.zero_grad()
        after_step.append(gc.isenabled())
    # evaluation only: no optimizer step ever ends the first compiling step
    step[0] = "eval init"
    ev, _ = deepcompile.initialize(make_model(1), make_optimizer, {"compiler": "aot_eager"})
    evals = []
    step[0] = "eval"
    with torch.no_grad():
        for _ in range(4):
            ev(x[:2], y[:2])
            evals.append(gc.isenabled())
    dynamo_gc_now = torch._dynamo.config.run_gc_after_compile  # no pause is held here
    frozen_after = gc.get_freeze_count()
    # gradient accumulation: the step's second micro-batch is no evaluation loop
    step[0] = "accumulation"
    am, aopt = deepcompile.initialize(make_model(3), make_optimizer,
                                      {"compiler": "aot_eager", "gradient_accumulation_steps": 2})
    micro = []
    for m in range(2):
        loss = am(x[:2], y[:2])
        micro.append(gc.isenabled())
        loss.backward()
        aopt.step()
        aopt.zero_grad()
    # a user who turned the collector off keeps it off
    gc.disable()
    step[0] = "user"
    um, uopt = deepcompile.initialize(make_model(2), make_optimizer, {"compiler": "aot_eager"})
    user = []
    for s in range(4):
        loss = um(x[:2], y[:2])
        loss.backward()
        uopt.step()
        uopt.zero_grad()
        user.append(gc.isenabled())
    gc.enable()
    return {"after_forward": after_forward, "after_step": after_step, "full": full, "evals": evals,
            "user": user, "micro": micro, "dynamo_flag": dynamo_flag, "dynamo_gc": dynamo_gc,
            "dynamo_gc_now": dynamo_gc_now, "frozen_after": frozen_after}


def test_collector_waits_for_the_compile_and_comes_back():
    r = run_ranks(_run, 2, timeout=300)[0]
    # steps 0-2 compile (warm-up trace, profiling, planned re-compile): off through them
    assert r["after_forward"] == [False, False, False, True, True], r
    # between the compiling steps it runs (over what is newer than the frozen compile heap)
    assert r["after_step"] == [True] * 5, r
    assert r["dynamo_flag"][:3] == [False] * 3 and r["dynamo_gc_now"] == r["dynamo_gc"], r
    # the one full collection at the end of step 2, with the frozen heap taken back
    assert 2 in r["full"] and r["frozen_after"] == 0, r
    # ... and one full collection: a later forward of that step does not pause (and collect) again
    assert r["evals"] == [False, True, True, True] and r["full"].count("eval") == 1, r
    assert r["micro"] == [False, False], r
    assert r["user"] == [False] * 4, r
