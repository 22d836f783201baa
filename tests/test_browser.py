"""tpkit in a real browser: JupyterLab + Chromium run the tutorial notebooks 01, 02 and 07 top
to bottom, check what each story prints (tests/notebook_claims.py, the claims test_notebooks.py
checks where there is no browser), click every tab of every dashboard, and check what a person would see: no console
error with three dashboards on one page, the summary's chart and top recommendation, Compare
for 6 runs within 1,200 px, the static copy shown only where the widget cannot render.
Screenshots go to ``tests/artifacts/`` (``TPKIT_ARTIFACTS`` overrides), each checked for size
and ink. All slow: the whole module takes a few minutes on a 2-core machine."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import browser
import nbformat
import notebook_claims
import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("TPKIT_ARTIFACTS", ROOT / "tests" / "artifacts"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))]


def notebook(cells: list[str]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab for the module, serving copies of the tutorials and made-up notebooks;
    runs go to a store of the module's own."""
    root = tmp_path_factory.mktemp("lab")
    for name in ("01_quickstart.ipynb", "02_data_stalls.ipynb", "07_tuning.ipynb"):
        shutil.copy(ROOT / "notebooks" / name, root / name)
    old = os.environ.get("TPKIT_RUNS")
    os.environ["TPKIT_RUNS"] = str(root / "tpkit_runs")
    try:
        with browser.jupyterlab(root) as (base, token):
            yield root, base, token
    finally:
        if old is None:
            os.environ.pop("TPKIT_RUNS", None)
        else:
            os.environ["TPKIT_RUNS"] = old
    ARTIFACTS.mkdir(parents=True, exist_ok=True)


def shot(page, element, name: str, min_ink: float = 0.01) -> dict:
    """Screenshot ``element`` to the artifacts, then check it is a real picture."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    png = element.screenshot(path=str(path))
    pic = browser.picture(page, png)
    assert path.stat().st_size > 5_000, f"{name}: {path.stat().st_size} bytes"
    assert pic["ink"] >= min_ink, f"{name}: almost blank ({pic})"
    return pic


def click_every_tab(page, panel, prefix: str) -> dict[str, int]:
    """Click each tab of each dashboard in ``panel``; wait for its charts; screenshot it.
    Returns ``'<dashboard>/<tab>' -> charts drawn``."""
    seen: dict[str, int] = {}
    dashboards = panel.locator(".tpkit-live")
    for d in range(dashboards.count()):
        dash = dashboards.nth(d)
        dash.scroll_into_view_if_needed()
        tabs = dash.locator(".lm-TabBar-tab")
        for t in range(tabs.count()):
            title = tabs.nth(t).inner_text().strip()
            tabs.nth(t).click()
            page.wait_for_timeout(200)
            seen[f"{d}/{title}"] = browser.wait_for_charts(dash)
            safe = re.sub(r"\W+", "_", title).strip("_").lower()
            shot(page, dash, f"{prefix}-{d}-{safe}", min_ink=0.005)
    return seen


def test_quickstart_summary_shows_a_chart_and_the_top_recommendation(lab):
    root, base, token = lab
    with browser.notebook_page(base, token, "01_quickstart.ipynb") as page:
        errors = browser.ConsoleErrors(page)
        browser.run_all(page, timeout_s=300)
        notebook_claims.quickstart(notebook_claims.text(browser.outputs(page)))
        panel = page.locator(".jp-NotebookPanel:visible")
        dash = panel.locator(".tpkit-live").first
        dash.scroll_into_view_if_needed()
        summary = dash.locator(".tp-live-chart:visible")
        assert browser.wait_for_charts(dash) >= 1 and summary.first.locator("svg.marks, canvas.marks").count() == 1
        assert dash.locator("text=Top recommendation").count() == 1 or dash.locator(
            "text=No recommendation: no rule fired").count() == 1
        assert dash.locator(".tp-verdict").first.inner_text().split(":")[0] in (
            "EVAL-BOUND", "SAVE-BOUND", "INPUT-BOUND", "INPUT-LIMITED", "COPY-BOUND", "OFFLOAD-BOUND", "OPTIMIZER-BOUND", "OVERHEAD-BOUND",
            "COMPUTE-BOUND")
        figures = dash.locator(".tp-figures").inner_text()
        assert "cpu_freq_mhz" not in figures and not re.search(r"\d\.0{4,}", figures)  # names and units
        shot(page, dash, "01-summary")
        seen = click_every_tab(page, panel, "01")
        assert {"0/Summary", "0/Stall timeline", "0/Memory", "0/Export"} <= set(seen)
        assert seen["0/Stall timeline"] >= 1 and seen["0/Memory"] >= 1
        # the static copy exists beside the widget and is hidden where the widget rendered
        assert panel.locator(".tpkit-static").count() >= 1
        assert panel.locator(".tpkit-static:visible").count() == 0
        assert errors.real() == [], errors.real()
        shutdown_kernel(page)


def shutdown_kernel(page) -> None:
    browser.shutdown_kernel(page)


def test_three_dashboards_on_one_page_raise_no_console_error(lab):
    root, base, token = lab
    with browser.notebook_page(base, token, "02_data_stalls.ipynb") as page:
        errors = browser.ConsoleErrors(page)
        browser.run_all(page, timeout_s=420)
        notebook_claims.data_stalls(notebook_claims.text(browser.outputs(page)))
        panel = page.locator(".jp-NotebookPanel:visible")
        assert panel.locator(".tpkit-live").count() == 3
        seen = click_every_tab(page, panel, "02")
        assert {"2/Summary", "2/Loader", "2/Compare"} <= set(seen), sorted(seen)
        assert all(n >= 1 for k, n in seen.items() if not k.endswith("/Export")), seen
        page.wait_for_timeout(500)
        assert errors.real() == [], errors.real()  # no "Identifier 'Ti' has already been declared"
        # the page holds vega's bundle once, however many dashboards show it
        assert page.evaluate("() => typeof window.vegaEmbed") == "function"
        shutdown_kernel(page)


def test_tuning_notebook_and_every_tuner_tab(lab):
    root, base, token = lab
    with browser.notebook_page(base, token, "07_tuning.ipynb") as page:
        errors = browser.ConsoleErrors(page)
        browser.run_all(page, timeout_s=540)
        notebook_claims.tuning(notebook_claims.text(browser.outputs(page)))
        panel = page.locator(".jp-NotebookPanel:visible")
        tuner = panel.locator(".jp-OutputArea-output").filter(has=page.locator(".tp-results")).first
        tabs = tuner.locator(".lm-TabBar-tab")
        assert tabs.all_inner_texts() == ["Summary", "Results", "Recommendations", "Compare"]
        tuner.scroll_into_view_if_needed()
        assert tuner.locator("text=Top recommendation").count() + tuner.locator("text=No recommendation").count() >= 1
        tabs.nth(1).click()
        results = tuner.locator(".tp-results").first
        head = [h.strip() for h in results.locator("th").all_inner_texts()]
        assert head[:3] == ["setting", "num_workers", "batch_size"] and "slices" in head
        assert results.locator("text=best").count() >= 1
        labels = panel.locator(".widget-dropdown label")
        assert "num_workers" in labels.all_inner_texts()  # the whole knob name, never cut
        for t in range(tabs.count()):
            title = tabs.nth(t).inner_text().strip()
            tabs.nth(t).click()
            page.wait_for_timeout(200)
            browser.wait_for_charts(tuner)
            safe = re.sub(r"\W+", "_", title).lower()
            shot(page, tuner, f"07-tuner-{safe}", min_ink=0.005)
        assert errors.real() == [], errors.real()
        shutdown_kernel(page)


def test_compare_of_six_runs_fits_in_1200_px(lab):
    root, base, token = lab
    nbformat.write(notebook([
        "%load_ext tpkit\nimport time\nimport tpkit as tp\n"
        "runs = [tp.profile_fn(lambda s=s: time.sleep(s), steps=6, warmup=1, name=f'sleep_{round(s * 1e3)}ms',\n"
        "                      progress=False, memory=False, clock_hz=0) for s in (0.004, 0.005, 0.006, 0.007, 0.008, 0.009)]\n"
        "tp.dashboard(runs[0], compare_with=runs[1:])",
    ]), root / "compare6.ipynb")
    with browser.notebook_page(base, token, "compare6.ipynb") as page:
        errors = browser.ConsoleErrors(page)
        browser.run_all(page, timeout_s=120)
        panel = page.locator(".jp-NotebookPanel:visible")
        dash = panel.locator(".tpkit-live").first
        dash.get_by_role("tab", name="Compare").click()
        view = dash.locator(".tpkit-compare:visible")
        view.wait_for(timeout=30_000)
        assert browser.wait_for_charts(dash) >= 2
        box = view.bounding_box()
        assert box["height"] <= 1200, f"Compare for 6 runs is {box['height']:.0f} px tall"
        assert view.locator("table.tp-grid").first.locator("tbody tr").count() == 6  # one row per run
        shot(page, view, "compare-6-runs")
        assert errors.real() == [], errors.real()
        shutdown_kernel(page)


def test_static_copy_shows_where_the_widget_cannot(lab):
    """A notebook saved without widget state (reopened later, or on GitHub): the widget says
    it cannot find its model, and the static copy (tables and SVG) is what shows."""
    from nbclient import NotebookClient

    root, base, token = lab
    nb = notebook(["import time\nimport tpkit as tp\n"
                   "run = tp.profile_fn(lambda: time.sleep(0.003), steps=6, warmup=1, name='static', progress=False,"
                   " memory=False, clock_hz=0)\ntp.dashboard(run)"])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(root)}}).execute()
    nb.metadata.pop("widgets", None)  # what a notebook saved without widget state holds
    nbformat.write(nb, root / "static.ipynb")
    with browser.notebook_page(base, token, "static.ipynb") as page:
        panel = page.locator(".jp-NotebookPanel:visible")
        static = panel.locator(".tpkit-static")
        static.wait_for(timeout=30_000)
        page.wait_for_timeout(1500)  # give the widget manager its chance to render
        assert panel.locator(".tpkit-live").count() == 0
        assert static.is_visible() and static.locator("img[src^='data:image/svg+xml']").count() >= 1
        assert "Top recommendation" in static.inner_text() or "No recommendation" in static.inner_text()
        shot(page, static, "static-copy")
        shutdown_kernel(page)


TUNER = [
    "%load_ext tpkit\nimport tpkit as tp\nfrom tpkit.demo import make_training, train\n"
    "def train_fn(batch_size, num_workers):\n"
    "    model, loader, opt = make_training(batch_size=batch_size, num_workers=num_workers)\n"
    "    train(model, loader, opt)\n"
    "tuner = tp.tune(train_fn, knobs={'batch_size': [8, 16], 'num_workers': [0]}, steps=3, warmup=1, replicates=1)\n"
    "first = tuner.run_slice()\n"
    "tuner",
]


def test_tuner_run_slice_in_jupyterlab(lab):
    root, base, token = lab
    nbformat.write(notebook(TUNER), root / "tuner.ipynb")
    with browser.notebook_page(base, token, "tuner.ipynb") as page:
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        panel = page.locator(".jp-NotebookPanel:visible")
        results = panel.locator(".tp-results")
        results.wait_for(state="attached", timeout=120_000)
        panel.get_by_role("tab", name="Results").click()  # Summary is the first tab
        assert "tune-1" in results.inner_text() and "tune-2" not in results.inner_text()
        panel.locator(".widget-dropdown select").first.select_option("16")
        panel.get_by_role("button", name="Run slice").click()
        panel.locator(".tp-results", has_text="tune-2").wait_for(timeout=120_000)
        assert panel.locator(".tp-results tbody tr").count() == 2
        panel.locator(".tp-live-chart:visible").first.wait_for(timeout=30_000)  # refresh swaps the chart in
        assert browser.wait_for_charts(panel) >= 1  # the trade-off chart, drawn by vega
        panel.get_by_role("tab", name="Compare").click()
        panel.locator("text=Comparison of 2 runs").wait_for(timeout=30_000)
        shot(page, panel, "tuner")
        assert page.locator("text=Error loading script").count() == 0
        shutdown_kernel(page)
