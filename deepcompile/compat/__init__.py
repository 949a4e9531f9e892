"""Torch shims: every touch of torch internals that is not a feature of ours, one module per torch
subsystem. Each function says why it is needed and which torch versions it was checked against
(2.11 on the GPU machines, 2.13 in CI). Public extension points are used wherever torch has one:
custom ops with fake impls (``torch.library``), a ``torch.compile`` backend function, FX passes,
``torch.nn.utils.parametrize``. Features built on these (nested regions, blocks, trace once, ...)
live in ``deepcompile.compile``.

- ``fx``: node and graph internals, storage identity, size hints
- ``dynamo``: compiled modules, nested regions, reset, dynamic marks, counters
- ``aot``: AOTAutograd's partitioner tag, boxed calls, input descriptors, saved outputs, strides
- ``inductor``: lowerings that keep the runtime's buffers out of Inductor's memory reuse
- ``c10d``: the rendezvous store, the all-gather, FSDP and DTensor checks
- ``nn``: parametrization getter, optimizer foreach default, the profiler's GPU spin

Nothing here imports the rest of deepcompile, and importing it patches nothing.
"""
