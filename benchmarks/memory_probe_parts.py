"""What the memory probe's own work inside the steps costs, part by part, against the allocation
counter recording alone (docs/OVERHEAD.md, "The memory probe's work inside the steps").

The default profile with the clock sampler off, beside the same profile with one of the memory
probe's per-step entries taken out while the slice is made (the probe is otherwise whole: it
starts the counter, walks the known sets at the slice's start and replays the stream at its end):

- its batch listener (a look at each batch the loader hands out: ``data``),
- its phase listener (the counter's ``boundary``, 12-14 a step, and the looks at the gradients
  it sets off),
- its optimizer hook (each optimizer known before it steps),
- all three: what is left is the probe's start and end, outside the steps;
- its phase listener replaced by a C call that does nothing: what a listener costs the recorder
  (its own-time span around the call) without the probe's work at the boundary;
- its phase listener whole but never setting off a look at the gradients (the Python the
  counter's ``boundary`` calls once a step);

and the counter recording with memory off (``overhead.py``'s "tpkit memory off + counter", clock
sampler off too). Each is timed in blocks inside one training run, paired with the no-profiler
blocks around it (``overhead.py``'s ``measure_blocks``), and each part's cost is read cycle by
cycle against the default. The parts taken out leave the run's memory wrong: a measurement of
cost only.

    python benchmarks/memory_probe_parts.py [--loop hf_gpt2_2l] [--budget 360] [--parts NAME,NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead  # noqa: E402
from common import load_avg, machine, peer_versions  # noqa: E402
from interleave import quotient  # noqa: E402

from tpkit.capture.probes import memory  # noqa: E402

DEFAULT = "default, no clocks"
COUNTER = "counter alone, no clocks"


class _NoHandle:
    def remove(self) -> None:
        pass


def _no_batch_listener() -> Any:
    return mock.patch.object(memory.MemoryProbe, "_on_batch", lambda self, batch: None)


def _no_optimizer_hook() -> Any:
    # the memory module's own reference only: the phase probe's optimizer hooks stay
    return mock.patch.object(memory, "_optim", types.SimpleNamespace(register_optimizer_step_pre_hook=lambda fn: _NoHandle()))


def _no_phase_listener() -> Any:
    install = memory.MemoryProbe.install

    def without_listener(self: memory.MemoryProbe) -> memory.MemoryProbe:
        out = install(self)
        while self._listener in self.rec.phase_listeners:
            self.rec.phase_listeners.remove(self._listener)
        return out

    return mock.patch.object(memory.MemoryProbe, "install", without_listener)


def _bare_phase_listener() -> Any:
    """The probe's phase listener replaced by a C callable that takes the three arguments and
    does nothing (``slice``): the recorder still calls a listener at each boundary and writes
    its own-time span around it; the counter's ``boundary`` and the looks it sets off are gone."""
    install = memory.MemoryProbe.install

    def with_bare_listener(self: memory.MemoryProbe) -> memory.MemoryProbe:
        out = install(self)
        listeners = self.rec.phase_listeners
        listeners[:] = [slice if fn is self._listener else fn for fn in listeners]
        return out

    return mock.patch.object(memory.MemoryProbe, "install", with_bare_listener)


def _no_looks() -> Any:
    """The phase listener whole, but never a look at the gradients (no phase counts as the
    first after a backward pass): what the once-a-step look in Python costs."""
    return mock.patch.object(memory, "_LOOK_AT", ())


def _none_of_them() -> Any:
    stack = contextlib.ExitStack()
    for part in (_no_batch_listener, _no_optimizer_hook, _no_phase_listener):
        stack.enter_context(part())
    return stack


PARTS: dict[str, Callable[[], Any]] = {
    "without its batch listener": _no_batch_listener,
    "without its phase listener": _no_phase_listener,
    "without its optimizer hook": _no_optimizer_hook,
    "with a bare C phase listener": _bare_phase_listener,
    "without its looks at the gradients": _no_looks,
    "without any of the three": _none_of_them,
}


def _counter_alone(steps: int, warmup: int) -> Any:
    ctx = overhead._MemoryOffWithStream(steps, warmup, counter=True)
    ctx.profile = overhead._tpkit(memory=False, clock_hz=0)(steps, warmup)
    return ctx


def _default_while(part: Callable[[], Any]) -> Callable[[int, int], Any]:
    return lambda steps, warmup: overhead._ProfileWhile(steps, warmup, part, clock_hz=0)


def register_modes(parts: list[str] | None = None) -> list[str]:
    """The modes (every part, or those named), put where ``overhead.py``'s block runner finds them."""
    chosen = list(PARTS) if parts is None else parts
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}: choose from {list(PARTS)}")
    overhead.COMPONENT_MODES[DEFAULT] = overhead._tpkit(clock_hz=0)
    overhead.COMPONENT_MODES[COUNTER] = _counter_alone
    for name in chosen:
        overhead.COMPONENT_MODES[name] = _default_while(PARTS[name])
    return [overhead.BASE, DEFAULT, COUNTER, *chosen]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loop", default="hf_gpt2_2l", choices=sorted(overhead.LOOPS))
    ap.add_argument("--budget", type=float, default=360.0, help="seconds of blocks (whole cycles)")
    ap.add_argument("--block", type=int, default=8, help="kept steps per block (after --skip)")
    ap.add_argument("--skip", type=int, default=3, help="steps dropped at the start of every block")
    ap.add_argument("--parts", help="comma-separated parts to time (default: all)")
    args = ap.parse_args()
    la = load_avg()
    print(f"{machine()}; torch threads {overhead.torch.get_num_threads()}; load average at start "
          f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}\n{peer_versions()}\nblocks of {args.block} steps "
          f"(+{args.skip} dropped) per mode, {args.budget:.0f} s")
    modes = register_modes(args.parts.split(",") if args.parts else None)
    t0 = time.perf_counter()
    loop = overhead.LOOPS[args.loop]()
    loop.run(args.skip + 3, contextlib.nullcontext())  # warm caches and the allocator
    overhead.freeze_startup()
    watch = overhead.GcWatch().install()
    out: dict[str, overhead.Samples] = {}
    cycles = overhead.measure_blocks(loop, modes, args.skip, args.block, args.budget, watch, out)
    watch.remove()
    print(f"{args.loop}: {cycles} cycles in {time.perf_counter() - t0:.0f} s, load {load_avg()[0]:.2f}\n")
    base_ms = sorted(out[overhead.BASE].steps)[len(out[overhead.BASE].steps) // 2] * 1e3
    print(f"== per-step time ratio vs no profiler (median step {base_ms:.2f} ms): median of the paired block "
          "ratios [95% interval] ==")
    for mode in modes[1:]:
        print(f"{mode:<34} {overhead.fmt_est(overhead.paired(out, mode))}")
    print("\n== each part's cost: the default over the default without it, cycle by cycle ==")
    for mode in [*modes[3:], COUNTER]:
        what = ("the probe's work over the counter" if mode == COUNTER
                else "its listener's work beyond a bare one" if mode == "with a bare C phase listener"
                else mode.replace("without", ""))
        print(f"{what.strip():<34} {overhead.fmt_est(quotient(out[DEFAULT].pairs, out[mode].pairs))}")


if __name__ == "__main__":
    main()
