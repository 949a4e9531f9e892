"""Decoder blocks named in a pass's parameters: which block a node was traced in, and a block list."""
from __future__ import annotations

import operator

import torch.fx as fx

from deepcompile.compile.blocks import block_label
from deepcompile.params import ConfigError


def parse_blocks(text: str, path: str = "blocks") -> set[int] | str:
    """``'all'``, or the set of block indices in ``text`` (``'0,2,5'``); raises ConfigError naming
    the key and the bad entry."""
    t = str(text).strip()
    if t == "all":
        return "all"
    out = set()
    for part in filter(None, (p.strip() for p in t.split(","))):
        if not part.isdigit():
            raise ConfigError(f"{path}: {part!r} is not a block index; give comma-separated indices "
                             "such as '0,1,2', 'all', or '' for none")
        out.add(int(part))
    return out


def block_of(n: fx.Node) -> int | None:
    """The decoder block index ``n`` was traced in (``compile.blocks.block_label``), or None."""
    lab = block_label(n)
    return lab[1] if lab is not None and len(lab) == 3 else None


def node_block(n: fx.Node) -> int | None:
    """``block_of``, and for an item of a multi-output op (which carries no scope) its op's."""
    b = block_of(n)
    if b is None and n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        b = block_of(n.args[0])
    return b
