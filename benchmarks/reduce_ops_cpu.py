"""The reduce ops called directly: one gloo rank, 91 tiny gradients (no compute), main-thread
CPU per backward of reduce_grad x91 vs one reduce_grads, then adds vs end_backward (flush + hand-over) and
a torch profiler table of where end_backward goes. Scratch measurement behind estimate.HOST_US["reduce_grads"]."""
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29711")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
import deepcompile
from deepcompile.models import GPT, GPTConfig
from deepcompile.runtime import ops
m, opt = deepcompile.initialize(GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=8, n_head=2, n_embd=4)), lambda ps: torch.optim.AdamW(ps), {"compiler": "aot_eager"})
metas = [mm for mm in m.dc_state.runtime.params.values() if mm.requires_grad]
grads = [torch.randn(mm.shape) for mm in metas]
ids = [mm.id for mm in metas]
R, RS, E = torch.ops.dc.reduce_grad.default, torch.ops.dc.reduce_grads.default, torch.ops.dc.end_backward.default
def per():
    for g, i in zip(grads, ids): R(g, i)
    E(grads, 0)
def batched():
    RS(grads, ids); E(grads, 0)
def endonly():
    E(grads, 0)
for f in (per, batched, per, batched):
    for _ in range(20): f()
    best = []
    for _ in range(5):
        c0 = time.thread_time()
        for _ in range(200): f()
        best.append((time.thread_time() - c0) / 200 * 1e6)
    print(f.__name__, len(grads), "grads: min CPU us per backward", round(min(best), 1))
for _ in range(5):
    c0 = time.thread_time()
    for _ in range(200): endonly()
print("end_backward alone (no grads)", round((time.thread_time()-c0)/200*1e6,1))
# the zero-gradient state each time: .grad dropped so apply_grads takes the fresh path
shards = [sp.shard for sp in m.dc_state.sharded]
def per_fresh():
    for s in shards: s.grad = None
    per()
def batched_fresh():
    for s in shards: s.grad = None
    batched()
def none_fresh():
    for s in shards: s.grad = None
for f in (per_fresh, batched_fresh, none_fresh, per_fresh, batched_fresh, none_fresh):
    best = []
    for _ in range(5):
        c0 = time.thread_time()
        for _ in range(300): f()
        best.append((time.thread_time() - c0) / 300 * 1e6)
    print(f.__name__, "min CPU us", round(min(best), 1))
ta = te = 0.0
for _ in range(300):
    for s in shards: s.grad = None
    c0 = time.thread_time(); RS(grads, ids); c1 = time.thread_time(); E(grads, 0); c2 = time.thread_time()
    ta += c1 - c0; te += c2 - c1
print("adds (reduce_grads) us", round(ta / 300 * 1e6, 1), "end_backward (flush+apply) us", round(te / 300 * 1e6, 1))
st = ops.C.stats(); print({k: st[k] for k in ("reduce_scatters", "reduce_copies", "reduce_cats")})
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(50):
        for s in shards: s.grad = None
        RS(grads, ids); E(grads, 0)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
