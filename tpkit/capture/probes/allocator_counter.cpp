// tpkit's CPU allocation counter: a CPU allocator that wraps the one it finds installed and
// writes (address, bytes) of every allocation (bytes > 0) and free (bytes < 0) made by one
// thread into an in-memory list while recording. What it replaces and why:
// tpkit/capture/probes/allocator_counter.py and docs/OVERHEAD.md ("A counting allocator").
// It also keeps the memory probe's phase boundaries and markers while the counter records
// (docs/OVERHEAD.md, "Boundaries noted in C++").
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>

#include <pthread.h>
#include <sys/mman.h>
#include <time.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace {

// While a thread records, each block it allocates gets a header in front of the bytes handed
// out: the wrapped block's own deleter and context, the requested size (a free finds it
// without a lookup), and two check words at its end that say "this block is the counter's" to
// a raw free (``raw_delete``). The header is 64 bytes, so the default allocator's 64-byte
// alignment holds; a block whose handed-out address would start a page gets 64 bytes more, so
// that reading the check words of any address a raw free is given never leaves its page.
constexpr size_t kHeaderBytes = 64;
constexpr size_t kPageBytes = 4096;
constexpr uint64_t kMagic = 0xC7A1C0DE5EE5B10CULL;  // an absurd size to glibc: never a chunk header
constexpr uint64_t kCheck = 0x9E3779B97F4A7C15ULL;
struct Header {
  c10::DeleterFnPtr inner_delete;
  void* inner_context;
  size_t bytes;
  uint64_t session;  // the recording session it was made in
  char unused[kHeaderBytes - 6 * sizeof(uint64_t)];
  uint64_t check;  // the handed-out address ^ kCheck
  uint64_t magic;  // kMagic (the last word: where glibc keeps a chunk's size for its own blocks)
};
static_assert(sizeof(Header) == kHeaderBytes, "the header is 64 bytes");

// The events' memory comes straight from the kernel, its pages made present when it is taken
// (MAP_POPULATE): a list growing into fresh memory inside the loop's steps faults at each new
// page (2-4 us a page on a 2-core VM: 3-6 a step of a 2-layer GPT-2's, 0.1-0.4% of its step:
// docs/OVERHEAD.md, "Instructions, caches and pages"), and a block of glibc's this large, freed at
// the slice's end, would have raised glibc's mmap threshold for the rest of the loop's process.
template <typename T>
struct PagesAllocator {
  using value_type = T;
  PagesAllocator() = default;
  template <typename U>
  PagesAllocator(const PagesAllocator<U>&) {}
  static size_t rounded(size_t n) { return (n * sizeof(T) + kPageBytes - 1) & ~(kPageBytes - 1); }
  T* allocate(size_t n) {
    int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MAP_POPULATE
    flags |= MAP_POPULATE;
#endif
    void* p = mmap(nullptr, rounded(n), PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED) {
      throw std::bad_alloc();
    }
#ifdef MADV_DONTFORK
    // A process forked while the list is held (a DataLoader's workers, started at each epoch
    // inside a slice) does not get it: its pages had been shared copy-on-write with the child,
    // and each the loop's thread wrote next faulted again. (The child drops its list: after_fork.)
    madvise(p, rounded(n), MADV_DONTFORK);
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) { munmap(p, rounded(n)); }
  template <typename U>
  bool operator==(const PagesAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const PagesAllocator<U>&) const { return false; }
};
using EventList = std::vector<int64_t, PagesAllocator<int64_t>>;
// Values the list has room for from each start: 8 MiB, 524,288 events (~650 steps of a 2-layer
// GPT-2's ~800; past them it grows as a vector does, each new block's pages made present at once).
constexpr size_t kReservedValues = size_t{1} << 20;

std::mutex events_mutex;
EventList events;                       // address, bytes, address, bytes, ... in order
std::atomic<uint64_t> recording{0};     // the recording session's number; 0: none
uint64_t sessions = 0;                  // sessions started so far
thread_local uint64_t thread_session = 0;  // the session this thread records for
c10::Allocator* inner = nullptr;        // the allocator found installed when ours went in

// The memory probe's notes (see "the memory probe's markers and boundaries" below).
std::vector<int64_t> markers;  // kind, index, kind, index, ...
int64_t marker_base = 1;
int64_t marker_sizes = 1;
struct Boundary {
  PyObject* phase;
  PyObject* event;
  int64_t raw_step;
  int64_t t_ns;
};
std::vector<Boundary> boundaries;
int64_t boundary_kind = 0;              // the probe's kind of marker for a boundary
PyObject* models = nullptr;             // the recorder's dict of models
PyObject* cuda_in_use = nullptr;        // the probe's set of CUDA devices in use
PyObject* at_boundary = nullptr;        // at_boundary(phase, event, raw_step, k, looks)
PyObject* look_after = nullptr;
PyObject* look_at = nullptr;            // a tuple of phase names
PyObject* enter_name = nullptr;
Py_ssize_t models_seen = 0;
bool look_armed = false;  // a look_after phase exited since the last look
// The looks the probe lets ``boundary`` answer itself (``skip_looks``): how many more, how many
// it answered since the probe's last look, and what must not have changed for each.
int64_t looks_to_skip = 0;
int64_t looks_skipped = 0;
// Flat tuples, so that the probe makes two objects the collector tracks a look, not one a
// parameter (150 pairs a look at 12 layers had started young collections inside the steps):
PyObject* sizes_watched = nullptr;       // container, its size, container, its size, ...
PyObject* optimizers_watched = nullptr;  // weakref to an optimizer, len(state), len(param_groups), ...
PyObject* params_watched = nullptr;      // weakrefs to the CPU parameters
PyObject* requires_grad_watched = nullptr;  // each one's requires_grad (True or False), in order
PyObject* state_name = nullptr;
PyObject* groups_name = nullptr;
PyObject* requires_grad_name = nullptr;

inline bool this_thread_records() {
  const uint64_t s = recording.load(std::memory_order_relaxed);
  return s != 0 && s == thread_session;
}

inline void record(void* ptr, int64_t bytes) {
  std::lock_guard<std::mutex> guard(events_mutex);  // seldom contended: see counted_delete
  events.push_back(reinterpret_cast<int64_t>(ptr));
  events.push_back(bytes);
}

inline Header* header_of(void* data) {
  return reinterpret_cast<Header*>(static_cast<char*>(data) - kHeaderBytes);
}

// A block the recording thread made in this session is recorded freed by whichever thread frees
// it: gloo frees FSDP2's collective buffers on its own threads, and without their frees the
// replay kept them alive (temporaries grew by ~300 KB a step, a 2-rank FSDP2 peak by 2 MB).
void counted_delete(void* data) {
  Header* header = header_of(data);
  const uint64_t session = recording.load(std::memory_order_relaxed);
  if (this_thread_records() || (session != 0 && header->session == session)) {
    record(data, -static_cast<int64_t>(header->bytes));
  }
  header->magic = 0;  // a block made later at this address is not taken for the counter's
  header->check = 0;
  header->inner_delete(header->inner_context);
}

// What Allocator::raw_deallocate calls: it looks the CPU allocator up at the free, so it gets
// blocks made before the counter went in (and oneDNN's, made through raw_allocate) as well as
// the counter's own. The check words tell them apart; an address at the start of a page is
// never the counter's (see above), and for any other the words lie in its own page.
void raw_delete(void* data) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  if (data != nullptr && address % kPageBytes != 0) {
    const Header* header = header_of(data);
    if (header->magic == kMagic && header->check == (address ^ kCheck)) {
      counted_delete(data);
      return;
    }
  }
  inner->raw_deleter()(data);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    if (bytes == 0 || !this_thread_records()) {
      return inner->allocate(bytes);  // as if the counter were not there (torch's reporter
      // leaves empty blocks out too)
    }
    c10::DataPtr block = inner->allocate(bytes + 2 * kHeaderBytes);
    char* base = static_cast<char*>(block.get());
    char* data = base + kHeaderBytes;
    if (reinterpret_cast<uintptr_t>(data) % kPageBytes == 0) {
      data += kHeaderBytes;
    }
    Header* header = header_of(data);
    header->inner_delete = block.get_deleter();
    header->bytes = bytes;
    header->session = thread_session;
    header->inner_context = block.release_context();
    header->check = reinterpret_cast<uintptr_t>(data) ^ kCheck;
    header->magic = kMagic;
    record(data, static_cast<int64_t>(bytes));
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator counting;

// A process forked while a thread records (a DataLoader's workers, started by the loop inside
// a slice) holds a copy of that thread, whose session would match: the child records nothing,
// and drops the copy of the list. Only the forking thread lives on in the child, so the lock
// is made anew (another thread may have held it at the fork).
void after_fork_in_child() {
  recording.store(0, std::memory_order_relaxed);
  thread_session = 0;
  new (&events_mutex) std::mutex();
  EventList().swap(events);
  // the probe's notes belong to the parent: dropped here without their references (touching
  // Python objects is not safe in a fork's child; the counts stay one too high, harmlessly)
  new (&boundaries) std::vector<Boundary>();
  new (&markers) std::vector<int64_t>();
  models = cuda_in_use = at_boundary = look_after = look_at = nullptr;
  sizes_watched = optimizers_watched = params_watched = requires_grad_watched = nullptr;
  looks_to_skip = looks_skipped = 0;
}

// Put the counter in front of the CPU allocator installed now, for the rest of the process: it
// passes every call straight through while no thread records. It is never taken out, because a
// block made through raw_allocate while it was in (oneDNN's) is freed by looking the CPU
// allocator up again, and the one underneath would be handed an address it never gave out.
// False when another allocator was installed with a priority above torch's default (ours would
// not take its place).
bool install() {
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &counting) {
    return true;
  }
  static const bool fork_handled = pthread_atfork(nullptr, nullptr, &after_fork_in_child) == 0;
  (void)fork_handled;
  inner = current;
  c10::SetCPUAllocator(&counting, 0);
  return c10::GetCPUAllocator() == &counting;
}

bool installed() { return c10::GetCPUAllocator() == &counting; }

// Whether some thread records now (a slice that ended must leave it false).
bool any_recording() { return recording.load(std::memory_order_relaxed) != 0; }

// The counter's address, for torch.UntypedStorage(..., allocator=): storages made from Python
// go to torch's default allocator directly unless given one.
int64_t address() { return reinterpret_cast<int64_t>(static_cast<c10::Allocator*>(&counting)); }

// Record the calling thread's allocations and frees from now on (a new session: a thread
// recording for an earlier one stops).
void start() {
  std::lock_guard<std::mutex> guard(events_mutex);
  events.clear();
  events.reserve(kReservedValues);
  thread_session = ++sessions;
  recording.store(sessions, std::memory_order_relaxed);
}

// -- the memory probe's markers and boundaries --------------------------------------------------
// A marker is an event of tpkit's own in the list where it stands now: an odd address no block
// has (blocks are 64-byte aligned) and an odd size, so that a boundary costs no allocation and no
// free (docs/OVERHEAD.md, "Markers written, not freed"). The n-th marker of a session is at
// address 2n + 1 with the size marker_base + 2 (n % marker_sizes), freed; what it marks (a kind
// and an index of the probe's) is kept beside the list, in order.

inline int64_t marker_address(int64_t n) { return 2 * n + 1; }
inline int64_t marker_bytes(int64_t n) { return marker_base + 2 * (n % marker_sizes); }

// Write the next marker if this thread records; false (nothing written) if it does not.
bool write_marker(int64_t kind, int64_t index) {
  if (!this_thread_records()) {
    return false;
  }
  const auto n = static_cast<int64_t>(markers.size() / 2);
  markers.push_back(kind);
  markers.push_back(index);
  record(reinterpret_cast<void*>(marker_address(n)), -marker_bytes(n));
  return true;
}

// The probe's phase boundaries: (phase, event, raw step, time) of each, in order, noted by
// ``boundary``, the recorder's phase listener while the counter records. Written in Python that
// listener took 4-6 us a boundary inside real steps (a dozen attribute reads on caches the step
// had just cooled); here it is one call that notes the boundary and writes its marker. The
// probe's Python (``at_boundary``) is called only where it has more to do: the first enter of a
// ``look_at`` phase after an exit of ``look_after`` (the probe looks at the gradients then), a
// model it has not seen, a CUDA device in use, or a boundary the counter does not record (another
// thread's, or after a torch profiler took the counter over). Called with the GIL held, as all
// of these are (the lists are only touched from Python).

// The same clock as Python's time.perf_counter_ns on Linux.
inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Two names alike (the recorder's are interned literals: the identity answers first).
inline bool same_name(PyObject* a, PyObject* b) {
  if (a == b) {
    return true;
  }
  if (!PyUnicode_Check(a) || !PyUnicode_Check(b)) {
    return false;
  }
  return PyUnicode_Compare(a, b) == 0;
}

inline bool is_look_at(PyObject* phase) {
  const Py_ssize_t n = PyTuple_GET_SIZE(look_at);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (same_name(phase, PyTuple_GET_ITEM(look_at, i))) {
      return true;
    }
  }
  return false;
}

inline void set_ref(PyObject*& slot, PyObject* value) {
  Py_XINCREF(value);
  Py_XDECREF(slot);
  slot = value;
}

void clear_boundaries() {
  for (const Boundary& b : boundaries) {
    Py_DECREF(b.phase);
    Py_DECREF(b.event);
  }
  boundaries.clear();
}

// From now on ``boundary`` notes the probe's boundaries and calls ``at_boundary`` where it must;
// markers and boundaries start anew.
void listen(pybind11::handle models_dict, pybind11::handle cuda_set, pybind11::handle callback,
            pybind11::handle after, pybind11::tuple at, int64_t kind, int64_t base, int64_t sizes) {
  if (!PyDict_Check(models_dict.ptr()) || !PySet_Check(cuda_set.ptr()) || sizes < 1) {
    throw pybind11::type_error("listen(models: dict, cuda_in_use: set, at_boundary, look_after, look_at, "
                               "boundary_kind, marker_base, marker_sizes >= 1)");
  }
  clear_boundaries();
  markers.clear();
  boundary_kind = kind;
  marker_base = base;
  marker_sizes = sizes;
  set_ref(models, models_dict.ptr());
  set_ref(cuda_in_use, cuda_set.ptr());
  set_ref(at_boundary, callback.ptr());
  set_ref(look_after, after.ptr());
  set_ref(look_at, at.ptr());
  if (enter_name == nullptr) {
    enter_name = PyUnicode_InternFromString("enter");
  }
  models_seen = PyDict_Size(models);
  look_armed = false;
  looks_to_skip = looks_skipped = 0;
  set_ref(sizes_watched, nullptr);
  set_ref(optimizers_watched, nullptr);
  set_ref(params_watched, nullptr);
  set_ref(requires_grad_watched, nullptr);
}

// Stop calling the probe (its objects are let go); what was noted stays until the next listen.
void unlisten() {
  set_ref(models, nullptr);
  set_ref(cuda_in_use, nullptr);
  set_ref(at_boundary, nullptr);
  set_ref(look_after, nullptr);
  set_ref(look_at, nullptr);
  set_ref(sizes_watched, nullptr);
  set_ref(optimizers_watched, nullptr);
  set_ref(params_watched, nullptr);
  set_ref(requires_grad_watched, nullptr);
  looks_to_skip = looks_skipped = 0;
}

// ``skip_looks(count, sizes, optimizers, params, requires_grad)``, called by the probe after a
// look at the gradients where the next ``count`` looks would do nothing but count themselves as
// long as nothing it reads changed (``MemoryProbe._let_counter_answer``): ``boundary`` answers those
// itself while every container in ``sizes`` keeps its size, every optimizer its numbers of states
// and groups, and every parameter its ``requires_grad``; at the first that changed it calls the
// probe, whose look decides as it always did. The probe's next look learns how many it answered.
// The look took 16-27 us a step inside a 2-layer GPT-2's steps, most of it the cold caches of the
// objects it reads (docs/OVERHEAD.md, "Looks the counter answers").
void skip_looks(int64_t count, pybind11::tuple sizes, pybind11::tuple optimizers, pybind11::tuple params,
                pybind11::tuple requires_grad) {
  if (at_boundary == nullptr) {
    return;  // not listening: nothing to answer, nothing to hold
  }
  if (PyTuple_GET_SIZE(sizes.ptr()) % 2 != 0 || PyTuple_GET_SIZE(optimizers.ptr()) % 3 != 0 ||
      PyTuple_GET_SIZE(params.ptr()) != PyTuple_GET_SIZE(requires_grad.ptr())) {
    throw pybind11::value_error("skip_looks(count, (container, size, ...), (weakref, states, groups, ...), "
                                "(weakref, ...), (requires_grad, ...) as many as the weakrefs)");
  }
  if (state_name == nullptr) {
    state_name = PyUnicode_InternFromString("state");
    groups_name = PyUnicode_InternFromString("param_groups");
    requires_grad_name = PyUnicode_InternFromString("requires_grad");
  }
  set_ref(sizes_watched, sizes.ptr());
  set_ref(optimizers_watched, optimizers.ptr());
  set_ref(params_watched, params.ptr());
  set_ref(requires_grad_watched, requires_grad.ptr());
  looks_to_skip = count;
}

// The size of ``owner``'s attribute ``name``, or -1 (the probe looks then).
Py_ssize_t attribute_size(PyObject* owner, PyObject* name) {
  PyObject* value = PyObject_GetAttr(owner, name);
  if (value == nullptr) {
    PyErr_Clear();
    return -1;
  }
  const Py_ssize_t n = PyObject_Size(value);
  Py_DECREF(value);
  if (n < 0) {
    PyErr_Clear();
  }
  return n;
}

// A new reference to what a weakref refers to, or nullptr where it died (or is no weakref).
PyObject* referent(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(ref, &obj) < 0) {
    PyErr_Clear();
    return nullptr;
  }
  return obj;
#else
  PyObject* obj = PyWeakref_GetObject(ref);  // borrowed; None when dead
  if (obj == nullptr || obj == Py_None) {
    PyErr_Clear();
    return nullptr;
  }
  Py_INCREF(obj);
  return obj;
#endif
}

// Whether everything ``skip_looks`` was given is as it was (an error reads as a change).
bool nothing_changed() {
  if (sizes_watched == nullptr || optimizers_watched == nullptr || params_watched == nullptr ||
      requires_grad_watched == nullptr) {
    return false;
  }
  for (Py_ssize_t i = 0; i + 1 < PyTuple_GET_SIZE(sizes_watched); i += 2) {
    const Py_ssize_t n = PyObject_Size(PyTuple_GET_ITEM(sizes_watched, i));
    if (n < 0) {
      PyErr_Clear();
      return false;
    }
    if (n != PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes_watched, i + 1))) {
      return false;
    }
  }
  for (Py_ssize_t i = 0; i + 2 < PyTuple_GET_SIZE(optimizers_watched); i += 3) {
    PyObject* opt = referent(PyTuple_GET_ITEM(optimizers_watched, i));
    if (opt == nullptr) {
      return false;  // it died
    }
    const bool same =
        attribute_size(opt, state_name) == PyLong_AsSsize_t(PyTuple_GET_ITEM(optimizers_watched, i + 1)) &&
        attribute_size(opt, groups_name) == PyLong_AsSsize_t(PyTuple_GET_ITEM(optimizers_watched, i + 2));
    Py_DECREF(opt);
    if (!same) {
      return false;
    }
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(params_watched); ++i) {
    PyObject* param = referent(PyTuple_GET_ITEM(params_watched, i));
    if (param == nullptr) {
      return false;  // it died
    }
    PyObject* now = PyObject_GetAttr(param, requires_grad_name);
    Py_DECREF(param);
    if (now == nullptr) {
      PyErr_Clear();
      return false;
    }
    Py_DECREF(now);  // (True or False: the singletons outlive the comparison)
    if (now != PyTuple_GET_ITEM(requires_grad_watched, i)) {
      return false;
    }
  }
  return true;
}

// ``boundary(phase, event, raw_step)``, called by the recorder at every phase boundary: a plain C
// function (METH_FASTCALL), without pybind11's dispatch, which cost ~0.5 us a boundary here.
PyObject* boundary(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "boundary(phase, event, raw_step) takes 3 arguments");
    return nullptr;
  }
  if (at_boundary == nullptr) {
    Py_RETURN_NONE;  // not listening (a listener left in a list after unlisten notes nothing)
  }
  PyObject* phase = args[0];
  PyObject* event = args[1];
  const int64_t raw_step = PyLong_AsLongLong(args[2]);
  if (raw_step == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  const auto k = static_cast<int64_t>(boundaries.size());
  Py_INCREF(phase);
  Py_INCREF(event);
  boundaries.push_back({phase, event, raw_step, now_ns()});
  const bool enter = same_name(event, enter_name);
  bool look = false;
  if (look_armed) {
    if (enter && is_look_at(phase)) {
      look_armed = false;
      look = true;
    }
  } else if (!enter && same_name(phase, look_after)) {
    look_armed = true;
  }
  if (look && looks_to_skip > 0 && nothing_changed()) {
    --looks_to_skip;  // a look the probe let the counter answer: nothing to do but count it
    ++looks_skipped;
    look = false;
  }
  if (!look && PyDict_Size(models) == models_seen && PySet_GET_SIZE(cuda_in_use) == 0 &&
      write_marker(boundary_kind, k)) {
    Py_RETURN_NONE;  // the usual boundary: noted, and its marker written
  }
  PyObject* callback = at_boundary;
  Py_INCREF(callback);  // the call may unlisten
  // ``looks``: 0 at a boundary that is no look, else this look and those answered since the last
  const long long looks = look ? 1 + looks_skipped : 0;
  if (look) {
    looks_skipped = 0;
  }
  PyObject* result = PyObject_CallFunction(callback, "OOLLL", phase, event, static_cast<long long>(raw_step),
                                           static_cast<long long>(k), looks);
  Py_DECREF(callback);
  if (models != nullptr) {
    models_seen = PyDict_Size(models);
  }
  return result;  // nullptr with the callback's exception set
}

PyMethodDef boundary_def = {"boundary", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&boundary)),
                            METH_FASTCALL, "boundary(phase, event, raw_step): the memory probe's phase listener"};

// (phase, event, raw_step, t_ns) of every boundary noted since the last listen.
pybind11::list noted_boundaries() {
  pybind11::list out(boundaries.size());
  for (size_t i = 0; i < boundaries.size(); ++i) {
    const Boundary& b = boundaries[i];
    out[i] = pybind11::make_tuple(pybind11::reinterpret_borrow<pybind11::object>(b.phase),
                                  pybind11::reinterpret_borrow<pybind11::object>(b.event), b.raw_step, b.t_ns);
  }
  return out;
}

// The last boundary noted, or None.
pybind11::object last_boundary() {
  if (boundaries.empty()) {
    return pybind11::none();
  }
  const Boundary& b = boundaries.back();
  return pybind11::make_tuple(static_cast<int64_t>(boundaries.size() - 1),
                              pybind11::reinterpret_borrow<pybind11::object>(b.phase),
                              pybind11::reinterpret_borrow<pybind11::object>(b.event));
}

// (address, bytes, kind, index) of every marker written since the last listen, in order.
pybind11::list written_markers() {
  const size_t n = markers.size() / 2;
  pybind11::list out(n);
  for (size_t i = 0; i < n; ++i) {
    const auto n_i = static_cast<int64_t>(i);
    out[i] = pybind11::make_tuple(marker_address(n_i), marker_bytes(n_i), markers[2 * i], markers[2 * i + 1]);
  }
  return out;
}

// Let go of what was noted.
void forget() {
  clear_boundaries();
  markers.clear();
}

// Stop recording; the events as a list of (address, bytes) pairs, in order.
pybind11::list stop() {
  EventList got;
  {
    recording.store(0, std::memory_order_relaxed);
    std::lock_guard<std::mutex> guard(events_mutex);
    got.swap(events);
  }
  pybind11::list out(got.size() / 2);
  for (size_t i = 0; i + 1 < got.size(); i += 2) {
    out[i / 2] = pybind11::make_tuple(got[i], got[i + 1]);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("installed", &installed);
  m.def("recording", &any_recording);
  m.def("address", &address);
  m.def("start", &start);
  m.def("stop", &stop);
  m.def("write_marker", &write_marker);
  m.def("listen", &listen);
  m.def("unlisten", &unlisten);
  m.def("skip_looks", &skip_looks);
  m.add_object("boundary", pybind11::reinterpret_steal<pybind11::object>(PyCFunction_New(&boundary_def, nullptr)));
  m.def("boundaries", &noted_boundaries);
  m.def("last_boundary", &last_boundary);
  m.def("markers", &written_markers);
  m.def("forget", &forget);
}
