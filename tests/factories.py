"""A model factory for ``deepcompile demo --model tests.factories:tiny_gpt`` (and Inspector.launch)."""
from __future__ import annotations


def tiny_gpt():
    import torch

    from tests.workloads import MODEL, make_model

    def make_batch(step, rank, device):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, MODEL.vocab_size, (2, 16), generator=g)
        return x.to(device), ((x * 7 + 3) % MODEL.vocab_size).to(device)

    return make_model(), make_batch
