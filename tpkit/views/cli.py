"""``python -m tpkit``: the main job (profile the built-in slice, write the report) and
small tools for saved runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{n} is below the smallest allowed value, {minimum}")
        return n
    return parse


def _warmup(text: str) -> int | str:
    return "auto" if text == "auto" else _count(0)(text)


def _nonnegative(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0")
    return x


def _demo(args: argparse.Namespace) -> int:
    from ..capture.slice import profile
    from ..demo import make_training, train
    from ..store import writable_folder

    out = writable_folder(args.out, "--out")  # before the slice: a bad path never costs a run
    model, loader, opt = make_training(batch_size=args.batch_size, num_workers=args.workers, cpu_ms=args.cpu_ms)
    warmup = args.warmup
    knobs = {"batch_size": args.batch_size, "num_workers": args.workers, "cpu_ms": args.cpu_ms}
    with profile(steps=args.steps, warmup=warmup, name=args.name, knobs=knobs) as prof:
        train(model, loader, opt)
    run = prof.run
    assert run is not None
    run.save(out / "run")
    report = run.to_html(out / "report.html")
    print(run.summary().to_text())
    print(f"\nrun saved to      {out / 'run'}  (tp.load('{out / 'run'}'))")
    print(f"dashboard written {report.resolve()}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from ..run import Run
    from ..store import writable_folder

    run = Run.load(args.run_dir)
    target = Path(args.out) if args.out else Path(args.run_dir) / "report.html"
    writable_folder(target.parent, "the report's folder")
    path = run.to_html(target)
    print(run.summary().to_text())
    print(f"dashboard written {Path(path).resolve()}")
    return 0


def _ranks(args: argparse.Namespace) -> int:
    import pandas as pd

    from ..ranks import load_ranks
    from ..store import writable_folder

    ranks = load_ranks(args.ranks_dir)
    target = Path(args.out) if args.out else Path(args.ranks_dir) / "ranks_report.html"
    writable_folder(target.parent, "the report's folder")
    print(ranks.summary_text())
    st = ranks.stragglers()
    st = st[st["excess_s"] > 0]  # a step no rank held back names none (ranks alike had read rank 0, 0.0 ms)
    if len(st):
        with pd.option_context("display.max_rows", args.rows, "display.width", 120):
            shown = st.assign(excess_ms=(st["excess_s"] * 1e3).round(2)).drop(columns="excess_s")
            at = shown.pop("collective")
            if at.notna().any():  # where the ranks' waits lined up: the collective they waited at
                shown["collective"] = at.fillna("")
            print(f"\nstragglers per step (the rank the others waited for, its late phase, by how much):\n"
                  f"{shown.to_string(index=False, max_rows=args.rows)}")
    path = ranks.to_html(target)
    print(f"\ndashboard written {Path(path).resolve()}")
    if args.traces:
        written = ranks.to_traces(args.traces)
        print(f"{len(written)} Kineto-style traces written to {Path(args.traces).resolve()} "
              "(HTA: TraceAnalysis(trace_dir=...))")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tpkit``: ``demo`` profiles the built-in slice, ``report`` draws a saved run,
    ``ranks`` merges the runs of a multi-process launch."""
    parser = argparse.ArgumentParser(prog="tpkit", description="Profile PyTorch training slices.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="profile the built-in tiny transformer on the CPU and write the dashboard")
    d.add_argument("--steps", type=_count(1), default=20, help="measured optimizer steps, after warmup; default 20")
    d.add_argument("--warmup", type=_warmup, default=3,
                   help="steps flagged as warmup: a number, or 'auto' (until step times settle); default 3")
    d.add_argument("--batch-size", type=_count(1), default=16, help="samples per batch; default 16")
    d.add_argument("--workers", type=_count(0), default=0, help="DataLoader workers; default 0")
    d.add_argument("--cpu-ms", type=_nonnegative, default=0.0,
                   help="busy work per sample in ms, to make the loader slow; default 0")
    d.add_argument("--name", default="demo", help="the run's name; default demo")
    d.add_argument("--out", default="tpkit_report",
                   help="the folder for the saved run (OUT/run) and the dashboard (OUT/report.html); "
                        "default tpkit_report")
    d.set_defaults(fn=_demo)
    r = sub.add_parser("report", help="write the HTML dashboard of a saved run")
    r.add_argument("run_dir")
    r.add_argument("--out", default=None)
    r.set_defaults(fn=_report)
    k = sub.add_parser("ranks", help="merge the per-rank runs of a multi-process launch: straggler summary, "
                                     "merged dashboard, optional per-rank traces for HTA")
    k.add_argument("ranks_dir", help="the folder of rank<k> runs (TPKIT_SAVE_DIR of the launch)")
    k.add_argument("--out", default=None, help="the merged dashboard (default: RANKS_DIR/ranks_report.html)")
    k.add_argument("--traces", default=None, help="also write one Kineto-style trace per rank into this folder")
    k.add_argument("--rows", type=_count(1), default=20, help="straggler rows printed at most")
    k.set_defaults(fn=_ranks)
    args = parser.parse_args(argv)  # bad arguments: argparse's one-line usage error, exit 2
    from ..errors import RunFormatError, TpkitError

    try:
        return args.fn(args)
    except (RunFormatError, OSError) as e:  # a file that cannot be read or written: exit 1
        print(f"tpkit: {e}", file=sys.stderr)
        return 1
    except TpkitError as e:  # anything else tpkit refuses, said plainly: exit 2
        print(f"tpkit: {e}", file=sys.stderr)
        return 2
