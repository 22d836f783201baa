"""What the tutorial notebooks 01, 02 and 07 must print, checked wherever they ran: by nbclient
(``test_notebooks.py``) or in JupyterLab (``test_browser.py``). Where Chromium is installed the
browser test runs them and checks these claims on the outputs JupyterLab holds, so the three
notebooks run once per suite, not twice."""

from __future__ import annotations

import re


def text(cells_outputs: list[list[dict]]) -> str:
    """All printed text and plain-text results, in order, from each code cell's outputs
    (nbformat's dicts: a text field may be one string or a list of lines)."""
    def joined(value: str | list[str]) -> str:
        return value if isinstance(value, str) else "".join(value)

    parts = []
    for outputs in cells_outputs:
        for o in outputs:
            if o["output_type"] == "stream" and o["name"] == "stdout":
                parts.append(joined(o["text"]))
            elif o["output_type"] in ("execute_result", "display_data"):
                parts.append(joined(o["data"].get("text/plain", "")))
    return "\n".join(parts)


def figure(out: str, pattern: str) -> float:
    m = re.search(pattern, out)
    assert m, f"the notebook did not print {pattern!r}"
    return float(m.group(1).replace(",", ""))


def quickstart(out: str) -> None:
    """01: a run, its verdict and throughput; parameters counted exactly (4 bytes per fp32)."""
    assert "tpkit run 'quickstart'" in out and "verdict:" in out
    assert figure(out, r"throughput from the frame: ([\d,.]+) samples/s") > 0
    m = re.search(r"parameters: ([\d,]+) bytes = 4 bytes x ([\d,]+) fp32", out)
    assert m and int(m.group(1).replace(",", "")) == 4 * int(m.group(2).replace(",", ""))
    assert "identical" in out and "timeline.png" in out


def data_stalls(out: str) -> None:
    """02: the stall is found, named and fixed twice, each fix measured."""
    assert figure(out, r"data stall: (\d+)% of step time") >= 25
    assert "INPUT-BOUND" in out and "knob: num_workers" in out
    assert figure(out, r"more workers: ([\d.]+)x samples/s") >= 1.2  # the notebook asserts it too
    assert figure(out, r"tp.data.Loader: ([\d.]+)x samples/s") >= 1.2
    assert "loader verdict:" in out and "tpkit comparison: starved" in out


def tuning(out: str) -> None:
    """07: four settings ran, the best uses workers and is measured faster, then rerun."""
    assert figure(out, r"(\d+) settings ran") == 4
    assert re.search(r"best setting: \{'num_workers': [1-9]", out)
    assert figure(out, r"workers at batch \d+: ([\d.]+)x samples/s") >= 1.2
    assert "rerun of" in out
