// Python entry points of the runtime: lifecycle, registry, and introspection for tests.
//
// Every entry point that touches the runtime lets go of the GIL and holds the runtime's lock
// (Runtime::mutex) while it runs: a thread polling the getters (the inspector following a live
// run) reads a consistent state while the ops run on the training thread, and a getter that waits
// for the lock blocks no other Python thread. Python objects are built only after the lock is let
// go and the GIL is held again.
#include "runtime.h"

#include <torch/csrc/utils/pybind.h>

namespace {

// f(runtime) under the runtime's lock, without the GIL; the runtime stays alive for the call even
// if another thread re-initialises or cleans up meanwhile
template <typename F>
auto locked(F&& f) {
  pybind11::gil_scoped_release nogil;
  std::shared_ptr<dc::Runtime> rt = dc::runtime_shared();
  std::lock_guard<std::mutex> guard(rt->mutex());
  return f(*rt);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deepcompile native runtime";
  m.def("init", &dc::init, "create the runtime on a process group", pybind11::arg("process_group"),
        pybind11::arg("bucket_elems"), pybind11::arg("max_inflight") = 2,
        pybind11::arg("timeout_ms") = 600000, pybind11::call_guard<pybind11::gil_scoped_release>());
  // hang and mismatch detection (config collective_timeout_s)
  m.def("set_seq_store", [](c10::intrusive_ptr<c10d::Store> store, const std::string& prefix) {
    locked([&](dc::Runtime& rt) { rt.set_seq_store(std::move(store), prefix); });
  });
  m.def("set_node_names", [](std::unordered_map<std::string, std::string> names) {
    locked([&](dc::Runtime& rt) { rt.set_node_names(std::move(names)); });
  });
  m.def("begin_check", []() { return locked([](dc::Runtime& rt) { return rt.begin_check(); }); });
  m.def("set_wait_slice_ms", [](int64_t ms) { locked([&](dc::Runtime& rt) { rt.set_wait_slice_ms(ms); }); });
  m.def("set_phase", [](int phase) { locked([&](dc::Runtime& rt) { rt.set_phase(phase); }); });
  m.def("cleanup", &dc::cleanup, "destroy the runtime and everything it holds",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("is_initialized", &dc::has_runtime);
  m.def("register_param", [](int64_t id, const std::string& name, at::Tensor shard,
                             std::vector<int64_t> shape, at::ScalarType dtype) {
    locked([&](dc::Runtime& rt) { rt.register_param(id, name, shard, std::move(shape), dtype); });
  });
  m.def("set_grad_scale", [](double s) { locked([&](dc::Runtime& rt) { rt.set_grad_scale(s); }); });
  m.def("set_grad_sync", [](bool v) { locked([&](dc::Runtime& rt) { rt.set_grad_sync(v); }); });
  m.def("set_copy_grads", &dc::set_copy_grads);
  m.def("set_replicate_group", [](c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    locked([&](dc::Runtime& rt) { rt.set_replicate_group(std::move(pg)); });
  });
  m.def("set_reduce_dtype", [](at::ScalarType d) { locked([&](dc::Runtime& rt) { rt.set_reduce_dtype(d); }); });
  // how a bucket of several gradients is reduced: "coalesced" or "cat" (config reduce_pack, set
  // by initialize right after init)
  m.def("set_reduce_pack", [](const std::string& v) {
    TORCH_CHECK(v == "coalesced" || v == "cat", "deepcompile: reduce pack '", v, "': use 'coalesced' or 'cat'");
    locked([&](dc::Runtime& rt) {
      rt.set_reduce_pack(v == "cat" ? dc::ReducePack::kCat : dc::ReducePack::kCoalesced);
    });
  });
  m.def("reduce_pack", []() {
    return std::string(locked([](dc::Runtime& rt) { return rt.reduce_pack(); }) == dc::ReducePack::kCat
                           ? "cat" : "coalesced");
  });
  // casts around the collectives on a side stream (config cast_stream, set by initialize right
  // after init, before any collective)
  m.def("set_cast_stream", [](bool on) { locked([&](dc::Runtime& rt) { rt.set_cast_stream(on); }); });
  m.def("cast_stream", []() { return locked([](dc::Runtime& rt) { return rt.cast_stream(); }); });
  m.def("live_gathered", []() { return locked([](dc::Runtime& rt) { return rt.live_gathered(); }); });
  m.def("check_idle", []() { locked([](dc::Runtime& rt) { rt.check_idle(); }); });
  m.def("invalidate_persistent", []() {
    if (dc::has_runtime()) locked([](dc::Runtime& rt) { rt.invalidate_persistent(); });
  });
  m.def("persistent_ptrs", []() { return locked([](dc::Runtime& rt) { return rt.persistent_ptrs(); }); });
  m.def("local_grad_bytes", []() { return locked([](dc::Runtime& rt) { return rt.local_grad_bytes(); }); });
  m.def("persistent_bytes", []() { return locked([](dc::Runtime& rt) { return rt.persistent_bytes(); }); });
  // memory by category: the gradient storages the runtime holds, and the step's high-water marks
  // (gathered bytes, gradient bytes held), reset by reading them
  m.def("reduce_storages", []() { return locked([](dc::Runtime& rt) { return rt.reduce_storages(); }); });
  m.def("reduce_held_bytes", []() { return locked([](dc::Runtime& rt) { return rt.reduce_held_bytes(); }); });
  m.def("take_step_peaks", []() { return locked([](dc::Runtime& rt) { return rt.take_step_peaks(); }); });
  m.def("reset_stats", []() { locked([](dc::Runtime& rt) { rt.reset_stats(); }); });
  m.def("stats", []() {
    const dc::Stats s = locked([](dc::Runtime& rt) { return rt.stats(); });  // a copy, taken under the lock
    pybind11::dict d;
    d["allgathers"] = s.allgathers;
    d["fused_allgathers"] = s.fused_allgathers;
    d["allgather_bytes"] = s.allgather_bytes;
    d["releases"] = s.releases;
    d["persistent_hits"] = s.persistent_hits;
    d["local_accumulations"] = s.local_accumulations;
    d["reduce_calls"] = s.reduce_calls;
    d["reduce_scatters"] = s.reduce_scatters;
    d["reduce_bytes"] = s.reduce_bytes;
    d["peak_live_gathered"] = s.peak_live_gathered;
    d["peak_live_gathered_bytes"] = s.peak_live_gathered_bytes;
    d["reduce_copies"] = s.reduce_copies;
    d["allgather_waits"] = s.allgather_waits;
    d["reduce_cats"] = s.reduce_cats;
    d["reduce_ops"] = s.reduce_ops;
    d["reduce_ops_flushing"] = s.reduce_ops_flushing;
    d["reduce_packed"] = s.reduce_packed;
    return d;
  });
}
