"""The dashboard panel: one ipywidgets Tab per view of a Run, charts rendered offline.

Composes what ``tpkit.report`` builds (summary HTML, the registered chart sections) and what
``tpkit.compare`` / ``tpkit.recommend`` compute; measures nothing, draws nothing itself.
Charts are HTML outputs inside ``Output`` widgets: vega's JavaScript is put on the page once
per dashboard (a hidden output at the top) and every chart waits for it.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import ipywidgets as w

from . import html as report

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
    return f'<div class="tpkit-dash"><style>{report.CSS}</style>{body}</div>'


def recommendations_html(run: "Run") -> str:
    """The recommendations as an ordered list."""
    try:
        from ..analysis.recommend import recommendations
    except ImportError:  # the recommendation rules are optional for a bare dashboard
        return ""
    recs = recommendations(run)
    if not recs:
        return '<h3>Recommendations</h3><div class="tp-note">nothing stands out: no rule fired</div>'
    items = "".join(
        f"<li><b>{html.escape(r.title)}</b> (knob: <code>{html.escape(str(r.knob))}</code>)<br>"
        f'<span class="tp-note">{html.escape(r.evidence)}; expected: {html.escape(str(r.expected_gain))}</span></li>'
        for r in recs
    )
    return f"<h3>Recommendations</h3><ol>{items}</ol>"


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
    """``tp.dashboard(run)``: Summary, one tab per chart section with data, Compare (when
    other runs are given), Export. Its plain-text form is the run's summary."""

    def __init__(self, run: "Run", compare_with: Sequence["Run"] = (), ab: Any = None) -> None:
        self.run = run
        tabs: list[tuple[str, w.Widget]] = [
            ("Summary", html_output(_styled(report.summary_html(run) + recommendations_html(run))))]
        if ab is not None:
            tabs.insert(0, ("Kernels A/B", html_output(_styled(ab_html(ab)))))
        for title, chart in report.section_charts(run):
            tabs.append((title, html_output(_styled(report.chart_html(chart)))))
        others = [r for r in compare_with if r is not run]
        if others:
            tabs.append(("Compare", html_output(_styled(compare_html([*others, run])))))
        tabs.append(("Export", self._export_panel()))
        tab = w.Tab(children=[t for _, t in tabs])
        for i, (title, _) in enumerate(tabs):
            tab.set_title(i, title)
        self.tab = tab
        bundle = html_output(report.bundle_html(), display="none")
        super().__init__(children=[bundle, tab])

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
                    path = self.run.to_csv(out / "csv")
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


def dashboard(run: "Run | None" = None, compare_with: Sequence["Run"] = (), ab: Any = None) -> Dashboard:
    """The dashboard of ``run`` (default: the last run), optionally compared with others."""
    from ..capture.slice import last_run

    run = run if run is not None else last_run()
    if run is None:
        from ..errors import TpkitError

        raise TpkitError("no run yet: profile a slice first (%%tp_profile or tp.profile)")
    return Dashboard(run, compare_with, ab)
