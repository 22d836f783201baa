"""Render the README's pictures of the dashboard, drawn offline by vl-convert from the charts
the dashboard itself shows:

- ``docs/dashboard.png``: stall timeline and memory of a data-starved slice (the README's top);
- ``docs/tab_summary.png``, ``tab_stall_timeline.png``, ``tab_clocks_and_power.png``,
  ``tab_memory.png``, ``tab_loader.png``, ``tab_compare.png``: one picture per tab.

The runs: the built-in slice with a slow dataset and no workers (so the stall timeline has
something to show), then the same data through ``tp.data.Loader`` with 2 workers (the loader
tab, and the comparison of the two).

    python docs/make_image.py            # or: make docs-image
"""

from __future__ import annotations

import sys
from pathlib import Path

import altair as alt
import pandas as pd
import torch

import tpkit as tp
from tpkit.analysis.compare import compare
from tpkit.charts.summary import phase_share_bars
from tpkit.demo import make_training, train
from tpkit.views import html as report
from tpkit.views.compare import comparison_charts
from tpkit.views.export import to_png

DOCS = Path(__file__).resolve().parent
OUT = DOCS / "dashboard.png"
SECTIONS = ("Stall timeline", "Memory")


def _slug(title: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in title.lower()).strip("_")


def summary_picture(run: "tp.Run") -> alt.TopLevelMixin:
    """The Summary tab's charts, titled with its verdict and top recommendation."""
    s = run.summary()
    shares = pd.DataFrame([(c[:-2], v, v * s.total_s / max(1, s.steps) * 1e3) for c, v in s.phase_share.items()
                           if v > 0.0005], columns=["phase", "share", "ms_per_step"])
    from tpkit.analysis.recommend import recommendations

    recs = recommendations(run)
    lines = [f"{s.verdict.headline}: {s.verdict.evidence}"]
    if recs:
        lines.append(f"Top recommendation: {recs[0].title}; expected: {recs[0].expected_gain}")
    spans = tp.analysis.steps.timeline_frame(run.spans, max_rows=1500)
    return alt.hconcat(phase_share_bars(shares), tp.charts.stall_timeline(spans, width=440)).properties(
        title=alt.TitleParams(lines[0], subtitle=lines[1:], anchor="start", fontSize=14))


def main() -> int:
    torch.set_num_threads(1)
    tp.set_store(None)  # the pictures' runs are not kept
    model, loader, opt = make_training(batch_size=16, sleep_ms=4.0)  # ~64 ms of IO per batch, no workers
    with tp.profile(steps=12, warmup=2, name="0 workers, slow IO", progress=False) as prof:
        train(model, loader, opt)
    starved = prof.run
    model, _, opt = make_training(batch_size=16, sleep_ms=4.0)
    fixed_loader = tp.data.Loader(loader.dataset, batch_size=16, shuffle=True, drop_last=True, num_workers=2, seed=0)
    with tp.profile(steps=12, warmup=3, name="tp.data.Loader, 2 workers", progress=False) as prof:
        train(model, fixed_loader, opt)
    fixed = prof.run

    charts = dict(report.section_charts(starved))
    picture = alt.vconcat(*(charts[s] for s in SECTIONS if s in charts)).resolve_scale(color="independent")
    to_png(picture, OUT, scale_factor=1.0)
    written = [OUT]
    tabs: dict[str, alt.TopLevelMixin] = {"Summary": summary_picture(starved), **charts}
    loader_tab = dict(report.section_charts(fixed)).get("Loader")
    if loader_tab is not None:
        tabs["Loader"] = loader_tab
    comp = compare(starved, fixed)
    tabs["Compare"] = alt.vconcat(*(c for _, c in comparison_charts(comp))).resolve_scale(color="independent")
    for title, chart in tabs.items():
        path = DOCS / f"tab_{_slug(title)}.png"
        to_png(chart, path, scale_factor=1.0)
        written.append(path)
    print(starved.summary().to_text())
    print(comp.to_text())
    for path in written:
        print(f"{path}: {path.stat().st_size / 1024:,.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
