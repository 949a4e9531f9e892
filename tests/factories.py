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


def diverging_gpt():
    """``tiny_gpt`` whose training diverges, as a far too large learning rate makes a run do: the
    loss is scaled past float32's range, so step 1's loss is inf, its gradients inf/NaN, AdamW
    fills the weights with NaN and every later loss is NaN. The demo must still end with a report."""
    import torch

    model, make_batch = tiny_gpt()

    class Diverging(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            return self.inner(x, y) * 1e39   # > float32 max (3.4e38): inf

    return Diverging(model), make_batch


def crashing_gpt():
    """``tiny_gpt`` whose rank 1 dies of a segfault when it makes its second batch (native code
    crashing, as a use-after-free would): the demo must say where."""
    model, make_batch = tiny_gpt()

    def crash_in_rank1_step2(step, rank, device):
        if rank == 1 and step == 2:
            import faulthandler

            faulthandler._sigsegv()
        return make_batch(step, rank, device)

    return model, crash_in_rank1_step2
