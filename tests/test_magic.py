"""%%tp_profile through a real IPython shell: phases against known sleeps, the stop, the
hooks taken out, partial runs on errors, argument errors before the cell runs."""

from __future__ import annotations

import time

import pytest
import sleepy
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import tpkit as tp

LOOP = """
import sleepy
model, loader, opt = sleepy.make()
iterations = 0
for batch in loader:
    iterations += 1
    loss = model(batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""

TOL_S = 0.010  # sleeps overshoot by a fraction of a ms; a loaded 2-core machine adds a few ms


def test_phases_match_known_sleeps_and_slice_stops(ip, one_thread):
    before = sleepy.registries()
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 5 --warmup 2 --name truth", LOOP)
    assert sleepy.registries() == before
    assert ip.user_ns["iterations"] == 7  # warmup + steps, then the loop was stopped
    run = ip.user_ns["_tp"]
    assert run is tp.last_run() and run.name == "truth" and run.complete
    steps = run.steps
    assert list(steps["step"]) == [-2, -1, 0, 1, 2, 3, 4]
    assert list(steps["warmup"]) == [True, True, False, False, False, False, False]
    m = run.measured_steps
    assert len(m) == 5
    assert (m["samples"] == sleepy.BATCH).all()
    truth = {"data_wait_s": sleepy.BATCH * sleepy.SAMPLE_S, "forward_s": sleepy.FORWARD_S,
             "backward_s": sleepy.BACKWARD_S, "optimizer_s": sleepy.OPTIMIZER_S}
    for col, want in truth.items():
        got = m[col].to_numpy()
        # lower bound tight (a sleep never ends early); upper bound allows a loaded machine's
        # late wake-ups but not a neighbouring phase's time (the smallest neighbour is 15 ms)
        assert (got >= want - 0.0005).all() and (got <= want + max(TOL_S, 0.3 * want)).all(), (col, got, want)
    # time outside every phase is small, once Python's own collector pauses (recorded as
    # "gc" spans) are set aside
    gc_s = run.spans[run.spans["phase"] == "gc"].groupby("step")["duration_s"].sum()
    assert ((m["other_s"] - m["step"].map(gc_s).fillna(0.0)) < TOL_S).all()
    assert (m["h2d_s"] == 0).all()
    total = sum(truth.values())
    assert m["duration_s"].median() == pytest.approx(total, abs=TOL_S * 2)
    assert m["throughput"].median() == pytest.approx(sleepy.BATCH / m["duration_s"].median())
    assert run.summary().verdict.kind == "input-bound"  # 20 ms of 90 ms waits for data
    # the cell's display: the summary as text and the dashboard as HTML with its charts
    data = cap.outputs[-1].data
    assert "INPUT-BOUND" in data["text/plain"]
    assert "application/vnd.jupyter.widget-view+json" in data  # the dashboard panel
    assert run.meta["model"] == {"class": "SleepyModel", "parameters": 5, "trainable": 5}
    assert run.meta["optimizers"] == ["SleepySGD"]


def test_error_mid_slice_keeps_partial_run_and_removes_hooks(ip):
    before = sleepy.registries()
    cell = LOOP.replace("    opt.zero_grad()", "    opt.zero_grad()\n    if iterations == 3: raise RuntimeError('boom')")
    with pytest.raises(RuntimeError, match="boom"):
        with capture_output() as cap:
            ip.run_cell_magic("tp_profile", "--steps 5 --warmup 1 --name broken", cell)
    assert sleepy.registries() == before
    run = tp.last_run()
    assert run.name == "broken" and not run.complete
    assert run.meta["stopped_by"] == "error" and "boom" in run.meta["error"]
    assert len(run.steps) == 3 and list(run.steps["step"]) == [-1, 0, 1]
    assert "INCOMPLETE" in cap.outputs[-1].data["text/plain"]


def test_a_cell_with_a_syntax_error_starts_no_slice_and_keeps_no_run(ip, tmp_path):
    """The cell is compiled before the slice starts: a syntax error is Python's own, and no run
    is made. It had started a slice and kept an empty INCOMPLETE run under the name asked for
    (tp.last_run() -> 'mine', 0 steps; the store held 'mine'), printed as "cut short by
    SyntaxError after 0 steps", and the fixed cell was then stored as 'mine-2'."""
    tp.set_store(tmp_path)
    before, previous = sleepy.registries(), tp.last_run()
    with pytest.raises(SyntaxError, match="never closed"):
        with capture_output() as cap:
            ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet --name mine",
                              LOOP.replace("loss = model(batch)", "loss = model(batch"))
    assert sleepy.registries() == before
    assert tp.last_run() is previous and cap.stdout == "" and not list(tmp_path.iterdir())
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet --name mine", LOOP)
    assert tp.last_run().name == "mine" and [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_interrupt_mid_slice(ip):
    before = sleepy.registries()
    cell = LOOP.replace("    loss.backward()", "    loss.backward()\n    if iterations == 2: raise KeyboardInterrupt")
    with pytest.raises(KeyboardInterrupt):
        with capture_output():
            ip.run_cell_magic("tp_profile", "--steps 5 --warmup 0 --quiet", cell)
    assert sleepy.registries() == before
    run = tp.last_run()
    assert run.meta["stopped_by"] == "interrupt" and len(run.steps) == 1
    # the interrupted step's forward and backward are kept in spans
    phases = set(run.spans[run.spans["step"] == 1]["phase"]) - {"tpkit", "gc"}  # tpkit: the memory probe's own work
    assert phases == {"data_wait", "forward", "backward", "optimizer"}


def test_loop_that_ends_early_keeps_its_steps(ip):
    cell = LOOP.replace("for batch in loader:", "for _, batch in zip(range(4), loader):")
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 10 --warmup 1 --quiet", cell)
    run = tp.last_run()
    assert len(run.steps) == 4 and run.complete and run.meta["stopped_by"] == "loop_end"
    assert any("ended after 4 steps" in n for n in run.meta["notes"])


def test_no_optimizer_explains_how_to_mark_steps_and_tp_step_works(ip):
    cell = "import time\nfor i in range(3):\n    time.sleep(0.001)\n"
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet", cell)
    run = tp.last_run()
    assert len(run.steps) == 0 and any("tp.step()" in n for n in run.meta["notes"])
    assert "tp.step()" in cap.stdout
    cell = "import time, tpkit as tp\nn = 0\nwhile True:\n    n += 1\n    time.sleep(0.001)\n    tp.step()\n"
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 4 --warmup 1 --quiet", cell)
    # the loop stops at its next training action after the 5th step: here nothing tpkit sees but
    # tp.step(), so a 6th iteration's body runs up to it
    assert ip.user_ns["n"] == 6 and len(tp.last_run().measured_steps) == 4


def test_no_stop_profiles_the_whole_cell(ip):
    cell = LOOP.replace("for batch in loader:", "for _, batch in zip(range(6), loader):")
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 1 --no-stop --quiet", cell)
    assert ip.user_ns["iterations"] == 6 and len(tp.last_run().steps) == 6


@pytest.mark.parametrize("line,match", [
    ("--steps 0", "--steps"),
    ("--warmup soon", "--warmup"),
    ("--warmup -1", "--warmup"),
    ("--bogus 3", "unrecognized arguments"),
    ("--steps three", "invalid int"),
])
def test_bad_arguments_are_refused_before_the_cell_runs(ip, line, match):
    ip.user_ns["ran"] = False
    with pytest.raises(UsageError, match=match) as err:
        ip.run_cell_magic("tp_profile", line, "ran = True")
    assert ip.user_ns["ran"] is False
    if "unrecognized" in match:
        assert "--steps" in str(err.value)  # says what is allowed


def test_empty_cell_and_nested_profile_are_refused(ip):
    with pytest.raises(UsageError, match="empty"):
        ip.run_cell_magic("tp_profile", "", "   \n")
    inner = "get_ipython().run_cell_magic('tp_profile', '--quiet', 'x = 1')"
    cell = LOOP.replace("    opt.zero_grad()", "    opt.zero_grad()\n    " + inner)
    with pytest.raises(UsageError, match="already running"):
        with capture_output():
            ip.run_cell_magic("tp_profile", "--steps 3 --quiet", cell)
    assert tp.last_run().meta["stopped_by"] == "error"


def test_save_option_writes_a_loadable_run(ip, tmp_path):
    cell = LOOP.replace("for batch in loader:", "for _, batch in zip(range(3), loader):")
    with capture_output():
        ip.run_cell_magic("tp_profile", f"--steps 2 --warmup 1 --quiet --save {tmp_path / 'r'}", cell)
    loaded = tp.load(tmp_path / "r")
    assert loaded.steps.equals(tp.last_run().steps)


def test_a_rerun_under_a_taken_name_says_where_it_is_stored(ip):
    cell = LOOP.replace("for batch in loader:", "for _, batch in zip(range(3), loader):")
    with capture_output() as first:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 1 --quiet --name base", cell)
    with capture_output() as again:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 1 --quiet --name base", cell)
    assert "stored as" not in first.stdout and tp.last_run().name == "base-2"
    assert (f"the store ({tp.store.store_path()}) already held a run given the name 'base': this one is stored as "
            "'base-2'; 'base' in %tp_compare and tp.load means this run now, the newest of the 2 runs given that name "
            "(the one before it: 'base~1'; tp.runs() lists the name that loads each run)") in again.stdout
    assert tp.load("base").meta["start_unix_ns"] == tp.last_run().meta["start_unix_ns"]
    assert "always" not in again.stdout  # 'base-2' is this run only while no run is given that name


def test_the_rerun_line_says_what_the_name_means_by_start_time(ip):
    """It had said "'base' ... means this run now (the newest of that name), 'base-2' always this
    one" unchecked: a run given 'base' that started later (another machine's, copied in) keeps
    'base'; a run later given the name 'base-2' takes that name (store2.py: tp.load('base-2') is
    base-2-2)."""
    import factories

    cell = LOOP.replace("for batch in loader:", "for _, batch in zip(range(3), loader):")
    later = factories.make_run("base", [0.05] * 3, 10, start_unix_ns=time.time_ns() + 3600 * 10**9)
    tp.store.save(later)  # started an hour from now
    with capture_output() as out:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 1 --quiet --name base", cell)
    assert tp.last_run().name == "base-2"
    assert ("this one is stored as 'base-2'; 'base' means 'base', which started later; this one is 'base~1' "
            "(tp.runs() lists the name that loads each run)") in out.stdout
    assert tp.load("base~1").meta["start_unix_ns"] == tp.last_run().meta["start_unix_ns"]
    tp.store.save(factories.make_run("base-2", [0.09] * 3, 10, start_unix_ns=time.time_ns() + 7200 * 10**9))
    assert tp.load("base-2").name == "base-2-2" and tp.load("base~1").name == "base-2"


def test_stop_drops_the_last_steps_gradients(ip):
    """The slice stops at the loop's next batch, after its own zero_grad() dropped the last
    step's consumed gradients (None), so a rerun does not add onto stale ones."""
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet", LOOP)
    assert all(p.grad is None for p in ip.user_ns["model"].parameters())


CLOSURE_LOOP = """
import time, torch
class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.seconds = []
    def forward(self, x):
        t0 = time.perf_counter()
        time.sleep(0.03)
        out = self.lin(x)
        self.seconds.append(time.perf_counter() - t0)
        return out
model = Slow()
opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=1)
x, y = torch.randn(4, 8), torch.randn(4, 1)
def closure():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss
for _ in range(50):
    opt.step(closure)
"""


def test_closure_loop_under_the_magic_charges_forward_not_optimizer(ip, one_thread):
    """``opt.step(closure)`` (LBFGS here; Lightning's automatic optimization does the same):
    the closure's forward is forward, against the model's own timing."""
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 3 --warmup 1 --name closure --clock-hz 0 --quiet", CLOSURE_LOOP)
    run, model = ip.user_ns["_tp"], ip.user_ns["model"]
    assert len(run.steps) == 4 and len(model.seconds) == 4  # max_iter=1: one closure call per step
    for got, want in zip(run.steps["forward_s"], model.seconds, strict=True):
        assert abs(got - want) <= 0.15 * want, (list(run.steps["forward_s"]), model.seconds)
    assert (run.steps["optimizer_s"] < 0.5 * run.steps["forward_s"]).all()
    assert run.summary().verdict.kind != "optimizer-bound"


# -- a magic inside the profiled cell ------------------------------------------------------------
# The slice stops the loop with StopSlice (tpkit/errors.py). A magic that runs its cell through
# shell.run_cell (%%capture, a user's own) catches every exception and shows it; one that runs the
# cell itself (%%time) reports after it, which the exception skips.


class _Seen:
    """The tracebacks the shell shows, by exception type."""

    def __init__(self) -> None:
        self.shown: list[str] = []

    def __call__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - IPython's showtraceback
        import sys

        self.shown.append(type(sys.exc_info()[1]).__name__)


@pytest.fixture
def shown(ip, monkeypatch):
    import sys

    seen = _Seen()
    monkeypatch.setattr(ip, "showtraceback", seen)
    sys.last_value = None  # IPython's record of the last error shown (set again at each one)
    return seen


def test_capture_inside_the_profiled_cell_shows_no_stop_and_captures_the_loop(ip, shown):
    import sys

    cell = "%%capture cap\n" + LOOP + "    print('step', iterations)\nprint('after the loop')\n"
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 3 --warmup 1 --quiet --name capin", cell)
    run = tp.last_run()
    assert run.name == "capin" and run.complete and run.meta["stopped_by"] == "slice" and len(run.steps) == 4
    assert ip.user_ns["iterations"] == 4  # stopped at its 5th batch
    # the cell succeeded: no traceback shown (the terminal shell prints it into the capture, the
    # kernel sends it as the cell's error output), nothing left as the last error
    assert shown.shown == [] and sys.last_value is None
    assert ip.user_ns["cap"].stdout.splitlines() == ["step 1", "step 2", "step 3", "step 4"]
    assert "StopSlice" not in cap.stdout and "StopSlice" not in ip.user_ns["cap"].stdout
    assert "tpkit: the slice's stop" not in cap.stdout  # nothing was cut
    # the other order (which worked before): the summary is captured, the run the same
    with capture_output():
        ip.run_cell("%%capture cap\n%%tp_profile --steps 3 --warmup 1 --quiet --name capout\n" + LOOP)
    assert tp.last_run().name == "capout" and len(tp.last_run().steps) == 4 and shown.shown == []
    assert "tpkit run 'capout'" in ip.user_ns["cap"].stdout


def test_time_inside_the_profiled_cell_says_its_report_was_cut_and_where_to_put_it(ip, shown):
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet --name timein", "%%time\n" + LOOP)
    assert tp.last_run().name == "timein" and tp.last_run().complete and ip.user_ns["iterations"] == 2
    assert "Wall time" not in cap.stdout  # %%time's report: the exception skips it (IPython's code)
    said = [line for line in cap.stdout.splitlines() if line.startswith("tpkit: the slice's stop")]
    assert said == ["tpkit: the slice's stop ended the loop inside %%time with an exception (StopSlice) that %%time "
                    "does not catch, so what %%time does after running its cell (its report) did not run; put %%time "
                    "above %%tp_profile to have it"]
    assert shown.shown == []
    # above %%tp_profile, %%time reports, and tpkit says nothing
    with capture_output() as cap:
        ip.run_cell("%%time\n%%tp_profile --steps 2 --warmup 0 --quiet --name timeout\n" + LOOP)
    assert tp.last_run().name == "timeout" and "Wall time" in cap.stdout
    assert "tpkit: the slice's stop" not in cap.stdout and shown.shown == []
    # a loop that ends before the slice is full is never stopped: %%time inside reports, no line
    short = LOOP.replace("for batch in loader:", "for _, batch in zip(range(2), loader):")
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 5 --warmup 0 --quiet --name timeshort", "%%time\n" + short)
    assert "Wall time" in cap.stdout and "tpkit: the slice's stop" not in cap.stdout
    # a line magic on the cell's first line is not the whole cell: the stop cuts nothing of it
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet", "%time x = 1\n" + LOOP)
    assert "Wall time" in cap.stdout and "tpkit: the slice's stop" not in cap.stdout


def test_a_line_magic_inside_is_told_to_go_in_front_of_tp_profile_and_that_works(ip, shown):
    """A line magic cannot go above a %%tp_profile line (IPython: a cell magic is the cell's first
    line; a '%time' line then '%%tp_profile' is a UsageError): it goes in front of %tp_profile."""
    ip.user_ns["train"] = lambda: exec(LOOP, ip.user_ns)  # noqa: S102 - the test's own loop
    with capture_output() as cap:
        ip.run_line_magic("tp_profile", "--steps 2 --warmup 0 --quiet %time train()")
    assert tp.last_run().complete and "Wall time" not in cap.stdout
    said = [line for line in cap.stdout.splitlines() if line.startswith("tpkit: the slice's stop")]
    assert said == ["tpkit: the slice's stop ended the loop inside %time with an exception (StopSlice) that %time "
                    "does not catch, so what %time does after running its statement (its report) did not run; put "
                    "%time in front of %tp_profile to have it: %time %tp_profile --steps 2 --warmup 0 --quiet train()"]
    # the line it gives, run as it is: %time reports, the slice is the same, tpkit says nothing
    with capture_output() as cap:
        ip.run_cell(said[0].rsplit("to have it: ", 1)[1])
    assert "Wall time" in cap.stdout and "tpkit: the slice's stop" not in cap.stdout and shown.shown == []
    assert tp.last_run().complete and len(tp.last_run().steps) == 2
    # a %%tp_profile cell that is one %time line: the same advice, with that cell's options
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet", "\n%time train()\n")
    assert cap.stdout.count("tpkit: the slice's stop") == 1
    assert "to have it: %time %tp_profile --steps 2 --warmup 0 --quiet train()" in cap.stdout


def test_run_of_a_file_inside_the_profiled_cell_shows_no_stop(ip, shown, tmp_path):
    """%run (IPython's safe_execfile) catches the file's exceptions and shows them itself, not
    through the custom exception slot: the slice's stop in the file is shown as nothing, an
    error of the file still is, and %run goes on (the file's names land in the notebook)."""
    import sys

    (tmp_path / "loop.py").write_text(LOOP + "print('after the loop')\n")
    (tmp_path / "bad.py").write_text("raise RuntimeError('bad file')\n")
    before = ip.showtraceback
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet --name runin",
                         f"%run {tmp_path / 'bad.py'}\n%run {tmp_path / 'loop.py'}\nafter_run = True\n")
    run = tp.last_run()
    assert run.name == "runin" and run.complete and run.meta["stopped_by"] == "slice" and len(run.steps) == 2
    assert ip.user_ns["iterations"] == 2 and ip.user_ns["after_run"]  # stopped reading its 3rd batch; the cell went on
    assert shown.shown == ["RuntimeError"] and sys.last_value is None
    assert "after the loop" not in cap.stdout and "StopSlice" not in cap.stdout + cap.stderr
    assert "tpkit: the slice's stop" not in cap.stdout  # %run did all it does after its file
    # the shell's showtraceback is its own again: a StopSlice in a %run file outside a slice is shown
    assert ip.showtraceback is before
    (tmp_path / "stop.py").write_text("from tpkit.errors import StopSlice\nraise StopSlice()\n")
    with capture_output():
        ip.run_cell(f"%run {tmp_path / 'stop.py'}")
    assert shown.shown[-1] == "StopSlice"


def test_kernels_ab_says_the_cut_report_once_per_cell(ip, shown):
    """--kernels ab runs the cell as two slices, each stopped inside %%time: one line for the cell."""
    ip.run_cell("import sleepy\nmodel, loader, opt = sleepy.make()")
    loop = "%%time\nfor batch in loader:\n    model(batch).backward(); opt.step(); opt.zero_grad()\n"
    try:
        with capture_output() as cap:
            ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet --kernels ab --name abtime", loop)
        ab = ip.user_ns["_tp_ab"]
        assert (ab.a.name, ab.b.name) == ("abtime-A", "abtime-B") and ab.a.complete and ab.b.complete
        assert "Wall time" not in cap.stdout and shown.shown == []
        assert cap.stdout.count("tpkit: the slice's stop ended the loop inside %%time") == 1
    finally:
        for name in ("model", "loader", "opt"):
            ip.user_ns.pop(name, None)


def test_a_users_own_cell_magic_inside_the_profiled_cell(ip, shown):
    from IPython.core.magic import register_cell_magic

    @register_cell_magic
    def through_run_cell(line: str, cell: str) -> None:
        result = ip.run_cell(cell)
        print("through_run_cell done, success:", result.success)

    @register_cell_magic
    def runs_it_itself(line: str, cell: str) -> None:
        exec(cell, ip.user_ns)  # noqa: S102 - the test's own cell
        print("runs_it_itself done")

    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet --name mine1", "%%through_run_cell\n" + LOOP)
    assert tp.last_run().complete and ip.user_ns["iterations"] == 2 and shown.shown == []
    # the magic's own code after the cell runs; its cell did not succeed: the slice stopped it
    assert "through_run_cell done, success: False" in cap.stdout and "tpkit: the slice's stop" not in cap.stdout
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet --name mine2", "%%runs_it_itself\n" + LOOP)
    assert tp.last_run().complete and shown.shown == [] and "runs_it_itself done" not in cap.stdout
    assert "ended the loop inside %%runs_it_itself with an exception (StopSlice)" in cap.stdout


class _MineError(Exception):
    pass


@pytest.mark.parametrize("ending", ["", "    if iterations == 1: raise RuntimeError('boom')\n",
                                    "    if iterations == 1: raise KeyboardInterrupt\n"])
def test_the_shells_custom_exception_handlers_are_kept_and_put_back(ip, shown, ending):
    """IPython's custom exception slot holds the user's handler for its exceptions during the slice,
    and is as before after it, whether the cell ends by the slice's stop, an error or Ctrl-C."""
    handled: list[str] = []

    def mine(shell, etype, value, tb, tb_offset=None) -> list[str]:  # noqa: ANN001
        handled.append(str(value))
        return []

    ip.set_custom_exc((_MineError,), mine)
    ip.user_ns["_MineError"] = _MineError
    types_before, handler_before = ip.custom_exceptions, ip.CustomTB
    try:
        cell = LOOP + "    get_ipython().run_cell('raise _MineError(iterations)')\n" + ending
        with capture_output():
            ip.run_cell("%%tp_profile --steps 2 --warmup 0 --quiet\n" + cell)
        assert ip.custom_exceptions == types_before and ip.CustomTB is handler_before
        assert tp.last_run().meta["stopped_by"] == ("error" if "boom" in ending else "interrupt" if ending else "slice")
        # the user's handler saw its exception in each iteration; the cell's error (only) was shown
        assert handled == (["1"] if ending else ["1", "2"])
        assert shown.shown == (["RuntimeError"] if "boom" in ending else ["KeyboardInterrupt"] if ending else [])
        # and a StopSlice raised outside a slice is shown as any exception again
        with capture_output():
            ip.run_cell("from tpkit.errors import StopSlice\nraise StopSlice()")
        assert shown.shown[-1] == "StopSlice"
    finally:
        ip.set_custom_exc((), None)
