"""Run.save / tp.load: a lossless round trip, and clear errors naming the bad file."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import sleepy

import tpkit as tp
from tpkit.run import SCHEMAS, TABLES


@pytest.fixture(scope="module")
def run():
    model, loader, opt = sleepy.make()
    with tp.profile(steps=3, warmup=1, name="store", progress=False, knobs={"workers": 0}) as prof:
        for batch in loader:
            model(batch).backward()
            opt.step()
            opt.zero_grad()
    return prof.run


def test_round_trip_is_lossless(run, tmp_path):
    run.save(tmp_path / "r")
    back = tp.load(tmp_path / "r")
    for table in TABLES:
        pd.testing.assert_frame_equal(getattr(back, table), getattr(run, table), check_exact=True)
        assert list(getattr(back, table).columns) == list(SCHEMAS[table])
    assert back.meta == run.meta
    assert back.meta["knobs"] == {"workers": 0}
    assert len(back.steps) == 4 and back.steps["loss"].notna().all()
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted([f"{t}.parquet" for t in TABLES] + ["meta.json"])


def test_load_refuses_what_is_not_a_run(tmp_path):
    with pytest.raises(tp.RunFormatError, match="not a folder"):
        tp.load(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(tp.RunFormatError, match="meta.json is missing"):
        tp.load(tmp_path / "empty")


def test_load_names_the_damaged_file(run, tmp_path):
    d = run.save(tmp_path / "r")
    (d / "spans.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(tp.RunFormatError, match="spans.parquet is damaged"):
        tp.load(d)
    d = run.save(tmp_path / "r2")
    (d / "clocks.parquet").unlink()
    with pytest.raises(tp.RunFormatError, match="clocks.parquet is missing"):
        tp.load(d)
    d = run.save(tmp_path / "r3")
    (d / "meta.json").write_text("{not json")
    with pytest.raises(tp.RunFormatError, match="meta.json is damaged"):
        tp.load(d)
    (d / "meta.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(tp.RunFormatError, match="not tpkit run metadata"):
        tp.load(d)
    d = run.save(tmp_path / "r4")
    run.steps.drop(columns=["forward_s"]).to_parquet(d / "steps.parquet")
    with pytest.raises(tp.RunFormatError, match=r"steps.parquet lacks the columns \['forward_s'\]"):
        tp.load(d)


def test_html_report_is_self_contained(run, tmp_path):
    path = run.to_html(tmp_path / "report.html")
    text = path.read_text()
    assert "vegaEmbed(" in text and "window.vegaEmbed" in text  # the library is inlined
    assert "<script src=" not in text and "cdn.jsdelivr" not in text
    assert "tpkit run 'store'" in text
