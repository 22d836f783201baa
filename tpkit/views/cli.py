"""``python -m tpkit``: the main job (profile the built-in slice, write the report) and
small tools for saved runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from ..capture.slice import profile
    from ..demo import make_training, train

    model, loader, opt = make_training(batch_size=args.batch_size, num_workers=args.workers, cpu_ms=args.cpu_ms)
    warmup = args.warmup if args.warmup == "auto" else int(args.warmup)
    knobs = {"batch_size": args.batch_size, "num_workers": args.workers, "cpu_ms": args.cpu_ms}
    with profile(steps=args.steps, warmup=warmup, name=args.name, knobs=knobs) as prof:
        train(model, loader, opt)
    run = prof.run
    assert run is not None
    out = Path(args.out)
    run.save(out / "run")
    report = run.to_html(out / "report.html")
    print(run.summary().to_text())
    print(f"\nrun saved to      {out / 'run'}  (tp.load('{out / 'run'}'))")
    print(f"dashboard written {report.resolve()}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from ..run import Run

    run = Run.load(args.run_dir)
    path = run.to_html(args.out or Path(args.run_dir) / "report.html")
    print(run.summary().to_text())
    print(f"dashboard written {Path(path).resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tpkit``: ``demo`` profiles the built-in slice, ``report`` draws a saved run."""
    parser = argparse.ArgumentParser(prog="tpkit", description="Profile PyTorch training slices.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="profile the built-in tiny transformer on the CPU and write the dashboard")
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--warmup", default="3", help="a number or 'auto'")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    d.add_argument("--cpu-ms", type=float, default=0.0, help="busy work per sample, to make the loader slow")
    d.add_argument("--name", default="demo")
    d.add_argument("--out", default="tpkit_report")
    d.set_defaults(fn=_demo)
    r = sub.add_parser("report", help="write the HTML dashboard of a saved run")
    r.add_argument("run_dir")
    r.add_argument("--out", default=None)
    r.set_defaults(fn=_report)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:  # the CLI prints tpkit's errors plainly
        from ..errors import TpkitError

        if isinstance(e, TpkitError):
            print(f"tpkit: {e}", file=sys.stderr)
            return 2
        raise
