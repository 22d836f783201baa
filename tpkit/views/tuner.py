"""``tp.tune``: a control per knob, a "Run slice" button, a "Sweep", the results table, the
trade-off chart, recommendations with an "Apply" button, and the comparison of every run.

``train_fn(**knobs)`` builds and runs the user's loop; each click profiles one slice of it
with the knobs' current values. An error in ``train_fn`` is shown in the panel and nothing
else changes: earlier runs stay, the controls keep working.
"""

from __future__ import annotations

import html
import traceback
from typing import TYPE_CHECKING, Any, Callable

import ipywidgets as w

from ..analysis import tuning
from ..capture.slice import profile
from ..charts import tradeoff
from . import html as report
from .dashboard import _styled, compare_html, html_output

if TYPE_CHECKING:
    from ..run import Run


def knob_control(name: str, spec: Any) -> w.ValueWidget:
    """A control for one knob: a list of options -> dropdown, a bool -> toggle, a range ->
    slider, an int or float -> a number box, a ready ipywidget -> itself."""
    if isinstance(spec, w.ValueWidget):
        return spec
    if isinstance(spec, bool):
        return w.Checkbox(value=spec, description=name, indent=False)
    if isinstance(spec, range):
        return w.IntSlider(value=spec.start, min=spec.start, max=spec[-1], step=spec.step, description=name)
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError(f"knob {name!r} has no options")
        return w.Dropdown(options=list(spec), value=spec[0], description=name)
    if isinstance(spec, int):
        return w.IntText(value=spec, description=name)
    if isinstance(spec, float):
        return w.FloatText(value=spec, description=name)
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
    def __init__(self, train_fn: Callable[..., Any], knobs: dict[str, Any], steps: int = 10, warmup: int = 2,
                 name: str = "tune", sweep_limit: int = 16, memory: bool = True, clock_hz: float = 20.0) -> None:
        if not callable(train_fn):
            raise TypeError("tp.tune needs train_fn(**knobs): a function that builds and runs your training loop")
        self.train_fn, self.steps, self.warmup, self.name = train_fn, steps, warmup, name
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
        results = w.Tab(children=[w.VBox([self.table, self.chart]), self.recs, self.compare])
        for i, t in enumerate(["Results", "Recommendations", "Compare"]):
            results.set_title(i, t)
        super().__init__(children=[
            html_output(report.bundle_html(), display="none"),
            w.HTML(f"<b>tpkit tuner</b>: {len(self.controls)} knobs, {steps} steps (+{warmup} warmup) per slice"),
            w.HBox(list(self.controls.values()), layout=w.Layout(flex_flow="row wrap")),
            w.HBox([self.run_button, self.sweep_button]), self.status, self.progress, results,
        ])

    # -- actions ----------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        return {k: c.value for k, c in self.controls.items()}

    def run_slice(self, **overrides: Any) -> "Run | None":
        """Profile one slice with the controls' values (``overrides`` set controls first).
        Returns the Run, or None when ``train_fn`` failed (the error is shown)."""
        for k, v in overrides.items():
            self._set(k, v)
        knobs = self.values()
        label = f"{self.name}-{len(self.runs) + 1}"
        self._busy(True, f"running <b>{html.escape(label)}</b> with {html.escape(_fmt(knobs))}...")
        self.progress.clear_output()
        error: Exception | None = None
        with self.progress:  # (an Output widget swallows exceptions under IPython: catch inside)
            try:
                with profile(steps=self.steps, warmup=self.warmup, name=label, knobs=knobs,
                             memory=self.memory, clock_hz=self.clock_hz) as prof:
                    self.train_fn(**knobs)
            except Exception as e:  # shown in the panel; earlier runs and the controls are untouched
                error = e
        self._busy(False)
        if error is not None:
            self.status.value = _error_html(label, error)
            return None
        run = prof.run
        assert run is not None
        self.runs.append(run)
        s = run.summary()
        self.status.value = (f"<b>{html.escape(run.name)}</b>: {s.throughput:,.1f} samples/s, "
                             f"step p50 {s.step_p50_s * 1e3:.2f} ms; {html.escape(s.verdict.text)}")
        self.refresh()
        return run

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
        return tuning.results_frame(self.runs)

    def refresh(self) -> None:
        df = self.results()
        self.table.value = _styled(df.to_html(index=False, float_format=lambda v: f"{v:,.4g}", border=0,
                                              classes="tp-sum tp-results"))
        self.chart.outputs = ()
        if len(df):
            self.chart.outputs = html_output(_styled(report.chart_html(tradeoff(df)))).outputs
        self.recs.children = self._rec_widgets(self.runs[-1]) if self.runs else ()
        if len(self.runs) > 1:
            self.compare.outputs = html_output(_styled(compare_html(self.runs))).outputs

    def _rec_widgets(self, run: "Run") -> tuple[w.Widget, ...]:
        from ..analysis.recommend import recommendations

        recs = recommendations(run)
        if not recs:
            return (w.HTML("no recommendation for the last run: no rule fired"),)
        rows = []
        for r in recs:
            text = w.HTML(f"<b>{html.escape(r.title)}</b><br><small>{html.escape(r.evidence)}; "
                          f"expected: {html.escape(str(r.expected_gain))}</small>", layout=w.Layout(width="80%"))
            if r.action:
                b = w.Button(description="Apply and rerun", tooltip=_fmt(r.action))
                b.on_click(lambda _b, a=dict(r.action): self.apply(a))
                rows.append(w.HBox([text, b]))
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


def _fmt(knobs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in knobs.items())


def _error_html(label: str, e: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
    return (f'<div style="color:#b00020"><b>{html.escape(label)} failed: {html.escape(type(e).__name__)}: '
            f"{html.escape(str(e))}</b></div><pre style='font-size:11px'>{html.escape(tb)}</pre>"
            "<div>earlier runs are kept; change a knob and run again</div>")


def tune(train_fn: Callable[..., Any], knobs: dict[str, Any], steps: int = 10, warmup: int = 2,
         name: str = "tune", **kwargs: Any) -> Tuner:
    """A tuning panel for ``train_fn(**knobs)``::

        def train_fn(num_workers, batch_size):
            model, loader, opt = build(num_workers, batch_size)
            train(model, loader, opt)          # the slice stops it
        tp.tune(train_fn, knobs={"num_workers": [0, 2, 4], "batch_size": [16, 32]})
    """
    return Tuner(train_fn, knobs, steps=steps, warmup=warmup, name=name, **kwargs)
