"""``%%tp_profile``: parse arguments, run the cell as a slice, show the dashboard.

Nothing is measured or drawn here: the slice is ``tpkit.profiler.Profile`` and the display
is the Run's own rich representation.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import CodeType
from typing import Any, Iterator, Literal

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from ..capture.interrupts import held_sigint
from ..capture.recorder import active
from ..capture.slice import Profile, SliceConfig, last_run
from ..errors import StopSlice, TpkitError


def _warmup(value: str) -> "int | Literal['auto']":
    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"--warmup takes a whole number >= 0 or 'auto', got {value!r}") from None
    if n < 0:
        raise UsageError(f"--warmup takes a whole number >= 0 or 'auto', got {value!r}")
    return n


@magics_class
class TpkitMagics(Magics):
    """``%%tp_profile``, ``%tp_runs`` and ``%tp_compare``."""

    @property
    def ip(self) -> Any:
        """The IPython shell the magics are registered with."""
        if self.shell is None:
            raise UsageError("tpkit's magics need an IPython shell: run %load_ext tpkit in one")
        return self.shell

    @magic_arguments()
    @argument("--steps", type=int, default=20, help="measured optimizer steps (after warmup); default 20")
    @argument("--warmup", default="3", help="steps flagged as warmup: a number, or 'auto' (until step times settle); default 3")
    @argument("--name", default=None, help="name of the run (default: run<N>)")
    @argument("--no-stop", action="store_true", help="profile the whole cell instead of stopping after the slice")
    @argument("--quiet", action="store_true", help="no progress bar and no charts: print the summary only")
    @argument("--save", metavar="DIR", default=None, help="also save the run (Parquet + JSON) into DIR")
    @argument("--no-memory", action="store_true", help="do not track memory by category")
    @argument("--memory-detail", action="store_true",
              help="CUDA: also record the allocator history and keep the largest allocations alive at the peak, with stacks")
    @argument("--comm", choices=["auto", "on", "off"], default="auto",
              help="time collectives: auto (where the process group has more than one rank), on (one rank "
                   "as well), off; default auto")
    @argument("--clock-hz", type=float, default=20.0, help="clock/power sampling rate, 0 turns it off (max 200); default 20")
    @argument("--samples-per-step", type=int, default=None, help="samples in one step, when the loader cannot tell")
    @argument("--kernels", choices=["on", "off", "ab"], default=None,
              help="tpkit's Triton kernels for the models in the notebook: on, off, or ab (the slice twice, "
                   "without then with kernels, from the same state: time, memory and loss side by side)")
    @argument("--ops", type=int, nargs="?", const=3, default=0, metavar="N",
              help="operator time per phase with torch.profiler (CPU and CUDA, input shapes) in the last N "
                   "measured steps (default N: 3); those steps run slower, the others are untouched")
    @line_cell_magic
    def tp_profile(self, line: str, cell: str | None = None) -> None:
        """Profile a slice of a training loop and show where the time went.

        As a cell magic, the cell is the loop; as a line magic (IPython's convention, like
        ``%timeit`` / ``%%timeit``), the statement after the options is::

            %tp_profile --steps 20 train(model, loader)

            %%tp_profile --steps 20 --warmup 3 --name baseline --ops
            for batch in loader:
                loss = model(batch).mean(); loss.backward(); opt.step(); opt.zero_grad()

        The loop runs until warmup + steps optimizer steps are done, then stops by itself.
        """
        if cell is None:
            line, cell = _split_statement(self.tp_profile, line)
            if not cell.strip():
                raise UsageError("%tp_profile: no statement to profile; e.g. %tp_profile --steps 20 "
                                 "train(model, loader), or %%tp_profile for a whole cell")
        config, save_dir, kernels = self._config(line, cell)
        previous = last_run()
        code = self.ip.transform_cell(cell)
        filename = self.ip.compile.cache(code)
        # compiled before the slice starts: a cell with a syntax error had started one and kept
        # an empty, incomplete run under the name asked for ("cut short by SyntaxError after 0
        # steps"), and the fixed cell was then stored as '<name>-2'. The SyntaxError is Python's
        # own, raised with no run (IPython shows its line and caret).
        compiled = compile(code, filename, "exec")
        inner = _inner_magic(cell)
        said = _cut_said(inner, line, cell) if inner is not None else None
        if kernels == "ab":
            return self._run_ab(config, compiled, save_dir, said)
        with _kernels_mode(kernels, self.ip.user_ns) as swaps:
            if kernels is not None:
                config = _with_kernels(config, kernels, swaps)
            run, error, cut = self._run(config, compiled)
        if cut and said is not None:
            print(said)
        if run is not None:
            self._show(run, config, save_dir, compare_with=[previous] if previous is not None else [])
        if error is not None:
            raise error

    def _run(self, config: SliceConfig, code: CodeType) -> tuple[Any, BaseException | None, bool]:
        """Run the cell's compiled code as one slice; the Run (partial on error), the error, and
        whether the slice's stop (``StopSlice``) unwound the cell's code to here.

        The stop ends the loop by unwinding it; a magic that runs its cell through
        ``shell.run_cell`` (``%%capture``), or a file (``%run``), had shown it as an error in a
        cell that succeeded, and one that runs the cell itself and reports after it (``%%time``,
        ``%%timeit``, ``%%prun``) lost its report without a word. The first is kept from showing
        it (``_stop_not_shown``); for the second the caller says what happened and what to do
        (``_cut_said``), once per cell (``--kernels ab`` runs the slice twice)."""
        prof = Profile(config)
        cut = False
        try:
            with _stop_not_shown(self.ip), prof:
                try:
                    exec(code, self.ip.user_ns)  # noqa: S102 - the user's own cell
                except StopSlice:
                    cut = True  # through the inner magic, if any: what it does after its cell did not run
                    raise
        except BaseException as e:  # shown with the partial run, then re-raised by the caller
            return prof.run, e, False
        return prof.run, None, cut

    def _show(self, run: Any, config: SliceConfig, save_dir: str | None, compare_with: list, ab: Any = None) -> None:
        self.ip.user_ns["_tp"] = run
        _say_where_stored(run)
        if save_dir:
            run.save(Path(save_dir) / run.name if ab is not None else save_dir)
        if config.progress:
            from .dashboard import dashboard

            display(dashboard(run, compare_with=compare_with, ab=ab))
        else:
            print(ab.to_text() if ab is not None else run.summary().to_text())

    def _run_ab(self, config: SliceConfig, code: CodeType, save_dir: str | None, said: str | None = None) -> None:
        from ..capture.ab import run_ab

        cuts: list[bool] = []

        def run_slice(name: str, knobs: dict[str, Any]) -> Any:
            run, error, cut = self._run(replace(config, name=name, knobs={**config.knobs, **knobs}), code)
            cuts.append(cut)
            if error is not None:
                if run is not None:
                    self._show(run, config, None, [])
                raise error
            return run

        try:
            result = run_ab(run_slice, self.ip.user_ns, config.name or "ab")
        except ValueError as e:
            raise UsageError(f"%%tp_profile --kernels ab: {e}") from None
        finally:
            if said is not None and any(cuts):
                print(said)  # one cell, one line: it had been said once per slice
        self.ip.user_ns["_tp_ab"] = result
        if save_dir:
            result.a.save(Path(save_dir) / result.a.name)
        self._show(result.b, config, save_dir, compare_with=[result.a], ab=result)

    def _config(self, line: str, cell: str) -> tuple[SliceConfig, str | None, str | None]:
        args = _parse(self.tp_profile, line, "%%tp_profile")
        if args.steps < 1:
            raise UsageError(f"--steps takes a whole number >= 1, got {args.steps}")
        if args.samples_per_step is not None and args.samples_per_step < 1:
            raise UsageError(f"--samples-per-step takes a whole number >= 1, got {args.samples_per_step}")
        if not cell.strip():
            raise UsageError("%%tp_profile: the cell is empty; put your training loop under the magic line")
        running = active()
        if running is not None:
            raise UsageError(f"%%tp_profile: a slice ('{running.name}') is already running; "
                             "one %%tp_profile cannot run inside another")
        try:
            config = SliceConfig(steps=args.steps, warmup=_warmup(args.warmup), name=args.name or _next_name(),
                                 stop=not args.no_stop, progress=not args.quiet,
                                 samples_per_step=args.samples_per_step, memory=not args.no_memory,
                                 memory_detail=args.memory_detail,
                                 clock_hz=args.clock_hz, ops=args.ops,
                                 comm={"auto": None, "on": True, "off": False}[args.comm]).validate()
        except TpkitError as e:
            raise UsageError(f"%%tp_profile: {e}") from None
        if args.save:
            from ..store import writable_folder

            try:  # checked before the cell runs: a bad path never costs the slice
                writable_folder(args.save, "--save")
            except TpkitError as e:
                raise UsageError(f"%%tp_profile: {e}") from None
        return config, args.save, args.kernels

    @magic_arguments()
    @argument("--store", metavar="DIR", default=None, help="list this store instead of the one in use")
    @line_magic
    def tp_runs(self, line: str) -> Any:
        """List the runs in the run store (``tp.runs()``): figures, verdicts, damaged folders."""
        from ..analysis.catalog import runs
        from ..store import store_path

        args = _parse(self.tp_runs, line, "%tp_runs")
        where = args.store or store_path()
        table = runs(args.store)
        if table.empty:
            print(f"no runs in {where}" if where is not None else "the run store is off (tp.set_store(path) turns it on)")
            return None
        return table

    @magic_arguments()
    @argument("--baseline", default=None, help="the run the others are compared with (one of NAMES); default: the first")
    @argument("names", nargs="+", help="runs to compare: store names, saved folders or variables holding a Run")
    @line_magic
    def tp_compare(self, line: str) -> None:
        """Compare runs against a baseline: figures with 95% intervals, deltas, significance, warnings.

        ``%tp_compare baseline workers4 workers8`` or ``%tp_compare --baseline workers4 baseline workers4``.
        """
        from ..analysis.compare import compare
        from ..run import Run
        from ..store import check_distinct, handles, load_resolved

        args = _parse(self.tp_compare, line, "%tp_compare")
        loaded, shared, resolved = [], [], []
        for name in args.names:
            var = self.ip.user_ns.get(name)
            if isinstance(var, Run):
                loaded.append(var)
                continue
            try:
                run, found = load_resolved(name)
                loaded.append(run)
                resolved.append(found)
                if found is not None and found.describe():
                    shared.append(found.describe())
            except TpkitError as e:
                msg = f"%tp_compare: cannot load {name!r}: {e}"
                if "known runs" not in msg:
                    msg += f"\nknown runs: {', '.join(sorted(handles().values())) or 'none'}"
                raise UsageError(msg) from None
        try:
            check_distinct(resolved)
        except TpkitError as e:
            raise UsageError(f"%tp_compare: {e}") from None
        baseline = None
        if args.baseline is not None:
            if args.baseline not in args.names:
                raise UsageError(f"%tp_compare: --baseline {args.baseline!r} is not one of the runs named: "
                                 f"{' '.join(args.names)}")
            baseline = args.names.index(args.baseline)
        comparison = compare(*loaded, baseline=baseline)
        comparison.warnings[:0] = list(dict.fromkeys(shared))  # which stored run a shared name meant
        self.ip.user_ns["_tp_compare"] = comparison
        display(comparison)


def _say_where_stored(run: Any) -> None:
    """A line when the store renamed the run (its name was taken): where it went, and what the
    name given means now, as ``tpkit.store.resolve`` finds it (the newest run given it by start
    time). It had said "(the newest)" unchecked and "'base-2' always this one", false once a
    later run is given the name 'base-2'."""
    from ..store import given_name, resolve, store_path

    asked = run.meta.get("name_requested")
    if not isinstance(asked, str) or store_path() is None:
        return
    given = given_name(run.meta)
    if given == run.name:
        return
    try:
        found = resolve(given)
    except TpkitError:
        return
    mine = [i for i, (name, _) in enumerate(found.shared) if name == run.name] if found is not None else []
    if found is None or not mine:
        return  # not in the store (its save failed and said so)
    head = (f"tpkit: the store ({store_path()}) already held a run given the name {given!r}: this one is stored as "
            f"{run.name!r}; ")
    n = len(found.shared)
    if mine[0] == 0:
        print(head + f"{given!r} in %tp_compare and tp.load means this run now, the newest of the {n} runs given "
              f"that name (the one before it: '{given}~1'; tp.runs() lists the name that loads each run)")
    else:
        print(head + f"{given!r} means {found.name!r}, which started later; this one is '{given}~{mine[0]}' "
              "(tp.runs() lists the name that loads each run)")


def _inner_magic(cell: str) -> str | None:
    """The magic the whole cell is, as IPython reads it (``'%%time'``, ``'%time'``), or None.

    A cell magic is a cell whose first line, after leading blank lines, starts with ``%%``
    (IPython's input transformers); a line magic is the whole cell only when the cell is that
    one line (the statement of ``%tp_profile %time train()``)."""
    lines = [line for line in cell.splitlines() if line.strip()]
    found = re.match(r"(%%?)([\w.]+)", lines[0].strip()) if lines else None
    if found is None or (found.group(1) == "%" and len(lines) > 1):
        return None
    return found.group(0)


def _cut_said(inner: str, line: str, cell: str) -> str:
    """The line for a slice's stop that cut ``inner`` short (the magic the whole cell, or the
    line form's statement, is), with where the magic goes to keep its report.

    A cell magic goes above ``%%tp_profile``. A line magic goes in front of ``%tp_profile``
    on one line (``%time %tp_profile --steps 2 train()``): the advice "above %%tp_profile" had
    been given for it too, and a ``%time`` line above a ``%%tp_profile`` line is a UsageError
    (a cell magic must be the cell's first line)."""
    head = (f"tpkit: the slice's stop ended the loop inside {inner} with an exception (StopSlice) that {inner} "
            f"does not catch, so what {inner} does after running its ")
    if inner.startswith("%%"):
        return head + f"cell (its report) did not run; put {inner} above %%tp_profile to have it"
    statement = cell.strip()[len(inner):].strip()
    together = " ".join(part for part in (inner, "%tp_profile", line.strip(), statement) if part)
    return head + f"statement (its report) did not run; put {inner} in front of %tp_profile to have it: {together}"


@contextmanager
def _stop_not_shown(shell: Any) -> Iterator[None]:
    """While the slice runs, IPython's ``run_cell`` (``run_code``) shows no ``StopSlice``: a magic
    inside the cell that runs its cell through it (``%%capture``, a user's own) catches every
    exception and shows it, and the slice's stop read as an error with a traceback through
    tpkit, in a cell that succeeded (and in ``sys.last_value``). It is IPython's custom exception
    slot (``set_custom_exc``): the handlers already there are kept for their exceptions, and the
    slot is put back as it was on every way out, unless the cell set its own meanwhile.

    ``%run`` (IPython's ``safe_execfile``) catches every exception of the file and calls the
    shell's ``showtraceback`` itself, never the slot: the slice's stop in a ``%run`` file was
    shown as an error. So ``showtraceback`` is wrapped too, for the slice, to show nothing for a
    ``StopSlice`` (the file ends there, as the loop does; ``%run`` goes on as after any error
    it shows); it is put back as the slot is."""
    types_before, handler_before = shell.custom_exceptions, shell.CustomTB
    own_show = shell.__dict__.get("showtraceback")  # an instance's own (a tool's, a test's), else the class's
    show = shell.showtraceback

    def handler(etype: type, value: BaseException, tb: Any, tb_offset: int | None = None) -> Any:
        if issubclass(etype, StopSlice):
            if isinstance(value, StopSlice):
                value.handled_by_tpkit = True  # no stop the loop swallowed
            return None  # the inner run_cell ends there, as the loop does: nothing to show
        return handler_before(etype, value, tb, tb_offset=tb_offset)

    def showtraceback(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
        etype, value = (exc_tuple or sys.exc_info())[:2]
        if isinstance(etype, type) and issubclass(etype, StopSlice):
            if isinstance(value, StopSlice):
                value.handled_by_tpkit = True  # no stop the loop swallowed
            return None
        return show(exc_tuple, *args, **kwargs)

    shell.custom_exceptions, shell.CustomTB = (*types_before, StopSlice), handler
    shell.showtraceback = showtraceback
    try:
        yield
    finally:
        with held_sigint():  # a Ctrl-C here would leave the slot half restored
            if shell.CustomTB is handler:
                shell.custom_exceptions = types_before
                shell.CustomTB = handler_before
            if shell.__dict__.get("showtraceback") is showtraceback:
                if own_show is None:
                    del shell.showtraceback
                else:
                    shell.showtraceback = own_show


def _split_statement(magic: Any, line: str) -> tuple[str, str]:
    """``'--steps 20 train(m, l)'`` -> ``('--steps 20', 'train(m, l)')``: the options the magic
    knows, then the statement from the first word that is neither an option nor its value."""
    actions = magic.parser._option_string_actions  # argparse's table of option strings
    words = list(re.finditer(r"\S+", line))
    i = 0
    while i < len(words):
        word = words[i].group()
        name = word.split("=", 1)[0]
        if not word.startswith("-") or name not in actions:
            break
        action = actions[name]
        if "=" not in word and action.nargs != 0:
            nxt = words[i + 1].group() if i + 1 < len(words) else None
            takes = action.nargs != "?" or (nxt is not None and re.fullmatch(r"\d+", nxt) is not None)
            i += 1 if takes else 0
        i += 1
    cut = words[i].start() if i < len(words) else len(line)
    return line[:cut].strip(), line[cut:].strip()


def _parse(magic: Any, line: str, prefix: str) -> Any:
    """Parse a magic's arguments; a bad line raises UsageError with the allowed usage."""
    try:
        return parse_argstring(magic, line)
    except UsageError as e:
        raise UsageError(f"{prefix}: {e}\n{magic.parser.format_usage()}") from None


@contextmanager
def _kernels_mode(mode: str | None, ns: dict[str, Any]) -> Iterator[list[str]]:
    """``on``: patch the notebook's models for the slice; ``off``: unpatch models the user had
    patched, for the slice. Either way they are as before afterwards. Yields the swaps in place
    for the slice (``on``) or taken out for it (``off``), as ``Class.module (kind)``."""
    if mode is None:
        yield []
        return
    from ..capture.ab import models_in
    from ..kernels import patch, patched, unpatch

    models = models_in(ns)
    if not models:
        raise UsageError(f"--kernels {mode}: no torch.nn.Module among the notebook's variables")
    before = {id(m): bool(patched(m)) for m in models}
    swaps = []
    for m in models:
        if mode == "on":
            patch(m)
            swaps += [f"{type(m).__name__}.{s.name} ({s.kind})" for s in patched(m)]
        else:
            swaps += [f"{type(m).__name__}.{s.name} ({s.kind})" for s in unpatch(m)]
    try:
        yield swaps
    finally:
        for m in models:
            unpatch(m)
            if before[id(m)]:
                patch(m)


def _with_kernels(config: SliceConfig, mode: str, swaps: list[str]) -> SliceConfig:
    """The slice's config with ``--kernels`` in its run: ``knobs["kernels"]`` (as the runs of
    ``--kernels ab``), ``meta["kernels"]`` (the mode and the modules swapped, or unswapped for
    ``off``), and a note where nothing changed. ``--kernels on`` had left no trace in the run,
    and said nothing where no module of the notebook matched a kernel."""
    if not swaps:
        note = ("--kernels on: no module matched a kernel: the slice ran the models' own code" if mode == "on"
                else "--kernels off: no model had tpkit's kernels in: the slice ran as without the option")
    else:
        note = None
    return replace(config, knobs={**config.knobs, "kernels": mode},
                   extra_meta={**config.extra_meta, "kernels": {"mode": mode, "swapped": list(swaps)}},
                   notes=config.notes + ([note] if note else []))


_COUNT = [0]


def _next_name() -> str:
    _COUNT[0] += 1
    return f"run{_COUNT[0]}"


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext tpkit``: register the magics and switch altair to offline rendering."""
    ipython.register_magics(TpkitMagics)
    enable_offline_charts()


def enable_offline_charts() -> str:
    """Make altair charts a user displays render with no network: altair's default renderer
    loads vega from a CDN and shows "Error loading script" offline (docs/MEASURED.md).
    A renderer the user chose is left alone. Returns the renderer in use."""
    import altair as alt

    if alt.renderers.active == "default":
        alt.renderers.enable("html", template="inline")
    return alt.renderers.active


def unload_ipython_extension(ipython: Any) -> None:
    """Nothing to undo: no hook is left installed between cells."""
