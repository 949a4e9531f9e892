// The torch.ops.dc operators. Schemas are declared once here; fake (meta) implementations for
// tracing live in deepcompile/runtime/ops.py, so tracing never touches communication.
//
// Ops that only have side effects declare a mutated argument (`Tensor(a!)`): that is what keeps
// FX dead-code elimination and Inductor's scheduler from dropping them or moving them ahead of
// the reads of that tensor, on every torch version we support, without touching torch internals.
#include "runtime.h"

namespace {

// The tensors the runtime makes (views of gathered buffers, bucket slices, .grad views, casts)
// need no autograd: they are never differentiated (the graph around the op is, by AOTAutograd),
// and the backward runs with grad mode off. Below the Autograd and ADInplaceOrView keys each
// ATen call goes straight to its kernel (the runtime's host time is mostly these calls); a view
// made here shares its buffer's memory but is not an autograd view of it.
//
// Each op holds the runtime's lock while it runs (dc::OpLock; see Runtime::mutex): getters called
// from another Python thread read a consistent state.
using Below = at::AutoDispatchBelowADInplaceOrView;

// -- the math-level ops that tracing sees (the `zero3` pass lowers them) ----------------------

at::Tensor unshard(const at::Tensor& shard, int64_t id) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("unshard", id);
  rt.start_allgather(shard, id);
  return rt.finish_allgather(id);
}

at::Tensor shard_grad(const at::Tensor& grad, int64_t id) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("shard_grad", id);
  return rt.reduce_scatter_now(grad, id);
}

// -- the runtime ops the passes insert ---------------------------------------------------------

at::Tensor allgather_param(const at::Tensor& shard, int64_t id) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("allgather_param", id);
  rt.start_allgather(shard, id);
  return at::empty({0}, shard.options());  // a handle: orders wait_allgather after this op
}

at::Tensor allgather_params(at::TensorList shards, at::IntArrayRef ids) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("allgather_params", ids.empty() ? -1 : ids[0]);
  rt.start_allgather_fused(shards.vec(), ids.vec());
  return at::empty({0}, shards[0].options());
}

at::Tensor wait_allgather(const at::Tensor& /*handle*/, int64_t id) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("wait_allgather", id);
  return rt.finish_allgather(id);
}

std::vector<at::Tensor> wait_allgather_many(const at::Tensor& /*handle*/, at::IntArrayRef ids) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("wait_allgather_many", ids.empty() ? -1 : ids[0]);
  return rt.finish_allgather_many(ids.vec());
}

at::Tensor gather_persistent(const at::Tensor& shard, int64_t id) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("gather_persistent", id);
  return rt.gather_persistent(shard, id);
}

std::vector<at::Tensor> gather_persistent_many(at::TensorList shards, at::IntArrayRef ids) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("gather_persistent_many", ids.empty() ? -1 : ids[0]);
  return rt.gather_persistent_many(shards.vec(), ids.vec());
}

// kept parameters in need order (selective_unshard.group_mb): start at the top, wait at first use
at::Tensor gather_persistent_start(at::TensorList shards, at::IntArrayRef ids) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("gather_persistent_start", ids.empty() ? -1 : ids[0]);
  TORCH_CHECK(!shards.empty(), "deepcompile: gather_persistent_start needs at least one shard");
  rt.start_persistent(shards.vec(), ids.vec());
  return at::empty({0}, shards[0].options());  // a handle: orders gather_persistent_wait after this op
}

std::vector<at::Tensor> gather_persistent_wait(const at::Tensor& /*handle*/, at::IntArrayRef ids) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("gather_persistent_wait", ids.empty() ? -1 : ids[0]);
  return rt.finish_persistent(ids.vec());
}

void release_param(at::Tensor& /*gathered*/, int64_t id) {  // no tensor work
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  rt.release(id);
}

void reduce_grad(at::Tensor& grad, int64_t id) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("reduce_grad", id);
  const int64_t before = rt.stats().reduce_scatters;
  rt.add_grad(grad, id);
  rt.count_reduce_op(rt.stats().reduce_scatters - before);
}

// One call per gradient bucket (a reduce_grad per parameter is the backward's largest host cost:
// 147 calls a step on the 953M Llama). The backward pass groups the gradients that
// reach the runtime between two bucket flushes (passes/zero3.py group_reduces) and calls this at
// the point where the last of them is ready; each is added in order exactly as reduce_grad adds
// it, so the buckets, the moment each flushes and what it holds are unchanged.
void reduce_grads(at::TensorList grads, at::IntArrayRef ids) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  TORCH_CHECK(grads.size() == ids.size(), "dc::reduce_grads: ", grads.size(), " gradients but ", ids.size(),
              " parameter ids; the pass must hand one id per gradient");
  const int64_t before = rt.stats().reduce_scatters;
  for (size_t i = 0; i < grads.size(); ++i) {
    rt.enter("reduce_grads", ids[i]);
    rt.add_grad(grads[i], ids[i]);
  }
  rt.count_reduce_op(rt.stats().reduce_scatters - before);
}

void end_backward(at::TensorList /*grads*/, int64_t graph_id) {
  auto& rt = dc::runtime();
  dc::OpLock lock(rt);
  Below below;
  rt.enter("end_backward", graph_id);
  rt.end_backward(graph_id);
}

}  // namespace

// The ids that compiled graphs pass are SymInt (the kernels still take int64_t; the dispatcher
// hands them concrete values): a decoder-block region compiled once takes each layer's ids as
// inputs (deepcompile/compile/blocks.py); with `int` the dispatcher would pin them to one layer's ids.
// Every op is tagged cudagraph_unsafe: each runs host logic every step (buckets, in-flight lists,
// collectives), which a CUDA graph replay would skip, so torch's CUDA-graph paths must never
// capture one.
TORCH_LIBRARY(dc, m) {
  m.def("unshard(Tensor shard, int id) -> Tensor", {at::Tag::cudagraph_unsafe});
  m.def("shard_grad(Tensor grad, int id) -> Tensor", {at::Tag::cudagraph_unsafe});
  m.def("allgather_param(Tensor shard, SymInt id) -> Tensor", {at::Tag::cudagraph_unsafe});
  m.def("allgather_params(Tensor[] shards, SymInt[] ids) -> Tensor", {at::Tag::cudagraph_unsafe});
  m.def("wait_allgather(Tensor handle, SymInt id) -> Tensor", {at::Tag::cudagraph_unsafe});
  m.def("wait_allgather_many(Tensor handle, SymInt[] ids) -> Tensor[]", {at::Tag::cudagraph_unsafe});
  m.def("gather_persistent(Tensor shard, SymInt id) -> Tensor", {at::Tag::cudagraph_unsafe});
  m.def("gather_persistent_many(Tensor[] shards, SymInt[] ids) -> Tensor[]", {at::Tag::cudagraph_unsafe});
  m.def("gather_persistent_start(Tensor[] shards, SymInt[] ids) -> Tensor", {at::Tag::cudagraph_unsafe});
  m.def("gather_persistent_wait(Tensor handle, SymInt[] ids) -> Tensor[]", {at::Tag::cudagraph_unsafe});
  m.def("release_param(Tensor(a!) gathered, SymInt id) -> ()", {at::Tag::cudagraph_unsafe});
  m.def("reduce_grad(Tensor(a!) grad, SymInt id) -> ()", {at::Tag::cudagraph_unsafe});
  m.def("reduce_grads(Tensor(a!)[] grads, SymInt[] ids) -> ()", {at::Tag::cudagraph_unsafe});
  m.def("end_backward(Tensor(a!)[] grads, int graph_id) -> ()", {at::Tag::cudagraph_unsafe});
}

#define DC_IMPLS(m)                                   \
  m.impl("unshard", &unshard);                        \
  m.impl("shard_grad", &shard_grad);                  \
  m.impl("allgather_param", &allgather_param);        \
  m.impl("wait_allgather", &wait_allgather);          \
  m.impl("wait_allgather_many", &wait_allgather_many); \
  m.impl("allgather_params", &allgather_params);      \
  m.impl("release_param", &release_param);            \
  m.impl("gather_persistent", &gather_persistent);    \
  m.impl("gather_persistent_many", &gather_persistent_many); \
  m.impl("gather_persistent_start", &gather_persistent_start); \
  m.impl("gather_persistent_wait", &gather_persistent_wait); \
  m.impl("reduce_grad", &reduce_grad);                \
  m.impl("reduce_grads", &reduce_grads);              \
  m.impl("end_backward", &end_backward);

TORCH_LIBRARY_IMPL(dc, CPU, m) { DC_IMPLS(m) }
TORCH_LIBRARY_IMPL(dc, CUDA, m) { DC_IMPLS(m) }
