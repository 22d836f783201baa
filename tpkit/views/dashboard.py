"""The dashboard panel: one ipywidgets Tab per view of a Run, charts rendered offline.

Composes what ``views.html`` builds (the summary, the chart sections, the loader's words) and
what ``analysis.compare`` / ``analysis.recommend`` compute; measures nothing, draws nothing
itself. Charts are HTML outputs inside ``Output`` widgets that wait for vega; vega's
JavaScript lives in ONE hidden Output widget shared by every dashboard and tuner of the
kernel (``shared_bundle``): a saved notebook holds it once, and its guarded script runs once
per page however many dashboards show it.

Displayed in a notebook, a dashboard is two outputs: a static copy (tables and SVG charts
drawn offline, ``views.html.static_html``) and the live widget. CSS hides the static copy
wherever the widget rendered, so it shows only where the widget cannot (a notebook reopened
without its kernel or widget state, GitHub, nbviewer without widget state).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import ipywidgets as w

from . import html as report
from . import render

if TYPE_CHECKING:
    from ..run import Run


def html_output(fragment: str, **layout: Any) -> w.Output:
    """An Output widget showing an HTML fragment (scripts run: JupyterLab, Notebook 7 and
    VS Code render Output widget contents as trusted outputs)."""
    out = w.Output(layout=w.Layout(**layout))
    # Set the output directly (no display hook, no shell formatter): the same HTML whether
    # a kernel, a terminal IPython or plain Python builds the dashboard.
    out.outputs = ({"output_type": "display_data", "metadata": {},
                    "data": {"text/html": fragment, "text/plain": "(tpkit chart: open in Jupyter)"}},)
    return out


def _styled(body: str) -> str:
    return render.styled(body)


_BUNDLE: list[w.Output] = []


def shared_bundle() -> w.Output:
    """The one hidden Output widget holding vega's JavaScript, shared by every dashboard and
    tuner of this kernel (made again if it was closed)."""
    if _BUNDLE and getattr(_BUNDLE[0], "comm", None) is not None:
        return _BUNDLE[0]
    out = html_output(render.bundle_html(), display="none")
    _BUNDLE[:] = [out]
    return out


def recommendations_html(run: "Run") -> str:
    """The recommendations of a run, each with its knob, expected gain and evidence."""
    from ..analysis.recommend import recommendations

    recs = recommendations(run)
    if not recs:
        return '<h3>Recommendations</h3><div class="tp-note">nothing stands out: no rule fired</div>'
    return "<h3>Recommendations</h3>" + "".join(report.recommendation_html(r) for r in recs)


def compare_html(runs: Sequence["Run"], baseline: Any = None) -> str:
    """The comparison of several runs (``views.compare.comparison_html``), charts live."""
    from ..analysis.compare import compare
    from .compare import comparison_html

    return comparison_html(compare(*runs, baseline=baseline), charts="vega")


def ab_html(ab: Any) -> str:
    """The kernels A/B view: the verdict on the loss, speed and memory side by side."""
    from ..charts.ab import loss_ab

    cls = "tp-verdict" if ab.verdict.ok else "tp-verdict tp-bad"
    text = html.escape(ab.to_text()).replace("\n", "<br>")
    return (f'<h3>Kernels A/B</h3><div class="{cls}">{html.escape(ab.verdict.message)}</div>'
            f'<div class="tp-note">{text}</div>' + report.chart_html(loss_ab(ab.losses))
            + compare_html([ab.a, ab.b]))


class Dashboard(w.VBox):
    """``tp.dashboard(run)``: Summary first, one tab per chart section with data, Compare
    (when other runs are given), Export. Its plain-text form is the run's summary.

    ``apply``: a function that sets knobs and reruns (the tuner's ``apply``); with it, the
    top recommendation gets a button when every knob it names is in ``knobs``."""

    def __init__(self, run: "Run", compare_with: Sequence["Run"] = (), ab: Any = None,
                 apply: Callable[[dict], Any] | None = None, knobs: Sequence[str] = (), static: bool = True) -> None:
        from ..analysis.recommend import recommendations

        self.run, self.compare_with, self.static = run, list(compare_with), static
        recs = recommendations(run)
        summary: w.Widget = html_output(_styled(report.summary_html(run, recs=recs)))
        self.apply_button: w.Button | None = None
        top = recs[0] if recs else None
        if apply is not None and top is not None and top.action and set(top.action) <= set(knobs):
            act = ", ".join(f"{k}={v!r}" for k, v in top.action.items())
            self.apply_button = w.Button(description=f"Apply {act} and rerun", button_style="success",
                                         layout=w.Layout(width="auto"))
            self.apply_button.on_click(lambda _b, a=dict(top.action): apply(a))
            summary = w.VBox([summary, self.apply_button])
        tabs: list[tuple[str, w.Widget]] = [("Summary", summary)]
        if ab is not None:
            tabs.insert(0, ("Kernels A/B", html_output(_styled(ab_html(ab)))))
        for title, chart in report.section_charts(run):
            extra = report.loader_html(run) if title == "Loader" else ""
            tabs.append((title, html_output(_styled(extra + report.chart_html(chart)))))
        others = [r for r in compare_with if r is not run]
        if others:
            tabs.append(("Compare", html_output(compare_html([*others, run]))))
        tabs.append(("Export", self._export_panel()))
        tab = w.Tab(children=[t for _, t in tabs])
        for i, (title, _) in enumerate(tabs):
            tab.set_title(i, title)
        self.tab = tab
        super().__init__(children=[shared_bundle(), tab])
        self.add_class("tpkit-live")

    def _export_panel(self) -> w.Widget:
        folder = w.Text(value=str(Path("tpkit_exports") / self.run.name), description="folder")
        status = w.HTML()
        buttons = {name: w.Button(description=name) for name in ("HTML report", "Perfetto trace", "CSV tables")}

        def export(kind: str) -> None:
            try:
                out = Path(folder.value)
                if kind == "HTML report":
                    path = self.run.to_html(out / "report.html")
                elif kind == "Perfetto trace":
                    path = self.run.to_perfetto(out / "trace.json")
                else:
                    path = out / "csv"
                    self.run.to_csv(path)
                status.value = f"written: <code>{html.escape(str(path))}</code>"
            except Exception as e:  # shown in the panel; the dashboard keeps working
                status.value = f'<span style="color:#b00020">{html.escape(type(e).__name__)}: {html.escape(str(e))}</span>'

        for kind, b in buttons.items():
            b.on_click(lambda _b, kind=kind: export(kind))
        return w.VBox([folder, w.HBox(list(buttons.values())), status])

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            bundle["text/plain"] = self.run.summary().to_text()
        return bundle

    def static_html(self) -> str:
        """The static copy shown beside the widget (``views.html.static_html``)."""
        return report.static_html(self.run, self.compare_with)

    def _ipython_display_(self) -> None:
        from IPython import get_ipython
        from IPython.display import display

        ip = get_ipython()
        if self.static and ip is not None and getattr(ip, "kernel", None) is not None:
            display({"text/html": self.static_html(), "text/plain": ""}, raw=True)
        display(self._repr_mimebundle_(), raw=True)


def dashboard(run: "Run | None" = None, compare_with: Sequence["Run"] = (), ab: Any = None, **kwargs: Any) -> Dashboard:
    """The dashboard of ``run`` (default: the last run), optionally compared with others."""
    from ..capture.slice import last_run

    run = run if run is not None else last_run()
    if run is None:
        from ..errors import TpkitError

        raise TpkitError("no run yet: profile a slice first (%%tp_profile or tp.profile)")
    return Dashboard(run, compare_with, ab, **kwargs)
