"""A real browser on a real JupyterLab: start both, run a notebook, hand back the page.

Debian's Chromium (no browser can be downloaded here) driven by Playwright; JupyterLab bound
to 127.0.0.1 with a token, stopped with its whole process group afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
CHROME_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def missing() -> str | None:
    """Why a browser test cannot run here, or None."""
    if not Path(CHROMIUM).exists():
        return "no chromium: apt-get install -y chromium (.ci/run does)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "no playwright: pip install playwright"
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        return "no jupyterlab in this environment"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyterlab(root: Path) -> Iterator[str]:
    """A JupyterLab serving ``root``; yields its base URL with the token as ``?token=``."""
    token, port = secrets.token_hex(12), _free_port()
    cmd = [str(Path(sys.executable).parent / "jupyter-lab"), "--no-browser", "--allow-root", "--ip=127.0.0.1",
           f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=", "--ServerApp.disable_check_xsrf=False"]
    log = open(root / "jupyterlab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "JUPYTER_PLATFORM_DIRS": "1"})
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"JupyterLab did not start: see {root / 'jupyterlab.log'}") from None
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}", token
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@contextlib.contextmanager
def notebook_page(base: str, token: str, name: str) -> Iterator[object]:
    """A Chromium page with notebook ``name`` open and its kernel ready."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(f"{base}/lab/tree/{name}?reset&token={token}")
            page.wait_for_function(
                "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                " return !!(w && w.sessionContext && w.sessionContext.session"
                " && w.sessionContext.session.kernel); }", timeout=90_000)
            yield page
        finally:
            browser.close()


# -- driving a notebook ---------------------------------------------------------------------

#: Console messages JupyterLab itself prints on a server with no network or extensions
#: manager: not tpkit's, and not errors in what the page shows.
IGNORED_CONSOLE = ("Failed to load resource", "favicon", "lab/api/news", "plugin", "Error: No provider")


class ConsoleErrors(list):
    """Console errors and uncaught page errors of a page, collected as they happen."""

    def __init__(self, page: object) -> None:
        super().__init__()
        page.on("console", lambda m: self.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.append(f"pageerror: {e}"))

    def real(self) -> list[str]:
        """The errors that are not JupyterLab's own offline noise."""
        return [e for e in self if not any(s in e for s in IGNORED_CONSOLE)]


DONE_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const cells = nb.content.widgets.filter(c => c.model.type === 'code');
  for (const c of cells) {
    const outs = c.model.outputs.toJSON();
    if (outs.some(o => o.output_type === 'error')) return 'error';
  }
  const k = nb.sessionContext.session && nb.sessionContext.session.kernel;
  if (!k || k.status !== 'idle') return false;
  return cells.every(c => c.model.executionCount !== null) ? 'done' : false;
}"""


def run_all(page: object, timeout_s: float) -> None:
    """Run every cell and wait until all ran; an error output fails at once with its text."""
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    handle = page.wait_for_function(DONE_JS, timeout=timeout_s * 1000, polling=500)
    if handle.json_value() == "error":
        text = page.evaluate("""() => window.jupyterapp.shell.currentWidget.content.widgets
            .flatMap(c => c.model.type === 'code' ? c.model.outputs.toJSON() : [])
            .filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue).join('\\n')""")
        raise AssertionError(f"a cell failed: {text}")


def outputs(page: object) -> list[list[dict]]:
    """Each code cell's outputs as JupyterLab holds them (nbformat's dicts), in order."""
    return page.evaluate("""() => window.jupyterapp.shell.currentWidget.content.widgets
        .filter(c => c.model.type === 'code').map(c => c.model.outputs.toJSON())""")


def shutdown_kernel(page: object) -> None:
    """Stop the notebook's kernel (frees the CPU for the next notebook)."""
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")


def wait_for_charts(scope: object, timeout_s: float = 60) -> int:
    """Wait until every visible live chart in ``scope`` is drawn; returns how many."""
    charts = scope.locator(".tp-live-chart:visible")
    n = charts.count()
    for i in range(n):
        charts.nth(i).locator("svg.marks, canvas.marks").first.wait_for(timeout=timeout_s * 1000)
    return n


NONBLANK_JS = """async (b64) => {
  const img = new Image(); img.src = 'data:image/png;base64,' + b64; await img.decode();
  const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0);
  const d = g.getImageData(0, 0, c.width, c.height).data; let ink = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] < 235 || d[i + 1] < 235 || d[i + 2] < 235) ink++;
  return {width: img.width, height: img.height, ink: ink / (d.length / 4)};
}"""


def picture(page: object, png: bytes) -> dict:
    """A screenshot's width, height and share of non-white pixels, decoded by the browser."""
    import base64

    return page.evaluate(NONBLANK_JS, base64.b64encode(png).decode())
