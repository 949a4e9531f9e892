"""Torch shims: every touch of torch internals that is not a feature of ours, one module per torch
subsystem (``fx``, ``dynamo``, ``aot``, ``inductor``, ``c10d``, ``nn``). Each function says why it
is needed; each module's docstring, which torch versions it is checked against (2.11 on the GPU
machines, 2.13 in CI). Features built on torch's public extension points (custom ops, the
``torch.compile`` backend, FX passes, ``parametrize``) live in ``deepcompile.compile``.

Nothing here imports the rest of deepcompile, and importing it patches nothing.
"""
