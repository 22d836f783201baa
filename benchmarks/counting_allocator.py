"""What exact CPU memory could cost with a counting CPU allocator instead of torch's profiler.

tpkit counts CPU memory exactly from torch's profiler memory stream: the CPU allocator reports
every allocation and free to the profiler, about 0.2 us each inside a real step (docs/OVERHEAD.md),
which is most of what the default profile costs a short step. The only other source of every
CPU allocation torch offers is the allocator itself: ``c10::SetCPUAllocator`` takes a C++
allocator. This script builds one (``torch.utils.cpp_extension.load_inline``, a C++ compiler
needed) that wraps the default allocator, keeps each block's size in a 64-byte header in front of
it (no hash map, no lock but the event list's) and appends ``(ptr, bytes, t_ns)`` per allocation
and free while recording. It is a measurement of the idea, not part of tpkit.

Modes, switched on and off inside one training run (benchmarks/interleave.py, blocks of 3 + 12
steps), on the bare step of a GPT-2 (forward, backward, AdamW; no Trainer):

  none              nothing
  profiler stream   tpkit's CpuAllocatorStream (what a default tp.profile runs)
  counting          the counting allocator recording (installed for the whole run: its header
                    is there in every mode, so only the recording is compared)

    python benchmarks/counting_allocator.py [--layers 2] [--threads 1] [--budget 240]

Prints each mode's ratio to none (median of paired blocks, 95% interval), their quotient, the
events a step each saw (the same count: both see every CPU allocation and free) and the cost
per event.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import interleave  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

namespace {
constexpr size_t kHeader = 64;  // keeps the default allocator's 64-byte alignment
struct Header { c10::DeleterFnPtr del; void* ctx; size_t n; };
struct Event { void* ptr; int64_t bytes; int64_t t_ns; };
std::mutex mu;
std::vector<Event> events;
std::atomic<bool> recording{false};
c10::Allocator* inner = nullptr;

inline int64_t now_ns() { return std::chrono::steady_clock::now().time_since_epoch().count(); }

inline void record(void* ptr, int64_t bytes) {
  if (recording.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> g(mu);
    events.push_back({ptr, bytes, now_ns()});
  }
}

void counting_delete(void* data) {
  auto* h = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
  record(data, -static_cast<int64_t>(h->n));
  h->del(h->ctx);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr base = inner->allocate(n + kHeader);
    char* b = static_cast<char*>(base.get());
    auto* h = reinterpret_cast<Header*>(b);
    h->del = base.get_deleter();
    h->n = n;
    h->ctx = base.release_context();
    void* data = b + kHeader;
    record(data, static_cast<int64_t>(n));
    return {data, data, &counting_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
CountingAllocator counting;
}  // namespace

void install() {
  inner = c10::GetCPUAllocator();
  events.reserve(1 << 22);
  c10::SetCPUAllocator(&counting, 100);
}
void start() { recording = true; }
int64_t stop() {
  recording = false;
  std::lock_guard<std::mutex> g(mu);
  int64_t n = static_cast<int64_t>(events.size());
  events.clear();
  return n;
}
"""

MODES = ("profiler stream", "counting")
GPT2: dict[str, Any] = dict(vocab_size=1000, n_positions=64, n_embd=64, n_head=4)


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline("tpkit_counting_allocator_bench", cpp_sources=SOURCE, functions=["install", "start", "stop"],
                       extra_cflags=["-O2"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a 2-core VM)")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds of blocks")
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--block", type=int, default=12)
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    from tpkit.capture.probes.memory import CpuAllocatorStream

    t0 = time.perf_counter()
    try:
        ext = build()
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: say so and stop
        sys.exit(f"could not build the counting allocator ({type(e).__name__}: {e}); it needs a C++ compiler")
    print(f"built in {time.perf_counter() - t0:.0f} s; torch {torch.__version__}, {args.threads} thread(s), "
          f"GPT-2 {args.layers} layers, blocks of {args.skip} + {args.block} steps, {args.budget:.0f} s")
    torch.set_num_threads(args.threads)
    ext.install()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, **GPT2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, GPT2["vocab_size"], (8, 64))

    def step() -> float:
        t = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t

    for _ in range(10):
        step()
    events: dict[str, list[float]] = {m: [] for m in MODES}
    blocks: list[interleave.Block] = []
    t_end = time.perf_counter() + args.budget
    cycle_len = 2 * len(MODES)
    for i, mode in enumerate(interleave.schedule(MODES, 10_000)):
        if i > 1 and (i - 1) % cycle_len == 0 and time.perf_counter() > t_end:
            break  # a whole cycle ended (its closing none block) past the budget
        cycle = max(i - 1, 0) // cycle_len
        stream = None
        if mode == "profiler stream":
            stream = CpuAllocatorStream()
            stream.start()
        elif mode == "counting":
            ext.start()
        block = interleave.Block(mode, cycle)
        for k in range(args.skip + args.block):
            dt = step()
            if k >= args.skip:
                block.steps.append(dt)
        n_steps = args.skip + args.block
        if stream is not None:
            events[mode].append(len(stream.stop()) / n_steps)
        elif mode == "counting":
            events[mode].append(ext.stop() / n_steps)
        blocks.append(block)
    cycles = (len(blocks) - 1) // cycle_len
    pairs = interleave.paired_ratios(blocks)
    none_ms = statistics.median(s for b in blocks if b.mode == interleave.BASE for s in b.steps) * 1e3
    print(f"{cycles} cycles; none {none_ms:.2f} ms/step")
    for mode in MODES:
        est = interleave.estimate([r for _, r in pairs[mode]])
        ev = statistics.median(events[mode])
        assert est is not None
        per_event_ns = (est.value - 1) * none_ms * 1e6 / ev
        print(f"  {mode:16s} {est.text()} vs none; {ev:,.0f} events a step; ~{per_event_ns:.0f} ns an event")
    q = interleave.quotient(pairs["counting"], pairs["profiler stream"])
    if q is not None:
        print(f"  counting / profiler stream, cycle by cycle: {q.text()}")


if __name__ == "__main__":
    main()
