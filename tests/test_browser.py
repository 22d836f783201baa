"""The tuner in a real browser: JupyterLab + Chromium run a notebook, click "Run slice", and
find a second run in the comparison and vega's charts drawn."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

import browser

NOTEBOOK = [
    "%load_ext tpkit\nimport tpkit as tp\nfrom tpkit.demo import make_training, train\n"
    "def train_fn(batch_size, num_workers):\n"
    "    model, loader, opt = make_training(batch_size=batch_size, num_workers=num_workers)\n"
    "    train(model, loader, opt)\n"
    "tuner = tp.tune(train_fn, knobs={'batch_size': [8, 16], 'num_workers': [0]}, steps=3, warmup=1)\n"
    "first = tuner.run_slice()\n"
    "tuner",
]

ARTIFACTS = Path(os.environ.get("TPKIT_ARTIFACTS", Path(__file__).parent.parent / "test_artifacts"))


@pytest.mark.slow
@pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))
def test_tuner_run_slice_in_jupyterlab(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "tuner.ipynb")
    with browser.jupyterlab(tmp_path) as (base, token), browser.notebook_page(base, token, "tuner.ipynb") as page:
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        panel = page.locator(".jp-NotebookPanel:visible")
        results = panel.locator(".tp-results")
        results.wait_for(timeout=120_000)
        assert "tune-1" in results.inner_text() and "tune-2" not in results.inner_text()
        panel.get_by_role("button", name="Run slice").click()
        panel.locator(".tp-results", has_text="tune-2").wait_for(timeout=120_000)
        rows = panel.locator(".tp-results tbody tr")
        assert rows.count() == 2
        # vega drew the trade-off chart (svg or canvas inside a vega-embed container)
        panel.locator(".vega-embed svg, .vega-embed canvas").first.wait_for(timeout=30_000)
        assert panel.locator(".vega-embed svg, .vega-embed canvas").count() >= 1
        # the comparison tab holds both runs
        panel.get_by_role("tab", name="Compare").click()
        panel.locator("text=Comparison of 2 runs").wait_for(timeout=30_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "tuner.png"), full_page=True)
        assert page.locator("text=Error loading script").count() == 0
