// The C++ fast path of fused_norm's eager calls (fused_norm/fast_path.py builds and loads it).
//
// A Recipe replays what the Python path did for one call signature: which tensors it allocated,
// and each kernel launch with its parameters, the tensors' addresses filled in per call. The
// forward records a C++ autograd node whose backward needs neither Python nor the GIL. Kernels
// are launched with the CUDA driver's cuLaunchKernel, looked up in libcuda at first use, so the
// build needs only torch's headers.
//
// Slots: every tensor a call touches has a slot. Forward: the tensors given, then the forward's
// allocations. Backward: the tensors saved by the forward, then the incoming gradient of each
// forward output, then the backward's allocations.

#include <torch/extension.h>

#include <ATen/Context.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::variable_list;

// ------------------------------------------------------------------------------ the driver

using CUresult = int;

// cuLaunchKernelEx's configuration, as cuda.h lays it out (CUDA 12), for the one attribute used:
// programmatic stream serialisation (PDL), which lets a kernel start while the one before it
// on the stream finishes; the kernel waits for that one's writes itself (griddepcontrol.wait).
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    int value;
  } value;
};
struct LaunchConfig {
  unsigned grid[3], block[3], shared;
  void* stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
constexpr int kProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_...

struct Driver {
  CUresult (*launch)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                     void*, void**, void**) = nullptr;
  CUresult (*launch_ex)(const LaunchConfig*, void*, void**, void**) = nullptr;
  CUresult (*ctx_get)(void**) = nullptr;
  CUresult (*ctx_set)(void*) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_retain)(void**, int) = nullptr;
  CUresult (*is_capturing)(void*, int*) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  std::string error;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.error = std::string("cannot open libcuda.so.1: ") + dlerror();
      return d;
    }
    auto find = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && d.error.empty()) d.error = std::string("libcuda has no ") + name;
    };
    find(d.launch, "cuLaunchKernel");
    // (optional: without it a dependent launches plainly, after the kernel before it)
    d.launch_ex = reinterpret_cast<decltype(d.launch_ex)>(dlsym(lib, "cuLaunchKernelEx"));
    find(d.ctx_get, "cuCtxGetCurrent");
    find(d.ctx_set, "cuCtxSetCurrent");
    find(d.device_get, "cuDeviceGet");
    find(d.primary_retain, "cuDevicePrimaryCtxRetain");
    find(d.is_capturing, "cuStreamIsCapturing");
    find(d.error_string, "cuGetErrorString");
    return d;
  }();
  TORCH_CHECK(d.error.empty(), "fused_norm fast path: ", d.error);
  return d;
}

void check(CUresult err, const char* what) {
  if (err == 0) return;
  const char* msg = nullptr;
  driver().error_string(err, &msg);
  TORCH_CHECK(false, "fused_norm fast path: ", what, " failed: ", msg ? msg : "unknown error",
              " (CUresult ", err, ")");
}

// The driver launches in the calling thread's current context: the device's primary context,
// made current here where the thread has none yet (as Triton's launcher does).
void ensure_context(int device) {
  const Driver& d = driver();
  void* ctx = nullptr;
  check(d.ctx_get(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) return;
  int dev = 0;
  check(d.device_get(&dev, device), "cuDeviceGet");
  check(d.primary_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(d.ctx_set(ctx), "cuCtxSetCurrent");
}

const c10::impl::DeviceGuardImplInterface* cuda_impl() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

void* current_stream(int device) {
  auto* impl = cuda_impl();
  return impl->getStreamNativeHandle(
      impl->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device))));
}

// The dropout key of an eager call: ops.dropout_key's arithmetic on the device's generator
// (its seed and offset mixed by SplitMix64, the offset advanced by 4), so that both paths
// draw the same masks from the same generator state.
int64_t dropout_key(int device) {
  at::Generator gen = at::globalContext().defaultGenerator(
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  uint64_t seed, offset;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    offset = gen.get_offset();
    gen.set_offset(offset + 4);
    seed = gen.current_seed();
  }
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL + offset;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z = (z ^ (z >> 31)) >> 1;
  const uint64_t low = 1ULL << 31;
  return static_cast<int64_t>(z >= low ? z : z + low);
}

// ------------------------------------------------------------------------------ the recipe

struct Launch {
  void* function = nullptr;
  std::array<unsigned, 3> grid{1, 1, 1};
  unsigned threads = 32, shared = 0;
  std::vector<uint64_t> cells;            // every kernel parameter, scalars packed
  std::vector<std::pair<int, int>> ptrs;  // (parameter, slot): addresses filled per call
  int key = -1;                           // the parameter that takes the dropout key, or -1
  bool pdl = false;                       // a programmatic dependent of the launch before
};

struct Alloc {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  std::optional<int64_t> fill;  // filled with this value (a fresh workspace), else uninitialised

  Tensor make(const at::TensorOptions& options) const {
    return fill ? at::full(shape, *fill, options.dtype(dtype))
                : at::empty(shape, options.dtype(dtype));
  }
};

// A stage's exchange workspaces (fused_norm/workspace.py): int64 words that each launch finds
// equal to ``fill``. Each keeps two buffers and alternates: a launch publishes into one and
// sets the same words of the other back to ``fill``, so the next launch, on the same stream,
// finds it clean. Under graph capture, on another stream than the first call's, or after a
// failed launch, a call takes a freshly filled buffer (and a scratch one) instead.
// A pair of workspaces of ``words`` words filled with ``fill``, as one allocation of 16-byte rows.
std::array<Tensor, 2> filled_pair(int64_t words, int64_t fill, const at::TensorOptions& options) {
  Tensor both = at::full({2, (words + 1) & ~int64_t{1}}, fill, options);
  return {both[0].narrow(0, 0, words), both[1].narrow(0, 0, words)};
}

struct Workspaces {
  std::vector<std::pair<int64_t, int64_t>> spec;  // (words, fill) per workspace
  std::mutex mutex;                              // held from taking buffers to the launches
  std::vector<std::array<Tensor, 2>> bufs;       // allocated at the first call
  int cur = 0;
  void* stream = nullptr;

  // Appends each workspace and the one its launch cleans to ``slots``; true where the pairs
  // are used (flip() after the launches).
  bool take(std::vector<Tensor>& slots, const at::TensorOptions& options, void* now) {
    int capturing = 0;
    check(driver().is_capturing(now, &capturing), "cuStreamIsCapturing");
    if (bufs.empty() && capturing == 0) {
      for (const auto& [words, fill] : spec) bufs.push_back(filled_pair(words, fill, options));
      stream = now;
    }
    const bool pairs = capturing == 0 && now == stream;
    for (size_t i = 0; i < spec.size(); ++i) {
      const auto pair = pairs ? std::array<Tensor, 2>{bufs[i][cur], bufs[i][1 - cur]}
                              : filled_pair(spec[i].first, spec[i].second, options);
      slots.push_back(pair[0]);
      slots.push_back(pair[1]);
    }
    return pairs;
  }
};

struct Stage {
  std::vector<Alloc> allocs;
  std::vector<Launch> launches;
  std::vector<int> results;  // slots returned (-1: None)
  std::shared_ptr<Workspaces> ws;  // null: none

  // Allocates, then launches on ``dev`` (a CUDA device wherever there are launches; the CPU
  // tests replay recipes without any).
  void run(std::vector<Tensor>& slots, c10::Device dev, int64_t key) const {
    const auto options = at::TensorOptions().device(dev);
    if (launches.empty()) {
      for (const Alloc& a : allocs) slots.push_back(a.make(options));
      return;
    }
    const c10::DeviceGuard guard(dev);
    for (const Alloc& a : allocs) slots.push_back(a.make(options));
    ensure_context(dev.index());
    void* stream = current_stream(dev.index());
    if (!ws) {
      launch_all(slots, stream, key);
      return;
    }
    std::lock_guard<std::mutex> lock(ws->mutex);
    const bool pairs = ws->take(slots, options.dtype(at::kLong), stream);
    try {
      launch_all(slots, stream, key);
    } catch (...) {
      if (pairs) ws->bufs.clear();  // a launch may be missing: a fresh pair next time
      throw;
    }
    if (pairs) ws->cur ^= 1;
  }

  void launch_all(const std::vector<Tensor>& slots, void* stream, int64_t key) const {
    const Driver& d = driver();
    std::vector<uint64_t> cells;
    std::vector<void*> params;
    for (const Launch& l : launches) {
      cells = l.cells;
      for (const auto& [param, slot] : l.ptrs) {
        const Tensor& t = slots[slot];
        cells[param] = t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
      }
      if (l.key >= 0) cells[l.key] = static_cast<uint64_t>(key);
      params.resize(cells.size());
      for (size_t i = 0; i < cells.size(); ++i) params[i] = &cells[i];
      if (l.pdl && d.launch_ex != nullptr) {
        LaunchAttribute attr{};
        attr.id = kProgrammaticStreamSerialization;
        attr.value.value = 1;
        const LaunchConfig config{{l.grid[0], l.grid[1], l.grid[2]}, {l.threads, 1, 1}, l.shared,
                                  stream, &attr, 1};
        check(d.launch_ex(&config, l.function, params.data(), nullptr), "cuLaunchKernelEx");
      } else {
        check(d.launch(l.function, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared,
                       stream, params.data(), nullptr),
              "cuLaunchKernel");
      }
    }
  }

  variable_list take(const std::vector<Tensor>& slots) const {
    variable_list out;
    out.reserve(results.size());
    for (int s : results) out.push_back(s >= 0 ? slots[s] : Tensor());
    return out;
  }
};

// A Python object held from C++ (whose last reference may go in an autograd thread).
struct PyRef : torch::CustomClassHolder {
  py::object obj;
  explicit PyRef(py::object o) : obj(std::move(o)) {}
  ~PyRef() override {
    if (!Py_IsInitialized()) {
      obj.release();  // the interpreter is gone: nothing to give back
      return;
    }
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
};

struct Recipe : torch::CustomClassHolder {
  c10::Device device{c10::DeviceType::CUDA, 0};
  bool graph = false;    // the call records an autograd graph
  bool has_key = false;  // the forward takes a dropout key
  Stage fwd;             // results: the outputs
  std::vector<int> saved;                 // forward slots saved for the backward (-1: None)
  std::vector<bool> saved_is_output;      // each saved slot is also an output
  std::vector<Alloc> out_info;            // each output's shape and dtype
  int stream_output = -1;                 // the output whose gradient picks the backward
  std::array<Stage, 2> bwd;               // by whether that gradient came in
  std::array<std::atomic<bool>, 2> bwd_ready{false, false};  // set once bwd[i] is complete
  // A weak reference to the Python call object, whose backward serves what bwd cannot: a graph
  // whose backward is not recorded yet holds it strongly (no cycle through the call object).
  c10::intrusive_ptr<PyRef> owner;

  bool ready(int variant) const { return bwd_ready[variant].load(std::memory_order_acquire); }
  bool backward_ready() const { return ready(0) && (stream_output < 0 || ready(1)); }

  variable_list forward(at::TensorList given, std::vector<Tensor>& slots) const {
    slots.assign(given.begin(), given.end());
    fwd.run(slots, device, has_key ? dropout_key(device.index()) : 0);
    return fwd.take(slots);
  }

  variable_list backward(const variable_list& saved_now, variable_list grads,
                         const c10::intrusive_ptr<PyRef>& strong) const {
    const int variant = stream_output >= 0 && grads[stream_output].defined() ? 1 : 0;
    bool plain = ready(variant);
    for (size_t k = 0; plain && k < grads.size(); ++k) {
      Tensor& g = grads[k];
      if (!g.defined()) {
        if (static_cast<int>(k) != stream_output) {
          g = at::zeros(out_info[k].shape,
                        at::TensorOptions().dtype(out_info[k].dtype).device(device));
        }
      } else if (g.scalar_type() != out_info[k].dtype || g.device() != device) {
        plain = false;
      } else if (!g.is_contiguous() || reinterpret_cast<uintptr_t>(g.data_ptr()) % 16) {
        g = g.clone(at::MemoryFormat::Contiguous);
      }
    }
    if (!plain) return python_backward(saved_now, grads, strong);
    std::vector<Tensor> slots(saved_now.begin(), saved_now.end());
    slots.insert(slots.end(), grads.begin(), grads.end());
    bwd[variant].run(slots, device, 0);
    return bwd[variant].take(slots);
  }

  // The Python path's backward (which records this variant where it can).
  variable_list python_backward(const variable_list& saved_now, const variable_list& grads,
                                const c10::intrusive_ptr<PyRef>& strong) const {
    py::gil_scoped_acquire gil;
    py::object call = strong ? strong->obj : owner->obj();
    TORCH_CHECK(!call.is_none(), "fused_norm fast path: the call's plan is gone");
    py::list s, g;
    for (const Tensor& t : saved_now) s.append(t.defined() ? py::cast(t) : py::none());
    for (const Tensor& t : grads) g.append(t.defined() ? py::cast(t) : py::none());
    py::object result = call.attr("fast_backward")(s, g);
    variable_list out;
    for (py::handle item : result) {
      out.push_back(item.is_none() ? Tensor() : item.cast<Tensor>());
    }
    return out;
  }
};

// The autograd node of a recipe's call, built directly as torch's generated nodes are (a
// torch::autograd::Function costs three times the host time: its context, its output
// wrapping). Inputs: the tensors given; outputs: the forward's results.
struct FusedNormNode : torch::autograd::Node {
  c10::intrusive_ptr<Recipe> recipe;
  std::vector<torch::autograd::SavedVariable> saved;
  // The call object, held while this graph's backward may need Python (not yet recorded).
  c10::intrusive_ptr<PyRef> strong;

  std::string name() const override { return "FusedNormBackward"; }

  variable_list apply(variable_list&& grads) override {
    variable_list now;
    now.reserve(saved.size());
    for (const auto& v : saved) now.push_back(v.unpack(getptr()));
    return recipe->backward(now, std::move(grads), strong);
  }

  void release_variables() override {
    for (auto& v : saved) v.reset_data();
  }
};

// A new node, owned as this torch owns nodes: an intrusive_ptr since torch 2.13, a shared_ptr
// with torch's deleter before (found by argument-dependent lookup: no name of the other era
// is compiled).
template <typename N, typename Base = torch::autograd::Node>
auto make_node() {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, Base>) {
    return c10::make_intrusive<N>();
  } else {
    return std::shared_ptr<N>(new N(), [](Base* node) { deleteNode(node); });
  }
}

// What Python hands over (fast_path.stage), converted by pybind11.
using OutSpec = std::pair<std::vector<int64_t>, at::ScalarType>;
using AllocSpec = std::tuple<std::vector<int64_t>, at::ScalarType, std::optional<int64_t>>;
using LaunchSpec = std::tuple<int64_t, std::array<int64_t, 3>, int64_t, int64_t,
                              std::vector<uint64_t>, std::vector<std::pair<int, int>>, int, int>;
using WorkspaceSpec = std::pair<int64_t, int64_t>;  // (words, fill)

std::vector<Alloc> to_allocs(const std::vector<AllocSpec>& specs) {
  std::vector<Alloc> out;
  for (const auto& [shape, dtype, fill] : specs) out.push_back({shape, dtype, fill});
  return out;
}

// A stage, its parameters and slots checked (``known`` slots come before its allocations,
// then two per workspace: the one its launches publish into, and the one they clean).
Stage make_stage(size_t known, const std::vector<AllocSpec>& allocs,
                 const std::vector<LaunchSpec>& launches, std::vector<int> results,
                 const std::vector<WorkspaceSpec>& workspaces) {
  Stage st;
  st.allocs = to_allocs(allocs);
  if (!workspaces.empty()) {
    for (const auto& [words, fill] : workspaces) TORCH_CHECK(words > 0, "workspace words");
    st.ws = std::make_shared<Workspaces>();
    st.ws->spec = workspaces;
  }
  const int slots = static_cast<int>(known + st.allocs.size() + 2 * workspaces.size());
  for (const auto& [function, grid, threads, shared, cells, ptrs, key, pdl] : launches) {
    const int params = static_cast<int>(cells.size());
    for (const auto& [param, slot] : ptrs) {
      TORCH_CHECK(param >= 0 && param < params, "pointer parameter out of range");
      TORCH_CHECK(slot >= 0 && slot < slots, "slot out of range");
    }
    TORCH_CHECK(key < params, "key parameter out of range");
    Launch l;
    l.function = reinterpret_cast<void*>(function);
    for (int i = 0; i < 3; ++i) l.grid[i] = static_cast<unsigned>(grid[i]);
    l.threads = static_cast<unsigned>(threads);
    l.shared = static_cast<unsigned>(shared);
    l.cells = cells;
    l.ptrs = ptrs;
    l.key = key;
    l.pdl = pdl != 0;
    st.launches.push_back(std::move(l));
  }
  const int plain = static_cast<int>(known + st.allocs.size());  // (no workspace is returned)
  for (int s : results) TORCH_CHECK(s < plain, "result slot out of range");
  st.results = std::move(results);
  return st;
}

// The entry point of an eager call: its outputs, or an empty list where this call must take
// the Python path (another current device; a dropout key under CUDA graph capture, where a key
// baked into the graph would repeat at every replay).
variable_list call(const c10::intrusive_ptr<Recipe>& r, std::vector<Tensor> given) {
  if (r->device.is_cuda()) {
    if (cuda_impl()->getDevice().index() != r->device.index()) return {};
    if (r->has_key) {
      int status = 0;
      check(driver().is_capturing(current_stream(r->device.index()), &status),
            "cuStreamIsCapturing");
      if (status != 0) return {};
    }
  }
  std::vector<Tensor> slots;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // (allocations need no history)
  // (graph: the call's key says grad mode is on and a tensor given requires grad)
  if (!r->graph) return r->forward(given, slots);
  variable_list outs = r->forward(given, slots);
  auto node = make_node<FusedNormNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(at::TensorList(given)));
  node->recipe = r;
  for (const Tensor& t : outs) torch::autograd::set_history(t, node);
  node->saved.reserve(r->saved.size());
  for (size_t i = 0; i < r->saved.size(); ++i) {  // (after set_history: outputs among them)
    const int slot = r->saved[i];
    node->saved.emplace_back(slot >= 0 ? slots[slot] : Tensor(), r->saved_is_output[i]);
  }
  if (!r->backward_ready()) {  // called from Python: the GIL is held
    node->strong = c10::make_intrusive<PyRef>(r->owner->obj());
  }
  return outs;
}

// The tensors' part of a call signature's key (functional._spec's fields, packed): per argument
// its Python type, dtype, device, requires_grad, 16-byte alignment, sizes and strides; a zero
// byte for None. None where an argument is anything else (a Tensor subclass other than
// Parameter, whose metadata Python may see differently): the caller keys that call in Python.
py::object signature(const py::tuple& args) {
  std::string key;
  key.reserve(args.size() * 48);
  auto put = [&key](const auto& v) {
    key.append(reinterpret_cast<const char*>(&v), sizeof(v));
  };
  for (py::handle h : args) {
    PyObject* obj = h.ptr();
    if (obj == Py_None) {
      key.push_back('\0');
      continue;
    }
    if (!THPVariable_CheckExact(obj)) return py::none();
    const Tensor& t = THPVariable_Unpack(obj);
    key.push_back('\1');
    put(reinterpret_cast<uintptr_t>(Py_TYPE(obj)));
    const int8_t fields[5] = {static_cast<int8_t>(t.scalar_type()),
                              static_cast<int8_t>(t.device().type()), t.device().index(),
                              static_cast<int8_t>(t.requires_grad()),
                              static_cast<int8_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15)};
    put(fields);
    put(static_cast<int32_t>(t.dim()));
    for (int64_t v : t.sizes()) put(v);
    for (int64_t v : t.strides()) put(v);
  }
  return py::bytes(key);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Recipe, c10::intrusive_ptr<Recipe>>(m, "Recipe")
      .def(py::init([](c10::Device device, bool graph, size_t n_given,
                       const std::vector<AllocSpec>& allocs,
                       const std::vector<LaunchSpec>& launches,
                       const std::vector<WorkspaceSpec>& workspaces, std::vector<int> outputs,
                       std::vector<int> saved, const std::vector<OutSpec>& out_info,
                       int stream_output, py::object owner) {
             auto r = c10::make_intrusive<Recipe>();
             r->device = device;
             r->graph = graph;
             r->fwd = make_stage(n_given, allocs, launches, std::move(outputs), workspaces);
             for (const Launch& l : r->fwd.launches) r->has_key |= l.key >= 0;
             TORCH_CHECK(device.is_cuda() || r->fwd.launches.empty(),
                         "a recipe with launches needs a CUDA device");
             for (int slot : saved) {
               TORCH_CHECK(slot < static_cast<int>(n_given + r->fwd.allocs.size()),
                           "saved slot out of range");
             }
             r->saved = std::move(saved);
             for (int slot : r->saved) {
               const auto& res = r->fwd.results;
               r->saved_is_output.push_back(std::find(res.begin(), res.end(), slot) != res.end());
             }
             for (const auto& [shape, dtype] : out_info) r->out_info.push_back({shape, dtype, {}});
             r->stream_output = stream_output;
             r->owner = c10::make_intrusive<PyRef>(std::move(owner));
             return r;
           }))
      .def("set_backward",
           [](Recipe& r, int variant, const std::vector<AllocSpec>& allocs,
              const std::vector<LaunchSpec>& launches,
              const std::vector<WorkspaceSpec>& workspaces, std::vector<int> grads) {
             TORCH_CHECK(variant == 0 || variant == 1, "variant: 0 or 1");
             TORCH_CHECK(r.device.is_cuda() || launches.empty(),
                         "a recipe with launches needs a CUDA device");
             if (r.ready(variant)) return;  // recorded once; readers may be using it
             r.bwd[variant] = make_stage(r.saved.size() + r.out_info.size(), allocs, launches,
                                         std::move(grads), workspaces);
             r.bwd_ready[variant].store(true, std::memory_order_release);
           })
      .def("has_backward", [](const Recipe& r, int variant) { return r.ready(variant); });
  m.def("call", &call, "An eager call through a recipe (empty: take the Python path)");
  m.def("signature", &signature, "The tensors' part of a call's cache key (None: key in Python)");
  m.def("dropout_key", &dropout_key, "The dropout key ops.dropout_key would take (tests)");
}
