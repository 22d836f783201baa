"""Saving and loading never lose or mix runs: atomic overwrites, names in any script, damaged
and hand-edited folders refused with RunFormatError (property-tested with hypothesis)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import factories
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpkit as tp
from tpkit.analysis import catalog
from tpkit.errors import RunFormatError
from tpkit.run import Run
from tpkit.schema import TABLES


def test_an_overwrite_that_fails_part_way_leaves_the_old_run_whole(tmp_path, monkeypatch):
    old = factories.make_run("old", [0.1, 0.2, 0.3])
    new = factories.make_run("new", [1.0, 2.0])
    new.spans = factories.table("spans", step=[0], phase=["forward"], start_s=[0.0], end_s=[1.0], duration_s=[1.0])
    folder = old.save(tmp_path / "run")
    real = pd.DataFrame.to_parquet
    written = []

    def fail_on_memory(df, path, *a, **k):
        written.append(Path(path).name)
        if Path(path).name == "memory.parquet":
            raise OSError("disk full")
        return real(df, path, *a, **k)

    monkeypatch.setattr(pd.DataFrame, "to_parquet", fail_on_memory)
    with pytest.raises(OSError, match="disk full"):
        new.save(folder)
    monkeypatch.undo()
    assert written[:2] == ["steps.parquet", "spans.parquet"]  # the new steps were written somewhere...
    back = Run.load(folder)  # ...but the folder still holds the old run, whole
    assert back.name == "old" and list(back.steps["duration_s"]) == [0.1, 0.2, 0.3] and back.spans.empty
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary folder left


def test_a_successful_overwrite_replaces_the_run_whole(tmp_path):
    folder = factories.make_run("old", [0.1, 0.2]).save(tmp_path / "run")
    factories.make_run("new", [1.0]).save(folder)
    back = Run.load(folder)
    assert back.name == "new" and list(back.steps["duration_s"]) == [1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


@pytest.mark.parametrize("name", ["训练-基线", "Überlauf", "🚀 fast", "a/b", "..", "x" * 300])
def test_a_run_keeps_the_name_the_user_gave(name, tmp_path):
    tp.set_store(tmp_path / "store")
    try:
        run = factories.make_run(name, [0.1, 0.2])
        folder = tp.store.save(run)
        assert run.meta["name"] == name  # only the folder is sanitised
        assert folder.parent == tmp_path / "store"  # never escapes the store
        assert tp.load(name).name == name
        assert list(catalog.runs()["name"]) == [name]
        again = factories.make_run(name, [0.3])
        tp.store.save(again)
        assert again.meta["name"] == f"{name}-2" and tp.load(f"{name}-2").name == f"{name}-2"
    finally:
        tp.store.reset_store()


@pytest.mark.parametrize("field,value", [("knobs", "batch=8"), ("notes", "a note"), ("complete", "yes"),
                                         ("name", 7), ("warmup_steps", "3")])
def test_wrong_typed_meta_is_refused_on_load(field, value, tmp_path):
    folder = factories.make_run("r", [0.1]).save(tmp_path / "r")
    meta = json.loads((folder / "meta.json").read_text())
    meta[field] = value
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunFormatError, match=field):
        Run.load(folder)


def test_string_durations_are_refused_on_load(tmp_path):
    folder = factories.make_run("r", [0.1, 0.2]).save(tmp_path / "r")
    steps = pd.read_parquet(folder / "steps.parquet")
    steps["duration_s"] = ["fast", "slow"]
    steps.to_parquet(folder / "steps.parquet")
    with pytest.raises(RunFormatError, match="wrong type"):
        Run.load(folder)


def test_runs_flags_a_zero_byte_table_as_damaged(tmp_path):
    tp.set_store(tmp_path / "store")
    try:
        folder = tp.store.save(factories.make_run("r", [0.1]))
        (folder / "spans.parquet").write_bytes(b"")
        row = catalog.runs().iloc[0]
        assert bool(row["damaged"]) and "spans.parquet" in row["problem"]
    finally:
        tp.store.reset_store()


DAMAGE = st.lists(st.tuples(st.sampled_from([*[f"{t}.parquet" for t in TABLES], "meta.json"]),
                            st.sampled_from(["delete", "empty", "truncate", "garbage", "json-list"])),
                  min_size=1, max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=DAMAGE)
def test_a_damaged_folder_loads_or_says_why_never_anything_else(damage, tmp_path):
    folder = tmp_path / "r"
    shutil.rmtree(folder, ignore_errors=True)
    factories.make_run("r", [0.1, 0.2], clocks=factories.table("clocks", t_s=[0.0], device=["cpu"],
                                                                 metric=["cpu_util_pct"], value=[5.0])).save(folder)
    for name, how in damage:
        f = folder / name
        if not f.exists():
            continue
        if how == "delete":
            f.unlink()
        elif how == "empty":
            f.write_bytes(b"")
        elif how == "truncate":
            f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 2)])
        elif how == "garbage":
            f.write_bytes(np.random.default_rng(len(damage)).bytes(64))
        else:
            f.write_text("[1, 2, 3]")
    try:
        run = Run.load(folder)
    except RunFormatError as e:
        assert str(e)  # says what is wrong
    else:
        assert list(run.steps["duration_s"]) == [0.1, 0.2]  # what loads is the run that was saved
