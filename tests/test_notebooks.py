"""The tutorial notebooks run top to bottom in a real kernel (nbclient) with their default
parameters, and say what their stories claim: no error output, the dashboard's charts drawn
offline (vega inlined in the widget state, no CDN), and the figures each story prints.

Each notebook also checks its own claims in ``assert`` cells (e.g. the loader fix really
raised throughput in that run); a failing assert is an error output here. The working
directory and the run store are temporary folders, so nothing is written into the checkout.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import browser
import nbformat
import notebook_claims
import pytest
from notebook_claims import figure

import tpkit.datasets as tds

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"
sys.path.insert(0, str(NB_DIR))
import nbtool  # noqa: E402

NOTEBOOKS = [p.name for p in nbtool.notebooks()]
EXPECTED = ["01_quickstart.ipynb", "02_data_stalls.ipynb", "03_memory_waterfall_and_offload.ipynb",
            "04_triton_kernels.ipynb", "05_clocks_and_energy.ipynb", "06_deepspeed_and_ranks.ipynb",
            "07_tuning.ipynb", "08_frameworks.ipynb", "09_many_ranks.ipynb"]
CELL_TIMEOUT_S = 600  # generous: the first DeepSpeed build alone can take two minutes
# DeepSpeed's JIT-built ops are cached where the offload tests cache them: built once per checkout.
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(NB_DIR.parent / "build" / "torch_extensions")


def widget_html(nb: nbformat.NotebookNode) -> list[str]:
    """Every text/html output held by Output widgets (where the dashboard draws its charts)."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    return [o["data"]["text/html"] for s in state.values() if s.get("model_name") == "OutputModel"
            for o in s["state"].get("outputs", []) if "text/html" in o.get("data", {})]


def text(nb: nbformat.NotebookNode) -> str:
    """All printed text and plain-text results, in order."""
    return notebook_claims.text([cell.get("outputs", []) for cell in nb.cells])


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Run each notebook once (lazily) and keep the result for its test."""
    cache: dict[str, nbformat.NotebookNode] = {}

    def run(name: str) -> nbformat.NotebookNode:
        if name not in cache:
            cwd = tmp_path_factory.mktemp(name.split("_")[0])
            env = {"TPKIT_RUNS": str(cwd / "tpkit_runs"), "TORCH_EXTENSIONS_DIR": EXTENSIONS}
            cache[name] = nbtool.execute(NB_DIR / name, cwd, CELL_TIMEOUT_S, env=env)
        return cache[name]

    return run


def test_notebooks_are_committed_without_outputs():
    assert NOTEBOOKS and set(NOTEBOOKS) <= set(EXPECTED), NOTEBOOKS
    for name in NOTEBOOKS:
        nb = nbformat.read(NB_DIR / name, as_version=4)
        assert not nbtool.strip(nb), f"{name} has outputs: run `python notebooks/nbtool.py strip`"
        first_code = next(c for c in nb.cells if c.cell_type == "code")
        assert "parameters" in first_code.metadata.get("tags", []), f"{name}: first code cell must be tagged parameters"


def check_common(nb: nbformat.NotebookNode, charts: int = 1) -> str:
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(nb.cells) for o in c.get("outputs", [])
              if o["output_type"] == "error"]
    assert not errors, errors
    html = widget_html(nb)
    drawn = [h for h in html if "vegaEmbed(" in h]
    assert len(drawn) >= charts, f"{len(drawn)} charts drawn, wanted {charts}"
    assert any("window.vegaEmbed=" in h for h in html)  # vega inlined: renders offline
    assert "cdn.jsdelivr" not in "".join(html)
    return text(nb)


#: Where Chromium is installed, test_browser.py runs 01, 02 and 07 in JupyterLab and checks the
#: same claims (tests/notebook_claims.py) on what JupyterLab holds: each runs once, not twice.
IN_BROWSER = pytest.mark.skipif(browser.missing() is None, reason="run in JupyterLab by test_browser.py, "
                                "which checks the same claims (tests/notebook_claims.py)")


@pytest.mark.slow
@IN_BROWSER
def test_01_quickstart(executed):
    notebook_claims.quickstart(check_common(executed("01_quickstart.ipynb"), charts=3))


@pytest.mark.slow
@IN_BROWSER
def test_02_data_stalls(executed):
    notebook_claims.data_stalls(check_common(executed("02_data_stalls.ipynb"), charts=4))  # 3 dashboards + a comparison


@pytest.mark.slow
@IN_BROWSER
def test_07_tuning(executed):
    notebook_claims.tuning(check_common(executed("07_tuning.ipynb"), charts=2))  # trade-off chart + comparison


@pytest.mark.slow
def test_08_frameworks(executed):
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    out = check_common(executed("08_frameworks.ipynb"), charts=4)  # 4 dashboards (+ a comparison)
    assert "stopped through transformers.Trainer" in out and "on_train_end ran: True" in out
    assert "Lightning: status FINISHED, global_step 11" in out
    assert figure(out, r"\d+ workers: data stall .*= ([\d.]+)x") >= 1.3
    assert "all claims hold in this run" in out


@pytest.mark.slow
def test_03_memory_waterfall_and_offload(executed):
    out = check_common(executed("03_memory_waterfall_and_offload.ipynb"), charts=4)
    assert "during optimizer" in out  # AdamW's peak is its step
    assert figure(out, r"optimizer state = ([\d.]+) bytes per parameter") == pytest.approx(8.0, abs=0.01)
    assert figure(out, r"bf16 moments: optimizer state ([\d.]+)x of AdamW's") <= 0.55
    assert figure(out, r"host step [\d.]+ ms/step, (\d+)% of it overlapped backward") >= 50
    # the offload peak is the end of backward: no activations alive there, the tied embedding/head
    # weight's gradient in flight as three blocks of its size (its two shares and their sum)
    assert "offload: peak during backward" in out
    assert figure(out, r"offload peak: activations ([\d.]+) MiB") < 0.01
    assert figure(out, r"= ([\d.]+)x the tied embedding/head weight") == pytest.approx(3.0, abs=0.01)
    assert figure(out, r"gradients ([\d.]+)x it short") == pytest.approx(1.0, abs=0.01)


@pytest.mark.slow
def test_04_triton_kernels(executed):
    out = check_common(executed("04_triton_kernels.ipynb"), charts=2)
    assert "kernels run as: interpreter" in out or "kernels run as: triton" in out
    assert figure(out, r"rms_norm  max \|diff\|: output ([\d.e+-]+)") < 1e-4
    assert figure(out, r"on: (\d+) modules swapped") >= 4
    assert "loss verdict: loss matches" in out


@pytest.mark.slow
def test_05_clocks_and_energy(executed):
    out = check_common(executed("05_clocks_and_energy.ipynb"), charts=2)
    assert "cpu_freq_mhz" in out and "cpu_util_pct" in out
    assert "unavailable" in out or "nvml" in out  # what the machine lacks is said, not faked
    assert figure(out, r"process CPU share while waiting on IO: ([\d.]+)x") < 0.8
    shipped = tds.reference_runs()
    assert f"reference runs shipped: {shipped}" in out
    for name in shipped:
        assert f"  {name}: benchmarks/gpu_check.py" in out


def test_clocks_notebook_prose_says_which_reference_runs_ship():
    """05's prose on the GPU runs names what tpkit.datasets ships, measured where it says (it had
    said none was measured yet while the cell printed three)."""
    nb = nbformat.read(NB_DIR / "05_clocks_and_energy.ipynb", as_version=4)
    prose = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    shipped = tds.reference_runs()
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
    assert f"ships {words[len(shipped)]} reference runs, measured on one NVIDIA H200" in prose
    for name in shipped:
        assert f"`{name}`" in prose
        run = tds.load_reference_run(name)
        assert any("NVIDIA H200" in d for d in run.meta["devices"])
        assert run.meta["reference"]["made_by"].startswith("benchmarks/gpu_check.py")
    assert f"the first, `{shipped[0]}`" in prose
    assert "None has been measured" not in prose


@pytest.mark.slow
def test_06_deepspeed_and_ranks(executed):
    pytest.importorskip("deepspeed", reason="notebook 06 needs deepspeed (pip install 'tpkit[deepspeed]')")
    out = check_common(executed("06_deepspeed_and_ranks.ipynb"), charts=3)
    assert "optimizer DeepSpeedCPUAdam (offload: True)" in out
    assert figure(out, r"gradients \+ temporaries at the peak: [\d,.]+ -> [\d,.]+ MiB \(([\d,]+)x less\)") >= 10
    assert "2 ranks finished" in out and "<tpkit.RankRuns: 2/2 ranks" in out
    assert figure(out, r"rank 1 waits ([\d.]+) ms more per step for data") > 0
    assert figure(out, r"rank 0 waits ([\d.]+) ms more per step in collectives") > 0  # the comm phase
    # DeepSpeed's all-reduce segment in /dev/shm (DeepSpeed never removes it): none of the
    # kernel's left once it has exited
    left = re.search(r"/dev/shm: 0 segment\(s\) named (deepspeed_allreduce_buffer_\d+_127\.0\.0\.1_\d+_)\*", out)
    assert left, "the notebook did not check /dev/shm"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(left.group(1))]


@pytest.mark.slow
def test_09_many_ranks(executed):
    out = check_common(executed("09_many_ranks.ipynb"), charts=1)  # the merged dashboard
    assert "4 ranks finished" in out and "4 of 4 ranks loaded" in out
    assert re.search(r"verdict: rank 2's data_wait held every step back by [\d.]+ ms \(p50\)", out)
    assert figure(out, r"found: rank 2, data_wait, ([\d.]+) ms") == pytest.approx(100.0, rel=0.25)
    assert "all claims hold in this run" in out and "rank3.json" in out


def test_every_notebook_has_a_test():
    assert NOTEBOOKS == EXPECTED
    tested = {name[5:] for name in globals() if name.startswith("test_0")}
    assert tested == {n[:-6] for n in EXPECTED}


def test_readme_lists_every_notebook_in_order():
    """The README's Tutorials list ("to run in order") names each notebook once, numbered as its file."""
    readme = (NB_DIR.parent / "README.md").read_text()
    listed = re.findall(r"^(\d+)\. \[(\w+)\]\(notebooks/(\w+)\.ipynb\): \S", readme.split("## Tutorials", 1)[1], re.M)
    assert [f"{stem}.ipynb" for _, _, stem in listed] == EXPECTED
    assert all(int(n) == i + 1 and label == stem for i, (n, label, stem) in enumerate(listed))
