"""Model and plan: between ``profile/`` (what was measured) and ``passes/`` (what is rewritten).

- ``estimate``: the engine that walks a graph's nodes into a schedule and a memory timeline;
- ``cost_model``: ``predict`` (time and peak of a compiled plan);
- ``memory``: the memory of a plan by category (shards, gathered, gradients, optimizer state,
  activations, offloaded) from a profile;
- ``planner``: the default plan's pass parameters from the agreed profile, the device's capacity
  and the user's memory limit.

Policy lives here; the passes only take parameters. The plan reads the layers below it (passes,
profile, record); none of them imports the plan.
"""
