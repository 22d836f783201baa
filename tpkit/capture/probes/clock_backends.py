"""What the clock sampler reads: one backend per hardware library, each a plain object with
``read() -> list[(device, metric, value)]``, ``close()`` and ``meta() -> dict``.

Missing hardware is a null object, never a crash: ``open_backends()`` probes once per slice
and returns the backends that can read something, plus a ``NullBackend`` per source that
cannot, whose ``meta()`` says why. A backend never invents a value: a metric that cannot be
read at start is left out, and one that fails mid-run is dropped from then on; both are
recorded in ``meta()["dropped"]``.

Devices and metrics (DESIGN.md "The Run's tables"):

- host: ``cpu_freq_mhz`` and ``cpu_util_pct`` per core as ``"cpu0"``, ``"cpu1"``, ... (up to
  ``PER_CORE_MAX`` cores) plus their mean as ``"cpu"``; ``cpu_util_pct`` of this process
  alone as ``"process"`` (its CPU time over all cores' capacity, so it sits on the same
  0-100 scale as ``"cpu"`` and stays readable on a machine other people load); ``cpu_power_w`` (all RAPL packages
  summed, from energy-counter deltas) and ``temperature_c`` (hottest CPU sensor) as ``"cpu"``.
- NVML, per visible GPU as ``"cuda:<i>"`` (torch's numbering): ``sm_clock_mhz``,
  ``mem_clock_mhz``, ``power_w``, ``temperature_c``, ``utilization_pct``,
  ``throttle_reasons`` (the raw clock-event bitmask; ``decode_throttle`` names the bits) and
  ``energy_j`` (the GPU's total-energy counter, counted from the slice's first sample).
"""

from __future__ import annotations

import glob
import os
import re
import sys
import time
import weakref
from time import perf_counter_ns
from typing import Any, Callable, Protocol

from ...errors import MissingExtraError, NvmlError

Reading = tuple[str, str, float]  # (device, metric, value)

#: Above this many cores the host backend records only the ``"cpu"`` aggregate rows.
PER_CORE_MAX = 16

#: This process's utilisation (``time.process_time_ns``, exact) needs only a window of a few
#: scheduler ticks to mean anything; at higher sampling rates it is emitted at most this often.
UTIL_MIN_WINDOW_S = 0.03
#: The machine's per-core utilisation comes from /proc/stat, counted in jiffies (10 ms): over
#: a 50 ms window a core reads in 20% steps, over 200 ms in 5% steps. It is read at most this
#: often, whatever the sampling rate: finer windows would only add quantisation noise.
SYSTEM_UTIL_PERIOD_S = 0.2
#: CPU time the host's other readings (frequency, package power, temperature) may take, as a
#: share of one core. Their cost grows with the core count (one cpufreq file per core; a
#: /proc/cpuinfo of every core) and lands on cores the training loop uses: when one reading
#: costs more than this share at the sampling rate, they are read less often (every k-th
#: sample), and ``meta()["periods_s"]`` says how often they were read.
HOST_CPU_BUDGET = 0.0025

class Backend(Protocol):
    """A source of clock readings (host, NVML): ``read()`` gives ``(device, metric, value)`` rows."""
    name: str

    def read(self) -> list[Reading]: ...

    def close(self) -> None: ...

    def meta(self) -> dict[str, Any]: ...


class NullBackend:
    """A source with nothing to read; ``meta()`` keeps the reason for ``run.meta``."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason

    def read(self) -> list[Reading]:
        return []

    def close(self) -> None:
        pass

    def meta(self) -> dict[str, Any]:
        return {"sources": {self.name: f"unavailable: {self.reason}"}, "devices": [], "dropped": []}


# -- host ---------------------------------------------------------------------------------

_MHZ_RE = re.compile(rb"^cpu MHz\s*:\s*([0-9.]+)", re.M)
_FLAGS_RE = re.compile(r"^flags\s*:(.*)$", re.M)
_CPU_TEMP_CHIPS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "soc_thermal", "acpitz")


#: At most this many files are kept open by one host backend (a cpufreq file per core on a
#: host with hundreds of cores would take that many descriptors from the user's process); the
#: others are opened at each read.
KEEP_OPEN_MAX = 32


class _KernelFile:
    """A /proc or /sys file kept open and read again from offset 0 (``os.pread``): the kernel
    regenerates it on every read, and no open()/close() is paid per sample. With
    ``keep_open=False`` it is opened at each read instead (and ``close()`` only marks it closed)."""

    def __init__(self, path: str, keep_open: bool = True) -> None:
        self.path = path
        self.keep_open = keep_open
        self.closed = False
        self.fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) if keep_open else None
        if not keep_open:
            self.read()  # unreadable files fail here, as the kept-open ones fail at open

    def read(self) -> bytes:
        if self.closed:
            raise OSError(f"{self.path} is closed")
        if not self.keep_open:
            with open(self.path, "rb") as f:
                return f.read()
        assert self.fd is not None
        parts: list[bytes] = []
        offset = 0
        while True:
            chunk = os.pread(self.fd, 65536, offset)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            offset += len(chunk)

    def close(self) -> None:
        self.closed = True
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def _close_all(files: list[_KernelFile]) -> None:
    for f in files:
        f.close()


def _busy_total(t: Any) -> tuple[float, float]:
    """(busy, total) seconds of one ``psutil.cpu_times`` entry. Linux counts guest time inside
    user/nice already, so it is taken out of the total once; iowait is idle."""
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return total - t.idle - getattr(t, "iowait", 0.0), total


def stat_core_times(text: bytes) -> list[tuple[float, float]]:
    """(busy, total) jiffies of every core, in order, from /proc/stat's ``cpuN`` lines; the same
    accounting as ``_busy_total`` (guest time is inside user and nice; iowait is idle)."""
    out = []
    for line in text.splitlines():
        if line.startswith(b"cpu") and line[3:4].isdigit():
            v = [int(x) for x in line.split()[1:9]]  # user nice system idle iowait irq softirq steal
            total = float(sum(v))
            out.append((total - v[3] - (v[4] if len(v) > 4 else 0), total))
    return out


def _cpuinfo_head(proc: str) -> str | None:
    try:
        with open(f"{proc}/cpuinfo") as f:
            return f.read(65536)  # the first core's entry holds its flags
    except OSError:
        return None


def nominal_cpuinfo_clock(proc: str = "/proc") -> bool:
    """Whether /proc/cpuinfo's 'cpu MHz' is a constant on this x86 host: without the APERF/MPERF
    counters (the ``aperfmperf`` flag; most virtual machines lack it) and without a cpufreq
    driver, the kernel prints the clock it measured at boot (``cpu_khz``), the same at every
    read. Reading it again costs ~0.1 ms of CPU (the kernel regenerates the file) for nothing.
    False where that cannot be told (no flags line: not x86)."""
    m = _FLAGS_RE.search(_cpuinfo_head(proc) or "")
    return m is not None and "aperfmperf" not in m.group(1).split()


def virtual_machine(proc: str = "/proc") -> bool | None:
    """Whether this host is a virtual machine, from the x86 ``hypervisor`` CPU flag in
    ``/proc/cpuinfo``; None where that cannot be told (no flags line: ARM, another OS). A VM's
    /proc/cpuinfo gives a fixed frequency, and a host that runs other guests' work on the same
    physical core slows ours without any figure in the guest moving: measured on our 2-core
    VM, a fixed piece of work took 97 us or 175-190 us by turns, while /proc/cpuinfo read
    the same MHz and /proc/stat counted no steal time (docs/MEASURED.md)."""
    text = _cpuinfo_head(proc)
    m = None if text is None else _FLAGS_RE.search(text)
    return None if m is None else "hypervisor" in m.group(1).split()


def _cpu_index(path: str) -> int:
    """The core number in a ``.../cpuN/cpufreq/...`` path (sort key; -1 if none)."""
    m = re.search(r"cpu(\d+)/cpufreq", path)
    return int(m.group(1)) if m else -1


class HostBackend:
    """CPU frequency, utilisation, package power and temperature, each from the first source
    that reads on this machine. Sources are probed once, at construction."""

    name = "host"

    def __init__(self, proc: str = "/proc", sys_root: str = "/sys") -> None:
        import psutil

        self._psutil = psutil
        self._proc = proc
        self.virtual_machine = virtual_machine(proc)
        self.sources: dict[str, str] = {}
        self.dropped: list[str] = []
        ncores = psutil.cpu_count(logical=True) or os.cpu_count() or 1
        self.per_core = ncores <= PER_CORE_MAX
        if not self.per_core:
            self.dropped.append(f"per-core rows: {ncores} cores > {PER_CORE_MAX}, only the 'cpu' mean is kept")

        # Files read at every sample stay open (see _KernelFile); the finalizer closes them
        # should the backend be dropped without close().
        self._files: list[_KernelFile] = []
        self._finalizer = weakref.finalize(self, _close_all, self._files)

        # Frequency: cpufreq (kHz, moves with DVFS) else /proc/cpuinfo (MHz, often frozen on VMs).
        self._freq_files: list[_KernelFile] = []
        self._cpuinfo: _KernelFile | None = None
        self._freq: Callable[[], list[float]] | None = None
        self._fixed_freq = False  # a figure read once (see nominal_cpuinfo_clock)
        paths = sorted(glob.glob(f"{sys_root}/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq"), key=_cpu_index)
        if paths and self._try(lambda: self._open_cpufreq(paths)):
            self._freq = self._freq_cpufreq
            self.sources["cpu_freq_mhz"] = "cpufreq (scaling_cur_freq)"
        elif self._try(self._open_cpuinfo):
            self._freq = self._freq_cpuinfo
            self.sources["cpu_freq_mhz"] = "/proc/cpuinfo 'cpu MHz'"
            if nominal_cpuinfo_clock(proc):
                fixed = self._freq_cpuinfo()
                self._freq = lambda: fixed
                self._fixed_freq = True
                self.sources["cpu_freq_mhz"] += (" (read once: without APERF/MPERF counters or a cpufreq driver "
                                                 "the kernel gives the nominal clock, which never moves)")
        else:
            self.sources["cpu_freq_mhz"] = "unavailable: no cpufreq in sysfs and no 'cpu MHz' in /proc/cpuinfo"

        # Utilisation: deltas of each core's busy and total time (our own baseline;
        # psutil.cpu_percent keeps one process-wide baseline that any other caller would
        # disturb), from /proc/stat kept open where there is one (psutil opens and parses it in
        # Python: 0.2 ms a reading here, against 0.1 ms for the kernel's part), else psutil.
        self._ncores = ncores
        self._stat: _KernelFile | None = None
        if self._try(self._open_stat):
            self._core_times = self._stat_times
            self.sources["cpu_util_pct"] = "/proc/stat deltas"
        else:
            self._core_times = self._psutil_times
            self.sources["cpu_util_pct"] = "psutil.cpu_times deltas"
        self._last_times = self._core_times()
        self._last_times_ns = self._last_proc_t_ns = perf_counter_ns()
        self._last_proc_ns = time.process_time_ns()

        # Package power: RAPL energy counters (µJ, wrapping at max_energy_range_uj).
        self._rapl: list[tuple[_KernelFile, int]] = []
        for d in sorted(glob.glob(f"{sys_root}/class/powercap/intel-rapl:[0-9]*")):
            if ":" in os.path.basename(d).split("intel-rapl:", 1)[1]:
                continue  # a sub-domain (core, dram): the package already includes the cores
            try:
                with open(f"{d}/max_energy_range_uj") as f:
                    wrap = int(f.read())
                counter = _KernelFile(f"{d}/energy_uj")
            except (OSError, ValueError):
                continue
            try:
                int(counter.read())
            except (OSError, ValueError):
                counter.close()
                continue
            self._files.append(counter)
            self._rapl.append((counter, wrap))
        self._last_energy: tuple[int, list[int]] | None = None
        if self._rapl:
            self.sources["cpu_power_w"] = f"RAPL ({len(self._rapl)} package counters)"
            self._last_energy = (perf_counter_ns(), self._energy_uj())
        elif os.path.isdir(f"{sys_root}/class/powercap"):
            self.sources["cpu_power_w"] = "unavailable: RAPL energy_uj not readable (permissions?)"
        else:
            self.sources["cpu_power_w"] = "unavailable: no /sys/class/powercap (no RAPL on this host)"

        # Temperature: psutil's sensors, when it sees a CPU chip.
        self._temp_chip: str | None = None
        temps = self._sensors()
        for chip in _CPU_TEMP_CHIPS:
            if temps.get(chip):
                self._temp_chip = chip
                self.sources["temperature_c"] = f"psutil.sensors_temperatures ({chip})"
                break
        else:
            self.sources["temperature_c"] = "unavailable: psutil sees no CPU temperature sensor"

        # What the budget (HOST_CPU_BUDGET) decided: the period of the other readings, grown
        # from the sampling period when one reading costs more than the budget allows.
        self._other_cost_ns: float | None = None  # running estimate of one reading's CPU time
        self._next_other_ns = 0
        self._next_system_ns = 0
        self.other_period_s = 0.0  # the longest period the budget asked for so far

    # sources
    @staticmethod
    def _try(fn: Callable[[], list[Any]]) -> bool:
        try:
            return len(fn()) > 0
        except (OSError, ValueError, AttributeError):
            return False

    def _open_cpufreq(self, paths: list[str]) -> list[float]:
        keep = len(paths) <= KEEP_OPEN_MAX  # one file per core: beyond that, opened per read
        for path in paths:
            self._freq_files.append(_KernelFile(path, keep_open=keep))
            self._files.append(self._freq_files[-1])
        return self._freq_cpufreq()

    def _open_cpuinfo(self) -> list[float]:
        self._cpuinfo = _KernelFile(f"{self._proc}/cpuinfo")
        self._files.append(self._cpuinfo)
        return self._freq_cpuinfo()

    def _open_stat(self) -> list[tuple[float, float]]:
        self._stat = _KernelFile(f"{self._proc}/stat")
        self._files.append(self._stat)
        return self._stat_times()

    def _stat_times(self) -> list[tuple[float, float]]:
        assert self._stat is not None  # opened by _open_stat
        return stat_core_times(self._stat.read())

    def _psutil_times(self) -> list[tuple[float, float]]:
        return [_busy_total(t) for t in self._psutil.cpu_times(percpu=True)]

    def _freq_cpufreq(self) -> list[float]:
        return [int(f.read()) / 1000.0 for f in self._freq_files]  # kHz -> MHz

    def _freq_cpuinfo(self) -> list[float]:
        assert self._cpuinfo is not None  # opened by _open_cpuinfo
        return [float(x) for x in _MHZ_RE.findall(self._cpuinfo.read())]

    def _energy_uj(self) -> list[int]:
        return [int(f.read()) for f, _ in self._rapl]

    def _sensors(self) -> dict[str, Any]:
        fn = getattr(self._psutil, "sensors_temperatures", None)
        try:
            return fn() if fn is not None else {}
        except Exception:  # psutil raises assorted errors on odd hwmon trees
            return {}

    # reading
    def read(self) -> list[Reading]:
        rows: list[Reading] = []
        now = perf_counter_ns()
        self._read_process(rows, now)
        if now >= self._next_system_ns and self._read_system_util(rows, now):
            self._next_system_ns = now + int(SYSTEM_UTIL_PERIOD_S * 1e9)
        if now >= self._next_other_ns:
            cpu0 = time.thread_time_ns()
            self._read_others(rows)
            cost = time.thread_time_ns() - cpu0
            # the running estimate follows a cheaper reading slowly and a dearer one at once
            est = self._other_cost_ns
            self._other_cost_ns = est = float(cost) if est is None or cost > est else 0.8 * est + 0.2 * cost
            period = est / 1e9 / HOST_CPU_BUDGET
            if self._fixed_freq and not self._rapl and self._temp_chip is None:
                period = max(period, SYSTEM_UTIL_PERIOD_S)  # nothing read: rows often enough to draw
            self.other_period_s = max(self.other_period_s, period)
            self._next_other_ns = now + int(period * 1e9)
        return rows

    def _read_others(self, rows: list[Reading]) -> None:
        if self._freq is not None:
            try:
                self._per_core(rows, "cpu_freq_mhz", self._freq())
            except (OSError, ValueError) as e:
                self._drop("cpu_freq_mhz", e)
        if self._last_energy is not None:
            self._read_power(rows)
        if self._temp_chip is not None:
            entries = self._sensors().get(self._temp_chip) or []
            values = [t.current for t in entries if t.current is not None]
            if values:
                rows.append(("cpu", "temperature_c", float(max(values))))

    def _per_core(self, rows: list[Reading], metric: str, values: list[float]) -> None:
        if not values:
            return
        if self.per_core:
            rows.extend((f"cpu{i}", metric, v) for i, v in enumerate(values))
        rows.append(("cpu", metric, sum(values) / len(values)))

    def _read_process(self, rows: list[Reading], now: int) -> None:
        if (now - self._last_proc_t_ns) / 1e9 < UTIL_MIN_WINDOW_S:
            return
        proc = time.process_time_ns()
        proc_pct = 100.0 * (proc - self._last_proc_ns) / ((now - self._last_proc_t_ns) * self._ncores)
        self._last_proc_ns, self._last_proc_t_ns = proc, now
        rows.append(("process", "cpu_util_pct", min(100.0, max(0.0, proc_pct))))

    def _read_system_util(self, rows: list[Reading], now: int) -> bool:
        """Per-core and mean utilisation since the last reading; False if the window was
        too short to mean anything (then nothing is read)."""
        if (now - self._last_times_ns) / 1e9 < UTIL_MIN_WINDOW_S:
            return False
        times = self._core_times()
        util = []
        for (busy_new, total_new), (busy_old, total_old) in zip(times, self._last_times):
            total = total_new - total_old
            util.append(100.0 * min(1.0, max(0.0, (busy_new - busy_old) / total)) if total > 0 else None)
        self._last_times, self._last_times_ns = times, now
        if all(u is not None for u in util):
            self._per_core(rows, "cpu_util_pct", util)  # type: ignore[arg-type]
        return True

    def _read_power(self, rows: list[Reading]) -> None:
        assert self._last_energy is not None
        now = perf_counter_ns()
        try:
            energy = self._energy_uj()
        except (OSError, ValueError) as e:
            self._drop("cpu_power_w", e)
            self._last_energy = None
            return
        t_old, old = self._last_energy
        self._last_energy = (now, energy)
        dt = (now - t_old) / 1e9
        if dt <= 0:
            return
        joules = sum(((e - o) % wrap if wrap > 0 else e - o) for e, o, (_, wrap) in zip(energy, old, self._rapl)) / 1e6
        rows.append(("cpu", "cpu_power_w", joules / dt))

    def _drop(self, metric: str, err: Exception) -> None:
        self.dropped.append(f"cpu {metric}: dropped mid-run after {type(err).__name__}: {err}")
        if metric == "cpu_freq_mhz":
            self._freq = None

    def close(self) -> None:
        self._finalizer()

    def meta(self) -> dict[str, Any]:
        """``periods_s``: the shortest period each metric allows itself (the sampler's own
        period applies above it); ``budget``: what the costliest reading cost."""
        periods = {"process cpu_util_pct": UTIL_MIN_WINDOW_S, "cpu_util_pct": SYSTEM_UTIL_PERIOD_S}
        for metric in ("cpu_freq_mhz", "cpu_power_w", "temperature_c"):
            if not self.sources.get(metric, "unavailable").startswith("unavailable"):
                periods[metric] = self.other_period_s
        cost_ms = (self._other_cost_ns or 0.0) / 1e6
        return {"sources": dict(self.sources), "devices": ["cpu", "process"], "dropped": list(self.dropped),
                "periods_s": periods, "virtual_machine": self.virtual_machine,
                "budget": f"host frequency/power/temperature: {cost_ms:.3f} ms of CPU per reading, read at "
                          f"most every {self.other_period_s:.3f} s ({HOST_CPU_BUDGET:.2%} of one core)"}


# -- NVML ---------------------------------------------------------------------------------

def _nvml_call(nvml: Any, fn_name: str, *args: Any) -> Any:
    """Every NVML call goes through here: an ``NVMLError`` of any kind becomes ``NvmlError``
    (tpkit's one exception for it), keeping NVML's code and its own words."""
    try:
        return getattr(nvml, fn_name)(*args)
    except nvml.NVMLError as e:
        code = getattr(e, "value", None)
        raise NvmlError(f"{fn_name}: {e}", code=code, kind=type(e).__name__) from e


def _metric_readers(nvml: Any) -> dict[str, Callable[[Any], float]]:
    """metric -> fn(handle) returning the value in the metric's unit."""
    events = ("nvmlDeviceGetCurrentClocksEventReasons" if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
              else "nvmlDeviceGetCurrentClocksThrottleReasons")
    return {
        "sm_clock_mhz": lambda h: float(_nvml_call(nvml, "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM)),
        "mem_clock_mhz": lambda h: float(_nvml_call(nvml, "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_MEM)),
        "power_w": lambda h: _nvml_call(nvml, "nvmlDeviceGetPowerUsage", h) / 1000.0,  # mW
        "temperature_c": lambda h: float(_nvml_call(nvml, "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)),
        "utilization_pct": lambda h: float(_nvml_call(nvml, "nvmlDeviceGetUtilizationRates", h).gpu),
        "throttle_reasons": lambda h: float(_nvml_call(nvml, events, h)),
        "energy_j": lambda h: _nvml_call(nvml, "nvmlDeviceGetTotalEnergyConsumption", h) / 1000.0,  # mJ
    }


def _instant_power_w(nvml: Any, handle: Any) -> float:
    """The GPU's power now (W), from NVML's instant field where the driver has it; raises
    ``NvmlError`` where it does not."""
    field = getattr(nvml, "NVML_FI_DEV_POWER_INSTANT", None)
    if field is None or not hasattr(nvml, "nvmlDeviceGetFieldValues"):
        raise NvmlError("no instant power field in this pynvml", kind="NVMLError_NotSupported")
    value = _nvml_call(nvml, "nvmlDeviceGetFieldValues", handle, [field])[0]
    if getattr(value, "nvmlReturn", 0) != 0:
        raise NvmlError(f"instant power field: NVML return {value.nvmlReturn}", code=value.nvmlReturn,
                        kind="NVMLError_NotSupported")
    return float(value.value.uiVal) / 1000.0  # mW


def _handles_by_uuid(nvml: Any) -> list[tuple[str, Any]] | None:
    """(torch device name, NVML handle) matched through each device's UUID, when torch has a CUDA
    context already (asking for the UUIDs must not create one); None otherwise. NVML numbers GPUs
    by PCI bus, CUDA by speed unless CUDA_DEVICE_ORDER=PCI_BUS_ID: indices alone can pair a device
    with another GPU's readings."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    out = []
    for i in range(torch.cuda.device_count()):
        uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        if uuid is None:
            return None
        text = str(uuid)
        out.append((f"cuda:{i}", _nvml_call(nvml, "nvmlDeviceGetHandleByUUID",
                                             text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")))
    return out


def _visible_indices(nvml: Any, count: int) -> list[tuple[str, Any]]:
    """(torch device name, NVML handle) per GPU this process may use (CUDA_VISIBLE_DEVICES)."""
    try:
        by_uuid = _handles_by_uuid(nvml)
    except NvmlError:
        by_uuid = None
    if by_uuid is not None:
        return by_uuid
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [(f"cuda:{i}", _nvml_call(nvml, "nvmlDeviceGetHandleByIndex", i)) for i in range(count)]
    out = []
    for i, item in enumerate(x.strip() for x in env.split(",") if x.strip()):
        if item.isdigit():
            if int(item) >= count:
                break  # CUDA stops at the first invalid entry
            out.append((f"cuda:{i}", _nvml_call(nvml, "nvmlDeviceGetHandleByIndex", int(item))))
        else:
            out.append((f"cuda:{i}", _nvml_call(nvml, "nvmlDeviceGetHandleByUUID", item)))
    return out


#: NVML start-up failures seen in this process, by pynvml module: a machine without a driver
#: does not grow one between slices, so later slices skip the failing call (STYLE.md 4).
_NVML_FAILED: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


class NvmlBackend:
    """NVML readings per visible GPU. Build it with ``NvmlBackend.open()``, which returns a
    ``NullBackend`` when the package, the library or a GPU is missing."""

    name = "nvml"

    def __init__(self, nvml: Any, devices: list[tuple[str, Any]], names: dict[str, str]) -> None:
        self._nvml = nvml
        self._readers = _metric_readers(nvml)
        self.dropped: list[str] = []
        self.device_names = names
        self._energy0: dict[str, float] = {}
        self._last_energy: dict[str, tuple[int, float]] = {}  # dev -> (ns, J) of the previous sample
        #: Where each device's power_w comes from: "instant" (NVML's instant field), "energy"
        #: (the energy counter's derivative between samples) or "average" (nvmlDeviceGetPowerUsage,
        #: a ~1 s moving average on recent GPUs: steps shorter than that are smeared).
        self.power_source: dict[str, str] = {}
        # Which metrics each device can give, decided once: a metric that fails now is left out.
        self._plan: list[tuple[str, Any, list[str]]] = []
        for dev, handle in devices:
            ok = []
            for metric, fn in self._readers.items():
                try:
                    fn(handle)
                    ok.append(metric)
                except NvmlError as e:
                    self.dropped.append(f"{dev} {metric}: not readable ({e.kind})")
            self._plan.append((dev, handle, ok))
            self.power_source[dev] = self._choose_power(handle, ok)
        self.metrics_at_start = sorted({m for _, _, ms in self._plan for m in ms})

    def _choose_power(self, handle: Any, ok: list[str]) -> str:
        try:
            _instant_power_w(self._nvml, handle)
            if "power_w" not in ok:
                ok.append("power_w")
            return "instant"
        except NvmlError:
            pass
        if "energy_j" in ok:
            if "power_w" not in ok:
                ok.append("power_w")
            return "energy"
        return "average"

    @classmethod
    def open(cls) -> "NvmlBackend | NullBackend":
        try:
            import pynvml as nvml
        except ImportError:
            err = MissingExtraError("nvidia-ml-py", "gpu", "GPU clock and power sampling")
            return NullBackend(cls.name, str(err))
        if nvml in _NVML_FAILED:
            return NullBackend(cls.name, _NVML_FAILED[nvml])
        try:
            _nvml_call(nvml, "nvmlInit")
        except NvmlError as e:
            reason = _NVML_FAILED[nvml] = f"NVML did not start ({e.kind}): no NVIDIA driver or GPU here"
            return NullBackend(cls.name, reason)
        try:
            devices = _visible_indices(nvml, int(_nvml_call(nvml, "nvmlDeviceGetCount")))
            names = {}
            for dev, h in devices:
                try:
                    name = _nvml_call(nvml, "nvmlDeviceGetName", h)
                    names[dev] = name.decode() if isinstance(name, bytes) else str(name)
                except NvmlError:
                    names[dev] = "unknown"
        except NvmlError as e:
            cls._shutdown(nvml)
            return NullBackend(cls.name, f"NVML could not list GPUs ({e.kind})")
        if not devices:
            cls._shutdown(nvml)
            return NullBackend(cls.name, "NVML sees no GPU")
        return cls(nvml, devices, names)

    @staticmethod
    def _shutdown(nvml: Any) -> None:
        try:
            _nvml_call(nvml, "nvmlShutdown")
        except NvmlError:
            pass

    def read(self) -> list[Reading]:
        rows: list[Reading] = []
        for dev, handle, metrics in self._plan:
            source = self.power_source.get(dev, "average")
            for metric in list(metrics):
                if metric == "power_w" and source == "energy":
                    continue  # derived from the energy reading below
                try:
                    if metric == "power_w" and source == "instant":
                        value = _instant_power_w(self._nvml, handle)
                    else:
                        value = self._readers[metric](handle)
                except NvmlError as e:  # dropped from now on; what was read stays
                    metrics.remove(metric)
                    self.dropped.append(f"{dev} {metric}: dropped mid-run after {e.kind}")
                    continue
                if metric == "energy_j":
                    now = perf_counter_ns()
                    last = self._last_energy.get(dev)
                    self._last_energy[dev] = (now, value)
                    if source == "energy" and "power_w" in metrics and last is not None and now > last[0]:
                        rows.append((dev, "power_w", (value - last[1]) / ((now - last[0]) / 1e9)))
                    value -= self._energy0.setdefault(dev, value)
                rows.append((dev, metric, value))
        return rows

    def close(self) -> None:
        if self._nvml is not None:
            self._shutdown(self._nvml)
            self._nvml = None

    def meta(self) -> dict[str, Any]:
        notes = {"instant": "NVML's instant power field", "energy": "the energy counter's change between samples",
                 "average": "nvmlDeviceGetPowerUsage, a ~1 s average on recent GPUs (short steps are smeared)"}
        return {"sources": {"nvml": f"NVML, {len(self._plan)} GPU(s)"},
                "devices": [f"{d}: {self.device_names.get(d, 'unknown')}" for d, _, _ in self._plan],
                "dropped": list(self.dropped), "nvml_metrics": list(self.metrics_at_start),
                "power_w_from": {d: notes[s] for d, s in self.power_source.items()}}


def open_backends() -> list[Backend]:
    """Every clock source of this machine, each a real backend or a NullBackend saying why."""
    out: list[Backend] = []
    try:
        out.append(HostBackend())
    except Exception as e:  # a host we cannot read at all still runs the slice
        out.append(NullBackend("host", f"{type(e).__name__}: {e}"))
    out.append(NvmlBackend.open())
    return out
