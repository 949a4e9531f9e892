// The deepcompile native runtime: one per process.
//
// It owns the parameter registry (each rank's row-aligned, padded shard of every parameter), the
// in-flight allgathers, the gradient reduce buckets and the process group the collectives run
// on. The operators in zero3.cpp are thin: they look a parameter up here and start or finish a
// collective. Collectives go through c10d's ProcessGroup (gloo on CPU, NCCL on GPU); c10d's
// NCCL backend runs them on its own stream and `Work::wait()` only makes the caller's stream
// wait on that stream's event, so communication overlaps compute without blocking the host.
//
// On the host (CPU tensors: gloo) every collective the runtime issues is one whose work honours
// a timed wait and reports completion truthfully (_allgather_base, allreduce): a fused group is
// gathered as one packed _allgather_base, and a reduce-scatter is an all-reduce of the packed
// input of which each rank keeps its own row (see start_allgather_fused and flush).
#pragma once

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <chrono>

#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace dc {

struct Param {
  int64_t id = -1;
  std::string name;
  at::Tensor shard;             // this rank's rows (ceil(d0 / world), zero-padded): the tensor the optimizer updates
  std::vector<int64_t> shape;   // full (unsharded) shape
  int64_t numel = 0;            // full numel
  int64_t chunk = 0;            // shard numel (a contiguous range of the flattened parameter)
  at::ScalarType gather_dtype;  // dtype the parameter travels and computes in
  // Precomputed once (host work per parameter per step): the full shape's contiguous strides (a
  // gathered buffer becomes the parameter by one as_strided) and a flat view of the shard
  // (re-made only when the shard's memory changed, e.g. a load that replaced .data).
  std::vector<int64_t> strides;
  at::Tensor flat_shard;
};

// A fused group gathered on the host as one packed collective: `out` is [world * cols], rank k's
// part holding its shard of every member side by side; each member's own buffer is filled from
// it (one split copy) at the group's first wait.
struct PackedGather {
  at::Tensor out;
  std::vector<at::Tensor> dsts;  // the members' flat [world * chunk] buffers
  std::vector<int64_t> cols;     // the members' chunks, in packing order
  bool unpacked = false;
};

struct PendingGather {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor buffer;  // flat, padded, gather dtype
  std::shared_ptr<PackedGather> packed;  // the host's packed fused gather; null otherwise
};

struct BucketEntry {
  int64_t id;
  at::Tensor flat;     // [world * chunk] in the reduce dtype: rank k's slice at [k * chunk, (k + 1) * chunk)
  bool owned = false;  // the runtime's own copy (padded / cast / summed); else the graph's gradient itself
};

struct Bucket {
  std::vector<BucketEntry> entries;
  int64_t elems = 0;
};

struct InFlightReduce {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> inputs;  // kept alive until the collective has finished
  at::Tensor output;  // concatenation of this rank's shard of every entry
  std::vector<std::pair<int64_t, int64_t>> entries;  // (param id, chunk)
  int64_t bucket = 0;  // n-th bucket reduced in this optimizer step (named in timeout messages)
  // the host path: inputs[0] ([world, cols], owned) is all-reduced in place and this rank's row is
  // copied into output once the collective has completed
  bool by_allreduce = false;
};

struct Stats {
  int64_t allgathers = 0;
  int64_t fused_allgathers = 0;
  int64_t allgather_bytes = 0;
  int64_t releases = 0;
  int64_t reduce_calls = 0;
  int64_t reduce_scatters = 0;
  int64_t reduce_bytes = 0;
  int64_t peak_live_gathered = 0;
  int64_t peak_live_gathered_bytes = 0;
  int64_t persistent_hits = 0;
  int64_t local_accumulations = 0;
  // host work per step: copies add_grad made of a gradient (padding, dtype cast, the
  // clone where the graph could reuse the memory), host waits on allgathers, cat-packed buckets
  int64_t reduce_copies = 0;
  int64_t allgather_waits = 0;
  int64_t reduce_cats = 0;
  // reduce_grad and reduce_grads calls, and those during which a bucket was flushed (grouped
  // per bucket, passes/zero3.group_reduces: every call but a graph's remainder and the
  // gradients it calls for on their own)
  int64_t reduce_ops = 0;
  int64_t reduce_ops_flushing = 0;
  // buckets of more than one gradient reduced as one packed (cat) reduce-scatter
  // (reduce_pack "cat"; reduce_cats also counts the host path's packing, which every bucket of
  // several gradients takes on gloo)
  int64_t reduce_packed = 0;
};

// How a bucket of several gradients travels (config reduce_pack, set after init):
// kCoalesced: one coalesced reduce-scatter over the gradients themselves (no copy; the process
// group's host work is per gradient); kCat: the gradients packed by one cat kernel into a
// [world, cols] buffer and reduced by one _reduce_scatter_base (a copy on the device, host work
// per bucket). Both reduce the same sums into the same output layout.
enum class ReducePack { kCoalesced = 0, kCat = 1 };

class Runtime {
 public:
  Runtime(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t bucket_elems, int64_t max_inflight,
          int64_t timeout_ms = 600000);

  void register_param(int64_t id, const std::string& name, at::Tensor shard,
                      std::vector<int64_t> shape, at::ScalarType gather_dtype);
  void set_grad_scale(double scale) { grad_scale_ = scale; }
  void set_reduce_dtype(at::ScalarType dtype) { reduce_dtype_ = dtype; }
  void set_reduce_pack(ReducePack pack) { reduce_pack_ = pack; }
  ReducePack reduce_pack() const { return reduce_pack_; }
  void set_cast_stream(bool on) { cast_stream_ = on; }
  bool cast_stream() const { return cast_stream_; }
  // ZeRO-1: between accumulation boundaries gradients are summed locally, not communicated
  void set_grad_sync(bool sync) { grad_sync_ = sync; }
  // Hybrid sharding (config mesh.shard): pg_ is the shard group (gathers, reduce-scatters); each
  // reduced shard gradient is then summed across the replicas holding the same shard (rep_pg_).
  void set_replicate_group(c10::intrusive_ptr<c10d::ProcessGroup> pg) { rep_pg_ = std::move(pg); }
  const Param& param(int64_t id) const;

  // allgather: start, then finish. The buffer lives in `pending_` in between.
  void start_allgather(const at::Tensor& shard, int64_t id);
  void start_allgather_fused(const std::vector<at::Tensor>& shards, const std::vector<int64_t>& ids);
  at::Tensor finish_allgather(int64_t id);
  std::vector<at::Tensor> finish_allgather_many(const std::vector<int64_t>& ids);
  void release(int64_t id);
  // selective unsharding: a gathered copy kept across micro-batches until the shards change
  at::Tensor gather_persistent(const at::Tensor& shard, int64_t id);
  std::vector<at::Tensor> gather_persistent_many(const std::vector<at::Tensor>& shards,
                                                 const std::vector<int64_t>& ids);
  // The same kept parameters gathered in need order (selective_unshard.group_mb): a group's
  // collective is started at the forward's top (start_persistent: those already kept gather
  // nothing) and waited just before the group's first use (finish_persistent: the stream waits
  // on that group alone, no host sync), so compute starts when the first group has arrived.
  void start_persistent(const std::vector<at::Tensor>& shards, const std::vector<int64_t>& ids);
  std::vector<at::Tensor> finish_persistent(const std::vector<int64_t>& ids);
  // The kept gathered parameters go stale when the optimizer changes the shards. With
  // keep_memory their buffers stay allocated and the next gather of each parameter writes into
  // the same memory (CUDA graphs read them at fixed addresses, runtime/cudagraphs.py); without
  // it they are freed, so the optimizer step's peak does not carry them.
  void invalidate_persistent();
  std::unordered_map<int64_t, int64_t> persistent_ptrs() const {
    std::unordered_map<int64_t, int64_t> out;
    for (auto& kv : persistent_) out[kv.first] = reinterpret_cast<int64_t>(kv.second.data_ptr());
    return out;
  }
  int64_t persistent_bytes() const;
  int64_t local_grad_bytes() const {
    int64_t b = 0;
    for (auto& kv : local_grads_) b += kv.second.nbytes();
    return b;
  }

  // gradients: bucketed reduce-scatter, accumulated into each shard's .grad
  void add_grad(const at::Tensor& grad, int64_t id);
  void end_backward(int64_t graph_id);
  at::Tensor reduce_scatter_now(const at::Tensor& grad, int64_t id);  // eager path

  std::vector<int64_t> live_gathered();
  // Memory by category. The gradient memory the runtime holds: buckets filling,
  // reduce-scatters in flight (inputs and output), HSDP all-reduces, ZeRO-1 local accumulations,
  // as distinct storages (data_ptr, nbytes), so the profiler files them under "gradients", not
  // "activations" (the allocator's rest). take_step_peaks: this step's high-water marks of live
  // gathered bytes and of those gradient bytes, reset for the next step (read once per step).
  std::vector<std::pair<int64_t, int64_t>> reduce_storages() const;
  int64_t reduce_held_bytes() const;
  std::pair<int64_t, int64_t> take_step_peaks() {
    auto r = std::make_pair(step_peak_gathered_, step_peak_reduce_);
    step_peak_gathered_ = step_peak_reduce_ = 0;
    return r;
  }
  const Stats& stats() const { return stats_; }
  void count_reduce_op(int64_t flushes) {
    stats_.reduce_ops += 1;
    stats_.reduce_ops_flushing += flushes > 0 ? 1 : 0;
  }
  void reset_stats() { stats_ = Stats(); }
  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }
  int64_t num_params() const { return static_cast<int64_t>(params_.size()); }
  void check_idle() const;

  // -- hang and mismatch detection (collective_timeout_s) ---------------------------------
  // Every op records which op and id it runs (two stores: cheap) so a timeout can name it.
  void enter(const char* op, int64_t id) {
    cur_op_ = op;
    cur_id_ = id;
  }
  // Python marks the compiled forward's run (0) and what follows it, the backward (1), so a
  // timeout names the node of the right graph when a parameter is gathered in both.
  void set_phase(int phase) { phase_ = phase; }
  // "op:id" (and "op:id:kind") -> graph nodes calling that op, registered at compile time (read
  // only on errors)
  void set_node_names(std::unordered_map<std::string, std::string> names) { node_names_ = std::move(names); }
  // The per-step collective count, checked across ranks at the optimizer step (Python, through
  // the store). Returns (check index, collectives issued since the last check) and resets.
  std::pair<int64_t, int64_t> begin_check() {
    auto r = std::make_pair(check_index_++, issued_);
    issued_ = 0;
    reduce_buckets_ = 0;
    return r;
  }
  // Where the other ranks post their counts ("<prefix>p<k%2>/r<rank>" = "<k> <count>") and an
  // abort message ("<prefix>abort"); a host wait that lasts probes them once a second.
  void set_seq_store(c10::intrusive_ptr<c10d::Store> store, const std::string& prefix) {
    store_ = std::move(store);
    store_prefix_ = prefix;
  }
  int64_t timeout_ms() const { return timeout_ms_; }
  // the host wait's probe interval (1 s); tests shorten it to make many slice ends race completions
  void set_wait_slice_ms(int64_t ms) { wait_slice_ms_ = ms > 0 ? ms : 1; }

  // -- concurrent readers ------------------------------------------------------------------
  // The ops run without the GIL while another Python thread (the inspector following a live run)
  // may call the getters. Every op holds mu_ for its whole run (OpLock, zero3.cpp) except while
  // its host thread waits for a collective (wait_work lets go of it then, so a getter is not held
  // up for the length of a collective); every Python entry point holds it too (bindings.cpp).
  // Uncontended, that is one lock and one unlock per op.
  std::mutex& mutex() { return mu_; }

 private:
  friend class OpLock;
  std::mutex mu_;
  std::unique_lock<std::mutex>* held_ = nullptr;  // the running op's lock (OpLock), released by wait_work
  // Work::wait with the collective timeout, probing the store for mismatches while it waits;
  // `what` describes the collective (built only on error).
  template <typename Describe>
  void wait_work(const c10::intrusive_ptr<c10d::Work>& work, bool on_cuda, Describe what);
  std::string where() const;     // the op and graph node this rank is in
  std::string probe_peers();     // non-empty: a mismatch or another rank's abort message

  Param& mutable_param(int64_t id);
  at::Tensor padded_flat(const at::Tensor& grad, const Param& p, bool copy, bool* owned);
  void flush(at::ScalarType dtype);
  void complete_oldest();
  void complete_replicated();
  void apply_grads(InFlightReduce& r);
  at::Tensor cast_scaled(const at::Tensor& src, at::ScalarType dtype);
  void cast_scaled_into(at::Tensor& out, const at::Tensor& src);
  const at::Tensor& scale_tensor(at::ScalarType dtype, const at::Device& device);  // grad_scale_, one element
  // The cast stream (config cast_stream, on by default; set after init, before any collective):
  // on CUDA the casts around
  // the collectives (a gather's fp32 shard to bf16, a reduced bucket to the shards' fp32 with its
  // scale) run on a side stream, so compute kernels queued after them do not wait for them.
  // to_side: the side stream, made to wait on all work queued so far on the current stream (the
  // optimizer's shard updates, the compute stream's wait on a reduce-scatter). join_side: the
  // current stream waits on everything queued on the side stream (before .grad is read).
  // Memory the side stream reads or writes is allocated on the current stream, so no block moves
  // between the allocator's per-stream pools; a block freed while the side stream may still read
  // it is recorded on that stream.
  bool side_enabled(const at::Tensor& t) const { return cast_stream_ && t.is_cuda(); }
  c10::Stream to_side(const at::Device& device);
  void join_side();
  void allreduce_replicas(at::Tensor& t, const std::string& what);
  // gathered buffers: weak references, pruned once per op (not once per buffer: the scan is over
  // every live buffer, which made a group's start quadratic in its size)
  void track_live(const at::Tensor& buffer, int64_t id) { live_.emplace_back(id, buffer.storage().getWeakStorageImpl()); }
  void prune_live();
  const at::Tensor& flat_shard(Param& p, const at::Tensor& shard);

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::intrusive_ptr<c10d::ProcessGroup> rep_pg_;  // null: no replicas (plain ZeRO)
  int64_t rank_, world_;
  int64_t bucket_elems_;
  int64_t max_inflight_;
  double grad_scale_ = 1.0;
  at::Tensor scale_t_;  // grad_scale_ as a one-element tensor (cast_scaled), made at first use
  double scale_t_value_ = 0.0;
  bool grad_sync_ = true;
  int coalesced_rs_ = -1;  // reduce_scatter_tensor_coalesced usable on pg_: -1 unknown, 0 no, 1 yes
  ReducePack reduce_pack_ = ReducePack::kCoalesced;
  bool cast_stream_ = true;
  std::optional<c10::Stream> side_;
  std::unique_ptr<c10::Event> to_side_ev_, from_side_ev_;
  bool side_pending_ = false;  // side-stream work that .grad readers have not waited on yet
  std::unordered_map<int64_t, at::Tensor> local_grads_;  // ZeRO-1 accumulation, full size
  at::ScalarType reduce_dtype_ = at::kFloat;
  std::unordered_map<int64_t, Param> params_;
  std::unordered_map<int64_t, PendingGather> pending_;
  std::unordered_map<int64_t, at::Tensor> persistent_;
  std::unordered_map<int, Bucket> buckets_;  // by reduce dtype
  std::deque<InFlightReduce> inflight_;      // reduce-scatters issued, not yet waited
  std::deque<InFlightReduce> replicating_;  // HSDP: reduced in the shard group, all-reduce across replicas in flight
  std::vector<std::pair<int64_t, c10::weak_intrusive_ptr<c10::StorageImpl>>> live_;
  Stats stats_;
  void note_reduce_peak() { step_peak_reduce_ = std::max(step_peak_reduce_, reduce_held_bytes()); }
  int64_t step_peak_gathered_ = 0;  // take_step_peaks
  int64_t step_peak_reduce_ = 0;
  int64_t timeout_ms_;
  int64_t wait_slice_ms_ = 1000;
  // gloo's own per-collective timeout, set on every host collective the runtime issues: longer
  // than the runtime's bound (the host wait names rank, collective and graph node first) whatever
  // the timeout of the process group the user created, and finite, so gloo's worker gives up a
  // collective the other ranks never join
  std::chrono::milliseconds host_op_timeout() const { return std::chrono::milliseconds(2 * timeout_ms_ + 10000); }
  int64_t issued_ = 0;          // collectives issued since the last sequence check
  int64_t check_index_ = 0;     // sequence checks done (optimizer steps)
  int64_t reduce_buckets_ = 0;  // reduce-scatter buckets flushed since the last check
  const char* cur_op_ = "";     // the op this rank entered last, and its id
  int64_t cur_id_ = -1;
  int phase_ = 0;
  std::unordered_map<std::string, std::string> node_names_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string store_prefix_;
};

// Holds the runtime's lock for an op's run (see Runtime::mutex).
class OpLock {
 public:
  explicit OpLock(Runtime& rt) : rt_(rt), lock_(rt.mu_) { rt_.held_ = &lock_; }
  ~OpLock() { rt_.held_ = nullptr; }
  OpLock(const OpLock&) = delete;
  OpLock& operator=(const OpLock&) = delete;

 private:
  Runtime& rt_;
  std::unique_lock<std::mutex> lock_;
};

// The process-wide runtime. Throws a clear error if `init` has not been called.
Runtime& runtime();
// The same, shared: a reader on another thread keeps it alive while init or cleanup replaces it.
std::shared_ptr<Runtime> runtime_shared();
bool has_runtime();
void init(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t bucket_elems, int64_t max_inflight,
          int64_t timeout_ms);
void cleanup();
// Copy every gradient handed to reduce_grad before bucketing it. Off by default: the bucket holds
// a reference instead, which is safe where nothing can write into that memory while the
// reduce-scatter reads it (eager/aot_eager free by refcount; under Inductor
// compat.never_reuse_inputs keeps the buffer out of reuse). Python turns it on when that lowering
// could not be installed. Process-wide (it describes the op's lowering), so it outlives init().
void set_copy_grads(bool copy);
bool copy_grads();

}  // namespace dc
