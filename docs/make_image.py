"""Render the README's picture of the dashboard: the built-in slice with a slow dataset
(so the stall timeline has something to show), its stall timeline and memory charts, as one
PNG drawn offline by vl-convert.

    python docs/make_image.py            # or: make docs-image
"""

from __future__ import annotations

import sys
from pathlib import Path

import altair as alt
import torch

import tpkit as tp
from tpkit.views import html as report
from tpkit.demo import make_training, train
from tpkit.views.export import to_png

OUT = Path(__file__).resolve().parent / "dashboard.png"
SECTIONS = ("Stall timeline", "Memory")


def main() -> int:
    torch.set_num_threads(1)
    tp.set_store(None)  # the picture's run is not kept
    model, loader, opt = make_training(batch_size=16, sleep_ms=4.0)  # ~64 ms of IO per batch, no workers
    with tp.profile(steps=12, warmup=2, name="demo (0 workers, slow IO)", progress=False) as prof:
        train(model, loader, opt)
    run = prof.run
    charts = dict(report.section_charts(run))
    picture = alt.vconcat(*(charts[s] for s in SECTIONS if s in charts)).resolve_scale(color="independent")
    to_png(picture, OUT, scale_factor=1.0)
    print(run.summary().to_text())
    print(f"{OUT}: {OUT.stat().st_size / 1024:,.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
