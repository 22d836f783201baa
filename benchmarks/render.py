"""Do the charts stay quick at scale? A synthetic Run of 10,000 steps with a million clock
rows and a million memory rows: time to build every dashboard section's spec (the analysis
aggregates or thins the data; the browser never sees a million rows), and the HTML's size.

    python benchmarks/render.py [--steps 10000] [--clock-rows 1000000] [--memory-rows 1000000]
"""

from __future__ import annotations

import argparse
import json
import time

from common import machine, versions, write_rows

from tpkit.datasets.synthetic_run import synthetic_run
from tpkit.views import html as report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--clock-rows", type=int, default=1_000_000)
    ap.add_argument("--memory-rows", type=int, default=1_000_000)
    args = ap.parse_args()
    run = synthetic_run(args.steps, args.clock_rows, args.memory_rows)
    print(f"run: {len(run.steps):,} steps, {len(run.spans):,} spans, {len(run.clocks):,} clock rows, "
          f"{len(run.memory):,} memory rows")
    rows = []
    t_all = time.perf_counter()
    for title, build in report.SECTIONS:
        t = time.perf_counter()
        chart = build(run)
        if chart is None:
            continue
        spec = json.dumps(chart.to_dict())
        dt = time.perf_counter() - t
        n_values = sum(len(v) for v in chart.to_dict().get("datasets", {}).values())
        print(f"  {title:18s} {dt:6.2f} s   spec {len(spec) / 1e6:5.2f} MB, {n_values:,} data rows to the browser")
        rows.append({"op": "section_spec", "section": title, "seconds": dt, "spec_bytes": len(spec),
                     "rows_to_browser": n_values, "machine": machine(), "versions": versions()})
    t = time.perf_counter()
    html = report.dashboard_html(run)
    print(f"  whole dashboard HTML {time.perf_counter() - t:6.2f} s, {len(html) / 1e6:.1f} MB "
          f"(sections + summary, vega inlined once); all sections {time.perf_counter() - t_all:.2f} s")
    print(f"rows written to {write_rows('render', rows)}")


if __name__ == "__main__":
    main()
