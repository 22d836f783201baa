"""What does watching cost? Per-step time of three training loops with no profiler, under
tpkit (four configurations) and under its peers, side by side in one run.

Loops
  hf_gpt2_2l    Hugging Face Trainer, GPT-2 built from GPT2Config (2 layers), synthetic tokens
  hf_gpt2_12l   the same with 12 layers
  plain_tiny    tpkit's built-in tiny transformer in a plain PyTorch loop (tpkit.demo)

Modes, in this process, in interleaved rounds (the order rotates every round, so a noisy
neighbour hits every mode alike):
  none, tpkit default (phases + memory + clocks at 20 Hz), tpkit memory off (phases + clocks),
  tpkit phases only (memory off, clock_hz=0), torch.profiler (CPU activities),
  torch.profiler + profile_memory.
TraceML runs through its own launcher (``traceml run script.py``: an aggregator process and
torchrun around the script), so it cannot share this process: after each in-process round
(while ``--sub-rounds`` last) an own-process round starts this script twice as a child, once under ``traceml run`` and
once under ``traceml run --disable-traceml`` (the same torchrun launch with TraceML off: the
"none, traceml launcher" baseline), alternating which goes first; TraceML's ratio is taken
against that baseline. (torchrun makes the Trainer wrap the model in DistributedDataParallel
with a world of one; the baseline pays that too.)

Step time is measured the same way in every mode: the time between one step's end and the
next (a TrainerCallback's ``on_step_end`` for the Trainer, after ``optimizer.step()`` for the
plain loop), so it includes fetching the batch. The first ``--skip`` steps of every run are
dropped. Each ratio is the median over every kept step of every round, over the same for
"none". gc pauses are timed with ``gc.callbacks`` in every mode; tpkit's own time per step is
its Run's ``tpkit_s`` column.

The host of a VM may run its core at two speeds by turns (docs/MEASURED.md, "Timing ground
truth": the same work 1.9x longer in the slow state, nothing in the guest showing it). After each
step a fixed pure-Python loop is timed in thread CPU time (``common.host_canary_us``, ~60 us,
left out of the step): its readings form two clusters, so each step is known to have run on a
fast or a slow host. A second table gives each mode's share of fast-host steps (modes that ran
more of their steps on a slow host are seen at once) and the ratios over the steps with a fast
reading before and after, where enough were. It is a diagnostic: the canary reads only the main
thread's core (torch's second thread runs on the other, whose state is its own), and in the
full run of 2026-12-02 its ratios were no steadier than the first table's, so the goals are
judged on every step.

    python benchmarks/overhead.py              # full run (about 10 minutes on 2 idle cores)
    python benchmarks/overhead.py --quick      # smoke run, under a minute on 2 idle cores
    python benchmarks/overhead.py --threads 1  # on a busy shared machine (see --help)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# Runs made here are not kept in tpkit's run store (tpkit/store.py reads TPKIT_RUNS at save time).
os.environ.setdefault("TPKIT_RUNS", "off")

import torch  # noqa: E402
from common import fast_host, host_canary_us, load_avg, machine, peer_versions, quantiles, write_rows  # noqa: E402

HERE = Path(__file__).resolve()

# -- the loops ---------------------------------------------------------------------------------
#: GPT-2 shapes for the Trainer loops: small enough for a 2-core CPU, the layer count is the knob.
#: On the idle 2-core VM: ~10 ms/step at 2 layers, ~39 ms at 12 (issue 14 names ~6 and ~29 ms).
GPT2 = {"n_embd": 64, "n_head": 4, "n_positions": 32, "vocab_size": 1024}
SEQ_LEN, HF_BATCH = 32, 4


class GcWatch:
    """Every garbage collection in this process, as (start, end, generation) perf_counter times."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((self._start, time.perf_counter(), info.get("generation", -1)))

    def install(self) -> "GcWatch":
        gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


@dataclass
class Record:
    """One run of a loop: step end times (and begin times where the loop has them), and the
    host canary read after each end (``common.host_canary_us``) with the time it ended."""

    ends: list[float] = field(default_factory=list)
    begins: list[float] = field(default_factory=list)
    canaries: list[float] = field(default_factory=list)  # us, one after each entry of ends
    resumed: list[float] = field(default_factory=list)  # when the canary after ends[i] was done

    def end_step(self) -> None:
        """A step ended now: stamp it, read the canary, stamp the next step's start."""
        self.ends.append(time.perf_counter())
        self.canaries.append(host_canary_us())
        self.resumed.append(time.perf_counter())

    def steps(self, skip: int) -> list[float]:
        """End-to-end step times, the canary after each step left out: resumed[i-1] to end[i],
        from step ``skip`` on."""
        return [b - a for a, b in zip(self.resumed[skip:], self.ends[skip + 1:])]

    def step_canaries(self, skip: int) -> list[tuple[float, float]]:
        """(canary before, canary after) each kept step, aligned with ``steps``."""
        return list(zip(self.canaries[skip:], self.canaries[skip + 1:]))

    def gc_in_steps(self, pauses: list[tuple[float, float, int]], skip: int) -> list[float]:
        """gc pause time (s) inside each kept step, aligned with ``steps``."""
        out = []
        for a, b in zip(self.resumed[skip:], self.ends[skip + 1:]):
            out.append(sum(e - s for s, e, _ in pauses if a <= s < b))
        return out


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class HFLoop:
    """A Hugging Face Trainer on a GPT-2 of ``n_layer`` layers; one fresh Trainer per run (the
    model is shared, so every mode trains the same weights' shapes)."""

    def __init__(self, n_layer: int) -> None:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, **GPT2))
        self.data = _Tokens(50_000, SEQ_LEN, GPT2["vocab_size"])
        self.out_dir = tempfile.mkdtemp(prefix="tpkit-overhead-")

    def run(self, n_steps: int, ctx: Any) -> Record:
        from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

        rec = Record()

        class Timer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001
                rec.end_step()  # the first step's start, as in the plain loop

            def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
                rec.begins.append(time.perf_counter())

            def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
                rec.end_step()

        args = TrainingArguments(output_dir=self.out_dir, per_device_train_batch_size=HF_BATCH, max_steps=n_steps,
                                 report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
                                 use_cpu=True, dataloader_num_workers=0, dataloader_pin_memory=False, seed=0)
        trainer = Trainer(model=self.model, args=args, train_dataset=self.data, callbacks=[Timer()])
        trainer.remove_callback(PrinterCallback)
        with ctx:
            trainer.train()
        return rec


class PlainLoop:
    """tpkit's built-in tiny transformer (tpkit.demo) in a plain loop; ``wrap`` is a per-step
    context (TraceML's ``trace_step``) or None."""

    def __init__(self) -> None:
        from tpkit.demo import make_training

        self.model, self.loader, self.opt = make_training()
        self.it = iter(self.loader)
        self.wrap: Callable[[], Any] | None = None

    def _batch(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)

    def run(self, n_steps: int, ctx: Any) -> Record:
        rec = Record()
        with ctx:
            rec.end_step()
            for _ in range(n_steps):
                with self.wrap() if self.wrap else nullcontext():
                    batch = self._batch()
                    self.model(batch["x"], batch["y"]).backward()
                    self.opt.step()
                    self.opt.zero_grad(set_to_none=True)
                rec.end_step()
        return rec


LOOPS: dict[str, Callable[[], Any]] = {
    "hf_gpt2_2l": lambda: HFLoop(2),
    "hf_gpt2_12l": lambda: HFLoop(12),
    "plain_tiny": PlainLoop,
}


# -- the modes ---------------------------------------------------------------------------------
def _tpkit(**kw: Any) -> Callable[[int, int], Any]:
    def make(steps: int, warmup: int) -> Any:
        import tpkit as tp

        return tp.profile(steps=steps, warmup=warmup, stop=False, progress=False, **kw)

    return make


def _torch_profiler(**kw: Any) -> Callable[[int, int], Any]:
    return lambda steps, warmup: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **kw)


MODES: dict[str, Callable[[int, int], Any]] = {
    "none": lambda steps, warmup: nullcontext(),
    "tpkit default": _tpkit(),
    "tpkit memory off": _tpkit(memory=False),
    "tpkit phases only": _tpkit(memory=False, clock_hz=0),
    "torch.profiler CPU": _torch_profiler(),
    "torch.profiler + memory": _torch_profiler(profile_memory=True),
}
SUBPROCESS_MODES = ("none, traceml launcher", "TraceML, own process")
#: Goals of issue 14 (ratios vs none; "clocks" is memory off / phases only, see below).
GOALS = {"tpkit default": 1.05, "tpkit phases only": 1.02, "clocks at 20 Hz": 1.01}
PEERS = ("torch.profiler CPU", "torch.profiler + memory", "TraceML, own process")


@dataclass
class Samples:
    steps: list[float] = field(default_factory=list)  # s, end to end
    canaries: list[tuple[float, float]] = field(default_factory=list)  # us, host canary before/after each step
    inner: list[float] = field(default_factory=list)  # s, on_step_begin -> on_step_end (Trainer only)
    gc: list[float] = field(default_factory=list)  # s of gc pause inside each kept step
    tpkit: list[float] = field(default_factory=list)  # s, the Run's tpkit_s per (non-warmup) step
    tpkit_frac: list[float] = field(default_factory=list)  # tpkit_s / duration_s per step
    gc_by_gen: list[int] = field(default_factory=lambda: [0, 0, 0])  # collections inside kept steps
    round_medians: list[float] = field(default_factory=list)
    round_ends: list[int] = field(default_factory=list)  # len(steps) after each round
    loads: list[float] = field(default_factory=list)


def measure(loop: Any, ctx_factory: Callable[[int, int], Any], steps: int, skip: int, watch: GcWatch,
            out: Samples) -> None:
    # the previous run's garbage (a Trainer, a Run, a profiler's results) is collected now, not
    # inside this run's steps, where it would be charged to whichever mode came next
    gc.collect()
    ctx = ctx_factory(steps, skip)
    watch.pauses.clear()
    rec = loop.run(skip + steps, ctx)
    kept = rec.steps(skip)
    out.steps += kept
    out.canaries += rec.step_canaries(skip)
    out.gc += rec.gc_in_steps(watch.pauses, skip)
    lo, hi = rec.resumed[skip], rec.ends[-1]  # the kept steps, from the end of the canary before the first
    for start, _, gen in watch.pauses:
        if lo <= start < hi and 0 <= gen <= 2:
            out.gc_by_gen[gen] += 1
    if rec.begins:
        out.inner += [e - b for b, e in zip(rec.begins[skip:], rec.ends[skip + 1:])]
    out.round_medians.append(statistics.median(kept))
    out.round_ends.append(len(out.steps))
    out.loads.append(load_avg()[0])
    run = getattr(ctx, "run", None)
    if run is not None and "tpkit_s" in run.steps:
        st = run.steps[~run.steps["warmup"]]
        out.tpkit += [float(v) for v in st["tpkit_s"]]
        out.tpkit_frac += [float(a / b) for a, b in zip(st["tpkit_s"], st["duration_s"]) if b > 0]


# -- TraceML and its baseline, each in a process of its own ------------------------------------
def traceml_available() -> str | None:
    """None when ``traceml run`` can be used here, else why not."""
    exe = Path(sys.executable).with_name("traceml")
    if not exe.exists():
        return "traceml-ai is not installed (pip install traceml-ai==0.5.0)"
    try:
        import traceml_ai  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means it cannot run here
        return f"traceml_ai does not import: {e!r}"
    return None


def child_main(args: argparse.Namespace) -> None:
    """Runs in a child process: each loop once, no profiler (or TraceML when launched by it)."""
    watch = GcWatch().install()
    result: dict[str, Any] = {}
    if args.traceml:
        import traceml_ai as traceml

        traceml.init(mode="auto")  # the plain loop's forward/backward/optimizer timers
    for name in args.loops.split(","):
        loop = LOOPS[name]()
        if args.traceml and isinstance(loop, PlainLoop):
            import traceml_ai as traceml

            loop.wrap = lambda m=loop.model: traceml.trace_step(m)
        loop.run(args.skip + 3, nullcontext())  # the same warm-up as in the main process
        s = Samples()
        measure(loop, lambda steps, warmup: nullcontext(), args.steps, args.skip, watch, s)
        result[name] = {"steps": s.steps, "canaries": s.canaries, "inner": s.inner, "gc": s.gc, "gc_by_gen": s.gc_by_gen}
    watch.remove()
    Path(args.child).write_text(json.dumps(result))


def run_child(loops: list[str], steps: int, skip: int, traceml: bool, log_dir: Path) -> tuple[dict | None, str]:
    """Starts this script as a child through TraceML's launcher, with TraceML on or off
    (``--disable-traceml``: the same torchrun launch, TraceML a no-op), so that the baseline
    differs from TraceML's run in TraceML alone. Returns the child's result and a line saying
    how it went."""
    fd, out_path = tempfile.mkstemp(suffix=".json", prefix="overhead-child-")
    os.close(fd)
    exe = str(Path(sys.executable).with_name("traceml"))
    cmd = [exe, "run", *([] if traceml else ["--disable-traceml"]), "--logs-dir", str(log_dir), str(HERE),
           "--args", "--child", out_path, "--loops", ",".join(loops), "--steps", str(steps), "--skip", str(skip),
           "--threads", str(torch.get_num_threads()), "--traceml"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=HERE.parent,
                          env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    wall = time.perf_counter() - t
    try:
        data = json.loads(Path(out_path).read_text())
    except (OSError, ValueError):
        data = None
    finally:
        Path(out_path).unlink(missing_ok=True)
    if proc.returncode != 0 or not data:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        return None, f"exit {proc.returncode} after {wall:.0f} s:\n    " + "\n    ".join(tail)
    return data, f"ok in {wall:.0f} s"


# -- the report --------------------------------------------------------------------------------
def ratio(samples: dict[str, Samples], mode: str, base: str) -> float | None:
    if not samples.get(mode) or not samples[mode].steps or not samples.get(base) or not samples[base].steps:
        return None
    return statistics.median(samples[mode].steps) / statistics.median(samples[base].steps)


#: A fast-host ratio is given for a mode when at least this share of its steps (and of its
#: baseline's), and this many, had the host fast before and after.
FAST_MIN_SHARE, FAST_MIN_STEPS = 0.25, 30


def fast_steps(s: Samples, is_fast: Callable[[float], bool], lo: int = 0, hi: int | None = None) -> list[float]:
    """The steps in ``s.steps[lo:hi]`` with the host canary fast before and after the step."""
    return [x for x, (a, b) in zip(s.steps[lo:hi], s.canaries[lo:hi]) if is_fast(a) and is_fast(b)]


def fast_ratio(samples: dict[str, Samples], mode: str, base: str,
               is_fast: Callable[[float], bool]) -> tuple[float | None, float, list[float]]:
    """Ratio of medians over fast-host steps only (None when too few), the smaller share of
    steps kept (mode or base), and the per-round ratios (rounds with 5+ fast steps each)."""
    m, b = samples.get(mode), samples.get(base)
    if not m or not b or not m.steps or not b.steps:
        return None, 0.0, []
    fm, fb = fast_steps(m, is_fast), fast_steps(b, is_fast)
    share = min(len(fm) / len(m.steps), len(fb) / len(b.steps))
    if min(len(fm), len(fb)) < FAST_MIN_STEPS or share < FAST_MIN_SHARE:
        return None, share, []
    per_round = []
    for (m0, m1), (b0, b1) in zip(zip([0, *m.round_ends], m.round_ends), zip([0, *b.round_ends], b.round_ends)):
        rm, rb = fast_steps(m, is_fast, m0, m1), fast_steps(b, is_fast, b0, b1)
        if len(rm) >= 5 and len(rb) >= 5:
            per_round.append(statistics.median(rm) / statistics.median(rb))
    return statistics.median(fm) / statistics.median(fb), share, per_round


def fmt(x: float | None, spec: str = ".3f", suffix: str = "x") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def print_table(results: dict[str, dict[str, Samples]], modes: list[str],
                cell: Callable[[str, str, str, Samples], str]) -> None:
    """A row per mode, a column per loop; ``cell(loop, mode, base, samples)`` for each mode that
    ran (``base``: what its ratio is taken against)."""
    print(f"{'mode':<24}" + "".join(f"{name:>24}" for name in results))
    for mode in modes:
        base = "none, traceml launcher" if mode == "TraceML, own process" else "none"
        cells = []
        for loop in results:
            s = results[loop].get(mode)
            cells.append("not run" if s is None or not s.steps else cell(loop, mode, base, s))
        print(f"{mode:<24}" + "".join(f"{c:>24}" for c in cells))


def report(results: dict[str, dict[str, Samples]], notes: list[str]) -> list[dict]:
    loops = list(results)
    modes = [*MODES, *SUBPROCESS_MODES]
    rows: list[dict] = []
    la = load_avg()
    print(f"\n== per-step time ratio vs none (median of every kept step; load average now "
          f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} on {os.cpu_count()} cores) ==")

    def every_step(loop: str, mode: str, base: str, s: Samples) -> str:
        ms = statistics.median(s.steps) * 1e3
        if mode == "none":
            return f"{ms:.1f} ms/step"
        if mode == "none, traceml launcher":
            return f"{ms:.1f} ms ({fmt(ratio(results[loop], mode, 'none'), '.2f')})"
        per_round = [m / b for m, b in zip(s.round_medians, results[loop][base].round_medians)]
        spread = f"({min(per_round):.2f}-{max(per_round):.2f})" if len(per_round) > 1 else ""
        return f"{fmt(ratio(results[loop], mode, base))} {spread}"

    print_table(results, modes, every_step)
    print("  (x.xx-y.yy): the lowest and highest per-round ratio. TraceML's ratio is against 'none, traceml "
          "launcher'; that row's own ratio (in brackets) is against the in-process 'none'.")

    # The same ratios over the steps the host ran at its fast speed before and after (common.host_canary_us)
    bars: dict[str, tuple[float, Callable[[float], bool]]] = {}
    canary_medians: dict[str, list[float]] = {}  # per loop: each mode's median canary
    for loop in loops:
        per_mode = [[c for pair in s.canaries for c in pair] for s in results[loop].values()]
        per_mode = [xs for xs in per_mode if xs]
        if per_mode:
            bars[loop] = fast_host([c for xs in per_mode for c in xs])
            canary_medians[loop] = [statistics.median(xs) for xs in per_mode]
    print("\n== the same, fast-host steps only (host canary fast before and after the step; "
          "share of steps kept in brackets) ==")

    def fast_only(loop: str, mode: str, base: str, s: Samples) -> str:
        if loop not in bars:
            return "not run"
        is_fast = bars[loop][1]
        if mode in ("none", "none, traceml launcher"):
            kept = fast_steps(s, is_fast)
            med = f"{statistics.median(kept) * 1e3:.1f} ms" if kept else "-"
            return f"{med} ({100 * len(kept) / len(s.steps):.0f}%)"
        r, share, per_round = fast_ratio(results[loop], mode, base, is_fast)
        spread = f" {min(per_round):.2f}-{max(per_round):.2f}" if len(per_round) > 1 else ""
        return f"{fmt(r)}{spread} ({100 * share:.0f}%)"

    print_table(results, modes, fast_only)
    for loop, (bar, _) in bars.items():
        meds = canary_medians[loop]
        print(f"  {loop}: canary fast at <= {bar:.0f} us; median canary per mode {min(meds):.0f}-{max(meds):.0f} us")
    print(f"  a ratio needs {FAST_MIN_STEPS}+ fast-host steps and {100 * FAST_MIN_SHARE:.0f}%+ of each mode's steps;"
          f" the range after it: lowest and highest per-round ratio over fast-host steps. A diagnostic: the canary"
          f" reads the main thread's core only, and in the runs so far these ratios were no steadier than the"
          f" table above (docs/MEASURED.md), so the goals below use every step")

    print("\n== goals (issue 14), on every kept step ==")
    for loop in loops:
        r = results[loop]
        default, phases, memoff = (ratio(r, m, "none") for m in ("tpkit default", "tpkit phases only", "tpkit memory off"))
        clocks = memoff / phases if memoff and phases else None
        checks = [("tpkit default <= 1.05x", default, default is not None and default <= GOALS["tpkit default"]),
                  ("tpkit phases only <= 1.02x", phases, phases is not None and phases <= GOALS["tpkit phases only"]),
                  ("clocks at 20 Hz <= 1.01x", clocks, clocks is not None and clocks <= GOALS["clocks at 20 Hz"])]
        for peer in PEERS:
            pr = ratio(r, peer, "none, traceml launcher" if peer.startswith("TraceML") else "none")
            checks.append((f"tpkit default ahead of {peer} ({fmt(pr)})", default,
                           None if pr is None else (default is not None and default < pr)))
        print(f"{loop}:")
        for what, value, met in checks:
            state = "not measured" if met is None or value is None else ("met" if met else "NOT met")
            print(f"  {what:<58} {fmt(value):>8}  {state}")
    print("  clocks only is not a configuration tp.profile offers (it always installs the phase probe); "
          "'clocks at 20 Hz' is tpkit memory off / tpkit phases only.")

    print("\n== tpkit's own time (Run.steps.tpkit_s) and gc pauses inside steps ==")
    print(f"{'loop':<14}{'mode':<24}{'step ms':>9}{'tpkit_s ms':>11}{'% of step':>10}"
          f"{'gc ms/step':>11}{'gc/100 st':>10}{'max gc ms':>10}{'gen0/1/2':>14}")
    for loop in loops:
        for mode in ("none", "tpkit default", "tpkit memory off", "tpkit phases only", "torch.profiler CPU",
                     "none, traceml launcher", "TraceML, own process"):
            s = results[loop].get(mode)
            if s is None or not s.steps:
                continue
            step_ms = statistics.median(s.steps) * 1e3
            tk = f"{statistics.median(s.tpkit) * 1e3:.2f}" if s.tpkit else "-"
            pct = f"{100 * statistics.median(s.tpkit_frac):.1f}%" if s.tpkit_frac else "-"
            gcs = s.gc
            n_gc = sum(1 for g in gcs if g > 0)
            print(f"{loop:<14}{mode:<24}{step_ms:>9.2f}{tk:>11}{pct:>10}{1e3 * sum(gcs) / len(gcs):>11.3f}"
                  f"{100 * n_gc / len(gcs):>10.1f}{1e3 * max(gcs):>10.2f}{'/'.join(map(str, s.gc_by_gen)):>14}")
    print("  gc/100 st: kept steps with a collection inside, per 100; gen0/1/2: collections inside kept steps.")
    small, big = results.get("hf_gpt2_2l", {}).get("tpkit default"), results.get("hf_gpt2_12l", {}).get("tpkit default")
    if small and big and small.tpkit and big.tpkit:
        a, b = statistics.median(small.tpkit), statistics.median(big.tpkit)
        print(f"  tpkit_s, tpkit default: {a * 1e3:.2f} ms/step at 2 layers ({100 * statistics.median(small.tpkit_frac):.1f}%"
              f" of the step), {b * 1e3:.2f} ms/step at 12 layers ({100 * statistics.median(big.tpkit_frac):.1f}%): "
              f"x{b / a:.1f} for 6x the layers (goal: <= 1% and flat)")
    for loop in loops:
        nr = results[loop].get("none")
        if nr and len(nr.round_medians) > 1 and max(nr.round_medians) > 1.3 * min(nr.round_medians):
            notes.append(f"{loop}: the 'none' rounds differ by more than 30% ({min(nr.round_medians) * 1e3:.1f}-"
                         f"{max(nr.round_medians) * 1e3:.1f} ms/step): the machine was busy, rerun before quoting")
    if la[0] > (os.cpu_count() or 1):
        notes.append(f"load average {la[0]:.2f} is above the {os.cpu_count()} cores: other work shared the "
                     "machine and these ratios carry its noise")
    for n in notes:
        print(f"note: {n}")

    mach, vers = machine(), peer_versions()
    for loop in loops:
        for mode, s in results[loop].items():
            if not s.steps:
                continue
            base = "none, traceml launcher" if mode == "TraceML, own process" else "none"
            r = ratio(results[loop], mode, base)
            load = statistics.mean(s.loads) if s.loads else la[0]
            series = {"step_ms": [x * 1e3 for x in s.steps], "step_begin_end_ms": [x * 1e3 for x in s.inner],
                      "gc_ms_in_step": [x * 1e3 for x in s.gc], "tpkit_ms": [x * 1e3 for x in s.tpkit],
                      "tpkit_pct_of_step": [x * 100 for x in s.tpkit_frac]}
            for metric, xs in series.items():
                if len(xs) < 2:
                    continue
                p20, p50, p80 = quantiles(xs)
                rows.append({"loop": loop, "mode": mode, "metric": metric, "n": len(xs), "p20": p20, "p50": p50,
                             "p80": p80, "mean": statistics.mean(xs),
                             "ratio_vs_none": r if metric == "step_ms" else "",
                             "load_avg_1m": round(load, 2), "machine": mach, "versions": vers})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per run (after --skip)")
    ap.add_argument("--skip", type=int, default=3, help="steps dropped at the start of every run")
    ap.add_argument("--sub-rounds", type=int, default=None,
                    help="rounds of the own-process pair (TraceML on / off); default 3, 0 with --quick")
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--modes", default=",".join(MODES), help="in-process modes")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default, what users get). On a shared, busy 2-core "
                         "machine, 1 keeps torch's thread pool from stretching steps 10-100x; it also makes steps "
                         "longer, so ratios vs none come out lower than with the default")
    ap.add_argument("--no-traceml", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 rounds of 8 steps, no TraceML (its launcher alone takes ~20 s a process) "
                         "unless --sub-rounds is given")
    ap.add_argument("--out", default="overhead", help="results/<out>.csv")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--traceml", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child_main(args)
        return
    if args.quick:
        args.rounds, args.steps, args.skip = 2, 8, 2
        if args.sub_rounds is None:
            args.sub_rounds = 0
        if args.out == "overhead":
            args.out = "overhead_quick"
    if args.sub_rounds is None:
        args.sub_rounds = 3
    loops = args.loops.split(",")
    modes = args.modes.split(",")
    notes: list[str] = []
    t_start = time.perf_counter()
    la = load_avg()
    print(f"{machine()}; torch threads {torch.get_num_threads()}; load average at start {la[0]:.2f} / {la[1]:.2f} / "
          f"{la[2]:.2f}\n{peer_versions()}\n{args.rounds} rounds x {args.steps} steps (+{args.skip} dropped) per "
          f"loop and mode; own-process pair: {args.sub_rounds} rounds x {args.steps * args.rounds // max(args.sub_rounds, 1)} steps")

    why_not_traceml = ("--no-traceml" if args.no_traceml else "--quick without --sub-rounds" if args.sub_rounds == 0
                       else traceml_available())
    if why_not_traceml:
        notes.append(f"TraceML not run: {why_not_traceml}")

    watch = GcWatch().install()
    results: dict[str, dict[str, Samples]] = {name: {} for name in loops}
    built = {}
    for name in loops:
        try:
            built[name] = LOOPS[name]()
        except ImportError as e:
            notes.append(f"{name} not run: {e} (pip install transformers accelerate)")
            results.pop(name)
            continue
        built[name].run(args.skip + 3, nullcontext())  # warm caches and the allocator
    use_traceml = not why_not_traceml and bool(built)
    sub_steps = args.steps * args.rounds // max(args.sub_rounds, 1)
    log_dir = Path(tempfile.mkdtemp(prefix="tpkit-traceml-logs-")) if use_traceml else None

    def own_process_round(r: int) -> None:
        """TraceML on and off (the launcher's baseline), each in a child of its own."""
        assert log_dir is not None
        for tm in ([False, True] if r % 2 == 0 else [True, False]):
            mode = SUBPROCESS_MODES[1] if tm else SUBPROCESS_MODES[0]
            data, how = run_child(list(built), sub_steps, args.skip, tm, log_dir)
            print(f"own-process round {r + 1}/{args.sub_rounds}: {mode}: {how}", flush=True)
            if data is None:
                notes.append(f"{mode} failed in round {r + 1}: {how}")
                continue
            for name, d in data.items():
                s = results[name].setdefault(mode, Samples())
                s.steps += d["steps"]
                s.canaries += [tuple(c) for c in d["canaries"]]
                s.inner += d["inner"]
                s.gc += d["gc"]
                s.gc_by_gen = [a + b for a, b in zip(s.gc_by_gen, d["gc_by_gen"])]
                s.round_medians.append(statistics.median(d["steps"]))
                s.round_ends.append(len(s.steps))
                s.loads.append(load_avg()[0])

    # Own-process rounds run between the in-process rounds (one after each, while they last),
    # so that both kinds meet the same neighbours.
    for r in range(max(args.rounds, args.sub_rounds if use_traceml else 0)):
        if r < args.rounds:
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for name, loop in built.items():
                for mode in order:
                    measure(loop, MODES[mode], args.steps, args.skip, watch, results[name].setdefault(mode, Samples()))
            print(f"round {r + 1}/{args.rounds} done at {time.perf_counter() - t_start:.0f} s, "
                  f"load {load_avg()[0]:.2f}", flush=True)
        if use_traceml and r < args.sub_rounds:
            own_process_round(r)
    watch.remove()
    if use_traceml:
        notes.append(f"TraceML ran in its own process, as `traceml run overhead.py --args --child ...` (its launcher "
                     f"starts an aggregator process and torchrun around the script: it cannot share this process), "
                     f"{args.sub_rounds} rounds of {sub_steps} steps, alternating with `traceml run --disable-traceml` "
                     f"(the same torchrun launch, TraceML off), the baseline of its ratio, each after an in-process "
                     f"round; TraceML's logs are in {log_dir}")
        notes.append("under torchrun the Trainer sees WORLD_SIZE=1 and wraps the model in DistributedDataParallel; "
                     "'none, traceml launcher' vs 'none' shows what that launch costs a Trainer loop before TraceML "
                     "does anything")

    rows = report(results, notes)
    path = write_rows(args.out, rows)
    print(f"\n{len(rows)} rows written to {path}; whole run {time.perf_counter() - t_start:.0f} s; "
          f"load average at end {' / '.join(f'{x:.2f}' for x in load_avg())}")


if __name__ == "__main__":
    main()
