// tpkit's CPU allocation counter: a CPU allocator that wraps the one it finds installed and
// writes (address, bytes) of every allocation (bytes > 0) and free (bytes < 0) made by one
// thread into an in-memory list while recording. What it replaces and why:
// tpkit/capture/probes/allocator_counter.py and docs/OVERHEAD.md ("A counting allocator").
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>

#include <pthread.h>

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
  char unused[kHeaderBytes - 5 * sizeof(uint64_t)];
  uint64_t check;  // the handed-out address ^ kCheck
  uint64_t magic;  // kMagic (the last word: where glibc keeps a chunk's size for its own blocks)
};
static_assert(sizeof(Header) == kHeaderBytes, "the header is 64 bytes");

std::mutex events_mutex;
std::vector<int64_t> events;            // address, bytes, address, bytes, ... in order
std::atomic<uint64_t> recording{0};     // the recording session's number; 0: none
uint64_t sessions = 0;                  // sessions started so far
thread_local uint64_t thread_session = 0;  // the session this thread records for
c10::Allocator* inner = nullptr;        // the allocator found installed when ours went in

inline bool this_thread_records() {
  const uint64_t s = recording.load(std::memory_order_relaxed);
  return s != 0 && s == thread_session;
}

inline void record(void* ptr, int64_t bytes) {
  std::lock_guard<std::mutex> guard(events_mutex);  // uncontended: one thread records
  events.push_back(reinterpret_cast<int64_t>(ptr));
  events.push_back(bytes);
}

inline Header* header_of(void* data) {
  return reinterpret_cast<Header*>(static_cast<char*>(data) - kHeaderBytes);
}

void counted_delete(void* data) {
  Header* header = header_of(data);
  if (this_thread_records()) {
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
  std::vector<int64_t>().swap(events);
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
  thread_session = ++sessions;
  recording.store(sessions, std::memory_order_relaxed);
}

// An event of the caller's own in the list, where it stands now, if this thread records: the
// memory probe's boundary markers (an odd address no block has, an odd size), so that a
// boundary costs no allocation and no free (docs/OVERHEAD.md, "Markers written, not freed").
void mark(int64_t address, int64_t bytes) {
  if (this_thread_records()) {
    record(reinterpret_cast<void*>(address), bytes);
  }
}

// Stop recording; the events as a list of (address, bytes) pairs, in order.
pybind11::list stop() {
  std::vector<int64_t> got;
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
  m.def("mark", &mark);
}
