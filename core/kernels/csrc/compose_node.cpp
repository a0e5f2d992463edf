// fastdora's composition autograd node in C++: the same kernels as the Python node, less host time per layer.
//
// The Python autograd.Function of fastdora.ops.compose costs tens of microseconds of interpreter time per layer
// call in the forward and in the backward (its ctx, its launch preparation), and a DoRA training step on the H200 is
// host-bound. This node does the same thing from C++: the forward allocates y (and inner), fills a launch template
// that the Python launcher registered for the problem's key (shapes, dtypes, flags, device) with this call's data
// pointers, stream and scalars, and calls Triton's compiled launcher (`CompiledKernel.run`) with it; the backward
// does the same for the backward kernel. Anything the templates do not cover (first call of a key, unaligned
// pointers, a CUDA graph capture in the backward, Triton launch hooks, empty problems) goes through the Python
// launchers (`slow_fwd` / `slow_bwd`, the same functions the Python path runs), which register templates as they
// go. The kernels, their arguments and the arithmetic are exactly those of the Python path: only who fills the
// argument list differs.
//
// Direct launch: a template whose kernel's parameter layout the Python side could derive (Triton's CompiledKernel:
// its signature minus constexprs, then the global and profile scratch pointers, all null here; one CTA per program,
// no cooperative / PDL launch, no scratch memory) also carries that layout, and the node launches it with the CUDA
// driver's cuLaunchKernel from C++ (the same function handle, grid, block, shared memory and parameter bytes Triton's
// launcher passes) instead of calling Triton's Python launcher. The Python side enables this only on the Triton
// versions the layout was verified on, after a self-check at first use (fastdora/kernels/native.py). The driver is
// opened with dlopen (no CUDA toolkit at build time). Where it is unavailable, no context is current, or the direct
// launch is off, the template's Triton launcher runs.
//
// LinearNode: a whole DoRA Linear layer -- the base layer's product (with its frozen bias, if any), lora_A's,
// lora_B's and the composition -- as one autograd node, called once per layer forward from
// fastdora.layers.lean_linear_forward. Under gradient checkpointing the separate nodes' saved tensors (W, x, A, h, B,
// inner: six Python pack hooks in the first forward, six in the recomputation, six unpack hooks) become three (x, h,
// inner), and the per-node autograd and Python work of three linears goes. Its forward runs the same ATen ops
// (at::linear, under autocast where it is on) and the same composition kernel; its backward the same matmuls as
// autograd's mm derivatives (mm_mat1_backward / mm_mat2_backward, incl. their column-major branch) and the same
// composition backward, and it hands x's two gradient contributions (lora_A's, then the base layer's) to autograd
// through two edges to x, so that they are accumulated one at a time in the order of the separate nodes: outputs and
// every gradient bitwise those of the separate nodes.
//
// Launch programs (at the end of this file): recorded Triton launch sequences -- POET-X's layer segments,
// fastdora._launch.Replay -- launched directly from C++ in one call per sequence; layer plans: a POET-X layer's whole
// forward or backward (its allocations, launch programs and GEMMs) in one call.
//
// Module functions (Python): configure(...), load_driver(), set_native_launch(on), register(...), clear(),
// compose(...), dora_linear(...), stats(), program(...), run_program(...), plan(...), run_plan(...),
// poetx_configure(...), poetx_set_plan(...), poetx_clear(), poetx_stats(), poetx_layer(...).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// argument roles a template slot can take (kept in sync with fastdora/kernels/native.py)
enum Role : int {
  COPY = -1,
  F_RESULT = 0, F_LORA = 1, F_BIAS = 2, F_MAG = 3, F_NORM = 4, F_Y = 5, F_INNER = 6,
  B_DY = 10, B_INNER = 11, B_MAG = 12, B_NORM = 13, B_DRES = 14, B_DLORA = 15, B_PART_DM = 16, B_DM = 17,
  B_COUNTS = 18,
  STREAM = 30, SCALE = 31, EPS = 32,
};

// A template's direct launch: Triton's compiled function, its launch dimensions and its parameter layout.
struct NativeLaunch {
  uint64_t function = 0;        // CUfunction (Triton's CompiledKernel.function)
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 0;           // 32 * num_warps
  unsigned shared = 0;          // dynamic shared memory bytes (Triton's metadata.shared)
  std::vector<int> roles;       // per kernel parameter: COPY or a role
  std::vector<char> types;      // per parameter: 'p' pointer, 'f' fp32, 'd' fp64, 'i' other integer (bytes in consts)
  std::vector<uint64_t> consts; // per parameter: its bytes (little-endian, zero-padded) where the role is COPY
};
constexpr size_t kMaxParams = 64;

// Held through shared_ptr: a call keeps its template alive even if another thread re-registers or clears it while
// Python code runs in between (the GIL can change hands at any Python call). Created and destroyed with the GIL held.
struct Template {
  PyObject* run = nullptr;   // Triton's launcher (owned)
  PyObject* args = nullptr;  // the argument tuple with this key's constants (owned)
  std::vector<int> roles;    // per argument: COPY or a role
  int64_t n_parts = 0;       // backward: rows of the per-row-block partial sums
  int64_t n_counters = 0;    // backward: program counters needed (0: none)
  bool tensor_args = false;  // pass tensors instead of data pointers (Triton interpreter, tests)
  std::unique_ptr<NativeLaunch> native;  // the direct launch, where the layout is known (null: the launcher only)
  Template(PyObject* r, PyObject* a) : run(r), args(a) {
    Py_INCREF(run);
    Py_INCREF(args);
  }
  Template(const Template&) = delete;
  Template& operator=(const Template&) = delete;
  ~Template() {
    Py_XDECREF(run);
    Py_XDECREF(args);
  }
};
using TemplatePtr = std::shared_ptr<const Template>;

struct Key {
  int64_t v[6];
  bool operator==(const Key& o) const { return std::memcmp(v, o.v, sizeof v) == 0; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t x : k.v) h = (h ^ static_cast<size_t>(x)) * 1099511628211ull;
    return h;
  }
};

// never destroyed: a static map's destructor would run after Python's finalisation and DECREF without the GIL
auto& g_templates = *new std::unordered_map<Key, TemplatePtr, KeyHash>();
PyObject* g_slow_fwd = nullptr;      // (result, lora, magnitude, norm, bias, scale, eps, out_dtype, save_inner)
PyObject* g_slow_bwd = nullptr;      // (dy, magnitude, norm, scale, eps, inner, rd, ld, need_dm, need_dres, need_dlora,
                                     //  dm_from_y)
PyObject* g_capturing = nullptr;     // () -> bool: the current CUDA stream is capturing a graph
PyObject* g_hooks_active = nullptr;  // () -> bool: Triton launch hooks are set (the Python launcher serves them)
PyObject* g_counters = nullptr;      // (dy, n) -> zeroed int32 program counters of dy's current stream
                                     //   -> (B's rows scaled by g * s, or None; the [d_out, 1] g * s, or None)
int64_t g_fast = 0, g_slow = 0;      // launches through templates / through the Python launchers
int64_t g_native = 0;                // of the template launches: direct (cuLaunchKernel)
int64_t g_layer = 0;                 // dora_linear calls (whole-layer nodes and inference calls)
bool g_host_templates = false;       // tests: compiled-launcher templates on CPU tensors (their argument layout)
bool g_native_on = true;             // FASTDORA_NATIVE_LAUNCH (set by the Python side)
bool g_record = false;               // tests: record direct launches instead of making them (CPU)
PyObject* g_records = nullptr;       // tests: a list of (function, grid, block, shared, stream, params bytes, pdl)

// cuda.h's CUlaunchAttribute and CUlaunchConfig (the arguments of cuLaunchKernelEx), written out with the same layout:
// the node is built without the CUDA toolkit. An attribute is its id, padding to 8 bytes, then a 64-byte value union.
struct LaunchAttribute {
  int id;
  char pad[4];
  alignas(8) unsigned char value[64];
};
struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
  void* stream;
  LaunchAttribute* attrs;
  unsigned n_attrs;
};
static_assert(sizeof(LaunchAttribute) == 72 && sizeof(LaunchConfig) == 56, "CUDA launch structs' layout");
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: a programmatic dependent launch (value: int 1)
constexpr int kProgrammaticStreamSerialization = 6;

// The CUDA driver's entry points (dlopen'ed: the node is built without the CUDA toolkit). CUresult is an int enum.
struct Driver {
  using launch_t = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                           void**);
  using launch_ex_t = int (*)(const LaunchConfig*, void*, void**, void**);
  using ctx_t = int (*)(void**);
  using capturing_t = int (*)(void*, int*);
  using errstr_t = int (*)(int, const char**);
  launch_t launch = nullptr;
  launch_ex_t launch_ex = nullptr;  // cuLaunchKernelEx, for programmatic dependent launches (null: an old driver)
  ctx_t ctx_current = nullptr;
  capturing_t stream_capturing = nullptr;
  errstr_t error_string = nullptr;
  bool ready() const { return launch != nullptr; }
};
Driver g_driver;

// the counters (zeroed int32, see fastdora.kernels.compose._counters) per (device, stream) the node has used
struct StreamKey {
  int64_t dev;
  uint64_t stream;
  bool operator==(const StreamKey& o) const { return dev == o.dev && stream == o.stream; }
};
struct StreamKeyHash {
  size_t operator()(const StreamKey& k) const { return std::hash<uint64_t>()(k.stream * 31 + k.dev); }
};
auto& g_counts = *new std::unordered_map<StreamKey, at::Tensor, StreamKeyHash>();

inline int64_t st(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.scalar_type()) : 63; }
inline int64_t st(at::ScalarType s) { return static_cast<int64_t>(s); }

Key fwd_key(const at::Tensor& r, const at::Tensor& l, at::ScalarType out, const at::Tensor& m, const at::Tensor& n,
            const at::Tensor& b, bool save_inner, int64_t M, int64_t N) {
  int64_t dt = st(r) | st(l) << 6 | st(out) << 12 | st(m) << 18 | st(n) << 24 | st(b) << 30;
  int64_t dev = r.is_cuda() ? r.get_device() : -1;
  return Key{{0, M, N, dt, dev, save_inner ? 1 : 0}};
}

Key bwd_key(const at::Tensor& dy, const at::Tensor& inner, at::ScalarType rd, at::ScalarType ld, const at::Tensor& m,
            const at::Tensor& n, bool need_dres, bool need_dlora, bool need_dm, bool from_y, int64_t M, int64_t N) {
  int64_t dt = st(dy) | st(inner) << 6 | st(rd) << 12 | st(ld) << 18 | st(m) << 24 | st(n) << 30;
  int64_t dev = dy.is_cuda() ? dy.get_device() : -1;
  return Key{{1, M, N, dt, dev, (need_dres ? 1 : 0) | (need_dlora ? 2 : 0) | (need_dm ? 4 : 0) | (from_y ? 8 : 0)}};
}

[[noreturn]] void throw_py() {  // the pending Python error, as the exception autograd / HANDLE_TH_ERRORS rethrow
  python_error err;
  err.persist();
  throw std::move(err);
}

PyObject* wrap(const at::Tensor& t) {
  if (!t.defined()) Py_RETURN_NONE;
  return THPVariable_Wrap(t);
}

at::Tensor unwrap(PyObject* o) {
  if (o == Py_None) return at::Tensor();
  if (!THPVariable_Check(o)) {
    PyErr_SetString(PyExc_TypeError, "fastdora native node: expected a tensor or None");
    throw_py();
  }
  return THPVariable_Unpack(o);
}

// The result of a Python fallback call (a new reference or null): its n tensors (None: undefined).
std::vector<at::Tensor> fallback_result(PyObject* r, Py_ssize_t n, const char* what) {
  if (!r) throw_py();
  std::vector<at::Tensor> out;
  const bool ok = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == n;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    PyObject* o = PyTuple_GET_ITEM(r, i);
    if (o != Py_None && !THPVariable_Check(o)) break;
    out.push_back(o == Py_None ? at::Tensor() : THPVariable_Unpack(o));
  }
  Py_DECREF(r);
  if (static_cast<Py_ssize_t>(out.size()) != n) {
    PyErr_Format(PyExc_TypeError, "fastdora native node: %s must return %zd tensors or None", what, n);
    throw_py();
  }
  return out;
}

bool call_bool(PyObject* fn) {
  PyObject* r = PyObject_CallNoArgs(fn);
  if (!r) throw_py();
  int v = PyObject_IsTrue(r);
  Py_DECREF(r);
  if (v < 0) throw_py();
  return v != 0;
}

// a plain strided tensor with storage (no wrapper subclass) whose data pointer is 16-byte aligned
bool aligned(const at::Tensor& t) {
  return t.layout() == c10::kStrided && t.has_storage() && (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0;
}

bool row_major(const at::Tensor& t, int64_t N) { return t.is_contiguous() && t.dim() >= 1 && t.size(-1) == N; }
bool vec_ok(const at::Tensor& t, int64_t N) { return t.is_contiguous() && t.numel() == N; }

// the raw handle of `on`'s device's current stream (0 for a CPU tensor); looked up once per node call
uint64_t stream_of(const at::Tensor& on) {
  if (!on.is_cuda()) return 0;
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return reinterpret_cast<uint64_t>(impl.getStream(on.device()).native_handle());
}

// Whether `on`'s device's current stream (`stream`) is capturing a CUDA graph (the driver's answer where it is loaded).
bool capturing(const at::Tensor& on, uint64_t stream) {
  if (!on.is_cuda()) return false;
  if (g_driver.stream_capturing) {
    int status = 0;
    if (g_driver.stream_capturing(reinterpret_cast<void*>(stream), &status) == 0) return status != 0;
  }
  return call_bool(g_capturing);
}

// The direct launch: can it run here (a driver and a current context on CUDA; the recorder in tests)?
bool native_ready(const Template& tp, const at::Tensor& on) {
  if (!tp.native || !g_native_on) return false;
  if (g_record) return true;
  if (!on.is_cuda() || !g_driver.ready()) return false;
  void* ctx = nullptr;
  return g_driver.ctx_current(&ctx) == 0 && ctx != nullptr;
}

// One direct launch (params: pointers to the parameters' bytes, `words` of them 8 bytes apart from `values`; pdl: a
// programmatic dependent launch, with cuLaunchKernelEx as Triton's launcher makes it), or in tests its record
// (function, grid, block, shared, stream, parameter bytes, pdl) appended to g_records. Needs the GIL only in tests
// (the recorder).
void direct_launch(uint64_t function, const unsigned* grid, unsigned block, unsigned shared, uint64_t stream,
                   const uint64_t* values, void** params, size_t words, bool pdl = false) {
  if (g_record) {
    PyObject* rec = Py_BuildValue("(K(III)IIKy#O)", static_cast<unsigned long long>(function), grid[0], grid[1],
                                  grid[2], block, shared, static_cast<unsigned long long>(stream),
                                  reinterpret_cast<const char*>(values), static_cast<Py_ssize_t>(words * 8),
                                  pdl ? Py_True : Py_False);
    if (!rec || PyList_Append(g_records, rec) < 0) {
      Py_XDECREF(rec);
      throw_py();
    }
    Py_DECREF(rec);
    return;
  }
  int rc;
  if (pdl) {
    TORCH_CHECK(g_driver.launch_ex, "fastdora native launch: a programmatic dependent launch needs cuLaunchKernelEx, ",
                "which this CUDA driver lacks");
    LaunchAttribute attr{};
    attr.id = kProgrammaticStreamSerialization;
    const int allowed = 1;
    std::memcpy(attr.value, &allowed, sizeof(allowed));
    const LaunchConfig config{grid[0], grid[1], grid[2], block, 1, 1, shared, reinterpret_cast<void*>(stream),
                              &attr, 1};
    rc = g_driver.launch_ex(&config, reinterpret_cast<void*>(function), params, nullptr);
  } else {
    rc = g_driver.launch(reinterpret_cast<void*>(function), grid[0], grid[1], grid[2], block, 1, 1, shared,
                         reinterpret_cast<void*>(stream), params, nullptr);
  }
  if (rc != 0) {
    const char* msg = nullptr;
    if (g_driver.error_string) g_driver.error_string(rc, &msg);
    TORCH_CHECK(false, "fastdora native launch: ", pdl ? "cuLaunchKernelEx" : "cuLaunchKernel", " failed: ",
                msg ? msg : "unknown error", " (CUresult ", rc, ")");
  }
}

// Launch a template's kernel directly: its parameters as Triton's launcher packs them (pointers as device
// addresses, fp32 scalars rounded from the double as a C cast does, constants as registered).
void launch_native(const NativeLaunch& nl, const at::Tensor* by_role, double scale, double eps, uint64_t stream) {
  const size_t n = nl.roles.size();
  uint64_t slots[kMaxParams];
  void* params[kMaxParams];
  for (size_t i = 0; i < n; ++i) {
    const int role = nl.roles[i];
    uint64_t v = 0;
    if (role == COPY) {
      v = nl.consts[i];
    } else if (role == SCALE || role == EPS) {
      const double d = role == SCALE ? scale : eps;
      if (nl.types[i] == 'f') {
        const float f = static_cast<float>(d);
        uint32_t b;
        std::memcpy(&b, &f, 4);
        v = b;
      } else {
        std::memcpy(&v, &d, 8);
      }
    } else {
      v = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(by_role[role].data_ptr()));
    }
    slots[i] = v;
    params[i] = &slots[i];
  }
  direct_launch(nl.function, nl.grid, nl.block, nl.shared, stream, slots, params, n);
  ++g_fast;
  ++g_native;
}

// Fill a template with this call's tensors (by role), scalars and stream (`on`'s: stream_of) and launch it. Needs
// the GIL.
void launch(const Template& tp, const at::Tensor* by_role, double scale, double eps, const at::Tensor& on,
            uint64_t stream) {
  if (native_ready(tp, on)) return launch_native(*tp.native, by_role, scale, eps, stream);
  const Py_ssize_t n = PyTuple_GET_SIZE(tp.args);
  PyObject* a = PyTuple_New(n);
  if (!a) throw_py();
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int role = tp.roles[i];
    PyObject* v;
    if (role == COPY) {
      v = PyTuple_GET_ITEM(tp.args, i);
      Py_INCREF(v);
    } else if (role == STREAM) {
      if (on.is_cuda()) {
        v = PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(stream));
      } else {
        v = Py_None;
        Py_INCREF(v);
      }
    } else if (role == SCALE) {
      v = PyFloat_FromDouble(scale);
    } else if (role == EPS) {
      v = PyFloat_FromDouble(eps);
    } else {
      const at::Tensor& t = by_role[role];
      v = tp.tensor_args ? THPVariable_Wrap(t) : PyLong_FromUnsignedLongLong(
          static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(t.data_ptr())));
    }
    if (!v) {
      Py_DECREF(a);
      throw_py();
    }
    PyTuple_SET_ITEM(a, i, v);
  }
  PyObject* r = PyObject_Call(tp.run, a, nullptr);
  Py_DECREF(a);
  if (!r) throw_py();
  Py_DECREF(r);
  ++g_fast;
}

struct Extra {  // the node's non-differentiable inputs
  at::Tensor norm, bias;
  double scale, eps;
  at::ScalarType out_dtype;
  bool discard = false;  // checkpointing discards what the node saves: save a placeholder instead of inner
};

struct GIL {
  PyGILState_STATE s;
  GIL() : s(PyGILState_Ensure()) {}
  ~GIL() { PyGILState_Release(s); }
};

// The composition's forward launch: (y, inner), inner only with save_inner. Needs the GIL.
std::pair<at::Tensor, at::Tensor> run_fwd(const at::Tensor& result, const at::Tensor& lora,
                                          const at::Tensor& magnitude, const Extra& ex, bool save_inner) {
  at::Tensor y, inner;
  const int64_t N = result.dim() ? result.size(-1) : 1;
  const int64_t M = N ? result.numel() / N : 0;
  TemplatePtr tp;
  if (M > 0 && N > 0 && row_major(result, N) && lora.sizes() == result.sizes() && row_major(lora, N) &&
      vec_ok(magnitude, N) && vec_ok(ex.norm, N) && (!ex.bias.defined() || vec_ok(ex.bias, N)) &&
      aligned(result) && aligned(lora) && aligned(magnitude) && aligned(ex.norm) &&
      (!ex.bias.defined() || aligned(ex.bias))) {
    auto it = g_templates.find(fwd_key(result, lora, ex.out_dtype, magnitude, ex.norm, ex.bias, save_inner, M, N));
    if (it != g_templates.end() && (result.is_cuda() || it->second->tensor_args || g_host_templates))
      tp = it->second;
  }
  if (tp && !call_bool(g_hooks_active)) {
    y = at::empty(result.sizes(), result.options().dtype(ex.out_dtype));
    if (save_inner)
      inner = at::empty(result.sizes(), result.options().dtype(c10::promoteTypes(result.scalar_type(),
                                                                                 lora.scalar_type())));
    at::Tensor roles[7] = {result, lora, ex.bias.defined() ? ex.bias : magnitude, magnitude, ex.norm, y,
                           save_inner ? inner : y};
    c10::OptionalDeviceGuard guard;
    if (result.is_cuda()) guard.reset_device(result.device());
    launch(*tp, roles, ex.scale, ex.eps, result, stream_of(result));
  } else {
    ++g_slow;
    // "N": new references handed over (the wrapped tensors); "O": borrowed (getTHPDtype's dtype objects, bools)
    PyObject* r = PyObject_CallFunction(
        g_slow_fwd, "NNNNNddOO", wrap(result), wrap(lora), wrap(magnitude), wrap(ex.norm), wrap(ex.bias), ex.scale,
        ex.eps, reinterpret_cast<PyObject*>(torch::getTHPDtype(ex.out_dtype)), save_inner ? Py_True : Py_False);
    auto out = fallback_result(r, 2, "slow_fwd");
    y = out[0];
    inner = out[1];
  }
  return {y, inner};
}

// The composition's backward launch for the requested gradients: (d_result, d_lora, dm). Needs the GIL. from_y:
// `inner` is the bias-free output y = g * inner, and dm = sum(dy * y) / m (the whole-layer node's saved output).
std::vector<at::Tensor> run_bwd(const at::Tensor& dy, const at::Tensor& inner, const at::Tensor& magnitude,
                                const at::Tensor& norm, double scale, double eps, at::ScalarType rd, at::ScalarType ld,
                                bool need_dres, bool need_dlora, bool need_dm, bool from_y = false) {
  from_y = from_y && need_dm;
  at::Tensor d_result, d_lora, dm;
  const int64_t N = dy.dim() ? dy.size(-1) : 1;
  const int64_t M = N ? dy.numel() / N : 0;
  TemplatePtr tp;  // released on return, under the caller's GIL
  if (M > 0 && N > 0 && row_major(dy, N) && vec_ok(magnitude, N) && vec_ok(norm, N) && aligned(dy) &&
      aligned(magnitude) && aligned(norm) &&
      (!need_dm || (inner.sizes() == dy.sizes() && row_major(inner, N) && aligned(inner)))) {
    auto it = g_templates.find(bwd_key(dy, need_dm ? inner : at::Tensor(), rd, ld, magnitude, norm, need_dres,
                                       need_dlora, need_dm, from_y, M, N));
    if (it != g_templates.end() && (dy.is_cuda() || it->second->tensor_args || g_host_templates))
      tp = it->second;
  }
  const uint64_t stream = tp ? stream_of(dy) : 0;
  if (tp && (capturing(dy, stream) || call_bool(g_hooks_active))) tp.reset();
  at::Tensor counts;
  if (tp && tp->n_counters > 0) {
    // the stream's counters: the Python side's (fastdora.kernels.compose._counters), kept here after the first ask
    const StreamKey sk{dy.is_cuda() ? dy.get_device() : -1, stream};
    auto ct = g_counts.find(sk);
    if (ct != g_counts.end() && ct->second.numel() >= tp->n_counters) {
      counts = ct->second;
    } else {
      PyObject* c = PyObject_CallFunction(g_counters, "NL", wrap(dy), static_cast<long long>(tp->n_counters));
      if (!c) throw_py();
      if (c == Py_None) {
        tp.reset();  // no counters here: the Python launcher's two-kernel reduction
      } else {
        counts = unwrap(c);
        g_counts[sk] = counts;
      }
      Py_DECREF(c);
    }
  }
  if (tp) {
    if (need_dres) d_result = at::empty(dy.sizes(), dy.options().dtype(rd));
    if (need_dlora) d_lora = at::empty(dy.sizes(), dy.options().dtype(ld));
    at::Tensor part;
    if (need_dm) {
      dm = at::empty(magnitude.sizes(), magnitude.options());
      part = at::empty({tp->n_parts, N}, dy.options().dtype(at::kFloat));
    }
    at::Tensor roles[19];
    roles[B_DY] = dy;
    roles[B_INNER] = need_dm ? inner : dy;
    roles[B_MAG] = magnitude;
    roles[B_NORM] = norm;
    roles[B_DRES] = need_dres ? d_result : dy;
    roles[B_DLORA] = need_dlora ? d_lora : dy;
    roles[B_PART_DM] = need_dm ? part : magnitude;
    roles[B_DM] = need_dm ? dm : magnitude;
    roles[B_COUNTS] = counts.defined() ? counts : magnitude;
    c10::OptionalDeviceGuard guard;
    if (dy.is_cuda()) guard.reset_device(dy.device());
    launch(*tp, roles, scale, eps, dy, stream);
  } else {
    ++g_slow;
    PyObject* r = PyObject_CallFunction(
        g_slow_bwd, "NNNddNOOOOOO", wrap(dy), wrap(magnitude), wrap(norm), scale, eps, wrap(inner),
        reinterpret_cast<PyObject*>(torch::getTHPDtype(rd)), reinterpret_cast<PyObject*>(torch::getTHPDtype(ld)),
        need_dm ? Py_True : Py_False, need_dres ? Py_True : Py_False, need_dlora ? Py_True : Py_False,
        from_y ? Py_True : Py_False);
    auto out = fallback_result(r, 3, "slow_bwd");
    d_result = out[0];
    d_lora = out[1];
    dm = out[2];
  }
  return {need_dres ? d_result : at::Tensor(), need_dlora ? d_lora : at::Tensor(), need_dm ? dm : at::Tensor()};
}

// What the node saves instead of inner while checkpointing discards saved tensors (fastdora.ops.compose.
// saves_discarded): a zero-stride view of inner's shape, dtype and device (what checkpointing's determinism check
// compares), never written or read (ops.compose._inner_placeholder is the Python node's)
at::Tensor placeholder(const at::Tensor& result, const at::Tensor& lora) {
  return at::empty({}, result.options().dtype(c10::promoteTypes(result.scalar_type(), lora.scalar_type())))
      .expand(result.sizes());
}

// the saved inner, refusing a checkpointing placeholder (a zero-stride view)
at::Tensor saved_inner(const at::Tensor& inner) {
  if (inner.dim() && inner.stride(-1) == 0 && inner.numel() > 1)
    TORCH_CHECK(false, "fastdora: the composition's saved activation was discarded by gradient checkpointing "
                       "but its backward ran without the recomputed one; please report this");
  return inner;
}

// what both nodes' backwards read besides the saved tensors
void save_common(AutogradContext* ctx, const at::Tensor& magnitude, const Extra& ex, const at::Tensor& result,
                 const at::Tensor& lora, bool need_dm) {
  ctx->saved_data["m"] = magnitude;
  ctx->saved_data["n"] = ex.norm;
  ctx->saved_data["s"] = ex.scale;
  ctx->saved_data["e"] = ex.eps;
  ctx->saved_data["rd"] = st(result);
  ctx->saved_data["ld"] = st(lora);
  ctx->saved_data["dm"] = need_dm;
}

struct ComposeNode : public torch::autograd::Function<ComposeNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& result, const at::Tensor& lora,
                            const at::Tensor& magnitude, const Extra& ex) {
    const bool need_dm = magnitude.requires_grad();
    const bool discard = ex.discard;
    auto yi = run_fwd(result, lora, magnitude, ex, need_dm && !discard);
    at::Tensor y = yi.first, inner = yi.second;
    if (need_dm && discard) inner = placeholder(result, lora);
    save_common(ctx, magnitude, ex, result, lora, need_dm);
    if (need_dm) ctx->save_for_backward({inner});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool need_dres = ctx->needs_input_grad(0), need_dlora = ctx->needs_input_grad(1);
    const bool need_dm = ctx->saved_data["dm"].toBool() && ctx->needs_input_grad(2);
    if (!(need_dres || need_dlora || need_dm)) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor inner;
    if (ctx->saved_data["dm"].toBool()) inner = saved_inner(ctx->get_saved_variables()[0]);
    const at::Tensor dy = grads[0].contiguous();
    GIL gil;
    auto g = run_bwd(dy, inner, ctx->saved_data["m"].toTensor(), ctx->saved_data["n"].toTensor(),
                     ctx->saved_data["s"].toDouble(), ctx->saved_data["e"].toDouble(),
                     static_cast<at::ScalarType>(ctx->saved_data["rd"].toInt()),
                     static_cast<at::ScalarType>(ctx->saved_data["ld"].toInt()), need_dres, need_dlora, need_dm);
    return {g[0], g[1], g[2], at::Tensor()};
  }
};

// autograd's derivatives of mm(mat1, mat2) (torch/csrc/autograd/FunctionsManual.cpp: mm_mat1_backward /
// mm_mat2_backward, strided layouts): a column-major input gets its gradient as the transpose of a product. mat1's
// layout is given by its rows and strides (it need not be at hand).
at::Tensor mm_mat1_backward(const at::Tensor& grad, const at::Tensor& mat2, int64_t rows, int64_t s0, int64_t s1) {
  if (s0 == 1 && s1 == rows) return mat2.mm(grad.t()).t();
  return grad.mm(mat2.t());
}

at::Tensor mm_mat2_backward(const at::Tensor& grad, const at::Tensor& mat1, const at::Tensor& mat2) {
  if (mat2.stride(0) == 1 && mat2.stride(1) == mat2.size(0)) return grad.t().mm(mat1).t();
  return mat1.t().mm(grad);
}

// a linear's input as the [rows, features] matrix its mm reads (at::matmul folds leading dims into rows)
at::Tensor as_rows(const at::Tensor& t) { return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)}); }

struct LinearExtra {  // dora_linear's non-differentiable inputs
  at::Tensor weight, bias, norm;  // the frozen base weight [d_out, d_in] and bias (or undefined); the detached norm
  double scale, eps;
  bool discard = false;     // checkpointing discards what the node saves (placeholder for inner)
  bool train = true;        // grad mode was on at the call: save what the backward needs
  bool from_y = false;      // the magnitude's gradient from the saved output (the caller checked m has no zeros)
};

// Whether the magnitude's gradient comes from the saved output y instead of inner: dm = sum(dy * y) / m, the same
// value as sum(dy * inner) / max(norm, eps) since y = g * inner with g = m / max(norm, eps). The model's next ops
// keep most layers' y anyway (SiLU and the gate product keep gate's and up's, attention v's), so saving y instead
// of inner takes no memory of its own there, and the forward writes no inner. Not with a bias (y - bias would
// cancel) nor in fp16 (its narrow range loses y's low bits where g is small).
bool dm_from_output(const LinearExtra& le, at::ScalarType out) {
  return le.from_y && !le.bias.defined() &&
         (out == at::kFloat || out == at::kBFloat16 || out == at::kDouble);
}

// version counters of the weights the backward reads (an in-place change in between is an error, as autograd's)
void check_version(AutogradContext* ctx, const char* key, const at::Tensor& t, const char* what) {
  const int64_t want = ctx->saved_data[key].toInt();
  TORCH_CHECK(want == static_cast<int64_t>(t._version()),
              "one of the variables needed for gradient computation has been modified by an inplace operation: "
              "fastdora's DoRA Linear node: ", what, " is at version ", t._version(), "; expected version ", want,
              " instead");
}

struct LinearNode : public torch::autograd::Function<LinearNode> {
  // inputs: x twice (lora_A's input, then the base layer's: two edges), lora_A's and lora_B's weights, magnitude
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& x_base, const at::Tensor& a,
                            const at::Tensor& b, const at::Tensor& magnitude, const LinearExtra& le) {
    // the separate nodes' forward ops, in their order (under autocast: its casts, as F.linear's)
    const at::Tensor result = at::linear(x_base, le.weight, le.bias);
    const at::Tensor h = at::linear(x, a);
    const at::Tensor lora = at::linear(h, b);
    Extra ex;
    ex.norm = le.norm;
    ex.bias = le.bias;
    ex.scale = le.scale;
    ex.eps = le.eps;
    ex.out_dtype = result.scalar_type();
    const bool need_dm = le.train && magnitude.requires_grad();
    const bool from_y = need_dm && dm_from_output(le, ex.out_dtype);
    auto yi = run_fwd(result, lora, magnitude, ex, need_dm && !from_y && !le.discard);
    if (!le.train) return yi.first;
    // y is saved as a detached alias (same storage and version counter, no grad_fn): saving y itself would put this
    // node in y's to-save list while y's grad_fn is the node, a reference cycle (node -> y -> node) that is never
    // freed where a saved-tensor pack hook raises mid-save (non-reentrant checkpointing's early stop, at the last
    // tensor a checkpointed region saves, interrupts save_variables before it clears that list)
    at::Tensor inner = from_y ? yi.first.detach() : yi.second;
    if (need_dm && !from_y && le.discard) inner = placeholder(result, lora);
    save_common(ctx, magnitude, ex, result, lora, need_dm);
    const at::Tensor x2 = as_rows(x), h2 = as_rows(h);
    auto& sd = ctx->saved_data;
    sd["fy"] = from_y;
    sd["w"] = le.weight;
    sd["a"] = a;
    sd["b"] = b;
    sd["vw"] = static_cast<int64_t>(le.weight._version());
    sd["va"] = static_cast<int64_t>(a._version());
    sd["vb"] = static_cast<int64_t>(b._version());
    sd["xsz"] = x.sizes().vec();
    sd["xd"] = st(x);
    sd["xl"] = std::vector<int64_t>{x2.size(0), x2.stride(0), x2.stride(1), h2.stride(0), h2.stride(1)};
    // what the backward reads of the activations: x for A's gradient, h for B's, inner (or y) for the magnitude's
    ctx->save_for_backward({a.requires_grad() ? x : at::Tensor(), b.requires_grad() ? h : at::Tensor(),
                            need_dm ? inner : at::Tensor()});
    return yi.first;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool need_xa = ctx->needs_input_grad(0), need_xb = ctx->needs_input_grad(1);
    const bool need_da = ctx->needs_input_grad(2), need_db = ctx->needs_input_grad(3);
    auto& sd = ctx->saved_data;
    const bool has_dm = sd["dm"].toBool();
    const bool need_dm = has_dm && ctx->needs_input_grad(4);
    variable_list out(6);
    // the separate composition node's flags: d_result for the base layer (x), d_lora for lora_B (x, A or B)
    const bool need_dres = need_xb, need_dlora = need_xa || need_da || need_db;
    if (!(need_dres || need_dlora || need_dm)) return out;
    const bool from_y = sd["fy"].toBool();
    std::vector<at::Tensor> saved;
    try {
      saved = ctx->get_saved_variables();
    } catch (const c10::Error& e) {
      if (!from_y) throw;
      TORCH_CHECK(false, e.what_without_backtrace(), "\nfastdora: the DoRA Linear node saves its output for the "
                  "magnitude's gradient; if the model changes a layer's output in place, switch this off with "
                  "fastdora's option dm_from_output=False");
    }
    const at::Tensor weight = sd["w"].toTensor(), a = sd["a"].toTensor(), b = sd["b"].toTensor();
    // the weights each gradient reads (the separate nodes' saved weights): W and A for x's, B for x's and A's
    if (need_xb) check_version(ctx, "vw", weight, "the base weight");
    if (need_xa) check_version(ctx, "va", a, "lora_A's weight");
    if (need_xa || need_da) check_version(ctx, "vb", b, "lora_B's weight");
    const at::Tensor inner = has_dm ? saved_inner(saved[2]) : at::Tensor();  // y is never a placeholder
    const at::Tensor dy = grads[0].contiguous();
    const auto ld = static_cast<at::ScalarType>(sd["ld"].toInt());
    std::vector<at::Tensor> g;
    {
      GIL gil;
      g = run_bwd(dy, inner, sd["m"].toTensor(), sd["n"].toTensor(), sd["s"].toDouble(), sd["e"].toDouble(),
                  static_cast<at::ScalarType>(sd["rd"].toInt()), ld, need_dres, need_dlora, need_dm, from_y);
    }
    out[4] = need_dm ? g[2] : at::Tensor();
    const auto xl = sd["xl"].toIntVector();  // x's and h's [rows, features] layouts in the forward's mm
    const auto xsz = sd["xsz"].toIntVector();
    const int64_t N = dy.size(-1);
    if (need_dlora) {
      // lora_B's and lora_A's products ran in lora's dtype (autocast's casts of fp32 adapters, as F.linear's)
      const at::Tensor dl = g[1].reshape({-1, N});
      const at::Tensor bc = b.scalar_type() == ld ? b : b.to(ld);
      if (need_db) {
        const at::Tensor d = mm_mat2_backward(dl, as_rows(saved[1]), bc.t()).t();
        out[3] = d.scalar_type() == b.scalar_type() ? d : d.to(b.scalar_type());
      }
      if (need_xa || need_da) {
        const at::Tensor ac = a.scalar_type() == ld ? a : a.to(ld);
        const at::Tensor dh = mm_mat1_backward(dl, bc.t(), xl[0], xl[3], xl[4]);  // lora_B's input gradient
        if (need_da) {
          const at::Tensor x = saved[0].scalar_type() == ld ? saved[0] : saved[0].to(ld);  // autocast's cast of x
          const at::Tensor d = mm_mat2_backward(dh, as_rows(x), ac.t()).t();
          out[2] = d.scalar_type() == a.scalar_type() ? d : d.to(a.scalar_type());
        }
        if (need_xa) out[0] = mm_mat1_backward(dh, ac.t(), xl[0], xl[1], xl[2]).reshape(xsz);
      }
    }
    if (need_xb) {  // the base product ran in result's dtype (autocast's casts of fp32 x and W, as F.linear's)
      const auto rd = static_cast<at::ScalarType>(sd["rd"].toInt());
      const at::Tensor wc = weight.scalar_type() == rd ? weight : weight.to(rd);
      out[1] = mm_mat1_backward(g[0].reshape({-1, N}), wc.t(), xl[0], xl[1], xl[2]).reshape(xsz);
    }
    // x's gradients in x's dtype (autograd's cast back through autocast's cast of x)
    const auto xd = static_cast<at::ScalarType>(sd["xd"].toInt());
    for (int i = 0; i < 2; ++i)
      if (out[i].defined() && out[i].scalar_type() != xd) out[i] = out[i].to(xd);
    return out;
  }
};

PyObject* py_configure(PyObject*, PyObject* args) {
  PyObject *f, *b, *c, *h, *k;
  if (!PyArg_ParseTuple(args, "OOOOO", &f, &b, &c, &h, &k)) return nullptr;
  PyObject** slots[5] = {&g_slow_fwd, &g_slow_bwd, &g_capturing, &g_hooks_active, &g_counters};
  PyObject* vals[5] = {f, b, c, h, k};
  for (int i = 0; i < 5; ++i) {
    Py_INCREF(vals[i]);
    Py_XDECREF(*slots[i]);
    *slots[i] = vals[i];
  }
  Py_RETURN_NONE;
}

PyObject* py_clear(PyObject*, PyObject*) {
  g_templates.clear();
  g_counts.clear();
  g_fast = g_slow = g_native = g_layer = 0;
  Py_RETURN_NONE;
}

// load_driver() -> None, or why the CUDA driver's entry points are unavailable (the templates' launchers then run)
PyObject* py_load_driver(PyObject*, PyObject*) {
  if (g_driver.ready()) Py_RETURN_NONE;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) return PyUnicode_FromFormat("dlopen(libcuda.so.1) failed: %s", dlerror());
  Driver d;
  d.launch = reinterpret_cast<Driver::launch_t>(dlsym(h, "cuLaunchKernel"));
  d.launch_ex = reinterpret_cast<Driver::launch_ex_t>(dlsym(h, "cuLaunchKernelEx"));  // optional
  d.ctx_current = reinterpret_cast<Driver::ctx_t>(dlsym(h, "cuCtxGetCurrent"));
  d.stream_capturing = reinterpret_cast<Driver::capturing_t>(dlsym(h, "cuStreamIsCapturing"));
  d.error_string = reinterpret_cast<Driver::errstr_t>(dlsym(h, "cuGetErrorString"));
  if (!d.launch || !d.ctx_current || !d.stream_capturing)
    return PyUnicode_FromString("libcuda.so.1 lacks cuLaunchKernel / cuCtxGetCurrent / cuStreamIsCapturing");
  g_driver = d;
  Py_RETURN_NONE;
}

// a module-level switch from a Python truth value
PyObject* set_flag(bool& flag, PyObject* arg) {
  const int v = PyObject_IsTrue(arg);
  if (v < 0) return nullptr;
  flag = v != 0;
  Py_RETURN_NONE;
}

PyObject* py_set_native_launch(PyObject*, PyObject* arg) { return set_flag(g_native_on, arg); }

// tests: record_native(list or None): direct launches append (function, grid, block, shared, stream, params) to the
// list instead of launching (also on CPU tensors); None: launch again
PyObject* py_record_native(PyObject*, PyObject* arg) {
  if (arg != Py_None && !PyList_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "fastdora native node: record_native takes a list or None");
    return nullptr;
  }
  Py_XDECREF(g_records);
  g_records = arg == Py_None ? nullptr : arg;
  Py_XINCREF(g_records);
  g_record = g_records != nullptr;
  Py_RETURN_NONE;
}

PyObject* py_host_templates(PyObject*, PyObject* arg) { return set_flag(g_host_templates, arg); }

PyObject* py_stats(PyObject*, PyObject*) {
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:n,s:O}", "fast", static_cast<long long>(g_fast), "slow",
                       static_cast<long long>(g_slow), "native", static_cast<long long>(g_native), "layer",
                       static_cast<long long>(g_layer), "templates",
                       static_cast<Py_ssize_t>(g_templates.size()), "direct",
                       (g_native_on && g_driver.ready()) ? Py_True : Py_False);
}

at::ScalarType dtype_of(PyObject* o) {
  if (!THPDtype_Check(o)) {
    PyErr_SetString(PyExc_TypeError, "fastdora native node: expected a torch.dtype");
    throw_py();
  }
  return reinterpret_cast<THPDtype*>(o)->scalar_type;
}

bool valid_role(int direction, long r) {
  const bool tensor_role = direction ? (r >= B_DY && r <= B_COUNTS) : (r >= F_RESULT && r <= F_INNER);
  return r == COPY || tensor_role || (r >= STREAM && r <= EPS);
}

// The direct launch of a template from (function, (gx, gy, gz), block, shared, roles, types, consts); null with a
// Python error set where it is malformed.
std::unique_ptr<NativeLaunch> parse_native(int direction, PyObject* o) {
  unsigned long long fn;
  unsigned gx, gy, gz, block, shared;
  PyObject *roles, *consts;
  const char* types;
  Py_ssize_t n_types;
  if (!PyArg_ParseTuple(o, "K(III)IIO!y#O!", &fn, &gx, &gy, &gz, &block, &shared, &PyTuple_Type, &roles, &types,
                        &n_types, &PyTuple_Type, &consts))
    return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(roles);
  if (n != n_types || n != PyTuple_GET_SIZE(consts) || n > static_cast<Py_ssize_t>(kMaxParams) || block == 0) {
    PyErr_SetString(PyExc_ValueError, "fastdora native node: bad direct-launch layout");
    return nullptr;
  }
  auto nl = std::make_unique<NativeLaunch>();
  nl->function = fn;
  nl->grid[0] = gx;
  nl->grid[1] = gy;
  nl->grid[2] = gz;
  nl->block = block;
  nl->shared = shared;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long r = PyLong_AsLong(PyTuple_GET_ITEM(roles, i));
    const unsigned long long c = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(consts, i));
    if (PyErr_Occurred()) return nullptr;
    const char t = types[i];
    const bool ok = valid_role(direction, r) && r != STREAM && (t == 'p' || t == 'f' || t == 'd' || t == 'i') &&
                    ((r == SCALE || r == EPS) ? (t == 'f' || t == 'd') : (r == COPY || t == 'p'));
    if (!ok) {
      PyErr_Format(PyExc_ValueError, "fastdora native node: bad direct-launch parameter %zd (role %ld, type %c)", i,
                   r, t);
      return nullptr;
    }
    nl->roles.push_back(static_cast<int>(r));
    nl->types.push_back(t);
    nl->consts.push_back(c);
  }
  return nl;
}

// register(direction, M, N, dtypes, device, flags, run, args, roles, n_parts, n_counters, tensor_args, native)
//   forward:  dtypes = (result, lora, out, magnitude, norm, bias or None), flags = save_inner
//   backward: dtypes = (dy, inner or None, result, lora, magnitude, norm), flags = dres | dlora << 1 | dm << 2
//   native:   None, or the direct launch (parse_native)
PyObject* py_register(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  int direction, tensor_args;
  long long M, N, dev, flags, n_parts, n_counters;
  PyObject *dtypes, *run, *targs, *roles, *native;
  if (!PyArg_ParseTuple(args, "iLLO!LLOO!O!LLpO", &direction, &M, &N, &PyTuple_Type, &dtypes, &dev, &flags, &run,
                        &PyTuple_Type, &targs, &PyTuple_Type, &roles, &n_parts, &n_counters, &tensor_args, &native))
    return nullptr;
  if (PyTuple_GET_SIZE(dtypes) != 6 || PyTuple_GET_SIZE(roles) != PyTuple_GET_SIZE(targs)) {
    PyErr_SetString(PyExc_ValueError, "fastdora native node: bad template");
    return nullptr;
  }
  int64_t d[6];
  for (int i = 0; i < 6; ++i) {
    PyObject* o = PyTuple_GET_ITEM(dtypes, i);
    d[i] = o == Py_None ? 63 : st(dtype_of(o));
  }
  int64_t dt = d[0] | d[1] << 6 | d[2] << 12 | d[3] << 18 | d[4] << 24 | d[5] << 30;
  Key key{{direction ? 1 : 0, M, N, dt, dev, flags}};
  auto tp = std::make_shared<Template>(run, targs);
  tp->roles.reserve(PyTuple_GET_SIZE(roles));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(roles); ++i) {
    long r = PyLong_AsLong(PyTuple_GET_ITEM(roles, i));
    if (r == -1 && PyErr_Occurred()) return nullptr;
    if (!valid_role(direction, r)) {
      PyErr_Format(PyExc_ValueError, "fastdora native node: bad template role %ld", r);
      return nullptr;
    }
    tp->roles.push_back(static_cast<int>(r));
  }
  tp->n_parts = n_parts;
  tp->n_counters = n_counters;
  tp->tensor_args = tensor_args != 0;
  if (native != Py_None) {
    tp->native = parse_native(direction, native);
    if (!tp->native) return nullptr;
  }
  g_templates[key] = std::move(tp);  // a replaced template lives on while a call still holds it
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// the arguments (norm, bias, scale, eps) at a[0..3] into ex; false with a Python error set
bool parse_extra(PyObject* const* a, Extra& ex) {
  ex.norm = unwrap(a[0]);
  ex.bias = unwrap(a[1]);
  ex.scale = PyFloat_AsDouble(a[2]);
  ex.eps = PyFloat_AsDouble(a[3]);
  return !PyErr_Occurred();
}

// a fast-call entry's argument count is `want`; false with a Python error set
bool n_args(Py_ssize_t n, Py_ssize_t want, const char* fn) {
  if (n == want) return true;
  PyErr_Format(PyExc_TypeError, "fastdora native node: %s takes %zd arguments", fn, want);
  return false;
}

// a Python truth value into `out`; false with a Python error set
bool truth(PyObject* o, bool& out) {
  const int v = PyObject_IsTrue(o);
  out = v > 0;
  return v >= 0;
}

// compose(result, lora, magnitude, norm, bias, scale, eps, out_dtype, discard) -> y (autograd-aware)
PyObject* py_compose(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  Extra ex;
  if (!n_args(n, 9, "compose") || !parse_extra(a + 3, ex) || !truth(a[8], ex.discard)) return nullptr;
  ex.out_dtype = dtype_of(a[7]);
  at::Tensor y = ComposeNode::apply(unwrap(a[0]), unwrap(a[1]), unwrap(a[2]), ex);
  return THPVariable_Wrap(y);
  END_HANDLE_TH_ERRORS
}

// dora_linear(x, weight, bias, lora_a, lora_b, magnitude, norm, scale, eps, discard, dm_from_y) -> y: the whole
// layer (autograd-aware where grad mode is on; an inference call otherwise; bias: the base layer's frozen bias or
// None; dm_from_y: the magnitude's gradient may come from the saved output, see dm_from_output)
PyObject* py_dora_linear(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (!n_args(n, 11, "dora_linear")) return nullptr;
  LinearExtra le;
  le.weight = unwrap(a[1]);
  le.bias = unwrap(a[2]);
  le.norm = unwrap(a[6]);
  le.scale = PyFloat_AsDouble(a[7]);
  le.eps = PyFloat_AsDouble(a[8]);
  if (PyErr_Occurred() || !truth(a[9], le.discard) || !truth(a[10], le.from_y)) return nullptr;
  le.train = at::GradMode::is_enabled();
  const at::Tensor x = unwrap(a[0]);
  ++g_layer;
  at::Tensor y = LinearNode::apply(x, x, unwrap(a[3]), unwrap(a[4]), unwrap(a[5]), le);
  return THPVariable_Wrap(y);
  END_HANDLE_TH_ERRORS
}

// ---------------------------------------------------------------------------------------------- launch programs
//
// A recorded sequence of Triton launches (fastdora._launch.Replay: POET-X's layer segments) launched from C++: per
// step the kernel's function handle, grid, block, shared memory and parameter layout, each pointer parameter a byte
// offset into one of the call's named tensors, every other parameter its recorded bytes -- the bytes Triton's
// launcher passes for the same launch (fastdora._native.native_layout); a step of a kernel compiled for programmatic
// dependent launch (Triton's launch_pdl) is launched as Triton's launcher launches it, with cuLaunchKernelEx and the
// programmatic stream serialization attribute. One call from Python per segment instead of one per launch, no argument
// parsing per launch.

constexpr Py_ssize_t kMaxNamed = 64;
constexpr const char* kProgram = "fastdora.launch_program";

struct ProgramStep {
  uint64_t function = 0;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 0;
  unsigned shared = 0;
  std::vector<int> slot;        // per parameter: the named tensor it points into, or -1 (a constant)
  std::vector<uint64_t> value;  // per parameter: the byte offset into that tensor, or the constant's bytes
  bool pdl = false;             // a programmatic dependent launch
};

struct Program {
  Py_ssize_t n_named = 0;
  std::vector<ProgramStep> steps;
};

void program_free(PyObject* capsule) {
  delete static_cast<Program*>(PyCapsule_GetPointer(capsule, kProgram));
}

// program(n_named, steps) -> capsule; each step (function, (gx, gy, gz), block, shared, slots, values[, pdl])
PyObject* py_program(PyObject*, PyObject* args) {
  Py_ssize_t n_named;
  PyObject* steps;
  if (!PyArg_ParseTuple(args, "nO!", &n_named, &PyTuple_Type, &steps)) return nullptr;
  if (n_named < 1 || n_named > kMaxNamed || PyTuple_GET_SIZE(steps) == 0) {
    PyErr_SetString(PyExc_ValueError, "fastdora launch program: 1 to 64 named tensors and at least one step");
    return nullptr;
  }
  auto prog = std::make_unique<Program>();
  prog->n_named = n_named;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(steps); ++k) {
    ProgramStep st;
    unsigned long long fn;
    PyObject *slots, *values;
    int pdl = 0;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(steps, k), "K(III)IIO!O!|p", &fn, &st.grid[0], &st.grid[1], &st.grid[2],
                          &st.block, &st.shared, &PyTuple_Type, &slots, &PyTuple_Type, &values, &pdl))
      return nullptr;
    st.pdl = pdl != 0;
    const Py_ssize_t n = PyTuple_GET_SIZE(slots);
    if (n != PyTuple_GET_SIZE(values) || n > static_cast<Py_ssize_t>(kMaxParams) || st.block == 0) {
      PyErr_Format(PyExc_ValueError, "fastdora launch program: bad step %zd", k);
      return nullptr;
    }
    st.function = fn;
    for (Py_ssize_t i = 0; i < n; ++i) {
      const long slot = PyLong_AsLong(PyTuple_GET_ITEM(slots, i));
      const unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(values, i));
      if (PyErr_Occurred()) return nullptr;
      if (slot < -1 || slot >= n_named) {
        PyErr_Format(PyExc_ValueError, "fastdora launch program: step %zd parameter %zd names tensor %ld of %zd", k,
                     i, slot, n_named);
        return nullptr;
      }
      st.slot.push_back(static_cast<int>(slot));
      st.value.push_back(v);
    }
    prog->steps.push_back(std::move(st));
  }
  PyObject* capsule = PyCapsule_New(prog.get(), kProgram, program_free);
  if (capsule) prog.release();
  return capsule;
}

// A direct launch can be made here: the recorder (tests), or the CUDA driver with a current context.
bool can_launch_direct() {
  if (g_record) return true;
  void* ctx = nullptr;
  return g_driver.ready() && g_driver.ctx_current(&ctx) == 0 && ctx != nullptr;
}

// Launch a program's steps with `base` its named tensors' data pointers.
void launch_program(const Program& prog, const uint64_t* base, uint64_t stream) {
  uint64_t words[kMaxParams];
  void* params[kMaxParams];
  for (const ProgramStep& st : prog.steps) {
    const size_t np = st.slot.size();
    for (size_t i = 0; i < np; ++i) {
      words[i] = st.slot[i] < 0 ? st.value[i] : base[st.slot[i]] + st.value[i];
      params[i] = &words[i];
    }
    direct_launch(st.function, st.grid, st.block, st.shared, stream, words, params, np, st.pdl);
  }
}

// The arguments (capsule, tuple, stream) of run_program / run_plan: the capsule's object (of kind `kind`), after
// checking that the tuple has `count(object)` items, and the stream; null with a Python error set.
template <class T, class Count>
const T* capsule_call(PyObject* const* a, Py_ssize_t n, const char* fn, const char* kind, Count count,
                      uint64_t& stream) {
  if (!n_args(n, 3, fn)) return nullptr;
  const auto* obj = static_cast<const T*>(PyCapsule_GetPointer(a[0], kind));
  if (!obj) return nullptr;
  const Py_ssize_t want = count(*obj);
  if (!PyTuple_Check(a[1]) || PyTuple_GET_SIZE(a[1]) != want) {
    PyErr_Format(PyExc_ValueError, "fastdora %s: expected a tuple of %zd tensors", fn, want);
    return nullptr;
  }
  stream = PyLong_AsUnsignedLongLong(a[2]);
  return PyErr_Occurred() ? nullptr : obj;
}

// run_program(program, named, stream) -> True, or False where nothing could be launched here (no CUDA driver or no
// current context: the caller launches through Triton's launchers). named: the tensors, in the program's order.
PyObject* py_run_program(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  uint64_t stream = 0;
  const auto* prog = capsule_call<Program>(a, n, "run_program", kProgram,
                                           [](const Program& p) { return p.n_named; }, stream);
  if (!prog) return nullptr;
  if (!can_launch_direct()) Py_RETURN_FALSE;
  uint64_t base[kMaxNamed];
  for (Py_ssize_t i = 0; i < prog->n_named; ++i) {
    PyObject* o = PyTuple_GET_ITEM(a[1], i);
    if (!THPVariable_Check(o)) {
      PyErr_SetString(PyExc_TypeError, "fastdora launch program: named entries must be tensors");
      return nullptr;
    }
    base[i] = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(THPVariable_Unpack(o).data_ptr()));
  }
  launch_program(*prog, base, stream);
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// ------------------------------------------------------------------------------------------------- layer plans
//
// A POET-X layer's forward or backward (fastdora.poetx.replay) as one call: the tensors its segments allocate, its
// segments' launch programs and the GEMMs between them, in the order the Python path runs them, over an array of
// slots (the call's inputs first). Each step is one of
//   ALLOC   (0, out, sizes, dtype): slots[out] = an empty tensor on the inputs' device;
//   PROGRAM (1, program, slots):    the launch program over those slots' tensors (its named tensors, in order);
//   LINEAR  (2, out, a, w):         slots[out] = at::linear(slots[a], slots[w]);
//   MATMUL  (3, out, a, w):         slots[out] = at::matmul(slots[a], slots[w]);
// with autocast excluded (the Python path runs them with autocast off). The Python side builds a plan from the
// tensors of a call that recorded every segment as a program, so the shapes, dtypes and launches are that call's.

constexpr const char* kPlan = "fastdora.layer_plan";
enum PlanCode : int { P_ALLOC = 0, P_PROGRAM = 1, P_LINEAR = 2, P_MATMUL = 3 };

struct PlanStep {
  int code = 0;
  int out = -1;
  std::vector<int> args;         // PROGRAM: its named slots; LINEAR / MATMUL: (a, w)
  std::vector<int64_t> sizes;    // ALLOC
  at::ScalarType dtype = at::kFloat;
  const Program* program = nullptr;
};

struct Plan {
  Py_ssize_t n_inputs = 0, n_slots = 0;
  std::vector<PlanStep> steps;
  std::vector<int> outputs;      // per output its slot, -1: None
  PyObject* programs = nullptr;  // the program capsules, kept alive (owned)
  ~Plan() { Py_XDECREF(programs); }
};

void plan_free(PyObject* capsule) { delete static_cast<Plan*>(PyCapsule_GetPointer(capsule, kPlan)); }

bool slot_ok(long v, Py_ssize_t n) { return v >= 0 && v < n; }

// plan(n_inputs, n_slots, steps, outputs) -> capsule
PyObject* py_plan(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  Py_ssize_t n_inputs, n_slots;
  PyObject *steps, *outputs;
  if (!PyArg_ParseTuple(args, "nnO!O!", &n_inputs, &n_slots, &PyTuple_Type, &steps, &PyTuple_Type, &outputs))
    return nullptr;
  if (n_inputs < 1 || n_slots < n_inputs || n_slots > kMaxNamed) {
    PyErr_SetString(PyExc_ValueError, "fastdora layer plan: 1 <= inputs <= slots <= 64");
    return nullptr;
  }
  auto plan = std::make_unique<Plan>();
  plan->n_inputs = n_inputs;
  plan->n_slots = n_slots;
  plan->programs = PyList_New(0);
  if (!plan->programs) return nullptr;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(steps); ++k) {
    PyObject* st = PyTuple_GET_ITEM(steps, k);
    if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) < 2) {
      PyErr_Format(PyExc_ValueError, "fastdora layer plan: bad step %zd", k);
      return nullptr;
    }
    PlanStep ps;
    ps.code = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(st, 0)));
    if (PyErr_Occurred()) return nullptr;
    bool ok = false;
    if (ps.code == P_ALLOC && PyTuple_GET_SIZE(st) == 4 && PyTuple_Check(PyTuple_GET_ITEM(st, 2))) {
      ps.out = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(st, 1)));
      PyObject* sizes = PyTuple_GET_ITEM(st, 2);
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sizes); ++i) ps.sizes.push_back(PyLong_AsLongLong(
          PyTuple_GET_ITEM(sizes, i)));
      ps.dtype = dtype_of(PyTuple_GET_ITEM(st, 3));
      ok = !PyErr_Occurred() && slot_ok(ps.out, n_slots) && ps.out >= n_inputs;
    } else if (ps.code == P_PROGRAM && PyTuple_GET_SIZE(st) == 3 && PyTuple_Check(PyTuple_GET_ITEM(st, 2))) {
      PyObject* cap = PyTuple_GET_ITEM(st, 1);
      ps.program = static_cast<const Program*>(PyCapsule_GetPointer(cap, kProgram));
      if (!ps.program || PyList_Append(plan->programs, cap) < 0) return nullptr;
      PyObject* slots = PyTuple_GET_ITEM(st, 2);
      ok = PyTuple_GET_SIZE(slots) == ps.program->n_named;
      for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(slots); ++i) {
        const long v = PyLong_AsLong(PyTuple_GET_ITEM(slots, i));
        ok = !PyErr_Occurred() && slot_ok(v, n_slots);
        ps.args.push_back(static_cast<int>(v));
      }
    } else if ((ps.code == P_LINEAR || ps.code == P_MATMUL) && PyTuple_GET_SIZE(st) == 4) {
      ps.out = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(st, 1)));
      const long a = PyLong_AsLong(PyTuple_GET_ITEM(st, 2)), w = PyLong_AsLong(PyTuple_GET_ITEM(st, 3));
      ps.args = {static_cast<int>(a), static_cast<int>(w)};
      ok = !PyErr_Occurred() && slot_ok(ps.out, n_slots) && ps.out >= n_inputs && slot_ok(a, n_slots) &&
           slot_ok(w, n_slots);
    }
    if (!ok) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "fastdora layer plan: bad step %zd", k);
      return nullptr;
    }
    plan->steps.push_back(std::move(ps));
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(outputs); ++i) {
    const long v = PyLong_AsLong(PyTuple_GET_ITEM(outputs, i));
    if (PyErr_Occurred()) return nullptr;
    if (v != -1 && !slot_ok(v, n_slots)) {
      PyErr_Format(PyExc_ValueError, "fastdora layer plan: output %zd names slot %ld", i, v);
      return nullptr;
    }
    plan->outputs.push_back(static_cast<int>(v));
  }
  PyObject* capsule = PyCapsule_New(plan.get(), kPlan, plan_free);
  if (capsule) plan.release();
  return capsule;
  END_HANDLE_TH_ERRORS
}

// Run a plan on `inputs` (its n_inputs tensors, undefined for None; the first defined, on the plan's device) and
// return its outputs (undefined for a -1 output). The caller checked can_launch_direct().
std::vector<at::Tensor> execute_plan(const Plan& plan, const at::Tensor* inputs, uint64_t stream) {
  at::Tensor slots[kMaxNamed];
  for (Py_ssize_t i = 0; i < plan.n_inputs; ++i) slots[i] = inputs[i];
  TORCH_CHECK(slots[0].defined(), "fastdora layer plan: the first input must be a tensor");
  const at::TensorOptions on = slots[0].options();
  c10::OptionalDeviceGuard guard;
  if (slots[0].is_cuda()) guard.reset_device(slots[0].device());
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  uint64_t base[kMaxNamed];
  for (const PlanStep& st : plan.steps) {
    switch (st.code) {
      case P_ALLOC:
        slots[st.out] = at::empty(st.sizes, on.dtype(st.dtype));
        break;
      case P_LINEAR:
        slots[st.out] = at::linear(slots[st.args[0]], slots[st.args[1]]);
        break;
      case P_MATMUL:
        slots[st.out] = at::matmul(slots[st.args[0]], slots[st.args[1]]);
        break;
      default:
        for (size_t i = 0; i < st.args.size(); ++i) {
          const at::Tensor& t = slots[st.args[i]];
          TORCH_CHECK(t.defined(), "fastdora layer plan: a program's tensor slot ", st.args[i], " is empty");
          base[i] = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()));
        }
        launch_program(*st.program, base, stream);
    }
  }
  std::vector<at::Tensor> out;
  out.reserve(plan.outputs.size());
  for (int slot : plan.outputs) out.push_back(slot < 0 ? at::Tensor() : slots[slot]);
  return out;
}

// run_plan(plan, inputs, stream) -> the outputs (a tuple, None for a -1 output), or None where nothing could be
// launched here (no CUDA driver or no current context: the caller runs its Python path). inputs: tensors or None,
// the first a tensor on the device the plan allocates on. Needs the GIL.
PyObject* py_run_plan(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  uint64_t stream = 0;
  const auto* plan = capsule_call<Plan>(a, n, "run_plan", kPlan, [](const Plan& p) { return p.n_inputs; }, stream);
  if (!plan) return nullptr;
  if (!can_launch_direct()) Py_RETURN_NONE;
  at::Tensor inputs[kMaxNamed];
  for (Py_ssize_t i = 0; i < plan->n_inputs; ++i) inputs[i] = unwrap(PyTuple_GET_ITEM(a[1], i));
  const std::vector<at::Tensor> outs = execute_plan(*plan, inputs, stream);
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(outs.size()));
  if (!out) return nullptr;
  for (size_t i = 0; i < outs.size(); ++i) {
    PyObject* v = wrap(outs[i]);
    if (!v) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
  }
  return out;
  END_HANDLE_TH_ERRORS
}

// ------------------------------------------------------------------------------------------ POET-X layer node
//
// The autograd node of a POET-X layer call whose forward has a layer plan (fastdora.poetx.replay decides): the
// forward runs that plan; the backward runs the backward plan registered under the node's id (poetx_set_plan) where
// one is and the call allows it (both Q need gradients, no double backward, gy aligned, no Triton launch hook), and
// otherwise the Python backward (poetx_configure's `backward`, the Python node's own), which records the backward's
// segments and registers its plan. Saved and returned tensors are those of the Python node (fastdora.poetx.ops.
// _PoetXLayer): the same launches, so the same results bit for bit.

auto& g_poetx_plans = *new std::unordered_map<int64_t, PyObject*>();  // id -> backward plan capsule (owned)
PyObject* g_poetx_backward = nullptr;  // (gy, x2, xp, up, g, weight, q_in, q_out, perm_in, perm_out, inv_in, b, k,
                                       //  need_x, need_q_in, need_q_out) -> (grad_x2, grad_q_in, grad_q_out)
PyObject* g_poetx_hooks = nullptr;     // () -> bool: Triton launch hooks are set
int64_t g_poetx_calls = 0, g_poetx_planned_bwd = 0;

struct PoetXArgs {
  at::Tensor weight, perm_in, perm_out, inv_in, inv_out, rows, cols;
  const Plan* forward = nullptr;
  int64_t id = 0, block = 0, terms = 0;
  bool save = true;  // "fast": keep xp, up and the blocks; "mem": the input
};

struct PoetXNode : public torch::autograd::Function<PoetXNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& q_in, const at::Tensor& q_out,
                            const PoetXArgs& pa) {
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    const at::Tensor inputs[6] = {x2, pa.weight, q_in, q_out, pa.perm_in, pa.inv_out};
    const std::vector<at::Tensor> o = execute_plan(*pa.forward, inputs, stream_of(x2));  // xp, up, y, g
    if (pa.save) {
      ctx->save_for_backward({at::Tensor(), o[0], o[1], o[3], pa.weight, q_in, q_out, pa.perm_in, pa.perm_out,
                              pa.inv_in});
    } else {
      ctx->save_for_backward({x, at::Tensor(), at::Tensor(), at::Tensor(), pa.weight, q_in, q_out, pa.perm_in,
                              pa.perm_out, pa.inv_in});
    }
    ctx->saved_data["rows"] = pa.rows;
    ctx->saved_data["cols"] = pa.cols;
    ctx->saved_data["id"] = pa.id;
    ctx->saved_data["b"] = pa.block;
    ctx->saved_data["k"] = pa.terms;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = pa.weight.size(0);
    return o[2].view(sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    GIL gil;
    const variable_list sv = ctx->get_saved_variables();
    const at::Tensor &x = sv[0], &weight = sv[4], &q_in = sv[5], &q_out = sv[6];
    const bool need_x = ctx->needs_input_grad(0), need_qi = ctx->needs_input_grad(1),
               need_qo = ctx->needs_input_grad(2);
    const at::Tensor gy = grads[0].reshape({-1, weight.size(0)}).contiguous();
    const at::Tensor x2 = x.defined() ? x.reshape({-1, x.size(-1)}) : at::Tensor();
    const at::Tensor rows = ctx->saved_data["rows"].toTensor(), cols = ctx->saved_data["cols"].toTensor();
    const int64_t id = ctx->saved_data["id"].toInt();
    std::vector<at::Tensor> g3;
    PyObject* capsule = nullptr;
    if (need_qi && need_qo && !at::GradMode::is_enabled() && aligned(gy) && (!x2.defined() || x2.is_contiguous())) {
      auto it = g_poetx_plans.find(id * 2 + (need_x ? 1 : 0));
      if (it != g_poetx_plans.end() && can_launch_direct() && !call_bool(g_poetx_hooks)) capsule = it->second;
    }
    if (capsule) {
      Py_INCREF(capsule);  // kept while it runs (a re-registration may replace it)
      const auto* plan = static_cast<const Plan*>(PyCapsule_GetPointer(capsule, kPlan));
      const at::Tensor inputs[13] = {gy, x2, sv[1], sv[2], sv[3], weight, q_in, q_out, sv[7], sv[8], sv[9], rows,
                                     cols};
      try {
        g3 = execute_plan(*plan, inputs, stream_of(gy));
      } catch (...) {
        Py_DECREF(capsule);
        throw;
      }
      Py_DECREF(capsule);
      ++g_poetx_planned_bwd;
    } else {
      PyObject* r = PyObject_CallFunction(
          g_poetx_backward, "NNNNNNNNNNNLLOOO", wrap(gy), wrap(x2), wrap(sv[1]), wrap(sv[2]), wrap(sv[3]),
          wrap(weight), wrap(q_in), wrap(q_out), wrap(sv[7]), wrap(sv[8]), wrap(sv[9]),
          static_cast<long long>(ctx->saved_data["b"].toInt()), static_cast<long long>(ctx->saved_data["k"].toInt()),
          need_x ? Py_True : Py_False, need_qi ? Py_True : Py_False, need_qo ? Py_True : Py_False);
      g3 = fallback_result(r, 3, "the POET-X backward");
    }
    at::Tensor grad_x;
    if (need_x && g3[0].defined()) grad_x = g3[0].view(ctx->saved_data["x_sizes"].toIntVector());
    return {grad_x, need_qi ? g3[1] : at::Tensor(), need_qo ? g3[2] : at::Tensor(), at::Tensor()};
  }
};

// poetx_configure(backward, hooks_active)
PyObject* py_poetx_configure(PyObject*, PyObject* args) {
  PyObject *b, *h;
  if (!PyArg_ParseTuple(args, "OO", &b, &h)) return nullptr;
  Py_INCREF(b);
  Py_INCREF(h);
  Py_XDECREF(g_poetx_backward);
  Py_XDECREF(g_poetx_hooks);
  g_poetx_backward = b;
  g_poetx_hooks = h;
  Py_RETURN_NONE;
}

// poetx_set_plan(id, need_x, plan capsule or None): the backward plan of the nodes with that id
PyObject* py_poetx_set_plan(PyObject*, PyObject* args) {
  long long id;
  int need_x;
  PyObject* cap;
  if (!PyArg_ParseTuple(args, "LpO", &id, &need_x, &cap)) return nullptr;
  if (cap != Py_None && !PyCapsule_IsValid(cap, kPlan)) {
    PyErr_SetString(PyExc_TypeError, "fastdora POET-X node: expected a layer plan or None");
    return nullptr;
  }
  const int64_t key = id * 2 + (need_x ? 1 : 0);
  auto it = g_poetx_plans.find(key);
  if (it != g_poetx_plans.end()) {
    Py_DECREF(it->second);
    g_poetx_plans.erase(it);
  }
  if (cap != Py_None) {
    Py_INCREF(cap);
    g_poetx_plans[key] = cap;
  }
  Py_RETURN_NONE;
}

PyObject* py_poetx_clear(PyObject*, PyObject*) {
  for (auto& kv : g_poetx_plans) Py_DECREF(kv.second);
  g_poetx_plans.clear();
  Py_RETURN_NONE;
}

PyObject* py_poetx_stats(PyObject*, PyObject*) {
  return Py_BuildValue("{s:L,s:L,s:n}", "calls", static_cast<long long>(g_poetx_calls), "planned_backward",
                       static_cast<long long>(g_poetx_planned_bwd), "backward_plans",
                       static_cast<Py_ssize_t>(g_poetx_plans.size()));
}

// poetx_layer(x, q_in, q_out, weight, perm_in, perm_out, inv_in, inv_out, rows, cols, forward_plan, id, block,
//             terms, save) -> y (autograd-aware; called under grad mode with x's rows contiguous), or None where
// nothing can be launched on this thread (the caller runs the Python node)
PyObject* py_poetx_layer(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (!n_args(n, 15, "poetx_layer")) return nullptr;
  if (!g_poetx_backward) {
    PyErr_SetString(PyExc_RuntimeError, "fastdora POET-X node: poetx_configure was not called");
    return nullptr;
  }
  PoetXArgs pa;
  at::Tensor* tensors[7] = {&pa.weight, &pa.perm_in, &pa.perm_out, &pa.inv_in, &pa.inv_out, &pa.rows, &pa.cols};
  for (int i = 0; i < 7; ++i) *tensors[i] = unwrap(a[3 + i]);
  pa.forward = static_cast<const Plan*>(PyCapsule_GetPointer(a[10], kPlan));
  if (!pa.forward) return nullptr;
  pa.id = PyLong_AsLongLong(a[11]);
  pa.block = PyLong_AsLongLong(a[12]);
  pa.terms = PyLong_AsLongLong(a[13]);
  if (PyErr_Occurred() || !truth(a[14], pa.save)) return nullptr;
  if (pa.forward->n_inputs != 6 || pa.forward->outputs.size() != 4) {
    PyErr_SetString(PyExc_ValueError, "fastdora POET-X node: not a forward plan (6 inputs, 4 outputs)");
    return nullptr;
  }
  if (!can_launch_direct()) Py_RETURN_NONE;  // no CUDA context on this thread: the Python node
  ++g_poetx_calls;
  at::Tensor y = PoetXNode::apply(unwrap(a[0]), unwrap(a[1]), unwrap(a[2]), pa);
  return THPVariable_Wrap(y);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"configure", py_configure, METH_VARARGS,
     "configure(slow_fwd, slow_bwd, capturing, hooks_active, counters)"},
    {"register", py_register, METH_VARARGS, "register a launch template"},
    {"clear", py_clear, METH_NOARGS, "drop every template and reset the counters"},
    {"load_driver", py_load_driver, METH_NOARGS, "open the CUDA driver for direct launches: None, or why not"},
    {"set_native_launch", py_set_native_launch, METH_O, "direct launches on (True) or off (False)"},
    {"testing_record_native", py_record_native, METH_O,
     "tests only: record direct launches into a list instead of launching (None: launch)"},
    {"testing_host_templates", py_host_templates, METH_O,
     "tests only: let compiled-launcher templates serve CPU tensors (to check their argument layout)"},
    {"stats", py_stats, METH_NOARGS, "{'fast': launches through templates, 'slow': through Python, 'templates'}"},
    {"compose", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_compose)), METH_FASTCALL,
     "compose(result, lora, magnitude, norm, bias, scale, eps, out_dtype, discard) -> y"},
    {"dora_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_dora_linear)), METH_FASTCALL,
     "dora_linear(x, weight, bias, lora_a, lora_b, magnitude, norm, scale, eps, discard, dm_from_y) -> y"},
    {"program", py_program, METH_VARARGS, "program(n_named, steps) -> a launch program (capsule)"},
    {"run_program", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_run_program)), METH_FASTCALL,
     "run_program(program, named, stream) -> True, or False where nothing could be launched here"},
    {"plan", py_plan, METH_VARARGS, "plan(n_inputs, n_slots, steps, outputs) -> a layer plan (capsule)"},
    {"poetx_configure", py_poetx_configure, METH_VARARGS, "poetx_configure(backward, hooks_active)"},
    {"poetx_set_plan", py_poetx_set_plan, METH_VARARGS, "poetx_set_plan(id, need_x, backward plan or None)"},
    {"poetx_clear", py_poetx_clear, METH_NOARGS, "drop every registered POET-X backward plan"},
    {"poetx_stats", py_poetx_stats, METH_NOARGS, "{'calls', 'planned_backward', 'backward_plans'}"},
    {"poetx_layer", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_poetx_layer)), METH_FASTCALL,
     "poetx_layer(x, q_in, q_out, weight, perm_in, perm_out, inv_in, inv_out, rows, cols, forward_plan, id, block, "
     "terms, save) -> y"},
    {"run_plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_run_plan)), METH_FASTCALL,
     "run_plan(plan, inputs, stream) -> the outputs, or None where nothing could be launched here"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "fastdora_compose_node", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_fastdora_compose_node(void) { return PyModule_Create(&module_def); }
