// Runtime state, the parameter registry, reduce buckets, and the Python entry points
// (init / register / reset / cleanup / stats). The graph-facing operators live in zero3.cpp.
#include "runtime.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/strides.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_set>
#include <utility>

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace dc {

namespace {
std::shared_ptr<Runtime> g_runtime;
std::mutex g_runtime_mu;  // init and cleanup against readers on other threads (runtime_shared)
bool g_copy_grads = false;

// a collective's own error, without the C++ backtrace c10::Error carries
std::string error_text(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}
}

void set_copy_grads(bool copy) { g_copy_grads = copy; }
bool copy_grads() { return g_copy_grads; }

Runtime& runtime() {
  TORCH_CHECK(g_runtime, "deepcompile runtime is not initialized: call deepcompile.initialize(...) first");
  return *g_runtime;
}

std::shared_ptr<Runtime> runtime_shared() {
  std::lock_guard<std::mutex> g(g_runtime_mu);
  TORCH_CHECK(g_runtime, "deepcompile runtime is not initialized: call deepcompile.initialize(...) first");
  return g_runtime;
}

bool has_runtime() {
  std::lock_guard<std::mutex> g(g_runtime_mu);
  return static_cast<bool>(g_runtime);
}

Runtime::Runtime(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t bucket_elems, int64_t max_inflight,
                 int64_t timeout_ms)
    : pg_(std::move(pg)), bucket_elems_(bucket_elems), max_inflight_(max_inflight), timeout_ms_(timeout_ms) {
  TORCH_CHECK(timeout_ms_ > 0, "deepcompile: collective timeout must be positive, got ", timeout_ms_, " ms");
  TORCH_CHECK(pg_, "deepcompile: process group is null");
  TORCH_CHECK(bucket_elems_ > 0, "deepcompile: reduce bucket size must be positive, got ", bucket_elems_);
  TORCH_CHECK(max_inflight_ > 0, "deepcompile: max in-flight reduces must be positive");
  rank_ = pg_->getRank();
  world_ = pg_->getSize();
}

c10::Stream Runtime::to_side(const at::Device& device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  const c10::Stream cur = impl->getStream(device);
  if (!side_ || side_->device() != cur.device()) {
    side_ = impl->getStreamFromGlobalPool(cur.device(), /*isHighPriority=*/false);
    to_side_ev_ = std::make_unique<c10::Event>(device.type());
    from_side_ev_ = std::make_unique<c10::Event>(device.type());
  }
  to_side_ev_->record(cur);
  to_side_ev_->block(*side_);
  return *side_;
}

void Runtime::join_side() {
  if (!side_pending_ || !side_) return;
  const c10::Stream cur = c10::impl::getDeviceGuardImpl(side_->device_type())->getStream(side_->device());
  from_side_ev_->record(*side_);
  from_side_ev_->block(cur);
  side_pending_ = false;
}

void Runtime::register_param(int64_t id, const std::string& name, at::Tensor shard,
                             std::vector<int64_t> shape, at::ScalarType gather_dtype) {
  TORCH_CHECK(params_.find(id) == params_.end(), "deepcompile: parameter id ", id, " ('", name,
              "') is already registered");
  TORCH_CHECK(shard.is_contiguous(), "deepcompile: shard of '", name, "' must be contiguous");
  int64_t numel = 1;
  for (auto s : shape) numel *= s;
  // Row-aligned shards (sharding.shard_layout): ceil(d0 / world) rows of the parameter per rank.
  const int64_t rows = shape.empty() ? 1 : shape[0];
  const int64_t row = rows > 0 ? numel / rows : 0;
  const int64_t expect = (rows + world_ - 1) / world_ * row;
  const int64_t chunk = shard.numel();
  TORCH_CHECK(chunk == expect, "deepcompile: shard of '", name, "' has ", chunk, " elements (shape ",
              shard.sizes(), "); a parameter of shape ", c10::IntArrayRef(shape), " over ", world_,
              " ranks needs ", (rows + world_ - 1) / world_, " rows of ", row, " elements");
  Param p;
  p.id = id;
  p.name = name;
  p.shard = shard;
  p.shape = std::move(shape);
  p.numel = numel;
  p.chunk = chunk;
  p.gather_dtype = gather_dtype;
  const auto st = c10::contiguous_strides(c10::IntArrayRef(p.shape));
  p.strides.assign(st.begin(), st.end());
  p.flat_shard = shard.view({-1});
  params_.emplace(id, std::move(p));
}

Param& Runtime::mutable_param(int64_t id) {
  auto it = params_.find(id);
  TORCH_CHECK(it != params_.end(), "deepcompile: unknown parameter id ", id, " (", params_.size(),
              " registered); was the graph compiled for another deepcompile.initialize?");
  return it->second;
}

const Param& Runtime::param(int64_t id) const {
  auto it = params_.find(id);
  TORCH_CHECK(it != params_.end(), "deepcompile: unknown parameter id ", id, " (", params_.size(),
              " registered); was the graph compiled for another deepcompile.initialize?");
  return it->second;
}

void Runtime::prune_live() {
  // drop the expired entries in place (no copy of the weak references) and count the rest
  int64_t n = 0, bytes = 0;
  size_t w = 0;
  for (size_t r = 0; r < live_.size(); ++r) {
    auto strong = live_[r].second.lock();
    if (!strong) continue;
    ++n;
    bytes += static_cast<int64_t>(strong->nbytes());
    if (w != r) live_[w] = std::move(live_[r]);
    ++w;
  }
  live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(w), live_.end());
  stats_.peak_live_gathered = std::max(stats_.peak_live_gathered, n);
  stats_.peak_live_gathered_bytes = std::max(stats_.peak_live_gathered_bytes, bytes);
  step_peak_gathered_ = std::max(step_peak_gathered_, bytes);  // gathered bytes only grow here
}

const at::Tensor& Runtime::flat_shard(Param& p, const at::Tensor& shard) {
  // The view made at registration while the shard's memory is still where it was (the graph
  // passes the registered tensor); a shard whose memory moved gets a new one, kept for next time.
  const at::Tensor& f = p.flat_shard;
  if (!(f.defined() && shard.const_data_ptr() == f.const_data_ptr() && shard.is_contiguous() &&
        shard.scalar_type() == f.scalar_type() && shard.device() == f.device()))
    p.flat_shard = shard.contiguous().view({-1});
  return p.flat_shard;
}

std::vector<std::pair<int64_t, int64_t>> Runtime::reduce_storages() const {
  // distinct storages: a bucket entry that is the graph's own gradient may share its storage with
  // another entry (views of one buffer), and an in-flight input is a bucket entry's flat
  // (read twice per flush, every step: a set, not a scan of what was added, so ZeRO-1's many
  // local accumulations do not make it quadratic)
  std::vector<std::pair<int64_t, int64_t>> out;
  std::unordered_set<int64_t> seen;
  auto add = [&out, &seen](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    const int64_t ptr = reinterpret_cast<int64_t>(t.storage().data());
    if (!seen.insert(ptr).second) return;
    out.emplace_back(ptr, static_cast<int64_t>(t.storage().nbytes()));
  };
  for (auto& kv : buckets_)
    for (auto& e : kv.second.entries) add(e.flat);
  for (auto* q : {&inflight_, &replicating_})
    for (auto& r : *q) {
      for (auto& t : r.inputs) add(t);
      add(r.output);
    }
  for (auto& kv : local_grads_) add(kv.second);
  return out;
}

int64_t Runtime::reduce_held_bytes() const {
  int64_t b = 0;
  for (auto& e : reduce_storages()) b += e.second;
  return b;
}

std::vector<int64_t> Runtime::live_gathered() {
  // transient gathered buffers still alive (kept, selectively unsharded parameters excluded)
  std::vector<int64_t> ids;
  std::vector<std::pair<int64_t, c10::weak_intrusive_ptr<c10::StorageImpl>>> keep;
  for (auto& e : live_) {
    if (!e.second.expired()) {
      if (persistent_.find(e.first) == persistent_.end()) ids.push_back(e.first);
      keep.push_back(e);
    }
  }
  live_.swap(keep);
  return ids;
}

void Runtime::invalidate_persistent() { persistent_.clear(); }

void Runtime::start_allgather(const at::Tensor& shard, int64_t id) {
  Param& p = mutable_param(id);
  TORCH_CHECK(shard.numel() == p.chunk, "deepcompile: allgather of '", p.name, "' got a shard of ",
              shard.numel(), " elements, the registry holds ", p.chunk);
  TORCH_CHECK(pending_.find(id) == pending_.end(), "deepcompile: allgather of '", p.name,
              "' started twice without wait_allgather in between");
  at::Tensor src = flat_shard(p, shard);
  at::Tensor buffer = at::empty({p.chunk * world_}, at::TensorOptions().dtype(p.gather_dtype).device(src.device()));
  c10::intrusive_ptr<c10d::Work> work;
  c10d::AllgatherOptions opts;
  if (!src.is_cuda()) opts.timeout = host_op_timeout();
  if (src.scalar_type() == p.gather_dtype) {
    work = pg_->_allgather_base(buffer, src, opts);
  } else if (!side_enabled(src)) {
    at::Tensor in = src.to(p.gather_dtype);
    work = pg_->_allgather_base(buffer, in, opts);
  } else {
    // the cast on the side stream, and the collective issued from it (NCCL's stream waits on
    // the stream current at issue); its input is allocated on the compute stream
    at::Tensor in = at::empty({p.chunk}, buffer.options());
    c10::StreamGuard guard(to_side(src.device()));
    in.copy_(src);
    work = pg_->_allgather_base(buffer, in, opts);
  }
  issued_ += 1;
  pending_[id] = PendingGather{work, buffer};
  track_live(buffer, id);  // memory is taken when the collective is issued, not when waited
  prune_live();
  stats_.allgathers += 1;
  stats_.allgather_bytes += buffer.nbytes();
}

void Runtime::start_allgather_fused(const std::vector<at::Tensor>& shards, const std::vector<int64_t>& ids) {
  TORCH_CHECK(shards.size() == ids.size() && !ids.empty(), "deepcompile: fused allgather needs one id per shard");
  // One collective for many parameters: the host pays one launch instead of one per parameter.
  //
  // On CUDA (NCCL) it is one coalesced collective and each parameter lands in its own buffer, so
  // nothing is packed or unpacked. The casts to the gather dtype run as one multi-tensor copy
  // (_foreach_copy_, not one aten::to per shard), each shard cast straight into its rank's slice
  // of its output and gathered in place (NCCL's in-place allgather: the input is
  // out[rank * chunk, (rank + 1) * chunk)), so no input tensor is allocated.
  //
  // On the host (gloo) the group is packed into one _allgather_base: torch's gloo corrupts its
  // heap ("malloc(): unaligned tcache chunk detected") when several
  // allgather_into_tensor_coalesced calls are in flight, and its _allgather_base is safe. One
  // cat (with the cast) packs the shards, and the group's first wait splits the packed result
  // into the members' buffers (one copy). benchmarks/gloo_fused_gather.py, 2 gloo ranks on a
  // loaded 2-core host, 3 groups in flight, ms a group over three runs: 8 x 1k elements packed
  // 0.7-1.2, coalesced 1.0-1.3, coalesced on a one-thread gloo group 1.3, one _allgather_base per
  // parameter 4-13; 32 x 4k packed 1.4-2.1, coalesced 2.1-3.4, one thread 1.9-5.1, per parameter
  // 13-47; 8 x 64k packed 6.5-12.6 (its two copies), coalesced 3.8-9.1, one thread 4.2-5.2. The
  // groups the passes fuse are small parameters, where packing costs least; a one-thread group
  // would also need a second process group beside the user's.
  const bool on_cuda = shards[0].is_cuda();
  std::vector<at::Tensor> ins, outs, srcs;
  for (size_t i = 0; i < ids.size(); ++i) {
    Param& p = mutable_param(ids[i]);
    TORCH_CHECK(shards[i].numel() == p.chunk, "deepcompile: allgather of '", p.name, "' got a shard of ",
                shards[i].numel(), " elements, the registry holds ", p.chunk);
    TORCH_CHECK(pending_.find(ids[i]) == pending_.end(), "deepcompile: allgather of '", p.name,
                "' started twice without wait_allgather in between");
    TORCH_CHECK(shards[i].device() == shards[0].device(), "deepcompile: fused allgather of '", p.name,
                "': shard on ", shards[i].device(), ", the group's first on ", shards[0].device());
    srcs.push_back(flat_shard(p, shards[i]));
    outs.push_back(at::empty({p.chunk * world_}, at::TensorOptions().dtype(p.gather_dtype).device(srcs.back().device())));
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works(ids.size());
  std::vector<std::shared_ptr<PackedGather>> packs(ids.size());
  if (!on_cuda) {
    // one packed collective per gather dtype (a group's members normally share one)
    std::vector<bool> done(ids.size(), false);
    for (size_t first = 0; first < ids.size(); ++first) {
      if (done[first]) continue;
      const at::ScalarType dtype = outs[first].scalar_type();
      std::vector<size_t> members;
      for (size_t i = first; i < ids.size(); ++i)
        if (!done[i] && outs[i].scalar_type() == dtype) {
          members.push_back(i);
          done[i] = true;
        }
      auto packed = std::make_shared<PackedGather>();
      std::vector<at::Tensor> parts;
      int64_t n = 0;
      for (size_t i : members) {
        parts.push_back(srcs[i]);
        packed->dsts.push_back(outs[i]);
        packed->cols.push_back(srcs[i].numel());
        n += srcs[i].numel();
      }
      at::Tensor in = at::empty({n}, outs[first].options());
      at::cat_out(in, parts);  // the cast, where there is one, in the same copy
      packed->out = at::empty({n * world_}, outs[first].options());
      c10d::AllgatherOptions opts;
      opts.timeout = host_op_timeout();
      auto work = pg_->_allgather_base(packed->out, in, opts);
      issued_ += 1;
      for (size_t i : members) {
        works[i] = work;
        packs[i] = packed;
      }
    }
  } else {
    c10::intrusive_ptr<c10d::Work> work;
    for (size_t i = 0; i < ids.size(); ++i) {
      const int64_t chunk = srcs[i].numel();
      ins.push_back(at::as_strided(outs[i], {chunk}, {1}, rank_ * chunk));
    }
    if (side_enabled(srcs[0])) {
      // the casts on the side stream (at the forward's top every kept group's cast would queue on
      // the compute stream ahead of the first layer), the collective issued from it
      c10::StreamGuard guard(to_side(srcs[0].device()));
      at::_foreach_copy_(ins, srcs);
      work = pg_->allgather_into_tensor_coalesced(outs, ins);
    } else {
      at::_foreach_copy_(ins, srcs);
      work = pg_->allgather_into_tensor_coalesced(outs, ins);
    }
    issued_ += 1;
    for (auto& w : works) w = work;
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    pending_[ids[i]] = PendingGather{works[i], outs[i], packs[i]};
    track_live(outs[i], ids[i]);
    stats_.allgather_bytes += outs[i].nbytes();
  }
  prune_live();
  stats_.allgathers += static_cast<int64_t>(ids.size());
  stats_.fused_allgathers += 1;
}

// A packed host gather's result into its members' buffers, once (at the group's first wait).
static void unpack(PackedGather& g, int64_t world) {
  if (g.unpacked) return;
  std::vector<at::Tensor> views;
  views.reserve(g.dsts.size());
  for (size_t i = 0; i < g.dsts.size(); ++i) views.push_back(g.dsts[i].view({world, g.cols[i]}));
  at::split_with_sizes_copy_out(views, g.out.view({world, -1}), g.cols, 1);
  g.unpacked = true;
  g.out = at::Tensor();
  g.dsts.clear();
}

// A gathered flat buffer ([world * chunk], zero-padded) as the parameter: its first numel
// elements in the full shape, one as_strided (one dispatcher call, where narrow + view are three).
static at::Tensor as_param(const at::Tensor& buffer, const Param& p) {
  return at::as_strided(buffer, p.shape, p.strides, buffer.storage_offset());
}

at::Tensor Runtime::finish_allgather(int64_t id) {
  const Param& p = param(id);
  auto it = pending_.find(id);
  TORCH_CHECK(it != pending_.end(), "deepcompile: wait_allgather for '", p.name,
              "' without a started allgather");
  PendingGather pg = std::move(it->second);
  pending_.erase(it);
  // a fused gather's later waits return at once (wait_allgather_many waits once for them all)
  wait_work(pg.work, pg.buffer.is_cuda(), [&] { return "allgather of parameter '" + p.name + "'"; });
  if (pg.packed) unpack(*pg.packed, world_);
  stats_.allgather_waits += 1;
  // Ownership passes to the graph: the runtime keeps only a weak reference, so the memory is
  // returned as soon as the graph drops its last use (release_param marks that point).
  return as_param(pg.buffer, p);
}

std::vector<at::Tensor> Runtime::finish_allgather_many(const std::vector<int64_t>& ids) {
  // The members of one coalesced gather finish together: one host wait (per distinct collective)
  // hands out all of them, instead of one dispatcher call and one wait per parameter.
  std::vector<PendingGather> got;
  got.reserve(ids.size());
  for (int64_t id : ids) {
    const Param& p = param(id);
    auto it = pending_.find(id);
    TORCH_CHECK(it != pending_.end(), "deepcompile: wait_allgather_many for '", p.name,
                "' without a started allgather");
    got.push_back(std::move(it->second));
    pending_.erase(it);
  }
  std::vector<at::Tensor> out;
  out.reserve(ids.size());
  const c10d::Work* waited = nullptr;
  for (size_t i = 0; i < ids.size(); ++i) {
    const Param& p = param(ids[i]);
    if (got[i].work.get() != waited) {
      wait_work(got[i].work, got[i].buffer.is_cuda(), [&] { return "allgather of parameter '" + p.name + "'"; });
      if (got[i].packed) unpack(*got[i].packed, world_);
      stats_.allgather_waits += 1;
      waited = got[i].work.get();
    }
    out.push_back(as_param(got[i].buffer, p));
  }
  return out;
}

at::Tensor Runtime::gather_persistent(const at::Tensor& shard, int64_t id) {
  return gather_persistent_many({shard}, {id})[0];
}

std::vector<at::Tensor> Runtime::gather_persistent_many(const std::vector<at::Tensor>& shards,
                                                        const std::vector<int64_t>& ids) {
  // The kept parameters of a graph in one coalesced collective (one launch, one wait) instead
  // of one synchronous gather each; those already kept (a later micro-batch, the backward) are
  // returned as they are. The need-order groups' start and wait, back to back.
  TORCH_CHECK(shards.size() == ids.size(), "deepcompile: gather_persistent_many needs one id per shard");
  start_persistent(shards, ids);
  return finish_persistent(ids);
}

void Runtime::start_persistent(const std::vector<at::Tensor>& shards, const std::vector<int64_t>& ids) {
  TORCH_CHECK(shards.size() == ids.size(), "deepcompile: gather_persistent_start needs one id per shard, got ",
              shards.size(), " shards and ", ids.size(), " ids");
  std::vector<at::Tensor> missing_shards;
  std::vector<int64_t> missing;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (persistent_.find(ids[i]) == persistent_.end()) {
      missing_shards.push_back(shards[i]);
      missing.push_back(ids[i]);
    }
  }
  if (missing.size() == 1) {
    start_allgather(missing_shards[0], missing[0]);
  } else if (!missing.empty()) {
    start_allgather_fused(missing_shards, missing);
  }
}

std::vector<at::Tensor> Runtime::finish_persistent(const std::vector<int64_t>& ids) {
  std::vector<int64_t> missing;
  for (int64_t id : ids) {
    if (persistent_.find(id) != persistent_.end()) {
      stats_.persistent_hits += 1;
    } else {
      TORCH_CHECK(pending_.find(id) != pending_.end(), "deepcompile: gather_persistent_wait for '", param(id).name,
                  "': it is neither kept nor being gathered (no gather_persistent_start for it ran in this graph, "
                  "or an optimizer step dropped the kept copies between the start and the wait)");
      missing.push_back(id);
    }
  }
  if (!missing.empty()) {
    // one host call; the stream waits once per collective (the group's members finish together)
    std::vector<at::Tensor> got = finish_allgather_many(missing);
    for (size_t i = 0; i < missing.size(); ++i) persistent_[missing[i]] = std::move(got[i]);
  }
  std::vector<at::Tensor> out;
  out.reserve(ids.size());
  for (int64_t id : ids) out.push_back(persistent_[id]);
  return out;
}

int64_t Runtime::persistent_bytes() const {
  int64_t b = 0;
  for (auto& kv : persistent_) b += kv.second.nbytes();
  return b;
}

void Runtime::release(int64_t id) {
  param(id);
  stats_.releases += 1;
}

at::Tensor Runtime::padded_flat(const at::Tensor& grad, const Param& p, bool copy, bool* owned) {
  // The gradient as the flat [world * chunk] input of a reduce-scatter, in the reduce dtype: rank
  // k's rows at [k * chunk, (k + 1) * chunk) (row-aligned shards). Copied only where it must be:
  // a cast, zero padding (numel not a multiple of chunk), a non-contiguous gradient, or `copy`.
  TORCH_CHECK(grad.numel() == p.numel, "deepcompile: gradient of '", p.name, "' has ", grad.numel(),
              " elements, the parameter has ", p.numel);
  // (view, not reshape, where it is one: reshape is two dispatcher calls)
  at::Tensor flat = grad.dim() == 1 ? grad : grad.is_contiguous() ? grad.view({-1}) : grad.reshape({-1});
  bool own = !flat.is_alias_of(grad);
  if (!flat.is_contiguous()) {  // a 1-D view with a stride (e.g. [n, 1] with stride 2): collectives need dense
    flat = flat.contiguous();
    own = true;
  }
  if (flat.scalar_type() != reduce_dtype_) {
    flat = flat.to(reduce_dtype_);
    own = true;
  }
  const int64_t padded = p.chunk * world_;
  if (padded != p.numel) {
    flat = at::constant_pad_nd(flat, {0, padded - p.numel}, 0);
    own = true;
  } else if (copy && !own) {
    flat = flat.clone();  // the graph may write into the gradient's memory while the bucket reads it
    own = true;
  }
  if (own) stats_.reduce_copies += 1;
  if (owned) *owned = own;
  return flat;
}

void Runtime::add_grad(const at::Tensor& grad_in, int64_t id) {
  const Param& p = param(id);
  stats_.reduce_calls += 1;
  at::Tensor grad = grad_in;
  bool grad_owned = false;
  auto lit = local_grads_.find(id);
  if (!grad_sync_) {
    stats_.local_accumulations += 1;
    if (lit == local_grads_.end()) {
      local_grads_[id] = grad.to(reduce_dtype_, /*non_blocking=*/false, /*copy=*/true);
    } else {
      lit->second.add_(grad);
    }
    return;
  }
  if (lit != local_grads_.end()) {  // the boundary: reduce what this rank accumulated
    grad = lit->second.add_(grad);
    grad_owned = true;
    local_grads_.erase(lit);  // freed as soon as it is in the bucket, before the optimizer step
  }
  Bucket& b = buckets_[static_cast<int>(reduce_dtype_)];
  for (auto& e : b.entries) {
    if (e.id == id) {  // a parameter used twice in one graph: sum before reducing
      at::Tensor more = padded_flat(grad, p, /*copy=*/false, nullptr);  // read at once, not held
      if (e.owned) {
        e.flat.add_(more);
      } else {  // never write into the graph's own gradient
        e.flat = e.flat + more;
        e.owned = true;
      }
      return;
    }
  }
  const int64_t elems = p.chunk * world_;
  if (!b.entries.empty() && b.elems + elems > bucket_elems_) flush(reduce_dtype_);
  Bucket& b2 = buckets_[static_cast<int>(reduce_dtype_)];
  bool owned = false;
  // No copy of a gradient the graph hands over (a clone per parameter costs a third of
  // reduce_grad's host time): holding the reference keeps the memory alive until the
  // reduce-scatter has read it, and nothing writes into it meanwhile (see set_copy_grads).
  at::Tensor flat = padded_flat(grad, p, /*copy=*/copy_grads() && !grad_owned, &owned);
  b2.entries.push_back(BucketEntry{id, flat, owned || grad_owned});
  b2.elems += elems;
  if (b2.elems >= bucket_elems_) flush(reduce_dtype_);
}

void Runtime::flush(at::ScalarType dtype) {
  auto it = buckets_.find(static_cast<int>(dtype));
  if (it == buckets_.end() || it->second.entries.empty()) return;
  note_reduce_peak();  // a full bucket and the reduces in flight: the gradients' high-water mark
  Bucket b = std::move(it->second);
  buckets_.erase(it);
  while (static_cast<int64_t>(inflight_.size()) >= max_inflight_) complete_oldest();
  InFlightReduce r;
  int64_t cols = 0;
  for (auto& e : b.entries) {
    const int64_t chunk = e.flat.numel() / world_;
    r.entries.emplace_back(e.id, chunk);
    cols += chunk;
  }
  // One output for the whole bucket: this rank's shard of every entry, side by side, so the
  // cast and the gradient scale run once per bucket (complete_oldest).
  r.output = at::empty({cols}, b.entries[0].flat.options());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  int64_t bytes = 0;
  for (auto& e : b.entries) bytes += e.flat.nbytes();
  if (!r.output.is_cuda()) {
    // The host (gloo): torch's gloo reduce-scatters return works that a timed wait cannot bound
    // (Work::wait(timeout) blocks until the collective ends and isCompleted() never turns true),
    // so a hung one would block past collective_timeout_s and a failed one would be reported as
    // a timeout. gloo implements them as an all-reduce of a packed copy and a copy-out anyway;
    // this is that, with an all-reduce whose work honours the timed wait: the bucket packed as
    // [world, cols] (row k: rank k's slice of every entry, side by side; an owned lone entry is
    // used as it is), reduced in place, and this rank's row copied into the output once it has
    // completed (complete_oldest).
    at::Tensor packed;
    if (b.entries.size() == 1) {
      packed = b.entries[0].owned ? b.entries[0].flat : b.entries[0].flat.clone();
    } else {
      std::vector<at::Tensor> parts;
      parts.reserve(b.entries.size());
      for (auto& e : b.entries) parts.push_back(e.flat.view({world_, -1}));
      packed = at::cat(parts, 1);
      stats_.reduce_cats += 1;
      if (reduce_pack_ == ReducePack::kCat) stats_.reduce_packed += 1;
    }
    r.inputs.push_back(packed);
    r.by_allreduce = true;
    std::vector<at::Tensor> ts{packed};
    c10d::AllreduceOptions aopts;
    aopts.reduceOp = c10d::ReduceOp::SUM;
    aopts.timeout = host_op_timeout();
    r.work = pg_->allreduce(ts, aopts);
  } else if (b.entries.size() == 1) {
    r.inputs.push_back(b.entries[0].flat);
    r.work = pg_->_reduce_scatter_base(r.output, r.inputs[0], opts);
  } else {
    if (coalesced_rs_ != 0 && reduce_pack_ == ReducePack::kCoalesced) {
      // One coalesced collective over the entries' own flat inputs (each already in the
      // [world * chunk] layout), each writing into its slice of the output: no packing copy.
      std::vector<at::Tensor> outs;
      int64_t off = 0;
      outs.reserve(r.entries.size());
      for (auto& [id, chunk] : r.entries) {
        outs.push_back(at::as_strided(r.output, {chunk}, {1}, off));
        off += chunk;
      }
      for (auto& e : b.entries) r.inputs.push_back(e.flat);
      try {
        r.work = pg_->reduce_scatter_tensor_coalesced(outs, r.inputs, opts);
        coalesced_rs_ = 1;
      } catch (const c10::Error& err) {
        // c10d's Backend default throws before communicating when a backend lacks it
        if (coalesced_rs_ == 1 || std::string(err.what()).find("does not support") == std::string::npos) throw;
        coalesced_rs_ = 0;
        r.inputs.clear();
      }
    }
    if (coalesced_rs_ == 0 || reduce_pack_ == ReducePack::kCat) {
      // [world, cols]: row k holds rank k's slice of every entry, so a reduce-scatter leaves each
      // rank exactly its own shard of each gradient, side by side. The bucket's gradients are
      // free to go once the cat has read them (only the packed copy is held).
      std::vector<at::Tensor> parts;
      parts.reserve(b.entries.size());
      for (auto& e : b.entries) parts.push_back(e.flat.view({world_, -1}));
      r.inputs.push_back(at::cat(parts, 1).view({-1}));
      stats_.reduce_cats += 1;
      if (coalesced_rs_ != 0) stats_.reduce_packed += 1;
      r.work = pg_->_reduce_scatter_base(r.output, r.inputs[0], opts);
    }
  }
  r.bucket = reduce_buckets_++;
  issued_ += 1;
  stats_.reduce_scatters += 1;
  stats_.reduce_bytes += bytes;
  inflight_.push_back(std::move(r));
  note_reduce_peak();
}

void Runtime::complete_oldest() {
  InFlightReduce r = std::move(inflight_.front());
  inflight_.pop_front();
  wait_work(r.work, r.output.is_cuda(), [&] {
    std::ostringstream ss;
    ss << "reduce-scatter of gradient bucket " << r.bucket << " of this step (" << r.entries.size()
       << " parameter(s):";
    for (size_t i = 0; i < r.entries.size() && i < 3; ++i) ss << " '" << param(r.entries[i].first).name << "'";
    ss << (r.entries.size() > 3 ? " ...)" : ")");
    return ss.str();
  });
  if (r.by_allreduce) {
    const at::Tensor& in = r.inputs[0];  // [world, cols], or a lone entry's flat [world * chunk]
    r.output.copy_((in.dim() == 2 ? in : in.view({world_, -1})).select(0, rank_));
  }
  r.inputs.clear();  // the graph's gradients (or our copies) are free to go now
  if (rep_pg_ && rep_pg_->getSize() > 1) {
    // HSDP: the reduce-scatter left this rank the sum over its shard group; the replicas' sums
    // (same shard, other data) complete it. The all-reduce is a second pipeline stage, not
    // waited here: backward goes on computing (and reduce-scattering) while it crosses the
    // slower inter-group link, and the bucket becomes .grad when the stage drains.
    std::vector<at::Tensor> ts{r.output};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    if (!r.output.is_cuda()) opts.timeout = host_op_timeout();
    r.work = rep_pg_->allreduce(ts, opts);
    issued_ += 1;
    replicating_.push_back(std::move(r));
    while (static_cast<int64_t>(replicating_.size()) >= max_inflight_) complete_replicated();
    return;
  }
  apply_grads(r);
}

void Runtime::complete_replicated() {
  InFlightReduce r = std::move(replicating_.front());
  replicating_.pop_front();
  wait_work(r.work, r.output.is_cuda(), [&] {
    return "all-reduce across replicas of gradient bucket " + std::to_string(r.bucket) + " of this step";
  });
  apply_grads(r);
}

void Runtime::apply_grads(InFlightReduce& r) {
  // Cast to the shards' dtype and scale once per bucket, then hand each parameter a view of its
  // slice as .grad (or add into the .grad it has). Numerics as per parameter: scale in the shard
  // dtype after the cast; a scale of 1 is skipped (exact).
  std::vector<Param*> ps;
  bool uniform = true;
  size_t fresh = 0;
  for (auto& [id, chunk] : r.entries) {
    ps.push_back(&mutable_param(id));
    uniform = uniform && ps.back()->shard.scalar_type() == ps.front()->shard.scalar_type();
    fresh += ps.back()->shard.grad().defined() ? 0 : 1;
  }
  const bool scale = grad_scale_ != 1.0;
  const bool scaled_all = uniform && fresh == ps.size() && scale;
  const at::ScalarType to = ps.front()->shard.scalar_type();
  at::Tensor cast;
  if (uniform && fresh == ps.size() && side_enabled(r.output) && (scale || r.output.scalar_type() != to)) {
    // The cast (and scale) on the side stream, after the compute stream's wait on the collective
    // (complete_oldest): backward's next kernels do not queue behind it. The result is allocated
    // on the compute stream, which reads it after join_side (end_backward); r.output is freed
    // when this returns, so the allocator is told the side stream still reads it.
    cast = r.output.scalar_type() == to ? r.output : at::empty(r.output.sizes(), r.output.options().dtype(to));
    if (scale) scale_tensor(to, r.output.device());  // made on the compute stream, before the side waits on it
    const c10::Stream side = to_side(r.output.device());
    {
      c10::StreamGuard guard(side);
      cast_scaled_into(cast, r.output);
    }
    c10::impl::getDeviceGuardImpl(side.device_type())->recordDataPtrOnStream(r.output.storage().data_ptr(), side);
    side_pending_ = true;
  } else {
    cast = !uniform ? r.output : scaled_all ? cast_scaled(r.output, to) : r.output.to(to);
  }
  std::vector<at::Tensor> dsts, srcs;
  int64_t off = 0;
  const int64_t base = cast.storage_offset();
  for (size_t i = 0; i < ps.size(); ++i) {
    Param& p = *ps[i];
    const int64_t chunk = r.entries[i].second;
    const auto sizes = p.shard.sizes();
    // its slice in the shard's shape: one as_strided (one dispatcher call; narrow + view are three)
    at::Tensor g = uniform ? at::as_strided(cast, sizes, c10::contiguous_strides(sizes), base + off)
                           : cast.narrow(0, off, chunk).to(p.shard.scalar_type()).view(sizes);
    off += chunk;
    at::Tensor& dst = p.shard.mutable_grad();
    if (!dst.defined()) {
      if (scale && !scaled_all) g.mul_(grad_scale_);  // its own slice (or its own cast copy)
      dst = std::move(g);
    } else {
      dsts.push_back(dst);
      srcs.push_back(dst.sizes() == sizes ? std::move(g) : g.view(dst.sizes()));
    }
  }
  if (!dsts.empty()) at::_foreach_add_(dsts, srcs, grad_scale_);
}

// HSDP, for a gradient reduced on its own (reduce_scatter_now): the replicas' sums complete the
// shard group's, and grad_scale_ (1 / all ranks) turns the total into the mean.
void Runtime::allreduce_replicas(at::Tensor& t, const std::string& what) {
  if (!rep_pg_ || rep_pg_->getSize() < 2) return;
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  if (!t.is_cuda()) opts.timeout = host_op_timeout();
  auto work = rep_pg_->allreduce(ts, opts);
  issued_ += 1;
  wait_work(work, t.is_cuda(), [&] { return "all-reduce across replicas of " + what; });
}

void Runtime::end_backward(int64_t /*graph_id*/) {
  std::vector<int> dtypes;
  for (auto& kv : buckets_) dtypes.push_back(kv.first);
  for (int d : dtypes) flush(static_cast<at::ScalarType>(d));
  while (!inflight_.empty()) complete_oldest();
  while (!replicating_.empty()) complete_replicated();
  join_side();  // the optimizer (and clipping) read .grad on the compute stream
}

at::Tensor Runtime::reduce_scatter_now(const at::Tensor& grad, int64_t id) {
  const Param& p = param(id);
  bool owned = false;
  at::Tensor in = padded_flat(grad, p, /*copy=*/false, &owned);  // waited on below: no copy
  at::Tensor out = at::empty({p.chunk}, in.options());
  c10::intrusive_ptr<c10d::Work> work;
  if (in.is_cuda()) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    work = pg_->_reduce_scatter_base(out, in, opts);
  } else {  // the host: an all-reduce of an owned copy, this rank's slice kept (see flush)
    if (!owned) in = in.clone();
    std::vector<at::Tensor> ts{in};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = host_op_timeout();
    work = pg_->allreduce(ts, opts);
  }
  issued_ += 1;
  wait_work(work, out.is_cuda(), [&] { return "reduce-scatter of the gradient of '" + p.name + "'"; });
  if (!in.is_cuda()) out.copy_(in.narrow(0, rank_ * p.chunk, p.chunk));
  allreduce_replicas(out, "the gradient of '" + p.name + "'");
  stats_.reduce_scatters += 1;
  stats_.reduce_bytes += in.nbytes();
  return cast_scaled(out, p.shard.scalar_type()).view(p.shard.sizes());
}

// src cast to dtype and multiplied by grad_scale_, in one kernel where src is of another dtype
// (on 2 H200s a separate cast and in-place scale cost 2.4 ms of the compute stream per step, the
// scale alone 0.9). The scale is a one-element tensor *of dtype*, not a 0-dim scalar:
// TensorIterator then computes in dtype, so every element is rounded exactly as by
// src.to(dtype).mul_(grad_scale_) (the scalar is rounded to dtype there too). A scale of 1 is
// the plain cast.
at::Tensor Runtime::cast_scaled(const at::Tensor& src, at::ScalarType dtype) {
  if (grad_scale_ == 1.0) return src.to(dtype);
  if (src.scalar_type() == dtype) return src.mul_(grad_scale_);
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  at::mul_out(out, src, scale_tensor(dtype, src.device()));
  return out;
}

const at::Tensor& Runtime::scale_tensor(at::ScalarType dtype, const at::Device& device) {
  if (!scale_t_.defined() || scale_t_.device() != device || scale_t_.scalar_type() != dtype ||
      scale_t_value_ != grad_scale_) {  // the value is kept on the host: no device read per call
    // A side-stream cast (apply_grads) may still be reading the tensor being replaced: the
    // allocator is told, so its memory is not handed out again before that stream has passed
    // this point (within a backward the shards' dtype can alternate between buckets, and the
    // side stream is joined only at end_backward).
    if (scale_t_.defined() && scale_t_.is_cuda() && side_ && side_->device() == scale_t_.device())
      c10::impl::getDeviceGuardImpl(side_->device_type())->recordDataPtrOnStream(scale_t_.storage().data_ptr(), *side_);
    scale_t_ = at::full({1}, grad_scale_, at::TensorOptions().dtype(dtype).device(device));
    scale_t_value_ = grad_scale_;
  }
  return scale_t_;
}

// cast_scaled into a given tensor (of the target dtype and src's shape); in place where out is src.
void Runtime::cast_scaled_into(at::Tensor& out, const at::Tensor& src) {
  if (grad_scale_ == 1.0) {
    if (!out.is_same(src)) out.copy_(src);
    return;
  }
  if (out.is_same(src)) {
    out.mul_(grad_scale_);
    return;
  }
  at::mul_out(out, src, scale_tensor(out.scalar_type(), src.device()));
}

// -- hang and mismatch detection ----------------------------------------------------------------
//
// A collective that another rank never joins (it raised and stayed alive, is stuck in user code,
// or runs a different graph) would block this rank until the process group's own timeout (30 min
// by default) and then fail without saying where. On the CPU (gloo) the host waits for every
// collective, so the wait is cut into one-second slices: between slices the store is probed for
// another rank's abort message or for a rank that already reached the optimizer step's sequence
// check (it skipped collectives this rank is waiting in), and after collective_timeout_s the wait
// fails naming this rank, the collective and the graph node. That bound holds whatever the
// timeout of the process group (one the user created may have a shorter or a longer one): every
// host collective is issued with gloo's own timeout set past it (host_op_timeout). A collective
// that fails (a peer died, gloo's own error) is reported with its own error and the same context.
// On CUDA (NCCL) Work::wait only makes the current stream wait, and a timeout argument would block
// the host on every collective instead, so it is called without one: the process group's timeout
// (the same key, when deepcompile creates the group) and the step's sequence check cover that case.
//
// While the host waits, the op's lock is let go (getters on other threads are not held up for a
// collective's length); nothing the wait reads is written by a getter.
namespace {
struct Unlocked {
  explicit Unlocked(std::unique_lock<std::mutex>* lock) : lock_(lock && lock->owns_lock() ? lock : nullptr) {
    if (lock_) lock_->unlock();
  }
  ~Unlocked() {
    if (lock_) lock_->lock();
  }
  std::unique_lock<std::mutex>* lock_;
};
}  // namespace

template <typename Describe>
void Runtime::wait_work(const c10::intrusive_ptr<c10d::Work>& work, bool on_cuda, Describe what) {
  if (on_cuda) {
    work->wait();
    return;
  }
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const auto deadline = t0 + std::chrono::milliseconds(timeout_ms_);
  const auto slice = std::chrono::milliseconds(std::min<int64_t>(timeout_ms_, wait_slice_ms_));
  auto fail = [&](const std::string& err) {
    std::ostringstream ss;
    ss << "deepcompile: rank " << rank_ << ": " << what() << where() << " failed: " << err;
    if (err.find("imed out") != std::string::npos)
      ss << " [the process group's own timeout ended the collective: another rank did not join it. "
            "collective_timeout_s = "
         << timeout_ms_ / 1000.0 << " s bounds the runtime's waits]";
    else
      ss << " [another rank may have failed or exited first: its own error is the cause]";
    if (store_) {  // ranks waiting elsewhere stop with this message
      try {
        if (!store_->check({store_prefix_ + "abort"})) store_->set(store_prefix_ + "abort", ss.str());
      } catch (const std::exception&) {
      }
    }
    TORCH_CHECK(false, ss.str());
  };
  while (true) {
    std::optional<std::string> error;
    {
      Unlocked unlocked(held_);
      try {
        if (work->wait(slice)) return;
      } catch (const std::exception&) {
        // Work::wait(timeout) throws "Operation timed out!" when the slice ends, after releasing
        // its lock: the collective may complete between that throw and this check (seen in CI
        // under load). So the slice's exception says nothing; a completed work is asked again,
        // untimed, which returns at once on success and rethrows the collective's own error (a
        // peer died, gloo's own timeout) on failure.
      }
      if (work->isCompleted()) {
        try {
          work->wait();
          return;
        } catch (const std::exception& e) {
          error = error_text(e);
        }
      }
    }
    if (error) fail(*error);
    std::string peer = probe_peers();
    if (!peer.empty()) {
      TORCH_CHECK(false, peer, " [rank ", rank_, " was waiting for ", what(), where(), "]");
    }
    if (clock::now() >= deadline) {
      std::ostringstream ss;
      ss << "deepcompile: rank " << rank_ << " timed out after "
         << std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - t0).count() / 1000.0
         << " s waiting for " << what() << where()
         << ": another rank did not join this collective (it raised and stayed alive, is stuck in user "
            "code, or runs a different forward). collective_timeout_s = "
         << timeout_ms_ / 1000.0 << " s sets this limit";
      if (store_) {  // ranks waiting elsewhere (the step's sequence check) stop with this message
        try {
          store_->set(store_prefix_ + "abort", ss.str());
        } catch (const std::exception&) {
        }
      }
      TORCH_CHECK(false, ss.str());
    }
  }
}

std::string Runtime::where() const {
  std::ostringstream ss;
  ss << " (in dc." << cur_op_;
  const std::string key = std::string(cur_op_) + ":" + std::to_string(cur_id_);
  auto it = node_names_.find(key + (phase_ == 0 ? ":forward" : ":backward"));
  if (it == node_names_.end() && phase_ == 0) it = node_names_.find(key + ":inference");
  if (it == node_names_.end()) it = node_names_.find(key);  // every candidate
  if (it != node_names_.end()) ss << ", graph node " << it->second;
  ss << ")";
  return ss.str();
}

std::string Runtime::probe_peers() {
  if (!store_) return "";
  try {
    const std::string abort_key = store_prefix_ + "abort";
    if (store_->check({abort_key})) {
      auto v = store_->get(abort_key);
      return std::string(v.begin(), v.end());
    }
    const std::string parity = "p" + std::to_string(check_index_ % 2) + "/r";
    for (int64_t j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      const std::string key = store_prefix_ + parity + std::to_string(j);
      if (!store_->check({key})) continue;
      auto v = store_->get(key);
      std::istringstream in(std::string(v.begin(), v.end()));
      int64_t k = -1, n = -1;
      in >> k >> n;
      if (k != check_index_) continue;  // an earlier step's count
      // Rank j already reached this step's optimizer step while this rank still waits in a
      // collective of the same step: the two issued different collective sequences.
      std::ostringstream ss;
      ss << "deepcompile: collective sequence mismatch in optimizer step " << k << ": rank "
         << (n < issued_ ? j : rank_) << " is behind: rank " << j
         << " reached optimizer.step() after issuing " << n << " collectives this step, rank " << rank_
         << " has issued " << issued_
         << " and is still waiting for the others to join. A rank skipped a backward (or ran a "
            "different forward); every rank must run the same forward and backward before optimizer.step()";
      store_->set(abort_key, ss.str());
      return ss.str();
    }
  } catch (const std::exception&) {
    // the store is gone (the launcher exited): the timeout still applies
  }
  return "";
}

void Runtime::check_idle() const {
  std::ostringstream ss;
  if (!pending_.empty()) {
    ss << "allgathers started but never waited for:";
    for (auto& kv : pending_) ss << " '" << param(kv.first).name << "'";
  }
  TORCH_CHECK(pending_.empty(), "deepcompile: ", ss.str());
}

void init(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t bucket_elems, int64_t max_inflight,
          int64_t timeout_ms) {
  // Re-initialising replaces everything: stale parameter ids must never reach a new graph. The
  // old runtime is destroyed outside the registry's lock (a reader may still hold it).
  auto fresh = std::make_shared<Runtime>(std::move(pg), bucket_elems, max_inflight, timeout_ms);
  std::shared_ptr<Runtime> old;
  {
    std::lock_guard<std::mutex> g(g_runtime_mu);
    old = std::exchange(g_runtime, std::move(fresh));
  }
}

void cleanup() {
  std::shared_ptr<Runtime> old;
  std::lock_guard<std::mutex> g(g_runtime_mu);
  old.swap(g_runtime);
}

}  // namespace dc
