"""The clock sampler: real host readings during a CPU-heavy slice (through %%tp_profile and
tp.profile), the NVML backend against a stand-in ``pynvml`` that replays recorded sequences,
the thread's life cycle, the analysis on hand-made frames, and the chart specs."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
import types
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from IPython.utils.capture import capture_output

import tpkit as tp
from tpkit.analysis import clocks as ca
from tpkit.analysis import steps as analysis
from tpkit.capture.probes import clock_backends as cb
from tpkit.capture.probes import clocks as clocks_mod
from tpkit.capture.recorder import Recorder
from tpkit.charts import clock_traces, clocks_with_timeline
from tpkit.charts.timeline import TIME_BRUSH_NAME
from tpkit.errors import MissingExtraError, NvmlError, TpkitError
from tpkit.run import SCHEMAS, Run
from tpkit.schema import decode_throttle
from tpkit.schema import frame as run_frame
from tpkit.views import html as report


def _clock_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == clocks_mod.THREAD_NAME and t.is_alive()]


# -- a stand-in for pynvml ------------------------------------------------------------------

class _NVMLError(Exception):
    def __init__(self, value: int = 999) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def _err(name: str, code: int) -> type:
    return type(name, (_NVMLError,), {"__init__": lambda self: _NVMLError.__init__(self, code)})


NotSupported = _err("NVMLError_NotSupported", 3)
GpuIsLost = _err("NVMLError_GpuIsLost", 15)
LibraryNotFound = _err("NVMLError_LibraryNotFound", 12)

#: Calls of one GPU, in NVML's own units, as a recording would give them (an H200 under load:
#: clocks dropping under a power cap, the cap bit set, the energy counter in mJ).
RECORDED = {
    "sm": [1980, 1980, 1755, 1620, 1980],
    "mem": [3201, 3201, 3201, 3201, 3201],
    "power": [310_000, 640_000, 700_000, 698_000, 420_000],  # mW
    "temp": [41, 44, 52, 58, 55],
    "util": [0, 100, 100, 100, 35],
    "events": [0x1, 0x0, 0x4, 0x4 | 0x20, 0x0],
    "energy": [5_000_000, 5_032_000, 5_067_000, 5_102_000, 5_123_000],  # mJ since driver load
}


def fake_pynvml(gpus: list[dict[str, list]] | None = None, init_error: type | None = None,
                throttle_api: str = "nvmlDeviceGetCurrentClocksEventReasons") -> types.ModuleType:
    """A module with pynvml's names that replays ``gpus[i][key]`` call by call (the last value
    repeats; an exception class in a sequence is raised at that call)."""
    gpus = [dict((k, list(v)) for k, v in g.items()) for g in (gpus if gpus is not None else [RECORDED])]
    calls: dict[tuple[int, str], int] = {}
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError
    m.NVMLError_NotSupported, m.NVMLError_GpuIsLost, m.NVMLError_LibraryNotFound = NotSupported, GpuIsLost, LibraryNotFound
    m.NVML_CLOCK_GRAPHICS, m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_TEMPERATURE_GPU = 0, 1, 2, 0
    m.log = []

    def replay(h: int, key: str) -> Any:
        seq = gpus[h].get(key)
        if seq is None:
            raise NotSupported()
        i = calls.get((h, key), 0)
        calls[(h, key)] = i + 1
        v = seq[min(i, len(seq) - 1)]
        if isinstance(v, type) and issubclass(v, BaseException):
            raise v()
        return v

    def init() -> None:
        m.log.append("init")
        if init_error is not None:
            raise init_error()

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.log.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: i if i < len(gpus) else (_ for _ in ()).throw(_err("NVMLError_InvalidArgument", 2)())
    m.nvmlDeviceGetName = lambda h: b"Fake H200" if h == 0 else "Fake H100"
    m.nvmlDeviceGetClockInfo = lambda h, c: replay(h, {1: "sm", 2: "mem"}[c])
    m.nvmlDeviceGetPowerUsage = lambda h: replay(h, "power")
    m.nvmlDeviceGetTemperature = lambda h, s: replay(h, "temp")
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=replay(h, "util"), memory=0)
    setattr(m, throttle_api, lambda h: replay(h, "events"))
    m.nvmlDeviceGetTotalEnergyConsumption = lambda h: replay(h, "energy")
    return m


@pytest.fixture
def nvml(monkeypatch):
    """Install a stand-in pynvml; returns a function to install another one."""
    def install(mod: types.ModuleType | None = None) -> types.ModuleType:
        mod = mod if mod is not None else fake_pynvml()
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return install


# -- the host, for real ---------------------------------------------------------------------

BUSY_IDLE_CELL = """
import time, torch
model = torch.nn.Linear(128, 128)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(100):
    t = time.perf_counter()
    if i % 2:
        while time.perf_counter() - t < 0.25:     # a busy step
            model(torch.randn(64, 128)).sum().backward()
    else:
        time.sleep(0.25)                          # an idle step
    opt.step()
    opt.zero_grad()
"""


def _busy_steps_show_more_cpu(run: Run) -> None:
    """Odd steps spin, even steps sleep: this process's CPU share per step must tell them
    apart. A ratio, not a level: on a machine others load, a busy step may get little CPU."""
    per = ca.step_clocks(run.clocks, run.measured_steps)
    util = per[(per["device"] == "process") & (per["metric"] == "cpu_util_pct")].set_index("step")["mean"]
    busy, idle = util[util.index % 2 == 1].mean(), util[util.index % 2 == 0].mean()
    assert busy > 2 * idle and busy > 1.0, (busy, idle)


def test_host_readings_change_during_a_cpu_heavy_slice_through_the_magic(ip, one_thread):
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 6 --warmup 0 --clock-hz 20 --name clocks_magic", BUSY_IDLE_CELL)
    assert not _clock_threads()
    run = ip.user_ns["_tp"]
    c = run.clocks
    assert list(c.columns) == list(SCHEMAS["clocks"]) and not c.empty
    # this process's share moves between busy and idle steps (the machine's total may not: other
    # people's work shares these cores); the machine's per-core and mean rows are there and sane
    util = c[(c["device"] == "process") & (c["metric"] == "cpu_util_pct")]["value"]
    assert len(util) >= 20  # ~3 s at 20 Hz
    assert util.nunique() > 1
    _busy_steps_show_more_cpu(run)
    assert {"cpu", "cpu0", "cpu1"} <= set(c.loc[c["metric"] == "cpu_util_pct", "device"])
    host = c.loc[c["metric"] == "cpu_util_pct", "value"]
    assert ((host >= 0) & (host <= 100)).all() and host.max() > 10
    freq = c[(c["device"] == "cpu") & (c["metric"] == "cpu_freq_mhz")]["value"]
    assert (freq > 100).all()  # read, moving or not (a VM's is frozen)
    assert c["t_s"].min() >= 0 and c["t_s"].max() <= run.steps["end_s"].max() + 0.5
    meta = run.meta["clocks"]
    # read about as often as the CPU budget let it (run.meta says how often: on a loaded machine
    # one reading costs more, so it is read less often; a busy sampler also skips late samples),
    # and never rarely
    span_s = c["t_s"].max() - c["t_s"].min()
    assert len(freq) >= min(20, span_s / meta["periods_s"]["cpu_freq_mhz"] / 2) and len(freq) >= 5
    assert meta["hz"] == 20.0 and meta["rows"] == len(c)
    assert meta["sources"]["cpu_util_pct"] == "/proc/stat deltas"
    assert {"cpu_freq_mhz", "cpu_power_w", "temperature_c", "nvml"} <= set(meta["sources"])
    # the cell showed the run; its dashboard has the clock section and the summary its clock line
    assert cap.outputs and "clocks_magic" in cap.outputs[-1].data["text/plain"]
    html = report.dashboard_html(run, include_js=False)
    assert "Clocks and power" in html and "time_brush" in html and "clock: cpu cpu_freq_mhz" in html


def test_host_backend_through_tp_profile_and_the_probe_shows_during_the_slice(one_thread):
    model = torch.nn.Linear(128, 128)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with tp.profile(steps=4, warmup=0, progress=False, clock_hz=50) as prof:
        for i in range(100):
            seen.append(len(_clock_threads()))
            t = time.perf_counter()
            while i % 2 and time.perf_counter() - t < 0.2:
                model(torch.randn(64, 128)).sum().backward()
            if not i % 2:
                time.sleep(0.2)
            opt.step()
            opt.zero_grad()
    # one sampler thread during the slice, none after: not at the next iteration's start either
    # (the loop stops at its first training action there)
    assert seen == [1] * 4 + [0]
    assert not _clock_threads()
    c = prof.run.clocks
    util = c[(c["device"] == "process") & (c["metric"] == "cpu_util_pct")]["value"]
    assert util.nunique() > 1
    _busy_steps_show_more_cpu(prof.run)
    assert prof.run.meta["clocks"]["samples"] >= 20
    periods = prof.run.meta["clocks"]["periods_s"]  # how often each host metric was read
    # read at the first sample after a metric's own period: 30 ms at 50 Hz is every 2nd sample
    assert periods["process cpu_util_pct"] == 0.04
    assert periods["cpu_util_pct"] == cb.SYSTEM_UTIL_PERIOD_S
    assert periods["cpu_freq_mhz"] >= 1 / 50
    sys_util = c[(c["device"] == "cpu") & (c["metric"] == "cpu_util_pct")]["t_s"].diff().dropna()
    assert (sys_util >= cb.SYSTEM_UTIL_PERIOD_S - 0.005).all()
    s = analysis.summarize(prof.run.steps, prof.run.meta, c)
    assert s.clocks["metric"] == "cpu_freq_mhz" and s.clock_lines


def test_clocks_off_gives_an_empty_table_and_no_thread(ip):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs in ({"clock_hz": 0}, {"clocks": False}):
        seen = []
        with tp.profile(steps=2, warmup=0, progress=False, **kwargs) as prof:
            for _ in range(10):
                seen.append(len(_clock_threads()))
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
        assert seen == [0, 0, 0] and prof.run.clocks.empty  # (the 3rd: the iteration the loop stops in)
        assert list(prof.run.clocks.columns) == list(SCHEMAS["clocks"])
        assert "clocks" not in prof.run.meta
        assert "Clocks and power" not in [t for t, _ in report.section_charts(prof.run)]
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --clock-hz 0 --quiet", BUSY_IDLE_CELL.replace("0.25", "0.01"))
    assert ip.user_ns["_tp"].clocks.empty


def test_thread_is_gone_after_a_failing_cell_and_the_partial_trace_is_kept(ip):
    cell = BUSY_IDLE_CELL.replace("0.25", "0.06").replace("    opt.zero_grad()",
                                                          "    opt.zero_grad()\n    if i == 2: raise ValueError('cell failed')")
    with pytest.raises(ValueError, match="cell failed"):
        with capture_output():
            ip.run_cell_magic("tp_profile", "--steps 10 --warmup 0 --clock-hz 100 --quiet", cell)
    assert not _clock_threads()
    run = tp.last_run()
    assert not run.complete and not run.clocks.empty and run.meta["clocks"]["samples"] >= 2


# -- the probe's life cycle -------------------------------------------------------------------

class _Counting:
    name = "counting"

    def __init__(self) -> None:
        self.n, self.closed = 0, 0

    def read(self) -> list[cb.Reading]:
        self.n += 1
        return [("cpu", "cpu_util_pct", float(self.n))]

    def close(self) -> None:
        self.closed += 1

    def meta(self) -> dict:
        return {"sources": {"counting": "test"}, "devices": ["cpu"], "dropped": []}


def test_remove_is_idempotent_and_hands_rows_to_the_recorder():
    rec, backend = Recorder("t"), _Counting()
    probe = clocks_mod.ClockProbe(rec, hz=200, backends=[backend]).install()
    assert probe.alive
    time.sleep(0.05)
    probe.remove()
    probe.remove()
    assert not probe.alive and backend.closed == 1
    values = [v for _, _, _, v in rec.clocks]
    assert values == [float(i) for i in range(1, len(values) + 1)] and len(values) >= 3
    assert all(t >= rec.t0_ns for t, _, _, _ in rec.clocks)
    meta = probe.meta()["clocks"]
    assert meta["rows"] == len(values) and meta["sources"] == {"counting": "test"}


def test_a_dropped_probe_stops_its_thread():
    backend = _Counting()
    probe = clocks_mod.ClockProbe(Recorder("t"), hz=100, backends=[backend]).install()
    thread = probe._thread
    del probe
    gc.collect()
    thread.join(3)
    assert not thread.is_alive() and backend.closed == 1


def test_the_buffer_is_bounded(monkeypatch):
    monkeypatch.setattr(clocks_mod, "MAX_ROWS", 5)
    rec = Recorder("t")
    probe = clocks_mod.ClockProbe(rec, hz=200, backends=[_Counting()]).install()
    time.sleep(0.08)
    probe.remove()
    assert len(rec.clocks) == 5
    assert any("clock buffer full" in n for n in rec.notes)


def test_a_failing_backend_does_not_stop_the_others():
    class Broken(_Counting):
        name = "broken"

        def read(self) -> list[cb.Reading]:
            raise RuntimeError("driver hiccup")

    rec = Recorder("t")
    probe = clocks_mod.ClockProbe(rec, hz=200, backends=[Broken(), _Counting()]).install()
    time.sleep(0.03)
    probe.remove()
    assert rec.clocks and "broken: RuntimeError: driver hiccup" in probe.meta()["clocks"]["errors"][0]


def test_rate_limits():
    with pytest.raises(ValueError):
        clocks_mod.ClockProbe(Recorder("t"), hz=201)
    with pytest.raises(TpkitError):
        tp.profile(clock_hz=500)
    assert clocks_mod.clock_probe(Recorder("t"), types.SimpleNamespace(clock_hz=0)) is None


# -- NVML against the stand-in ----------------------------------------------------------------

def test_nvml_backend_replays_a_recording_in_tpkit_units(nvml, monkeypatch):
    host_ns = iter(range(0, 10**10, 50_000_000))  # a sample every 50 ms
    monkeypatch.setattr(cb, "perf_counter_ns", lambda: next(host_ns))
    mod = nvml()
    b = cb.NvmlBackend.open()
    assert isinstance(b, cb.NvmlBackend)
    reads = [dict(((d, m), v) for d, m, v in b.read()) for _ in range(5)]
    b.close()
    b.close()
    assert mod.log == ["init", "shutdown"]
    assert [r[("cuda:0", "sm_clock_mhz")] for r in reads] == [1980, 1755, 1620, 1980, 1980]  # call 1 was the probe
    # no instant field here: power is the energy counter's change over the 50 ms between samples
    # (NVML's own power reading is a ~1 s average on recent GPUs)
    assert b.power_source == {"cuda:0": "energy"}
    assert [r.get(("cuda:0", "power_w")) for r in reads] == [None, 700.0, 700.0, 420.0, 0.0]
    assert [r[("cuda:0", "energy_j")] for r in reads] == [0.0, 35.0, 70.0, 91.0, 91.0]  # counted from the first sample
    assert [r[("cuda:0", "throttle_reasons")] for r in reads] == [0.0, 4.0, 36.0, 0.0, 0.0]
    assert reads[0][("cuda:0", "mem_clock_mhz")] == 3201 and reads[0][("cuda:0", "temperature_c")] == 44
    assert reads[0][("cuda:0", "utilization_pct")] == 100
    assert b.meta()["devices"] == ["cuda:0: Fake H200"] and b.meta()["dropped"] == []
    assert decode_throttle(36) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert decode_throttle(0x1 | 0x200 | 0x400) == ["gpu_idle", "board_limit", "reliability"]
    assert decode_throttle(0x1 | 0x800) == ["gpu_idle", "bit_0x800"]


def test_nvml_power_from_the_instant_field_when_the_driver_has_it(nvml):
    mod = fake_pynvml()
    mod.NVML_FI_DEV_POWER_INSTANT = 186
    readings = iter([512_000, 515_000, 640_000])
    mod.nvmlDeviceGetFieldValues = lambda h, ids: [types.SimpleNamespace(
        nvmlReturn=0, value=types.SimpleNamespace(uiVal=next(readings)))]
    nvml(mod)
    b = cb.NvmlBackend.open()
    assert b.power_source == {"cuda:0": "instant"}
    assert [dict(((d, m), v) for d, m, v in b.read())[("cuda:0", "power_w")] for _ in range(2)] == [515.0, 640.0]
    assert "instant" in b.meta()["power_w_from"]["cuda:0"]


def test_nvml_pairs_cuda_devices_with_gpus_by_uuid_not_by_index(nvml, monkeypatch):
    import torch

    two = fake_pynvml([RECORDED, dict(RECORDED, sm=[1410])])
    two.nvmlDeviceGetHandleByUUID = lambda u: {"GPU-aaaa": 1, "GPU-bbbb": 0}[u]  # NVML's order is the PCI bus
    nvml(two)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid=["aaaa", "bbbb"][i]))
    b = cb.NvmlBackend.open()
    sm = dict(((d, m), v) for d, m, v in b.read())
    assert sm[("cuda:0", "sm_clock_mhz")] == 1410  # cuda:0 is NVML's GPU 1
    assert sm[("cuda:1", "sm_clock_mhz")] == 1980


def test_nvml_missing_metric_and_error_mid_run_are_dropped_and_noted_never_invented(nvml):
    gpu = dict(RECORDED)
    del gpu["energy"]  # an older GPU: no total-energy counter
    gpu["power"] = [300_000, 310_000, GpuIsLost, 320_000]  # fails at the third call
    nvml(fake_pynvml([gpu], throttle_api="nvmlDeviceGetCurrentClocksThrottleReasons"))  # older pynvml name
    b = cb.NvmlBackend.open()
    metrics = [sorted(m for _, m, _ in b.read()) for _ in range(4)]
    assert "energy_j" not in metrics[0]
    assert "power_w" in metrics[0] and all("power_w" not in m for m in metrics[1:])
    assert "throttle_reasons" in metrics[0]
    dropped = b.meta()["dropped"]
    assert "cuda:0 energy_j: not readable (NVMLError_NotSupported)" in dropped
    assert "cuda:0 power_w: dropped mid-run after NVMLError_GpuIsLost" in dropped


def test_nvml_through_a_slice_lands_in_the_run_with_meta(nvml):
    nvml()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tp.profile(steps=3, warmup=0, progress=False, clock_hz=100) as prof:
        for _ in range(10):
            time.sleep(0.03)
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    run = prof.run
    gpu = run.clocks[run.clocks["device"] == "cuda:0"]
    assert set(gpu["metric"]) == {"sm_clock_mhz", "mem_clock_mhz", "power_w", "temperature_c",
                                  "utilization_pct", "throttle_reasons", "energy_j"}
    assert run.meta["clocks"]["devices"] == ["cpu", "process", "cuda:0: Fake H200"]
    assert run.meta["clocks"]["sources"]["nvml"] == "NVML, 1 GPU(s)"
    s = ca.clock_summary(run.clocks, run.steps)
    assert s.device == "cuda:0" and s.metric == "sm_clock_mhz" and s.clock_moved
    assert s.energy["cuda:0"]["source"] == "counter"
    assert not ca.throttle_bands(run.clocks).empty
    assert "cuda:0 sm_clock_mhz" in "\n".join(analysis.summarize(run.steps, run.meta, run.clocks).clock_lines)


def test_nvml_absent_is_a_null_backend_that_names_the_extra(nvml, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    b = cb.NvmlBackend.open()
    assert isinstance(b, cb.NullBackend) and b.read() == []
    assert "pip install 'tpkit[gpu]'" in b.meta()["sources"]["nvml"]
    assert isinstance(MissingExtraError("nvidia-ml-py", "gpu", "x"), ImportError)

    mod = nvml(fake_pynvml(init_error=LibraryNotFound))
    b = cb.NvmlBackend.open()
    assert isinstance(b, cb.NullBackend) and "NVMLError_LibraryNotFound" in b.reason
    assert cb.NvmlBackend.open().reason == b.reason
    assert mod.log == ["init"]  # probed once: the next slice does not try again

    mod = nvml(fake_pynvml(gpus=[]))
    b = cb.NvmlBackend.open()
    assert isinstance(b, cb.NullBackend) and b.reason == "NVML sees no GPU" and mod.log == ["init", "shutdown"]


def test_every_nvml_error_maps_to_one_tpkit_exception(nvml):
    mod = nvml()
    with pytest.raises(NvmlError) as info:
        cb._nvml_call(mod, "nvmlDeviceGetHandleByIndex", 7)
    e = info.value
    assert isinstance(e, TpkitError) and e.kind == "NVMLError_InvalidArgument" and e.code == 2
    assert isinstance(e.__cause__, mod.NVMLError)


def test_nvml_follows_cuda_visible_devices(nvml, monkeypatch):
    second = dict(RECORDED, sm=[1410])
    nvml(fake_pynvml([RECORDED, second]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    b = cb.NvmlBackend.open()
    rows = b.read()
    assert {d for d, _, _ in rows} == {"cuda:0"}
    assert ("cuda:0", "sm_clock_mhz", 1410.0) in rows and b.meta()["devices"] == ["cuda:0: Fake H100"]


def test_real_pynvml_on_this_machine_gives_a_null_or_real_backend():
    b = cb.NvmlBackend.open()  # no GPU here: NVMLError_LibraryNotFound -> null; on a GPU: real
    try:
        assert isinstance(b, (cb.NullBackend, cb.NvmlBackend))
    finally:
        b.close()


# -- analysis on hand-made frames -------------------------------------------------------------

def _frame(rows: list[tuple]) -> pd.DataFrame:
    return run_frame("clocks", rows)


def _full(steps: pd.DataFrame) -> pd.DataFrame:
    """A hand-made steps frame with every column of ``run.steps`` (phases at 0)."""
    return run_frame("steps", steps.assign(**{c: 0.0 for c in SCHEMAS["steps"] if c not in steps})[list(SCHEMAS["steps"])])


T = np.round(np.arange(0, 1.01, 0.1), 10)
STEPS = pd.DataFrame({"step": [-1, 0, 1], "warmup": [True, False, False], "start_s": [0.0, 0.2, 0.6],
                      "end_s": [0.2, 0.6, 1.0], "duration_s": [0.2, 0.4, 0.4], "samples": [8, 8, 10]})


def test_step_means_are_time_weighted_over_the_sampled_line():
    clocks = _frame([(t, "cuda:0", "sm_clock_mhz", 1000 + 1000 * t) for t in T]
                    + [(t, "cpu", "cpu_freq_mhz", 2596.0) for t in T])
    per = ca.step_clocks(clocks, STEPS).set_index(["device", "metric", "step"])["mean"]
    assert per[("cuda:0", "sm_clock_mhz", -1)] == pytest.approx(1100)
    assert per[("cuda:0", "sm_clock_mhz", 0)] == pytest.approx(1400)
    assert per[("cuda:0", "sm_clock_mhz", 1)] == pytest.approx(1800)
    assert (per.xs(("cpu", "cpu_freq_mhz"), level=[0, 1]) == 2596.0).all()
    # a step between two samples gets the line's value there; one outside the samples gets NaN
    t, v = np.array([0.0, 1.0]), np.array([100.0, 200.0])
    got = ca.window_mean(t, v, np.array([0.25, 2.0, 0.5]), np.array([0.35, 3.0, 0.5]))
    assert got[0] == pytest.approx(130) and np.isnan(got[1]) and got[2] == pytest.approx(150)


def test_energy_per_step_from_the_counter_and_from_power():
    counter = _frame([(t, "cuda:0", "energy_j", 80.0 * t) for t in T] + [(t, "cuda:0", "power_w", 1.0) for t in T])
    e = ca.step_energy(counter, STEPS).set_index("step")
    assert list(e["source"]) == ["counter"] * 3  # the counter wins over power
    assert e["energy_j"].to_dict() == pytest.approx({-1: 16.0, 0: 32.0, 1: 32.0})
    assert e.loc[1, "energy_per_sample_j"] == pytest.approx(3.2)
    ramp = _frame([(t, "cpu", "cpu_power_w", 100.0 * t) for t in T])  # 0 -> 100 W over 1 s
    e = ca.step_energy(ramp, STEPS).set_index("step")
    assert list(e["source"]) == ["power"] * 3
    assert e["energy_j"].to_dict() == pytest.approx({-1: 2.0, 0: 16.0, 1: 32.0})
    # a step half outside the samples is scaled by its covered share; under MIN_COVER it is NaN
    late = pd.DataFrame({"step": [0, 1], "warmup": [False, False], "start_s": [0.9, 0.95], "end_s": [1.05, 1.25],
                         "duration_s": [0.15, 0.3], "samples": [1, 1]})
    e = ca.step_energy(counter, late)
    assert e["energy_j"].iloc[0] == pytest.approx(8.0 * 0.15 / 0.1) and np.isnan(e["energy_j"].iloc[1])


def test_throttled_steps_and_bands():
    masks = [1, 1, 0, 0, 4, 4, 36, 0, 0, 0, 0]  # idle, then a power cap, then cap + thermal
    clocks = _frame([(t, "cuda:0", "throttle_reasons", float(m)) for t, m in zip(T, masks)])
    thr = ca.step_throttle(clocks, STEPS).set_index("step")
    assert thr["mask"].to_dict() == {-1: 1, 0: 36 | 4 | 0, 1: 36}
    assert thr["throttled"].to_dict() == {-1: False, 0: True, 1: True}  # idle is not throttling
    assert thr.loc[0, "reasons"] == "sw_power_cap, sw_thermal_slowdown"
    bands = ca.throttle_bands(clocks)
    assert bands["start_s"].tolist() == pytest.approx([0.0, 0.4, 0.6])
    assert bands["end_s"].tolist() == pytest.approx([0.2, 0.6, 0.7])
    assert bands["mask"].tolist() == [1, 4, 36]
    assert bands["slowdown"].tolist() == [False, True, True]
    # a step with no sample inside holds the last sample before it
    short = pd.DataFrame({"step": [0], "warmup": [False], "start_s": [0.42], "end_s": [0.44], "duration_s": [0.02],
                          "samples": [1]})
    assert ca.step_throttle(clocks, short)["mask"].tolist() == [4]


def test_correlation_and_slowest_steps():
    steps = pd.DataFrame({"step": [0, 1, 2, 3], "warmup": [False] * 4, "start_s": [0.0, 1.0, 2.0, 3.0],
                          "end_s": [1.0, 2.0, 3.0, 4.0], "duration_s": [0.10, 0.20, 0.10, 0.30], "samples": [4] * 4})
    clock_by_step = [1900.0, 1700.0, 1900.0, 1500.0]  # slower steps ran at lower clocks
    clocks = _frame([(s + f, "cuda:0", "sm_clock_mhz", c) for s, c in enumerate(clock_by_step) for f in (0.0, 0.999)])
    per = ca.step_clocks(clocks, steps)
    slow = ca.slowest_steps(steps, per, "cuda:0", "sm_clock_mhz", n=2)
    assert slow["step"].tolist() == [3, 1] and slow["clock"].tolist() == pytest.approx([1500.0, 1700.0], abs=1.0)
    r = ca.clock_correlation(steps["duration_s"].to_numpy(), np.array(clock_by_step))
    assert r == pytest.approx(-1.0)
    assert np.isnan(ca.clock_correlation(np.array([1.0, 2.0, 3.0]), np.array([2596.0] * 3)))  # flat: says nothing
    noisy_flat = np.array([2596.1280000000006, 2596.1279999999997, 2596.128])  # means of a flat clock
    assert np.isnan(ca.clock_correlation(np.array([1.0, 2.0, 3.0]), noisy_flat))
    assert np.isnan(ca.clock_correlation(np.array([1.0, 2.0]), np.array([1.0, 2.0])))  # too few steps
    s = ca.clock_summary(clocks, steps)
    assert s.correlation == pytest.approx(-1.0, abs=1e-3) and s.clock_moved and s.slowest[0]["step"] == 3
    assert "step time vs clock r = -1.00" in s.lines()[0] and "slowest step 3" in s.lines()[0]


def test_summary_lines_and_figures():
    clocks = _frame([(t, "cpu", "cpu_freq_mhz", 2596.0) for t in T] + [(t, "cuda:0", "energy_j", 80.0 * t) for t in T])
    s = analysis.summarize(_full(STEPS), {"name": "x", "warmup_steps": 1}, clocks)
    assert s.clock_lines == [
        "clock: cpu cpu_freq_mhz mean 2,596 MHz (did not change during the slice: no DVFS to see on this host)",
        "energy: cuda:0 32 J/step, 3.56 J/sample (energy counter)",
    ]
    fig = s.to_frame().set_index("figure")
    assert fig.loc["energy per sample (cuda:0)", "value"] == pytest.approx(64 / 18)
    assert "clock: cpu" in s.to_text()
    assert analysis.summarize(_full(STEPS), {}).clock_lines == []  # no clocks, no lines
    assert ca.clock_summary(_frame([]), STEPS) is None


def test_measured_steps_with_no_reading_inside_say_so_and_give_the_nearest():
    """A slice shorter than the sampling period (0.2 s): every reading of the clock falls before
    its measured steps. The summary and the dashboard had printed "mean nan MHz (steady)"; they
    say there was no reading inside the steps, and the nearest one with its distance.
    Truth: the readings' known times (0.0 and 0.2 s) and the steps' (0.30 to 0.34 s)."""
    steps = pd.DataFrame({"step": [-1, 0, 1], "warmup": [True, False, False], "start_s": [0.25, 0.30, 0.32],
                          "end_s": [0.30, 0.32, 0.34], "duration_s": [0.05, 0.02, 0.02], "samples": [8, 8, 8]})
    clocks = _frame([(0.0, "cpu", "cpu_freq_mhz", 2596.0), (0.2, "cpu", "cpu_freq_mhz", 2596.0)])
    s = analysis.summarize(_full(steps), {"name": "x", "warmup_steps": 1}, clocks)
    assert s.clock_lines[0] == ("clock: cpu cpu_freq_mhz no reading inside the measured steps; the nearest, "
                                f"0.10 s before them: 2,596 MHz ({ca.FLAT_CLOCK})")
    assert s.clocks["nearest_gap_s"] == pytest.approx(-0.1)
    run = Run(steps=_full(steps), clocks=clocks, meta={"name": "short", "warmup_steps": 1})
    figures = dict(report.key_figures(run))
    assert figures["CPU frequency (cpu)"] == "No reading inside the measured steps; the nearest, 0.10 s before them: 2,596 MHz"
    assert "nan" not in " ".join(figures.values())
    assert ca.clock_summary(clocks, STEPS).clock_text("MHz") == "mean 2,596 MHz"  # readings inside: their mean


def test_trace_frame_downsamples_long_runs_and_keeps_flat_lines_flat():
    t = np.linspace(0, 100, 5000)
    clocks = _frame([(x, "cpu", "cpu_freq_mhz", 2596.0) for x in t] + [(x, "cpu", "cpu_util_pct", x % 7) for x in t]
                    + [(x, "cuda:0", "throttle_reasons", 4.0) for x in t[:10]])
    tr = ca.trace_frame(clocks, max_rows=1000)
    assert len(tr) == 1000 and set(tr["metric"]) == {"cpu_freq_mhz", "cpu_util_pct"}
    assert (tr.loc[tr["metric"] == "cpu_freq_mhz", "value"] == 2596.0).all()
    assert len(ca.trace_frame(clocks.head(100))) == 100


# -- charts and the dashboard -----------------------------------------------------------------

def _trace() -> pd.DataFrame:
    return _frame([(t, d, "cpu_freq_mhz", 2596.0) for t in T for d in ("cpu", "cpu0")]
                  + [(t, "cpu", "cpu_util_pct", 50 + 40 * np.sin(7 * t)) for t in T]
                  + [(t, "cuda:0", "power_w", 300 + 100 * t) for t in T])


def test_clock_chart_spec():
    bands = pd.DataFrame({"device": ["cuda:0"], "start_s": [0.4], "end_s": [0.7], "mask": [4],
                          "reasons": ["sw_power_cap"], "slowdown": [True]})
    spec = clock_traces(_trace(), STEPS, bands).to_dict()
    strip, body = spec["vconcat"]  # the overview strip holds the brush; the panels zoom to it
    panels = body["vconcat"]
    titles = [p["title"]["text"] for p in panels]
    assert titles == ["CPU frequency (MHz): constant 2,596 during the slice", "CPU utilisation (%)", "GPU power (W)"]
    assert body["resolve"]["scale"]["x"] == "shared"
    (brush,) = spec["params"]
    assert brush["name"] == TIME_BRUSH_NAME and brush["select"]["encodings"] == ["x"] and brush["views"] == [strip["name"]]
    zoom = {"param": TIME_BRUSH_NAME, "encoding": "x"}
    assert all(layer["encoding"]["x"]["scale"]["domain"] == zoom for p in panels for layer in p["layer"])
    layers = panels[0]["layer"]
    assert [layer["mark"]["type"] for layer in layers] == ["rect", "rule", "line"]
    assert layers[1]["encoding"]["x"]["field"] == "end_s" and layers[2]["encoding"]["x"]["field"] == "t_s"
    flat_scale = layers[2]["encoding"]["y"]["scale"]["domain"]
    assert flat_scale[0] < 2596.0 < flat_scale[1]  # centred, not stretched into noise


def test_clock_chart_shares_x_with_the_stall_timeline_and_the_dashboard_section():
    spans = pd.DataFrame({"step": [0, 0], "phase": ["forward", "backward"], "start_s": [0.2, 0.4],
                          "end_s": [0.4, 0.6], "duration_s": [0.2, 0.2], "depth": [0, 0], "source": ["hook", "hook"]})
    spec = clocks_with_timeline(analysis.timeline_frame(spans), _trace(), STEPS).to_dict()
    strip, body = spec["vconcat"]
    assert len(body["vconcat"]) == 4 and body["resolve"]["scale"]["x"] == "shared"
    assert [p["name"] for p in spec["params"]] == [TIME_BRUSH_NAME]  # one zoom for the timeline and the clocks
    import vl_convert as vlc

    assert vlc.vegalite_to_vega(spec)["marks"]  # a valid Vega-Lite spec
    run = Run(steps=_full(STEPS), spans=run_frame("spans", spans),
              clocks=_trace(), meta={"name": "hand"})
    assert "Clocks and power" in [t for t, _ in report.section_charts(run)]
    assert "clock: cuda:0" not in report.summary_html(run)  # no sm clock: the host clock speaks
    assert "clock: cpu cpu_freq_mhz" in report.summary_html(run)


def test_clocks_survive_save_and_load(tmp_path):
    run = Run(clocks=_trace(), meta={"name": "saved", "clocks": {"hz": 20.0}})
    back = tp.load(run.save(tmp_path / "r"))
    pd.testing.assert_frame_equal(back.clocks, run.clocks)
    assert back.meta["clocks"] == {"hz": 20.0}


def test_host_backend_reads_cpufreq_and_rapl_where_a_host_has_them(tmp_path):
    """This VM has neither (docs/MEASURED.md); a tree laid out like a bare-metal host's
    /sys stands in, to check the units, the wrap of the RAPL counter and the sources."""
    sys_root = tmp_path / "sys"
    for cpu, khz in enumerate([2_400_000, 3_100_000]):
        d = sys_root / f"devices/system/cpu/cpu{cpu}/cpufreq"
        d.mkdir(parents=True)
        (d / "scaling_cur_freq").write_text(f"{khz}\n")
    pkg = sys_root / "class/powercap/intel-rapl:0"
    sub = sys_root / "class/powercap/intel-rapl:0:0"  # the cores' sub-domain: not counted twice
    for d in (pkg, sub):
        d.mkdir(parents=True)
        (d / "max_energy_range_uj").write_text("1000000000\n")
    (pkg / "energy_uj").write_text("999000000\n")
    (sub / "energy_uj").write_text("5\n")
    b = cb.HostBackend(sys_root=str(sys_root))
    assert b.sources["cpu_freq_mhz"] == "cpufreq (scaling_cur_freq)"
    assert b.sources["cpu_power_w"] == "RAPL (1 package counters)"
    (pkg / "energy_uj").write_text("2000000\n")  # wrapped: 1,000,000 + 2,000,000 uJ = 3 J later
    time.sleep(0.05)
    rows = {(d, m): v for d, m, v in b.read()}
    assert rows[("cpu0", "cpu_freq_mhz")] == 2400.0 and rows[("cpu1", "cpu_freq_mhz")] == 3100.0
    assert rows[("cpu", "cpu_freq_mhz")] == 2750.0
    assert 0 < rows[("cpu", "cpu_power_w")] <= 3.0 / 0.05  # 3 J over at least 50 ms
    assert ("process", "cpu_util_pct") in rows and ("cpu", "cpu_util_pct") in rows


def test_host_backend_on_this_machine_says_what_it_could_read():
    b = cb.HostBackend()
    meta = b.meta()
    assert set(meta["sources"]) == {"cpu_freq_mhz", "cpu_util_pct", "cpu_power_w", "temperature_c"}
    for metric, source in meta["sources"].items():  # each either read or says why not
        assert source.startswith("unavailable: ") or metric in {m for _, m, _ in b.read()} or metric == "cpu_util_pct"


def _fake_proc(tmp_path, flags: str | None = None) -> tuple[str, str]:
    """A /proc with a two-core cpuinfo (with ``flags``: a flags line per core, as x86 has) and an
    empty /sys (no cpufreq, no RAPL)."""
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    proc.mkdir(parents=True)
    sys_root.mkdir()
    flags_line = f"flags\t\t: {flags}\n" if flags is not None else ""
    (proc / "cpuinfo").write_text("".join(f"processor\t: {i}\ncpu MHz\t\t: {mhz}\n{flags_line}\n"
                                          for i, mhz in enumerate(("2100.5", "2300.5"))))
    return str(proc), str(sys_root)


def _open_files() -> set[str]:
    """What this process's file descriptors point at."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def test_host_readings_that_cost_more_than_the_budget_are_read_less_often(monkeypatch, tmp_path):
    """The host's frequency/power/temperature reading is timed; past HOST_CPU_BUDGET of one
    core it is read less often, and the Run's meta says how often. The machine's per-core
    utilisation (jiffies) is read at most every SYSTEM_UTIL_PERIOD_S; this process's at
    every sample."""
    proc, sys_root = _fake_proc(tmp_path)
    monkeypatch.setattr(cb, "HOST_CPU_BUDGET", 1e-9)  # any reading is over budget: read once
    b = cb.HostBackend(proc=proc, sys_root=sys_root)
    first = {(d, m): v for d, m, v in b.read()}
    assert first[("cpu", "cpu_freq_mhz")] == 2200.5
    later = []
    for _ in range(4):
        time.sleep(0.04)
        later.append({(d, m) for d, m, _ in b.read()})
    assert all(("cpu", "cpu_freq_mhz") not in rows for rows in later)
    assert all(("process", "cpu_util_pct") in rows for rows in later)  # 40 ms > UTIL_MIN_WINDOW_S
    assert sum(("cpu", "cpu_util_pct") in rows for rows in later) <= 1  # 160 ms < one 200 ms period
    meta = b.meta()
    assert meta["periods_s"]["cpu_freq_mhz"] > 1000 and meta["periods_s"]["cpu_util_pct"] == cb.SYSTEM_UTIL_PERIOD_S
    assert "ms of CPU per reading" in meta["budget"]
    monkeypatch.setattr(cb, "HOST_CPU_BUDGET", 1e9)  # a fresh backend with room: read at every sample
    b2 = cb.HostBackend(proc=proc, sys_root=sys_root)
    for _ in range(3):
        time.sleep(0.04)
        assert ("cpu", "cpu_freq_mhz") in {(d, m) for d, m, _ in b2.read()}
    b.close()
    b2.close()


def test_host_backend_keeps_its_files_open_until_close_and_no_longer(tmp_path):
    """The files read at every sample are opened once (os.pread from offset 0 after that)."""
    proc, sys_root = _fake_proc(tmp_path)
    cpuinfo = os.path.join(proc, "cpuinfo")

    b = cb.HostBackend(proc=proc, sys_root=sys_root)
    assert b.sources["cpu_freq_mhz"] == "/proc/cpuinfo 'cpu MHz'" and cpuinfo in _open_files()
    with open(cpuinfo, "w") as f:  # the file changes: the open descriptor reads the new text
        f.write("cpu MHz\t\t: 1000.0\ncpu MHz\t\t: 3000.0\n")
    assert {(d, m): v for d, m, v in b.read()}[("cpu", "cpu_freq_mhz")] == 2000.0
    b.close()
    b.close()  # twice is fine
    assert cpuinfo not in _open_files()
    with pytest.raises(OSError, match="closed"):
        b._freq_cpuinfo()
    dropped = cb.HostBackend(proc=proc, sys_root=sys_root)
    assert cpuinfo in _open_files()
    del dropped  # never closed: the finalizer closes its files
    gc.collect()
    assert cpuinfo not in _open_files()


def test_a_host_with_many_cores_does_not_lend_a_descriptor_per_core(tmp_path):
    """Past KEEP_OPEN_MAX cpufreq files (one per core), the host backend opens them at each read
    instead of holding a descriptor per core in the user's process; the readings are the same."""
    proc, sys_root = _fake_proc(tmp_path)
    n = cb.KEEP_OPEN_MAX + 8
    for cpu in range(n):
        d = os.path.join(sys_root, f"devices/system/cpu/cpu{cpu}/cpufreq")
        os.makedirs(d)
        with open(os.path.join(d, "scaling_cur_freq"), "w") as f:
            f.write(f"{1_000_000 + 1000 * cpu}\n")

    before = _open_files()
    b = cb.HostBackend(proc=proc, sys_root=sys_root)
    assert b.sources["cpu_freq_mhz"] == "cpufreq (scaling_cur_freq)"
    assert len(_open_files() - before) < 4  # not one descriptor per core
    rows = {(d, m): v for d, m, v in b.read()}
    assert rows[("cpu", "cpu_freq_mhz")] == pytest.approx(1000 + (n - 1) / 2)  # the mean of all cores
    b.close()
    with pytest.raises(OSError, match="closed"):
        b._freq_cpufreq()


def test_a_virtual_machine_is_told_by_the_hypervisor_cpu_flag(tmp_path):
    assert cb.virtual_machine(_fake_proc(tmp_path / "a", "fpu vme sse2 hypervisor avx2")[0]) is True
    assert cb.virtual_machine(_fake_proc(tmp_path / "b", "fpu vme sse2 avx2")[0]) is False
    assert cb.virtual_machine(_fake_proc(tmp_path / "c", "fpu hypervisorx")[0]) is False  # a whole flag only
    assert cb.virtual_machine(_fake_proc(tmp_path / "d")[0]) is None  # ARM: no flags line, not known
    assert cb.virtual_machine(str(tmp_path / "nowhere")) is None


def test_the_run_says_a_flat_cpuinfo_clock_on_a_virtual_machine_cannot_show_a_slower_core(tmp_path):
    """A VM's /proc/cpuinfo gives a fixed MHz figure: "no DVFS to see" would read as "the core
    ran at one speed", which the guest cannot know. The run says where the flat figure came
    from and what it cannot show; a cpufreq figure that stayed flat keeps its plain meaning."""
    proc, sys_root = _fake_proc(tmp_path, "fpu sse2 hypervisor")
    rec = Recorder("t")
    probe = clocks_mod.ClockProbe(rec, hz=100, backends=[cb.HostBackend(proc=proc, sys_root=sys_root)]).install()
    time.sleep(0.05)
    probe.remove()
    meta = probe.meta()["clocks"]
    assert meta["virtual_machine"] is True and meta["sources"]["cpu_freq_mhz"].startswith("/proc/cpuinfo 'cpu MHz'")
    clocks = _frame([(t, "cpu", "cpu_freq_mhz", 2300.0) for t in T])
    line = analysis.summarize(_full(STEPS), {"name": "x", "clocks": meta}, clocks).clock_lines[0]
    assert line == f"clock: cpu cpu_freq_mhz mean 2,300 MHz ({ca.FLAT_VM_CLOCK})"
    bare = dict(meta, virtual_machine=False)
    assert ca.clock_summary(clocks, STEPS, bare).flat_note == ca.FLAT_CPUINFO_CLOCK
    cpufreq = dict(meta, sources={"cpu_freq_mhz": "cpufreq (scaling_cur_freq)"})
    assert ca.clock_summary(clocks, STEPS, cpufreq).flat_note == ca.FLAT_CLOCK
    moving = _frame([(t, "cpu", "cpu_freq_mhz", 2300.0 + 100 * (i % 2)) for i, t in enumerate(T)])
    assert ca.FLAT_VM_CLOCK not in analysis.summarize(_full(STEPS), {"clocks": meta}, moving).clock_lines[0]


def test_a_cpuinfo_clock_the_kernel_cannot_measure_is_read_once(tmp_path):
    """x86 without the APERF/MPERF counters (no ``aperfmperf`` flag) and without cpufreq: the
    kernel prints its boot-time clock in 'cpu MHz' at every read, so the backend reads it once and
    says so; with the counters it reads the file at every reading, and a change shows."""
    for flags, moves in (("fpu sse2 hypervisor", False), ("fpu sse2 aperfmperf", True)):
        proc, sys_root = _fake_proc(tmp_path / flags.split()[-1], flags)
        b = cb.HostBackend(proc=proc, sys_root=sys_root)
        assert cb.nominal_cpuinfo_clock(proc) is not moves
        assert ("read once" in b.sources["cpu_freq_mhz"]) is not moves
        with open(os.path.join(proc, "cpuinfo"), "w") as f:
            f.write(f"cpu MHz\t\t: 1000.0\nflags\t\t: {flags}\ncpu MHz\t\t: 3000.0\n")
        b._next_other_ns = 0
        got = {(d, m): v for d, m, v in b.read()}[("cpu", "cpu_freq_mhz")]
        assert got == (2000.0 if moves else 2200.5)
        if not moves:  # nothing is read: its rows come as often as the utilisation's, no more
            assert b.other_period_s >= cb.SYSTEM_UTIL_PERIOD_S
        b.close()
    assert cb.nominal_cpuinfo_clock(_fake_proc(tmp_path / "arm")[0]) is False  # no flags line: not told


_STAT = """cpu  {tu} 0 {ts} {ti} 0 0 0 0 0 0
cpu0 {u0} 5 {s0} {i0} {w0} 1 2 3 40 0
cpu1 {u1} 0 0 {i1} 0 0 0 0 0 0
intr 123 4 5
ctxt 999
"""


def test_core_utilisation_comes_from_proc_stat_deltas(tmp_path):
    """Busy over total jiffies per core between two readings of /proc/stat (kept open), with the
    same accounting as psutil's: guest time is already inside user, iowait counts as idle."""
    proc, sys_root = _fake_proc(tmp_path)
    stat = os.path.join(proc, "stat")
    with open(stat, "w") as f:
        f.write(_STAT.format(tu=0, ts=0, ti=0, u0=100, s0=50, i0=800, w0=10, u1=0, i1=1000))
    assert cb.stat_core_times(open(stat, "rb").read()) == [(100 + 5 + 50 + 1 + 2 + 3, 971.0), (0.0, 1000.0)]
    b = cb.HostBackend(proc=proc, sys_root=sys_root)
    assert b.sources["cpu_util_pct"] == "/proc/stat deltas" and stat in _open_files()
    with open(stat, "w") as f:  # cpu0: 60 busy of 100 jiffies (10 of them iowait: idle); cpu1: 25 of 100
        f.write(_STAT.format(tu=0, ts=0, ti=0, u0=150, s0=60, i0=830, w0=20, u1=25, i1=1075))
    time.sleep(cb.UTIL_MIN_WINDOW_S)
    rows = {(d, m): v for d, m, v in b.read() if m == "cpu_util_pct"}
    assert rows[("cpu0", "cpu_util_pct")] == pytest.approx(60.0)
    assert rows[("cpu1", "cpu_util_pct")] == pytest.approx(25.0)
    assert rows[("cpu", "cpu_util_pct")] == pytest.approx(42.5)
    b.close()
    assert stat not in _open_files()
    os.unlink(stat)  # no /proc/stat (not Linux): psutil's figures instead
    assert cb.HostBackend(proc=proc, sys_root=sys_root).sources["cpu_util_pct"] == "psutil.cpu_times deltas"


def test_proc_stat_reads_as_psutil_reads_it():
    """The real /proc/stat, parsed here and by psutil within a few jiffies of each other."""
    ours = cb.stat_core_times(open("/proc/stat", "rb").read())
    theirs = [cb._busy_total(t) for t in __import__("psutil").cpu_times(percpu=True)]
    assert len(ours) == len(theirs)
    hz = os.sysconf("SC_CLK_TCK")
    for (busy, total), (busy_s, total_s) in zip(ours, theirs):
        assert busy / hz == pytest.approx(busy_s, abs=0.5) and total / hz == pytest.approx(total_s, abs=0.5)
