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
            and "text/html" in o["data"] and "tpkit-dash" in o["data"]["text/html"]]
    assert len(rich) == 1  # one dashboard (the other display is the progress bar)
    assert "text/html" in rich[0]["data"] and "vegaEmbed(" in rich[0]["data"]["text/html"]
    assert "tpkit run 'nb'" in rich[0]["data"]["text/plain"]
    assert nb.cells[2].outputs[0]["text"].strip() == "(4, 15) True nb"
    bad = nb.cells[3].outputs
    assert bad[-1]["output_type"] == "error" and bad[-1]["ename"] == "ValueError"
    assert any(o.get("output_type") == "display_data" and "INCOMPLETE" in o["data"]["text/plain"] for o in bad)
    assert nb.cells[4].outputs[0]["text"].strip() == "bad False"
