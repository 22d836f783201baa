"""The run store: unique names, listing with damaged folders, load by name or path, on/off."""

from __future__ import annotations

import json
import shutil

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


def test_runs_stored_before_the_requested_name_was_kept_group_by_the_store_suffix(tmp_store):
    for k, (name, sleep) in enumerate([("lr", 0.1), ("lr", 0.2), ("lr-3", 0.3), ("solo-2", 0.5)]):
        store.save(make_run(name, [sleep], start_unix_ns=1_000 + k))
    for folder in tmp_store.iterdir():  # as an older tpkit wrote them: no name_requested
        meta = json.loads((folder / "meta.json").read_text())
        del meta["name_requested"]
        (folder / "meta.json").write_text(json.dumps(meta))
    assert store.load("lr").name == "lr-3"      # lr-2 and lr-3 beside lr: the store's reruns of lr
    assert store.load("lr-2").steps["duration_s"].tolist() == [0.2]
    assert store.load("solo-2").name == "solo-2" and store.resolve("solo-2").others == ()  # no 'solo': its own name


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
