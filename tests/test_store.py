"""The run store: unique names, listing with damaged folders, load by name or path, on/off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import factories
import numpy as np
import pandas as pd
import pytest

from tpkit import store
from tpkit.analysis import catalog
from tpkit.errors import RunFormatError
from tpkit.run import Run


def make_run(name: str, durations: list[float], samples: int = 10, **meta) -> Run:
    meta.setdefault("start_time", "2026-01-01T00:00:00+00:00")
    return factories.make_run(name, durations, samples, data_share=0.5, loss=np.ones(len(durations)), **meta)


@pytest.fixture(autouse=True)
def tmp_store(tmp_path, monkeypatch):
    monkeypatch.setenv("TPKIT_RUNS", str(tmp_path / "runs"))
    store.reset_store()
    return tmp_path / "runs"


def test_rerun_gets_a_unique_name_and_meta_follows(tmp_store):
    a, b, c = (make_run("baseline", [0.1, 0.2]) for _ in range(3))
    assert store.save(a) == tmp_store / "baseline"
    assert store.save(b) == tmp_store / "baseline-2"
    assert store.save(c) == tmp_store / "baseline-3"
    assert (a.name, b.name, c.name) == ("baseline", "baseline-2", "baseline-3")
    assert store.load("baseline-2").name == "baseline-2"
    assert store.names() == ["baseline", "baseline-2", "baseline-3"]


def test_a_name_means_the_newest_run_given_it_and_stored_names_stay_exact(tmp_store):
    """Rerun ``--name baseline`` and "baseline" is the run just measured (stored as baseline-2),
    by start time, not by suffix; a stored name no run was given is that run; a folder, any."""
    first, second = make_run("baseline", [0.1, 0.1], start_unix_ns=1_000), make_run("baseline", [0.2, 0.2], start_unix_ns=2_000)
    store.save(first)
    store.save(second)
    assert second.meta["name_requested"] == "baseline" and second.name == "baseline-2"
    assert store.load("baseline").steps["duration_s"].tolist() == [0.2, 0.2]
    assert store.load("baseline-2").steps["duration_s"].tolist() == [0.2, 0.2]
    assert store.load(tmp_store / "baseline").steps["duration_s"].tolist() == [0.1, 0.1]
    found = store.resolve("baseline")
    assert (found.name, found.others) == ("baseline-2", (("baseline", tmp_store / "baseline"),))
    assert "'baseline' is the run stored as 'baseline-2', the newest of the 2 runs" in found.describe()
    assert store.resolve("baseline-2").others == ()                    # its own name: one run, nothing to say
    store.save(make_run("baseline", [0.3, 0.3], start_unix_ns=3_000))  # baseline-3
    shutil.rmtree(tmp_store / "baseline-2")
    store.save(make_run("baseline", [0.4, 0.4], start_unix_ns=4_000))  # reuses baseline-2, the newest
    assert store.load("baseline").steps["duration_s"].tolist() == [0.4, 0.4]
    assert [n for n, _ in store.resolve("baseline").others] == ["baseline-3", "baseline"]


def test_runs_stored_before_the_requested_name_was_kept_answer_to_their_stored_name_exactly(tmp_store):
    """A tpkit older than ``name_requested`` wrote only the stored name, and a ``-<k>`` suffix does
    not say whether the store or the user put it there: the user's own ``resnet`` (10 ms) and
    ``resnet-50`` (50 ms), ``lr`` and ``lr-3``, ``gpt`` and ``gpt-2``. Each name is its own run: it
    had read ``resnet-50`` for ``tp.load("resnet")`` with no word, and a comparison's warning had
    called ``resnet`` an older run of it."""
    for k, (name, sleep) in enumerate([("resnet", 0.01), ("resnet-50", 0.05), ("lr", 0.1), ("lr", 0.2), ("lr-3", 0.3),
                                       ("gpt", 0.4), ("gpt-2", 0.5)]):
        store.save(make_run(name, [sleep], start_unix_ns=1_000 + k))
    for folder in tmp_store.iterdir():  # as an older tpkit wrote them: no name_requested
        meta = json.loads((folder / "meta.json").read_text())
        del meta["name_requested"]
        (folder / "meta.json").write_text(json.dumps(meta))
    dur = {name: store.load(name).steps["duration_s"].tolist() for name in ("resnet", "resnet-50", "lr", "lr-2",
                                                                            "lr-3", "gpt", "gpt-2")}
    assert dur == {"resnet": [0.01], "resnet-50": [0.05], "lr": [0.1], "lr-2": [0.2], "lr-3": [0.3], "gpt": [0.4],
                   "gpt-2": [0.5]}
    assert all(store.resolve(name).others == () for name in dur)  # nothing to warn of
    assert sorted(catalog.runs()["name"]) == sorted(dur)


def test_every_run_tp_runs_lists_loads_by_the_name_it_shows(tmp_store):
    """Two sessions ran ``baseline`` (20 ms, then 60 ms), a third a run given the name
    ``baseline-2`` (90 ms, stored as baseline-2-2), then ``baseline`` again (30 ms, stored as
    baseline-3). tp.runs() had listed ``baseline`` and ``baseline-2`` with no name that loads the
    20 ms run (``baseline`` meant the newest). Now ``name`` loads exactly its row, older runs
    given a name as ``name~k``, and ``stored_as`` is the store's name."""
    for k, (name, d) in enumerate([("baseline", 0.02), ("baseline", 0.06), ("baseline-2", 0.09), ("baseline", 0.03)]):
        store.save(make_run(name, [d] * 2, start_unix_ns=1_000 + k))
    df = catalog.runs()
    assert list(zip(df["name"], df["stored_as"], df["step_p50_ms"].round(3))) == [
        ("baseline~2", "baseline", 20.0), ("baseline~1", "baseline-2", 60.0), ("baseline-2", "baseline-2-2", 90.0),
        ("baseline", "baseline-3", 30.0)]  # oldest first
    for name, path in zip(df["name"], df["path"]):
        assert store.resolve(name).folder == Path(path), name
        assert store.load(name).steps.equals(store.load(path).steps), name
    with pytest.raises(RunFormatError, match=r"'baseline~3': only 3 run\(s\) were given 'baseline' "
                                             r"\('baseline', 'baseline~1', 'baseline~2'\)"):
        store.load("baseline~3")
    with pytest.raises(RunFormatError, match=r"known runs: baseline, baseline-2, baseline~1, baseline~2"):
        store.load("nope")


def test_two_names_of_one_run_are_an_error_that_says_what_each_meant(tmp_store):
    """``tp.compare("baseline", "baseline-2")`` after a rerun had loaded baseline-2 twice and said
    "no meaningful difference" (20 ms against 60 ms stored)."""
    import tpkit as tp

    store.save(make_run("baseline", [0.02] * 6, start_unix_ns=1))
    store.save(make_run("baseline", [0.06] * 6, start_unix_ns=2))
    with pytest.raises(RunFormatError) as e:
        tp.compare("baseline", "baseline-2")
    assert str(e.value) == (
        f"'baseline' and 'baseline-2' are the same run, stored as 'baseline-2' in {tmp_store / 'baseline-2'}: "
        "'baseline' means the newest of the 2 runs given that name; 'baseline-2' is its stored name. The other runs "
        f"given 'baseline': 'baseline~1' (stored as 'baseline' in {tmp_store / 'baseline'}). tp.runs() lists the name "
        "that loads each run")
    with pytest.raises(RunFormatError, match="are the same run"):
        tp.compare("baseline-2", str(tmp_store / "baseline-2"))  # a name and a folder of one run
    c = tp.compare("baseline~1", "baseline")
    assert [r.steps["duration_s"].iloc[0] for r in c.runs] == [0.02, 0.06] and c.baseline == "baseline"
    assert c.warnings[0].startswith("'baseline~1' is the run stored as 'baseline', 1 before the newest of the 2 runs "
                                    "given 'baseline'")
    assert tp.compare("baseline~1", "baseline", baseline="baseline").baseline == "baseline-2"  # as the name means


def test_the_ranks_of_a_launch_are_stored_as_their_own_runs_not_reruns(tmp_store, monkeypatch):
    """Each rank of a launch autosaves its slice (capture/ranks.py writes rank and world size into
    meta first). They had been stored as ``x`` and ``x-2`` given ``x``: ``tp.load("x")`` the rank that
    started last, and a comparison calling the other rank an older run. Real slices, the launcher's
    RANK / WORLD_SIZE in the environment (as torchrun sets them), rank 1 sleeping 20 ms a step more."""
    import time

    import torch

    import tpkit as tp

    def launch(rank: int) -> Run:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tp.profile(steps=3, warmup=1, name="x", progress=False, clock_hz=0, memory=False) as prof:
            for _ in range(20):
                time.sleep(0.02 + 0.02 * rank)
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
        return prof.run

    first = [launch(1), launch(0)]  # rank 1 saved first
    second = [launch(0), launch(1)]  # the launch run again
    assert [r.name for r in first + second] == ["x.rank1", "x.rank0", "x.rank0-2", "x.rank1-2"]
    assert all(r.meta["name_requested"] == "x" for r in first + second)
    with pytest.raises(RunFormatError, match=r"'x' was given to the ranks of a multi-process launch.*"
                                             r"name one \('x.rank0', 'x.rank1'\)"):
        tp.load("x")
    assert tp.load("x.rank1").meta["start_unix_ns"] == second[1].meta["start_unix_ns"]  # the newest launch's rank 1
    assert tp.load("x.rank1~1").meta["start_unix_ns"] == first[0].meta["start_unix_ns"]
    p50 = tp.load("x.rank1").steps.query("not warmup")["duration_s"].median()
    assert 0.035 < p50 < 0.08  # rank 1's own steps (40 ms), not rank 0's (20 ms)
    assert sorted(catalog.runs()["name"]) == ["x.rank0", "x.rank0~1", "x.rank1", "x.rank1~1"]


def test_a_name_that_is_also_the_folder_of_another_run_takes_the_name_and_says_so(tmp_store, tmp_path, monkeypatch):
    """``./store_t/base`` is the folder of one run (20 ms); a later run was named "store_t/base"
    (50 ms, stored as store_t_base): the name is taken, as everywhere a name is given, and it had
    said nothing; now a warning gives the folder's full path, which loads the other run."""
    import tpkit as tp

    monkeypatch.chdir(tmp_path)
    other = make_run("base", [0.02] * 6).save(tmp_path / "store_t" / "base")
    store.save(make_run("store_t/base", [0.05] * 6))
    with pytest.warns(UserWarning, match=r"'store_t/base' names the stored run 'store_t/base' .*the folder "
                                         r"store_t/base holds another run: give it as '.*store_t/base' to load"):
        assert store.load("store_t/base").steps["duration_s"].iloc[0] == 0.05
    assert store.load(str(other.resolve())).steps["duration_s"].iloc[0] == 0.02
    c = tp.compare("store_t/base", str(other.resolve()))
    assert any("the folder store_t/base holds another run" in w for w in c.warnings)


def test_a_save_dir_folder_says_which_runs_it_holds(tmp_path):
    """``tp.profile(save_dir=D)`` writes ``D/<name>`` (a launch's ranks ``D/rank<k>``): ``tp.load(D)``
    had said only "meta.json is missing"."""
    import torch

    import tpkit as tp

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tp.profile(steps=2, warmup=0, name="sd", progress=False, clock_hz=0, memory=False, save_dir=tmp_path / "D"):
        for _ in range(5):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert store.load(tmp_path / "D" / "sd").name in ("sd", "sd-2")
    with pytest.raises(RunFormatError, match=r"meta.json is missing; it holds saved runs in its folders: "
                                             rf"{tmp_path / 'D' / 'sd'} \(tp.profile\(save_dir=DIR\) saves a run "
                                             r"in DIR/<name>"):
        store.load(tmp_path / "D")


def test_unsafe_names_stay_inside_the_store(tmp_store):
    path = store.save(make_run("../../etc/x y", [0.1]))
    assert path.parent == tmp_store and path.name == "etc_x_y"


def test_runs_lists_figures_and_flags_damaged_folders(tmp_store):
    store.save(make_run("fast", [0.1, 0.1, 0.3], knobs={"num_workers": 4}, start_time="2026-01-02T00:00:00+00:00"))
    store.save(make_run("slow", [1.0, 1.0], start_time="2026-01-01T00:00:00+00:00"))
    (tmp_store / "junk").mkdir()                              # no meta.json
    broken = store.save(make_run("broken", [0.1]))
    (broken / "steps.parquet").write_bytes(b"not parquet")    # unreadable table
    half = store.save(make_run("half", [0.1]))
    (half / "clocks.parquet").unlink()                        # a save cut short
    (tmp_store / "notes.txt").write_text("a file, not a run")
    df = catalog.runs()
    assert list(df.columns) == list(catalog.RUNS_COLUMNS)
    assert list(df["name"][:2]) == ["slow", "fast"]           # oldest first
    fast = df.set_index("name").loc["fast"]
    assert fast["steps"] == 3 and fast["throughput"] == pytest.approx(30 / 0.5)
    assert fast["step_p50_ms"] == pytest.approx(100.0) and fast["verdict"] == "input-bound"
    assert fast["knobs"] == "num_workers=4" and not fast["damaged"] and fast["complete"]
    damaged = df[df["damaged"]].set_index("name")
    assert sorted(damaged.index) == ["broken", "half", "junk"]
    assert "meta.json" in damaged.loc["junk", "problem"]
    assert "clocks.parquet" in damaged.loc["half", "problem"]
    assert damaged.loc["broken", "problem"]


def test_load_by_name_path_and_unknown_name(tmp_store, tmp_path):
    store.save(make_run("a", [0.1, 0.2]))
    assert store.load("a").steps["duration_s"].tolist() == [0.1, 0.2]
    elsewhere = make_run("b", [0.3]).save(tmp_path / "elsewhere" / "b")
    assert store.load(str(elsewhere)).name == "b"
    assert store.load(elsewhere).name == "b"
    with pytest.raises(RunFormatError, match=r"'nope'.*known runs: a"):
        store.load("nope")
    run = make_run("c", [0.1])
    assert store.load(run) is run


def test_store_off_and_set_store(tmp_path, monkeypatch):
    monkeypatch.setenv("TPKIT_RUNS", "off")
    assert store.store_path() is None
    run = make_run("x", [0.1])
    assert store.autosave(run) is None
    assert catalog.runs().empty
    with pytest.raises(RunFormatError, match="store is off"):
        store.save(run)
    assert store.set_store(tmp_path / "mine") == tmp_path / "mine"
    assert store.autosave(run) == tmp_path / "mine" / "x"
    assert store.set_store(None) is None


def test_autosave_never_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store.set_store(blocker)  # a file where the store folder should be
    run = make_run("x", [0.1], notes=[])
    with pytest.warns(RuntimeWarning, match="not saved"):
        assert store.autosave(run) is None
    assert "not saved" in run.meta["notes"][-1]


def test_runs_frame_dtypes_when_empty():
    df = catalog.runs()
    assert df.empty and list(df.columns) == list(catalog.RUNS_COLUMNS)
    assert isinstance(df, pd.DataFrame)


def test_tp_runs_magic_lists_the_store(ip, tmp_store, capsys):
    from IPython.core.error import UsageError

    ip.run_line_magic("tp_runs", "")
    assert "no runs in" in capsys.readouterr().out
    store.save(make_run("m1", [0.1, 0.2]))
    df = ip.run_line_magic("tp_runs", "")
    assert list(df["name"]) == ["m1"] and not df["damaged"].any()
    other = tmp_store.parent / "other"
    store.save(make_run("o1", [0.1]), store=other)
    assert list(ip.run_line_magic("tp_runs", f"--store {other}")["name"]) == ["o1"]
    with pytest.raises(UsageError, match="%tp_runs"):
        ip.run_line_magic("tp_runs", "--bogus")


def test_paths_keep_run_load_errors(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(RunFormatError, match="not a folder"):
        store.load(f)
    with pytest.raises(RunFormatError, match="not a folder"):
        store.load(str(tmp_path / "missing" / "run"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunFormatError, match="meta.json is missing"):
        store.load(tmp_path / "empty")


def test_garbled_meta_json_is_listed_as_damaged(tmp_store):
    path = store.save(make_run("g", [0.1]))
    (path / "meta.json").write_text("{not json")
    other = store.save(make_run("h", [0.1]))
    (other / "meta.json").write_text('{"name": "h"}')  # JSON, but not tpkit's
    df = catalog.runs().set_index("name")
    assert df.loc["g", "damaged"] and "JSONDecodeError" in df.loc["g", "problem"]
    assert df.loc["h", "damaged"] and "not tpkit run metadata" in df.loc["h", "problem"]
