"""``import deepcompile`` changes nothing in torch; ``initialize`` routes ``clip_grad_norm_``
(``deepcompile.clip.route_clip_grad_norm``), once, however often it is called."""
import subprocess
import sys

_CHECK = r"""
import torch, torch.nn.utils.clip_grad as cg
before = (torch.nn.utils.clip_grad_norm_, cg.clip_grad_norm_)
import deepcompile
assert (torch.nn.utils.clip_grad_norm_, cg.clip_grad_norm_) == before, "import deepcompile patched clip_grad_norm_"
from deepcompile import clip
clip.route_clip_grad_norm()
routed = torch.nn.utils.clip_grad_norm_
assert routed is not before[0] and cg.clip_grad_norm_ is routed and routed.__dc_original__ is before[0]
clip.route_clip_grad_norm()
assert torch.nn.utils.clip_grad_norm_ is routed, "a second route wrapped the wrapper"
p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 3.0)
assert abs(float(torch.nn.utils.clip_grad_norm_([p], 1.0)) - 6.0) < 1e-6  # a plain tensor: torch's own
print("ok")
"""


def test_import_patches_nothing_and_the_route_is_installed_once():
    r = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
