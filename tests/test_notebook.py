"""A real kernel runs a notebook with %%tp_profile (nbclient): outputs and mime types."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

CELLS = [
    "%load_ext tpkit\nimport tpkit as tp\nfrom tpkit.demo import make_training\n"
    "model, loader, opt = make_training(batch_size=8)",
    "%%tp_profile --steps 3 --warmup 1 --name nb\nfor batch in loader:\n"
    "    loss = model(batch['x'], batch['y'])\n    loss.backward()\n    opt.step()\n    opt.zero_grad()",
    "print(_tp.steps.shape, tp.last_run() is _tp, _tp.name)",
    "%%tp_profile --steps 3 --warmup 0 --name bad\nfor batch in loader:\n    raise ValueError('bad batch')",
    "print(tp.last_run().name, tp.last_run().complete)",
]


@pytest.mark.slow
def test_magic_in_a_real_kernel():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    profile_cell = nb.cells[1].outputs
    rich = [o for o in profile_cell if o.get("output_type") == "display_data"
            and "tpkit run 'nb'" in o["data"].get("text/plain", "")]
    assert len(rich) == 1  # one dashboard (the other display is the progress bar)
    view = rich[0]["data"]["application/vnd.jupyter.widget-view+json"]
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    assert state[view["model_id"]]["model_name"] == "VBoxModel"
    html_outputs = [o["data"]["text/html"] for s in state.values() if s["model_name"] == "OutputModel"
                    for o in s["state"].get("outputs", []) if "text/html" in o.get("data", {})]
    bundles = [h for h in html_outputs if "window.vegaEmbed=" in h]
    assert len(bundles) == 1  # vega inlined once for both dashboards (one hidden widget they share)
    static = [o for o in profile_cell if "tpkit-static" in o.get("data", {}).get("text/html", "")]
    assert len(static) == 1 and "<script" not in static[0]["data"]["text/html"]  # the copy shown without a kernel
    charts = [h for h in html_outputs if "vegaEmbed(" in h and "Stall timeline" in h]
    assert charts and "cdn.jsdelivr" not in "".join(html_outputs)
    from tpkit.schema import SCHEMAS

    assert nb.cells[2].outputs[0]["text"].strip() == f"(4, {len(SCHEMAS['steps'])}) True nb"
    bad = nb.cells[3].outputs
    assert bad[-1]["output_type"] == "error" and bad[-1]["ename"] == "ValueError"
    assert any(o.get("output_type") == "display_data" and "INCOMPLETE" in o["data"]["text/plain"] for o in bad)
    assert nb.cells[4].outputs[0]["text"].strip() == "bad False"
    # nothing of tpkit's (or kineto's, which prints on fd 2) leaks into the notebook as stderr
    stderr = [o["text"] for c in nb.cells for o in c.outputs if o.get("name") == "stderr"]
    assert not any("USDT" in t or "profiler_start" in t for t in stderr), stderr
