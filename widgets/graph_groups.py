"""Which box of the graph picture each node is drawn in, and the union of two graph versions.

Grouping is :mod:`deepcompile.report.graph_groups`'s (``node_groups``: the module-collapsed
picture of the HTML report); :func:`key_chains` opens expanded modules one scope level at a time,
down to single nodes (``blocks.3`` -> ``blocks.3.attn`` -> ``blocks.3.attn/addmm_4``), and
:func:`collapse_keys` builds the boxes and edges of explicit group keys. :func:`union_diff` merges
two versions for a diff: removed nodes kept at their old place (so positions stay stable), and
"moved" nodes, those off the longest common order (prefetch hoisting). Plain functions over node
dicts, used by :class:`~deepcompile.widgets.graph_view.GraphModel`.
"""
from __future__ import annotations

import bisect
from collections import Counter

from deepcompile.plan import estimate as E
from deepcompile.report import graph_groups as L

# --------------------------------------------------------------------------- grouping
effective_scope = L.effective_scope  # one rule for where a node belongs, shared with the report


def key_chains(nodes: list[dict], expanded: set[str], pscopes: dict,
               depth: int | None = None) -> tuple[list[list[str]], list[bool]]:
    """Per node, the chain of group keys from its top-level box down to the box that shows it
    (``["blocks.3", "blocks.3.attn", "blocks.3.attn/addmm_4"]`` with ``blocks.3`` and
    ``blocks.3.attn`` expanded); every key but the last is an expanded (open) module."""
    keys, inferred = L.node_groups(nodes, depth, pscopes)
    if not expanded:
        return [[k] for k in keys], inferred
    out = []
    for n, k in zip(nodes, keys):
        chain = [k]
        key = k
        s = effective_scope(n, pscopes)
        for _ in range(64):
            if key not in expanded:
                break
            if s.startswith(key + "."):
                rest = s[len(key) + 1:].split(".")
                key = f"{key}.{rest[0]}"
            else:
                key = f"{key}/{n['name']}"
                chain.append(key)
                break
            chain.append(key)
        out.append(chain)
    return out, inferred


def expanded_keys(nodes: list[dict], expanded: set[str], pscopes: dict,
                  depth: int | None = None) -> tuple[list[str], list[bool]]:
    """Group keys with the groups in ``expanded`` opened one scope level (or to nodes)."""
    chains, inferred = key_chains(nodes, expanded, pscopes, depth)
    return [c[-1] for c in chains], inferred


def collapse_keys(nodes: list[dict], keys: list[str], inferred: list[bool]) -> L.Collapsed:
    """``report.graph_groups.Collapsed`` for explicit group keys (same fields as ``collapse``)."""
    groups: dict[str, L.Group] = {}
    for i, (n, k) in enumerate(zip(nodes, keys)):
        g = groups.get(k)
        if g is None:
            g = groups[k] = L.Group(k, len(groups))
        g.node_indices.append(i)
        g.inferred += bool(inferred[i]) and "/" not in k
        c = E.comm_kind(n)
        if c is not None:
            g.comm[c] += 1
        elif n["op"] not in ("placeholder", "get_attr", "output"):
            t = n["target"].split(".")
            g.ops[t[1] if len(t) > 1 and t[0] in ("aten", "prims", "dc") else n["target"]] += 1
    gi = {n["name"]: groups[k].index for n, k in zip(nodes, keys)}
    edges: Counter = Counter()
    for n, k in zip(nodes, keys):
        dst = groups[k].index
        for r in E.inputs_of(n):
            src = gi.get(r)
            if src is not None and src != dst:
                edges[(src, dst)] += 1
    return L.Collapsed(list(groups.values()), [(a, b, c) for (a, b), c in edges.items()], len(nodes))


# --------------------------------------------------------------------------- diff
def _lis_members(seq: list[int]) -> set[int]:
    """Indices (into ``seq``) of one longest increasing subsequence."""
    tails: list[int] = []
    tails_i: list[int] = []
    prev = [-1] * len(seq)
    for i, v in enumerate(seq):
        j = bisect.bisect_left(tails, v)
        if j == len(tails):
            tails.append(v)
            tails_i.append(i)
        else:
            tails[j] = v
            tails_i[j] = i
        prev[i] = tails_i[j - 1] if j else -1
    out, i = set(), (tails_i[-1] if tails_i else -1)
    while i >= 0:
        out.add(i)
        i = prev[i]
    return out


def union_diff(before: list[dict], after: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """(union node list in a stable order, node name -> "added" | "removed" | "moved").

    Removed nodes are placed right after the node that preceded them in ``before`` so that the
    picture of ``after`` keeps its layout and the removals show where they were."""
    bnames = {n["name"]: i for i, n in enumerate(before)}
    anames = {n["name"] for n in after}
    status: dict[str, str] = {}
    common = [n["name"] for n in after if n["name"] in bnames]
    keep = _lis_members([bnames[c] for c in common])
    for i, c in enumerate(common):
        if i not in keep:
            status[c] = "moved"
    for n in after:
        if n["name"] not in bnames:
            status[n["name"]] = "added"
    # removed nodes: insert after their nearest surviving predecessor in `before`
    follow: dict[str | None, list[dict]] = {}
    last_kept: str | None = None
    for n in before:
        if n["name"] in anames:
            last_kept = n["name"]
        else:
            status[n["name"]] = "removed"
            follow.setdefault(last_kept, []).append(n)
    union = list(follow.get(None, []))
    for n in after:
        union.append(n)
        union.extend(follow.get(n["name"], []))
    return union, status
