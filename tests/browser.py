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
                    raise RuntimeError(f"JupyterLab did not start: see {root / 'jupyterlab.log'}")
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
