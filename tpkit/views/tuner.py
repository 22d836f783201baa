"""``tp.tune``: a control per knob, a "Run slice" button, a "Sweep", the results table, the
trade-off chart, recommendations with an "Apply" button, and the comparison of every setting.

``train_fn(**knobs)`` builds and runs the user's loop; each click profiles ``replicates``
short slices of it (default 3) with the knobs' current values, named ``<name>-<k>.<r>``
(setting k, replicate r) under names the store does not hold yet, so the status names each
run as it is stored. Results are per setting: the mean throughput over the replicates with
its 95% interval, and "best" chosen from those means (``analysis.tuning.settings_frame``).
An error in ``train_fn`` is shown in the panel and nothing else changes: earlier runs stay,
the controls keep working. "Apply and rerun" is offered only for knobs this tuner has.

Each slice's warmup is ``warmup`` plus the batches the loader queues ahead of the loop
(``queued_batches``: ``num_workers`` x ``prefetch_factor`` of the knobs being tried): the
workers fill that queue while the first steps are slow, and a window that starts on it times
the queue's draining, not the loader's pace (4 workers read 347.8 samples/s where a training
run's steady rate was 252). The drain steps take the loop's own time only, so the longer warmup
costs little where the loader is the bottleneck. Where the loop's own work is a good share of
the loader's pace, the queue drains slower than a batch a step and some of it can remain; name
``num_workers`` (and ``prefetch_factor``) among the knobs, or the tuner cannot know the queue.
The queue's warmup is at most twice the measured steps (``queue_warmup``), so a slice is at most
``warmup`` + 3 x the window long; a deeper queue is partly in the window. A ``train_fn`` whose
loop ends before the slice is full (one finite epoch) measures fewer steps than asked: that run
is marked short in the table and the status, and never chosen best (``tuning.short_of_steps``).
Its measured steps are a whole number of ``num_workers`` (``window_steps``): workers started
together make their batches in step, and the loop gets them in bursts of that many.
"""

from __future__ import annotations

import html
import traceback
from typing import TYPE_CHECKING, Any, Callable

import ipywidgets as w

from ..analysis import tuning
from ..capture.slice import profile
from ..charts import tradeoff
from ..data.process_pool import DEEP_PREFETCH
from ..schema import MIB, fmt_bytes
from . import html as report
from .dashboard import _styled, compare_html, html_output, shared_bundle

if TYPE_CHECKING:
    from ..run import Run


#: Batches a torch DataLoader queues per worker by default (its ``prefetch_factor``).
TORCH_PREFETCH = 2


def queued_batches(knobs: dict[str, Any]) -> int:
    """Batches the loader these knobs build can hold ready before the loop asks:
    ``num_workers`` x ``prefetch_factor`` (or ``prefetch``); without a prefetch knob, torch's
    default 2, or tp.data.Loader's deepest default (8, its small batches') with ``loader="tpkit"``.
    0 without an integer ``num_workers`` knob."""
    workers = knobs.get("num_workers")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers <= 0:
        return 0
    prefetch = knobs.get("prefetch_factor", knobs.get("prefetch"))
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch <= 0:
        prefetch = DEEP_PREFETCH if knobs.get("loader") == "tpkit" else TORCH_PREFETCH
    return workers * prefetch


def queue_warmup(steps: int, knobs: dict[str, Any]) -> int:
    """The warmup steps added for the loader's queue: ``queued_batches``, at most twice the
    window (``window_steps``). Without a cap, 16 workers of tp.data.Loader (8 batches each) would
    warm up for 128 steps before a 10-step window, and a one-epoch ``train_fn`` would end first."""
    return min(queued_batches(knobs), 2 * window_steps(steps, knobs))


def window_steps(steps: int, knobs: dict[str, Any]) -> int:
    """``steps`` rounded up to a whole multiple of the ``num_workers`` knob. Workers that
    started together and take as long per batch hand the loop a burst of ``num_workers``
    batches, then it waits for the next burst; any run of whole bursts holds as many of those
    waits as bursts, wherever it starts, where 10 steps of 4 workers held 2 or 3 (333 or 222
    samples/s for a steady 266)."""
    workers = knobs.get("num_workers")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers <= 1:
        return steps
    return -(-steps // workers) * workers


def knob_control(name: str, spec: Any) -> w.ValueWidget:
    """A control for one knob: a list of options -> dropdown, a bool -> toggle, a range ->
    slider, an int or float -> a number box, a ready ipywidget -> itself."""
    if isinstance(spec, w.ValueWidget):
        return spec
    full = {"description": name, "style": {"description_width": "initial"}}  # the whole name, never "num_work..."
    if isinstance(spec, bool):
        return w.Checkbox(value=spec, indent=False, **full)
    if isinstance(spec, range):
        return w.IntSlider(value=spec.start, min=spec.start, max=spec[-1], step=spec.step, **full)
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError(f"knob {name!r} has no options")
        return w.Dropdown(options=list(spec), value=spec[0], layout=w.Layout(width="auto"), **full)
    if isinstance(spec, int):
        return w.IntText(value=spec, **full)
    if isinstance(spec, float):
        return w.FloatText(value=spec, **full)
    raise TypeError(f"knob {name!r}: give a list of options, a bool, a range, a number or an ipywidget, "
                    f"not {type(spec).__name__}")


def sweep_options(control: w.ValueWidget) -> list[Any]:
    """The values a sweep tries for a control."""
    if isinstance(control, w.Dropdown):
        return list(control.options)
    if isinstance(control, w.Checkbox):
        return [False, True]
    if isinstance(control, w.IntSlider):
        values = list(range(control.min, control.max + 1, control.step))
        return values if len(values) <= 4 else [control.min, (control.min + control.max) // 2, control.max]
    return [control.value]


class Tuner(w.VBox):
    """The tuning panel (``tp.tune``); its buttons call ``run_slice``, ``sweep`` and ``apply``."""

    def __init__(self, train_fn: Callable[..., Any], knobs: dict[str, Any], steps: int = 10, warmup: int = 2,
                 name: str = "tune", sweep_limit: int = 16, memory: bool = True, clock_hz: float = 20.0,
                 replicates: int = 3) -> None:
        if not callable(train_fn):
            raise TypeError("tp.tune needs train_fn(**knobs): a function that builds and runs your training loop")
        if not isinstance(replicates, int) or isinstance(replicates, bool) or replicates < 1:
            raise ValueError(f"replicates must be a whole number of slices >= 1, not {replicates!r}")
        self.train_fn, self.steps, self.warmup, self.name = train_fn, steps, warmup, name
        self.replicates, self._settings = replicates, 0
        self.sweep_limit, self.memory, self.clock_hz = sweep_limit, memory, clock_hz
        self.controls = {k: knob_control(k, v) for k, v in knobs.items()}
        self.runs: list[Run] = []
        self.run_button = w.Button(description="Run slice", button_style="primary", icon="play")
        self.sweep_button = w.Button(description="Sweep", icon="th")
        self.status = w.HTML()
        self.progress = w.Output()
        self.table = w.HTML()
        self.chart = w.Output()
        self.recs = w.VBox()
        self.compare = w.Output()
        self.run_button.on_click(lambda _: self.run_slice())
        self.sweep_button.on_click(lambda _: self.sweep())
        self.summary = w.VBox()
        results = w.Tab(children=[self.summary, w.VBox([self.table, self.chart]), self.recs, self.compare])
        for i, t in enumerate(["Summary", "Results", "Recommendations", "Compare"]):
            results.set_title(i, t)
        super().__init__(children=[
            shared_bundle(),
            w.HTML(f"<b>tpkit tuner</b>: {len(self.controls)} knobs, {steps} steps (rounded up to whole "
                   f"num_workers; +{warmup} warmup, + the batches the loader queues: num_workers x "
                   f"prefetch_factor) per slice, "
                   f"{replicates} slice{'s' if replicates != 1 else ''} per setting"),
            w.HBox(list(self.controls.values()), layout=w.Layout(flex_flow="row wrap")),
            w.HBox([self.run_button, self.sweep_button]), self.status, self.progress, results,
        ])

    # -- actions ----------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        return {k: c.value for k, c in self.controls.items()}

    def _labels(self) -> list[str]:
        """Names for the next setting's replicates that the store does not hold yet, so the
        name shown while a slice runs is the name it is stored under."""
        from ..store import safe_name, store_path

        root = store_path()
        taken = {r.name for r in self.runs}
        while True:
            self._settings += 1
            k = self._settings
            labels = [f"{self.name}-{k}" if self.replicates == 1 else f"{self.name}-{k}.{i}"
                      for i in range(1, self.replicates + 1)]
            if not any(lab in taken or (root is not None and (root / safe_name(lab)).exists()) for lab in labels):
                return labels

    def run_slice(self, **overrides: Any) -> "Run | None":
        """Profile ``replicates`` slices with the controls' values (``overrides`` set controls
        first). Returns the replicate nearest the setting's mean throughput, or None when
        ``train_fn`` failed (the error is shown; replicates that ran are kept)."""
        for k, v in overrides.items():
            self._set(k, v)
        knobs = self.values()
        done: list[Run] = []
        self.progress.clear_output()
        for i, label in enumerate(self._labels()):
            which = f" (slice {i + 1} of {self.replicates})" if self.replicates > 1 else ""
            self._busy(True, f"running <b>{html.escape(label)}</b>{which} with {html.escape(_fmt(knobs))}...")
            error: Exception | None = None
            with self.progress:  # (an Output widget swallows exceptions under IPython: catch inside)
                try:
                    with profile(steps=window_steps(self.steps, knobs), warmup=self.warmup + queue_warmup(self.steps, knobs),
                                 name=label, knobs=knobs, memory=self.memory, clock_hz=self.clock_hz) as prof:
                        self.train_fn(**knobs)
                except Exception as e:  # shown in the panel; earlier runs and the controls are untouched
                    error = e
            self._busy(False)
            if error is not None:
                self.status.value = _error_html(label, error)
                if done:
                    self.refresh()
                return None
            run = prof.run
            assert run is not None
            self.runs.append(run)
            done.append(run)
        row = self._row(knobs)
        by_name = {r.name: r for r in self.runs}
        rep = by_name.get(row["run"], done[-1]) if row is not None else done[-1]
        spread = ""
        if row is not None and row["throughput_low"] == row["throughput_low"]:
            spread = f" [{row['throughput_low']:,.1f}, {row['throughput_high']:,.1f}]"
        thr = row["throughput"] if row is not None else rep.summary().throughput
        p50 = row["step_p50_ms"] if row is not None else rep.summary().step_p50_s * 1e3
        n = int(row["replicates"]) if row is not None else len(done)
        self.status.value = (f"<b>{html.escape(', '.join(r.name for r in done))}</b>: this setting "
                             f"{thr:,.1f}{spread} samples/s over {n} slice{'s' if n != 1 else ''}, step p50 "
                             f"{p50:.2f} ms; {html.escape(rep.summary().verdict.text)}{_short_html(done)}")
        self.refresh()
        return rep

    def _row(self, knobs: dict[str, Any]) -> Any:
        """The settings row of ``knobs`` (every replicate of that setting so far)."""
        key = tuning.setting_key(knobs)
        same = [r for r in self.runs if tuning.setting_key(r.meta.get("knobs", {}) or {}) == key]
        df = tuning.settings_frame(same)
        return df.iloc[0] if len(df) else None

    def sweep(self, options: dict[str, list[Any]] | None = None) -> list["Run"]:
        """Run every combination of ``options`` (default: every knob's options); a setting
        that fails is reported and the sweep goes on."""
        opts = options or {k: sweep_options(c) for k, c in self.controls.items()}
        try:
            settings = tuning.grid(opts, self.sweep_limit)
        except ValueError as e:
            self.status.value = f'<span style="color:#b00020">{html.escape(str(e))}</span>'
            return []
        done = []
        for setting in settings:
            run = self.run_slice(**setting)
            if run is not None:
                done.append(run)
        self.status.value += f"<br>sweep: {len(done)} of {len(settings)} settings ran"
        return done

    def apply(self, action: dict[str, Any]) -> "Run | None":
        """Set the knobs a recommendation names and rerun."""
        unknown = [k for k in action if k not in self.controls]
        if unknown:
            self.status.value = (f'<span style="color:#b00020">this tuner has no knob {html.escape(str(unknown))}: '
                                 "add it to knobs= to let tpkit change it</span>")
            return None
        return self.run_slice(**action)

    # -- views --------------------------------------------------------------------------------
    def results(self) -> Any:
        """One row per setting: knobs, replicates, mean throughput with its 95% interval, best."""
        return tuning.settings_frame(self.runs)

    def run_results(self) -> Any:
        """One row per slice (every replicate)."""
        return tuning.results_frame(self.runs)

    def refresh(self) -> None:
        df = self.results()
        self.table.value = _styled(results_html(df))
        self.chart.outputs = ()
        if len(df):
            self.chart.outputs = html_output(_styled(report.chart_html(tradeoff(df)))).outputs
        self.recs.children = self._rec_widgets(self.runs[-1]) if self.runs else ()
        self.summary.children = self._summary_widgets(self.runs[-1]) if self.runs else ()
        if len(df) > 1:  # one run per setting (the replicate nearest its mean), against the first
            by_name = {r.name: r for r in self.runs}
            self.compare.outputs = html_output(compare_html([by_name[n] for n in df["run"]])).outputs

    def _summary_widgets(self, run: "Run") -> tuple[w.Widget, ...]:
        """The last run's summary, answer first, with a button that applies its top
        recommendation when this tuner has every knob it names."""
        from ..analysis.recommend import recommendations

        recs = recommendations(run)
        out: list[w.Widget] = [html_output(_styled(report.summary_html(run, recs=recs)))]
        top = recs[0] if recs else None
        if top is not None and top.action and set(top.action) <= set(self.controls):
            b = w.Button(description=f"Apply {_fmt(top.action)} and rerun", button_style="success",
                         layout=w.Layout(width="auto"))
            b.on_click(lambda _b, a=dict(top.action): self.apply(a))
            out.append(b)
        return tuple(out)

    def _rec_widgets(self, run: "Run") -> tuple[w.Widget, ...]:
        from ..analysis.recommend import recommendations

        recs = recommendations(run)
        if not recs:
            return (w.HTML("no recommendation for the last run: no rule fired"),)
        rows = []
        for r in recs:
            text = w.HTML(report.recommendation_html(r), layout=w.Layout(width="80%"))
            missing = [k for k in r.action if k not in self.controls]
            if r.action and not missing:
                b = w.Button(description="Apply and rerun", tooltip=_fmt(r.action), button_style="success")
                b.on_click(lambda _b, a=dict(r.action): self.apply(a))
                rows.append(w.HBox([text, b]))
            elif missing:
                rows.append(w.VBox([text, w.HTML(f"<small>to apply it here, add {html.escape(', '.join(missing))} "
                                                 "to knobs=</small>")]))
            else:
                rows.append(text)
        return tuple(rows)

    def _set(self, knob: str, value: Any) -> None:
        if knob not in self.controls:
            raise KeyError(f"no knob {knob!r}; knobs are {sorted(self.controls)}")
        c = self.controls[knob]
        if isinstance(c, w.Dropdown) and value not in c.options:
            c.options = [*c.options, value]
        c.value = value

    def _busy(self, busy: bool, message: str | None = None) -> None:
        self.run_button.disabled = self.sweep_button.disabled = busy
        if message is not None:
            self.status.value = message


def results_html(df: Any) -> str:
    """The settings as a readable table: one header per column, throughput with its interval."""
    from ..charts.tuning import NOT_KNOBS

    if df is None or len(df) == 0:
        return '<div class="tp-note">no runs yet: press "Run slice" or "Sweep"</div>'
    knobs = [c for c in df.columns if c not in NOT_KNOBS]
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in
                   ["setting", *knobs, "slices", "throughput (samples/s, 95% interval)", "step p50 (ms)",
                    "data stall (%)", "peak memory", "verdict", ""])
    rows = []
    for i, r in enumerate(df.itertuples(index=False), 1):
        d = r._asdict()
        thr = "n/a" if d["throughput"] != d["throughput"] else f"{d['throughput']:,.1f}"
        if d["throughput_low"] == d["throughput_low"]:
            thr += f" [{d['throughput_low']:,.1f}, {d['throughput_high']:,.1f}]"
        best = ("<b>best</b>" + ("" if d["clear"] else " (within noise of another)")) if d["best"] else ""
        cells = [f"{i}: {html.escape(str(d['run']))}", *[html.escape(str(d[k])) for k in knobs], str(d["replicates"]),
                 thr, f"{d['step_p50_ms']:,.2f}", f"{d['data_stall_pct']:.1f}",
                 "n/a" if d["peak_mib"] != d["peak_mib"] else fmt_bytes(d["peak_mib"] * MIB),
                 html.escape(str(d["verdict"])) + ("" if d["complete"] else " (incomplete)")
                 + (" (short: fewer steps than asked, not ranked)" if d.get("short") else ""), best]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f'<table class="tp-grid tp-results"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def _short_html(runs: list["Run"]) -> str:
    """A warning naming the runs that measured fewer steps than asked, or ""."""
    short = [(r.name, n) for r in runs if (n := tuning.short_of_steps(r)) is not None]
    if not short:
        return ""
    which = ", ".join(f"{html.escape(name)} measured {got} of the {asked} steps asked" for name, (got, asked) in short)
    return (f'<br><span style="color:#b00020"><b>short</b>: {which} (the loop ended first: a finite epoch '
            "shorter than warmup + steps); not ranked as best. Give train_fn more batches or ask fewer steps</span>")


def _fmt(knobs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in knobs.items())


def _error_html(label: str, e: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
    return (f'<div style="color:#b00020"><b>{html.escape(label)} failed: {html.escape(type(e).__name__)}: '
            f"{html.escape(str(e))}</b></div><pre style='font-size:11px'>{html.escape(tb)}</pre>"
            "<div>earlier runs are kept; change a knob and run again</div>")


def tune(train_fn: Callable[..., Any], knobs: dict[str, Any], steps: int = 10, warmup: int = 2,
         name: str = "tune", replicates: int = 3, **kwargs: Any) -> Tuner:
    """A tuning panel for ``train_fn(**knobs)``::

        def train_fn(num_workers, batch_size):
            model, loader, opt = build(num_workers, batch_size)
            train(model, loader, opt)          # the slice stops it
        tp.tune(train_fn, knobs={"num_workers": [0, 2, 4], "batch_size": [16, 32]})

    ``replicates``: slices per setting (default 3), whose mean and interval rank the settings.
    """
    return Tuner(train_fn, knobs, steps=steps, warmup=warmup, name=name, replicates=replicates, **kwargs)
