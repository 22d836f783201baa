"""What tpkit's default cost is made of: the torch mechanisms an invisible probe has to switch
on, each measured alone, beside tpkit and torch.profiler, in one run.

tpkit sees an unchanged loop through two torch mechanisms whose cost does not depend on
tpkit's own code:

- a replaced ``nn.Module.__call__``: how the forward phase is found without touching the
  user's model. Every module call goes through one more Python function, so the cost grows
  with the number of module calls per step. Until 2026-12-02 tpkit used torch's global module
  forward hooks instead (``register_module_forward_pre_hook`` / ``..._forward_hook``), which
  send every module call down ``Module._call_impl``'s slow path: still measured here, as
  "global hooks (before)", the way other tools see a model. (Hooks on the outermost model
  only would be cheaper still, but they live in the model: a ``torch.save(model)`` or
  ``copy.deepcopy(model)`` made during the slice would carry them, and adding them mid-run
  makes a compiled model recompile.)
- the CPU allocator stream (torch's profiler with ``profile_memory`` and no op events): how
  CPU memory is known exactly, allocation by allocation.

Modes, in interleaved rounds (the order rotates each round), in this process, one torch thread:
  none; global hooks (before) (no-op pre and post hooks); floor: call wrapper (a pass-through
  ``nn.Module.__call__``); floor: allocator stream; floor: both (wrapper and stream);
  tpkit phases only; tpkit phases + memory (clock_hz=0); tpkit default (+ clocks at 20 Hz);
  torch.profiler (CPU activities), the peer.
Loop: GPT-2 from a config (``--layers``), synthetic tokens, AdamW, a plain loop. Each step is
timed twice: its wall time and the CPU time of this thread (torch runs on this one thread, so the
CPU time is the step's work; on a shared VM it does not grow when the host lends the core to
someone else, which wall time does by 5-50% from one round to the next). Each ratio is the
median over the median of ``none``; "tpkit's own" is tpkit's ratio minus the floor it switches
on. tpkit's clock sampler runs in its own thread: its CPU time is not in the "tpkit default"
CPU ratio (it is in the wall ratio).

    python benchmarks/floors.py                 # 2 and 12 layers, about 4 minutes on 2 idle cores
    python benchmarks/floors.py --layers 2 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import load_avg, machine, peer_versions, write_rows  # noqa: E402

MODES = ("none", "global hooks (before)", "floor: call wrapper", "floor: allocator stream", "floor: both",
         "tpkit phases only", "tpkit phases + memory", "tpkit default", "torch.profiler CPU")


def gpt2_step(layers: int) -> tuple[Callable[[], None], int]:
    """One training step of a GPT-2 built from a config; and its module calls per step."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 1000, (4, 32))

    def step() -> None:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    calls = [0]
    mm = torch.nn.modules.module
    h = mm.register_module_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    step()
    h.remove()
    return step, calls[0]


@contextlib.contextmanager
def global_hooks() -> Iterator[None]:
    mm = torch.nn.modules.module
    pre = mm.register_module_forward_pre_hook(lambda m, a: None)
    post = mm.register_module_forward_hook(lambda m, a, o: None, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


@contextlib.contextmanager
def call_wrapper() -> Iterator[None]:
    """The least a replaced ``nn.Module.__call__`` costs: one pass-through function."""
    torch_call = torch.nn.Module.__dict__["__call__"]

    def call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return torch_call(self, *args, **kwargs)

    torch.nn.Module.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.__call__ = torch_call  # type: ignore[method-assign]


@contextlib.contextmanager
def allocator_stream() -> Iterator[None]:
    from tpkit.capture.probes.memory import CpuAllocatorStream, quiet_stderr

    s = CpuAllocatorStream()
    s.start()
    try:
        yield
    finally:
        with quiet_stderr():
            s.stop()


@contextlib.contextmanager
def torch_profiler() -> Iterator[None]:
    from tpkit.capture.probes.memory import quiet_stderr

    with quiet_stderr():
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    try:
        yield
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)


def per_call_us(n: int = 200_000, repeats: int = 7) -> dict[str, float]:
    """What one module call costs (an ``nn.Identity``; each mode's best loop of ``n`` calls, the
    modes taking turns ``repeats`` times, since this host's speed drifts by 10-40% within
    minutes): alone, under global no-op hooks, through a pass-through ``__call__``, and as an
    inner call under tpkit's phase probe (an outermost call of the loop's thread running), on its
    C route (the default) and on its Python route (``module_calls.py``)."""
    import threading

    from tpkit.capture.probes import module_calls
    from tpkit.capture.probes.phases import PhaseProbe
    from tpkit.capture.recorder import Recorder

    m, x = torch.nn.Identity(), torch.zeros(1)

    def inner_call_under_tpkit(c_route: bool) -> Callable[[], Any]:
        @contextlib.contextmanager
        def ctx() -> Iterator[None]:
            module_calls.C_ROUTE = c_route
            probe = PhaseProbe(Recorder("floors")).install()
            try:
                module_calls.set_inside(threading.get_ident())  # as inside the model's outermost call
                yield
            finally:
                module_calls.set_inside(None)
                probe.remove()
                module_calls.C_ROUTE = True
        return ctx

    modes: dict[str, Callable[[], Any]] = {
        "none": contextlib.nullcontext, "global hooks (before)": global_hooks,
        "floor: call wrapper": call_wrapper, "tpkit, an inner module call": inner_call_under_tpkit(True),
        "tpkit, an inner module call, Python route": inner_call_under_tpkit(False)}
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(repeats):
        for name, ctx in modes.items():
            with ctx():
                t = time.perf_counter()
                for _ in range(n):
                    m(x)
                best[name] = min(best[name], (time.perf_counter() - t) / n)
    return {k: 1e6 * v for k, v in best.items()}


def run_mode(mode: str, step: Callable[[], None], steps: int, skip: int) -> list[tuple[float, float]]:
    """``(wall_s, cpu_s)`` of each kept step."""
    import tpkit as tp

    times: list[tuple[float, float]] = []

    def loop(n: int) -> None:
        for _ in range(n):
            t, c = time.perf_counter(), time.thread_time()
            step()
            times.append((time.perf_counter() - t, time.thread_time() - c))

    tpkit_kw: dict[str, dict[str, Any]] = {
        "tpkit phases only": dict(memory=False, clock_hz=0), "tpkit phases + memory": dict(clock_hz=0),
        "tpkit default": {}}
    if mode in tpkit_kw:
        with tp.profile(steps=steps + skip, warmup=0, progress=False, name="floors", **tpkit_kw[mode]):
            loop(steps + skip + 1)  # the last step() ends the slice
        times = times[:steps + skip]
    else:
        ctx = {"none": contextlib.nullcontext, "global hooks (before)": global_hooks,
               "floor: call wrapper": call_wrapper,
               "floor: allocator stream": allocator_stream, "torch.profiler CPU": torch_profiler,
               "floor: both": lambda: _both()}[mode]()
        with ctx:
            loop(steps + skip)
    return times[skip:]


@contextlib.contextmanager
def _both() -> Iterator[None]:
    with call_wrapper(), allocator_stream():
        yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,12")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--out", default="floors")
    args = ap.parse_args()
    import os

    os.environ.setdefault("TPKIT_RUNS", "off")  # nothing written to the run store
    torch.set_num_threads(1)
    print(f"{machine()}; torch threads 1; load average at start {' / '.join(f'{x:.2f}' for x in load_avg())}")
    print(peer_versions("transformers"))
    rows: list[dict] = []
    calls_us = per_call_us()
    print("one module call (nn.Identity, each mode's best of 7 turns x 200,000 calls): " + ", ".join(
        f"{k} {v:.2f} us" for k, v in calls_us.items()))
    rows += [{"layers": 0, "module_calls_per_step": 1, "mode": k, "per_call_us": v} for k, v in calls_us.items()]
    c_us, py_us = calls_us["tpkit, an inner module call"], calls_us["tpkit, an inner module call, Python route"]
    print(f"an inner module call under tpkit over none: C route {c_us - calls_us['none']:+.2f} us, Python route "
          f"{py_us - calls_us['none']:+.2f} us; C route / Python route per call {c_us / py_us:.3f}x")
    table: dict[int, dict[str, float]] = {}  # CPU-time ratios
    walls: dict[int, dict[str, float]] = {}
    for layers in (int(x) for x in args.layers.split(",")):
        step, calls = gpt2_step(layers)
        for _ in range(3):
            step()
        wall: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for mode in order:
                kept = run_mode(mode, step, args.steps, args.skip)
                wall[mode] += [w for w, _ in kept]
                cpu[mode] += [c for _, c in kept]
        wbase, cbase = statistics.median(wall["none"]), statistics.median(cpu["none"])
        table[layers] = {m: statistics.median(cpu[m]) / cbase for m in MODES}
        walls[layers] = {m: statistics.median(wall[m]) / wbase for m in MODES}
        for m in MODES:
            rows.append({"layers": layers, "module_calls_per_step": calls, "mode": m,
                         "median_cpu_ms": 1e3 * statistics.median(cpu[m]), "cpu_ratio": table[layers][m],
                         "median_wall_ms": 1e3 * statistics.median(wall[m]), "wall_ratio": walls[layers][m],
                         "load_avg_1m": load_avg()[0]})
        print(f"GPT-2 {layers} layers: {1e3 * cbase:.2f} ms CPU / {1e3 * wbase:.2f} ms wall per step, "
              f"{calls} module calls per step, load {load_avg()[0]:.2f}", flush=True)
    layers_list = list(table)
    print("\n== per-step ratio vs none: CPU time of the training thread (wall time in brackets) ==")
    print(f"{'mode':28s}" + "".join(f"{f'GPT-2 {n}L':>22s}" for n in layers_list))
    for m in MODES:
        print(f"{m:28s}" + "".join(f"{table[n][m]:13.3f}x ({walls[n][m]:.3f}x)" for n in layers_list))
    print("\n== tpkit's own cost above the floor it switches on (CPU time) ==")
    pairs = [("tpkit phases only", "floor: call wrapper"), ("tpkit phases + memory", "floor: both"),
             ("tpkit default", "floor: both")]
    for mode, floor in pairs:
        print(f"{mode + ' - ' + floor:52s}" + "".join(f"{100 * (table[n][mode] - table[n][floor]):+12.1f}%"
                                                      for n in layers_list))
    print(f"\nwrote {write_rows(args.out, rows)}")


if __name__ == "__main__":
    main()
