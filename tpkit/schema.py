"""The one vocabulary of tpkit: the Run's tables and their columns, phases, memory categories,
clock metrics and their units, NVML throttle bits, and how bytes are written for people.

Every layer imports its names from here (capture writes them, analysis reads them, charts
colour them); nothing here imports another tpkit module.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd  # imported in ``frame``: the probes import this module at a slice's start

# -- phases ---------------------------------------------------------------------------------
#: Phases with a fixed column in ``run.steps``; every other phase name is a user phase.
#: ``tpkit`` is tpkit's own probe work, shown so that what tpkit costs is measured in every
#: run instead of hiding in ``other``. ``comm`` is time the rank was blocked in collectives
#: (capture/probes/comm.py): it is taken out of the phase it happened in. ``eval`` is evaluation
#: run inside the slice: the trained model called without grad in eval mode (or in train mode on
#: batches of a source that feeds no training), and the batches read for it
#: (capture/evaluation.py); its samples are not the step's. ``setup`` is a trainer's setup
#: inside the slice: from the previous run's last step (or the slice's start) to a new run's first
#: batch, what no other phase covered there (capture/setups.py). ``compile`` is torch.compile's
#: compilations inside the slice (dynamo's, and a backward graph's at its first run), taken out of
#: the forward or backward they ran in (capture/probes/compile.py).
BUILTIN_PHASES: tuple[str, ...] = ("data_wait", "h2d", "forward", "backward", "optimizer", "offload", "comm",
                                   "eval", "save", "setup", "compile", "tpkit")
#: Time no built-in phase covered.
OTHER = "other"
#: Every phase in the order a step usually runs, ``other`` last.
PHASE_ORDER: tuple[str, ...] = (*BUILTIN_PHASES, OTHER)
#: The per-phase columns of ``run.steps``.
PHASE_COLUMNS: tuple[str, ...] = tuple(f"{p}_s" for p in PHASE_ORDER)
#: Python collector pauses recorded as spans nested in the phase they interrupted.
GC_PHASE = "gc"
#: Collectives in flight behind compute (not waited for): spans kept in ``run.spans`` for the
#: timeline and trace exports, never charged to a step's phases.
COMM_OVERLAPPED = "comm_overlapped"
#: Files read in the loop's thread outside a wait for data (``torch.load``, safetensors): spans
#: of their own, whose time stays ``other_s`` (a checkpoint read back, or batches read with no
#: loader: tpkit cannot tell which), and a note says how much (capture/probes/phases.py). A
#: resume's 127 ms had been other with no word.
FILE_LOAD = "file_load"
#: The sources of those spans (a user's own ``tp.phase`` of any name is never one of them)
FILE_LOAD_SOURCES: tuple[str, ...] = ("torch.load", "safetensors.torch.load_file", "safetensors.torch.load_model")
#: Calls of a metric module (torchmetrics' ``Metric`` or ``MetricCollection``: ``train_acc(logits, y)``,
#: an update and a compute on the batch) outside evaluation: spans of their own whose time stays
#: ``other_s`` (not the model's forward), and a note says how much (capture/probes/phases.py). A
#: metric whose compute took 77% of the step had been forward, the verdict COMPUTE-BOUND.
METRIC_CALL = "metric_call"
#: ``torch.jit.trace`` (``trace_module``, ``_get_trace_graph``) run in the loop's thread: spans of
#: their own whose time stays ``other_s``, and a note says how much (capture/build.py). Its calls
#: of the model are no forward and no evaluation: TensorBoard's ``add_graph`` (tensorboardX's,
#: Lightning's ``log_graph=True``) traces the model in eval mode, and had read as an evaluation
#: of 2 calls, the verdict OVERHEAD-BOUND "between evaluation calls".
JIT_TRACE = "jit_trace"
#: Experiment trackers, whose hooks on a model observe it (``wandb.watch``; comet_ml's and
#: neptune's watches): the only packages whose hooks (``meta["model"]["hooks"]``,
#: capture/foreign_hooks.py) are called a tracker's and get advice. Any other package's hooks may be
#: how the model trains (a ZeRO-style parameter gather, a compression library's): named, no advice.
TRACKERS: frozenset[str] = frozenset({
    "wandb", "comet_ml", "neptune", "neptune_pytorch", "clearml", "aim", "mlflow", "tensorboard", "tensorboardX",
    "dvclive", "swanlab",
})
#: What to do about a tracker's hooks other than wandb's (whose advice reads its ``log_freq``).
TRACKER_REMEDY = "stop its watching of the model while profiling to time the model alone"


def hooks_phrase(hooks: dict[str, int]) -> str:
    """``"7 hook(s) of wandb on the model"``: the third-party hooks ``meta["model"]["hooks"]`` counts, in words."""
    return " and ".join(f"{n} hook(s) of {name}" for name, n in sorted(hooks.items())) + " on the model"


def hooks_remedy(hooks: dict[str, int], every: dict[str, int] | None = None, steps: int = 0) -> str:
    """What the note and the verdict advise about the trackers' hooks among ``hooks`` ("" for none):
    ``every``: how often each logs (``meta["model"]["hooks_log_freq"]``, wandb's ``log_freq``);
    ``steps``: the steps profiled. Hooks logging less often than once in those steps are advised
    nothing (``wandb.watch``'s default, every 1000th call, had been told to log "less often" with
    ``log_freq=100``); no advice names a smaller interval than theirs."""
    out: list[str] = []
    for name in sorted(hooks):
        if name not in TRACKERS:
            continue
        n = (every or {}).get(name)
        if name != "wandb":
            out.append(f"{name}: {TRACKER_REMEDY}")
        elif n is None:
            out.append("wandb: call wandb.unwatch(model) while profiling, or watch it with a larger log_freq")
        elif not steps or n <= steps:
            out.append(f"wandb.watch logs every {n} call(s) (log_freq={n}): call wandb.unwatch(model) while "
                       f"profiling, or watch it with a log_freq above the {steps} steps profiled")
    return "; ".join(dict.fromkeys(out))


#: Span phases left out of the steps table's accounting (they overlap the phases, not nest in them).
UNCOUNTED_PHASES: tuple[str, ...] = (COMM_OVERLAPPED,)
#: The source of a span a user opened with ``tp.phase(name)`` (capture/slice.py).
USER_PHASE_SOURCE = "tp.phase"
#: The source of an ``optimizer`` span that is ``optimizer.zero_grad()`` (capture/probes/phases.py),
#: not the parameter update: no place of the step is named after it (analysis/steps.py).
ZERO_GRAD_SOURCE = "zero_grad"


def user_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """The spans of phases the user named (``tp.phase``, whose source is ``USER_PHASE_SOURCE``)
    under a name that is no built-in phase (a built-in name counts as that phase). Any other name
    is the user's, ``gc``, ``file_load`` or ``metric_call`` included: tpkit's own spans of those
    names have sources of their own (a collection's generation, ``FILE_LOAD_SOURCES``, a metric's
    class), and a user's ``tp.phase("gc")`` had never been named. Their own time is ``other_s`` (capture/build.py): analysis/steps.py
    ``other_parts`` names it."""
    if spans.empty:
        return spans
    return spans[(spans["source"] == USER_PHASE_SOURCE) & ~spans["phase"].isin(BUILTIN_PHASES)]


#: Phases as a person reads them (waterfall bars, ops sections); a phase not listed keeps its name.
PHASE_NAMES: dict[str, str] = {
    "data_wait": "waiting for data", "h2d": "copy to device", "forward": "forward", "backward": "backward",
    "optimizer": "optimizer step", "offload": "offload", "comm": "collectives", "eval": "evaluation",
    "save": "saving checkpoints", "setup": "a trainer's setup", "compile": "compilation (torch.compile)",
    "tpkit": "tpkit's own work", "other": "other (no phase)", "gc": "garbage collection",
    FILE_LOAD: "files loaded (torch.load, safetensors; in other)",
    METRIC_CALL: "metric calls (torchmetrics; in other)",
    JIT_TRACE: "torch.jit.trace (in other)",
}

# -- memory ---------------------------------------------------------------------------------
#: Memory categories, in the order they are drawn.
#: ``activations`` are blocks allocated in forward (saved for backward) and ``temporaries`` blocks
#: allocated inside backward (autograd buffers, gradients in flight before they reach ``.grad``).
MEMORY_CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations", "temporaries",
                                      "data", "other")
#: Categories counted exactly from the tensors themselves.
KNOWN_MEMORY_CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "data")
#: Memory rows' ``event`` values: a phase boundary, or the highest point inside a phase.
MEMORY_EVENTS: tuple[str, ...] = ("enter", "exit", "peak")
#: How a run's note on steps ended where no optimizer hook ran begins, after its count (the
#: capture writes it, a comparison reads it: the update's time is other there, not optimizer)
UNSEEN_UPDATES_NOTE = "step(s) ended with no optimizer.step() tpkit saw run"
#: Why backward passes ran with no optimizer step seen, in each note that says so (no step
#: recorded; steps ended by ``tp.step()`` with optimizer time 0): the loop's optimizer is one tpkit
#: does not follow. A loop "without an optimizer" had been said of fastai's and Keras's fits.
UNSEEN_OPTIMIZER_NOTE = ("the loop's optimizer is not one tpkit sees (a framework's or a library's own, or an "
                         "update by hand; tpkit follows torch.optim optimizers, fastai's and Keras 3's)")
KIB = 1024
MIB = 1024 * 1024
GIB = 1024 * 1024 * 1024

# -- clocks ---------------------------------------------------------------------------------
#: Clock metric -> a person's title with its unit (metrics not listed are titled by name).
CLOCK_METRICS: dict[str, str] = {
    "sm_clock_mhz": "SM clock (MHz)",
    "mem_clock_mhz": "memory clock (MHz)",
    "cpu_freq_mhz": "CPU frequency (MHz)",
    "utilization_pct": "GPU utilisation (%)",
    "cpu_util_pct": "CPU utilisation (%)",
    "power_w": "GPU power (W)",
    "cpu_power_w": "CPU package power (W)",
    "temperature_c": "temperature (°C)",
    "energy_j": "energy (J)",
    "throttle_reasons": "throttle reasons (bitmask)",
}
#: NVML clock-event ("throttle") reason bits, from nvml.h.
THROTTLE_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}
#: The bits that mean the GPU ran slower than it could: idle and the clock settings are not
#: slowdowns, so a step is "throttled" only when one of these was set.
SLOWDOWN_MASK = 0x4 | 0x8 | 0x10 | 0x20 | 0x40 | 0x80 | 0x200 | 0x400


def decode_throttle(mask: float | int) -> list[str]:
    """Names of the bits set in an NVML clock-event bitmask (unknown bits as ``bit_0x...``)."""
    m = int(mask)
    names = [name for bit, name in THROTTLE_BITS.items() if m & bit]
    rest = m & ~sum(THROTTLE_BITS)
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"bit_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return names


#: The launch environment's variable that makes every rank save its run under ``DIR/rank<k>``.
ENV_SAVE_DIR = "TPKIT_SAVE_DIR"
#: Where exact CPU memory comes from: ``counter`` (the default where it can be built: tpkit's
#: CPU allocation counter) or ``stream`` (torch's profiler memory stream, which costs more per
#: allocation; always used on a machine with an accelerator, whose allocator reports only there).
ENV_CPU_ALLOCATIONS = "TPKIT_CPU_ALLOCATIONS"

#: ``run.meta["memory"]["cpu_source"]``: what the run's CPU memory was counted from.
CPU_SOURCE_COUNTER = "allocation counter (tpkit's CPU allocator wrapper)"
CPU_SOURCE_STREAM = "allocator stream (torch profiler memory events only)"
CPU_SOURCE_KNOWN_SETS = "known sets only"


#: ``run.meta["stopped_by"]``: how the slice ended.
STOPPED_BY: dict[str, str] = {
    "slice": "the slice was full (warmup + steps): tpkit stopped the loop, or the loop ran on unprofiled",
    "loop_end": "the loop ended by itself (before the slice was full, or with stop=False)",
    "body_returned": "the slice's body returned while the training loop it had started in another thread "
                     "ran on (the body never joined it), before the slice was full",
    "interrupt": "Ctrl-C (KeyboardInterrupt, or what a trainer made of one)",
    "error": "an exception, the loop's or tpkit's",
    "terminated": "SIGTERM",
    "stalled": "this rank saw no step end for TPKIT_RANK_TIMEOUT_S (a peer died or hangs)",
}


# -- the Run's tables -----------------------------------------------------------------------
#: Column name -> dtype, per table. The order is the public column order.
SCHEMAS: dict[str, dict[str, str]] = {
    "steps": {
        "step": "int64", "warmup": "bool", "start_s": "float64", "end_s": "float64",
        "duration_s": "float64", "samples": "int64", "data_wait_s": "float64", "h2d_s": "float64",
        "forward_s": "float64", "backward_s": "float64", "optimizer_s": "float64",
        "offload_s": "float64", "tpkit_s": "float64", "other_s": "float64", "throughput": "float64", "loss": "float64",
        "skipped": "bool", "comm_s": "float64", "eval_s": "float64", "save_s": "float64",
        "setup_s": "float64", "compile_s": "float64",
    },
    "spans": {
        "step": "int64", "phase": "object", "start_s": "float64", "end_s": "float64",
        "duration_s": "float64", "depth": "int64", "source": "object",
    },
    "memory": {
        "step": "int64", "phase": "object", "event": "object", "t_s": "float64",
        "device": "object", "category": "object", "bytes": "int64",
    },
    "clocks": {"t_s": "float64", "device": "object", "metric": "object", "value": "float64"},
    "loader": {
        "batch": "int64", "worker": "int64", "fetch_s": "float64", "collate_s": "float64",
        "queue_wait_s": "float64", "transfer_s": "float64",
    },
    # one row per operator event torch.profiler saw in the traced steps (``--ops``); times on
    # the slice's clock, self times exclusive of the op's children; shapes as text
    "ops": {
        "step": "int64", "op": "object", "start_s": "float64", "end_s": "float64",
        "self_cpu_s": "float64", "self_device_s": "float64", "input_shapes": "object",
    },
}
TABLES: tuple[str, ...] = tuple(SCHEMAS)
#: Tables added after the first layout: a saved run without the file loads them empty.
ADDED_TABLES: tuple[str, ...] = ("ops",)
#: Columns added after the first layout, with the value they take where a frame (a saved run,
#: rows built by hand) has none. They come last in their table, so positional rows of the
#: older layout still line up.
DEFAULTS: dict[str, dict[str, Any]] = {"steps": {"skipped": False, "comm_s": 0.0, "eval_s": 0.0, "save_s": 0.0,
                                           "setup_s": 0.0, "compile_s": 0.0}}
#: Version of the saved-run layout (``meta.json``'s ``tpkit_format``).
FORMAT_VERSION = 1


def frame(table: str, rows: Any = None) -> pd.DataFrame:
    """A frame with the table's columns and dtypes (strings as plain Python objects, so a
    Parquet round trip gives back the same frame)."""
    import pandas as pd  # after the slice: not in its start-up (capture/slice.py, _collect_startup)

    schema = SCHEMAS[table]
    defaults = DEFAULTS.get(table, {})
    columns = list(schema)
    if isinstance(rows, list) and rows and isinstance(rows[0], tuple) and len(rows[0]) < len(columns) \
            and all(c in defaults for c in columns[len(rows[0]):]):
        columns = columns[:len(rows[0])]  # positional rows of an older layout: the added columns come last
    df = pd.DataFrame(rows if rows is not None else [], columns=columns)
    for col, value in defaults.items():  # missing (NaN after reindexing) -> the default
        df[col] = df[col].astype(object).fillna(value) if col in df.columns else value
    for col, dtype in schema.items():
        if df[col].dtype == dtype:
            continue  # already right (a frame read back from Parquet): no copy
        if dtype == "object":
            df[col] = df[col].astype(object)
        else:
            df[col] = df[col].astype(dtype)
    return df


def jsonable(x: Any) -> Any:
    """``x`` with numpy scalars made plain, NaN made None and unknown objects made ``repr``:
    what ``json.dumps`` accepts, for ``meta.json`` and exports."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if math.isnan(float(x)) else float(x)
    if isinstance(x, (np.bool_,)):
        return bool(x)
    if x is None or isinstance(x, (str, int, bool)):
        return x
    return repr(x)


# -- people's units -------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: binary units, whole bytes below 1 KiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_mib(n: float) -> str:
    """Bytes as MiB with two decimals, for chart tooltips."""
    return f"{n / MIB:,.2f} MiB"


# -- verdicts -------------------------------------------------------------------------------
#: The bottleneck verdicts of a run, kind -> the headline every view shows (summary, report,
#: tuner, compare). ``analysis.steps.verdict`` picks one; nothing else names a verdict.
VERDICTS: dict[str, str] = {
    "eval-bound": "EVAL-BOUND",
    "save-bound": "SAVE-BOUND",
    "setup-bound": "SETUP-BOUND",
    "compile-bound": "COMPILE-BOUND",
    "input-bound": "INPUT-BOUND",
    "input-limited": "INPUT-LIMITED",
    "copy-bound": "COPY-BOUND",
    "offload-bound": "OFFLOAD-BOUND",
    "comm-bound": "COMM-BOUND",
    "optimizer-bound": "OPTIMIZER-BOUND",
    "overhead-bound": "OVERHEAD-BOUND",
    "compute-bound": "COMPUTE-BOUND",
    "no-steps": "NO STEPS",
}

# -- comparison metrics ---------------------------------------------------------------------
#: Comparison metric -> a person's name (phase shares, memory categories and energy devices
#: are named by ``metric_label``).
METRIC_LABELS: dict[str, str] = {
    "throughput": "throughput",
    "step_time_p50": "step time p50",
    "data_stall_share": "data stall",
    "loss_final": "final loss",
    "steps": "measured steps",
}


def metric_label(metric: str) -> str:
    """``'step_time_p50'`` -> ``'step time p50'``, ``'forward_share'`` -> ``'forward share'``,
    ``'peak_memory_total'`` -> ``'peak memory, total'``, ``'energy_per_sample[cuda:0]'`` ->
    ``'energy per sample (cuda:0)'``."""
    if metric in METRIC_LABELS:
        return METRIC_LABELS[metric]
    if metric.startswith("peak_memory_"):
        return "peak memory, " + metric[len("peak_memory_"):].replace("_", " ")
    if metric.startswith("energy_per_sample[") and metric.endswith("]"):
        return f"energy per sample ({metric[len('energy_per_sample['):-1]})"
    return metric.replace("_", " ")
