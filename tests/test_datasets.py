"""tpkit.datasets: generators deterministic by seed, cost knobs that really cost, shipped
samples that load from the installed package (importlib.resources, not the checkout's cwd)."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources

import numpy as np
import pytest
import torch

import tpkit.datasets as tds
from tpkit.datasets import cost

GENERATORS = [
    lambda **kw: tds.SyntheticTokens(n=50, seq_len=16, vocab_size=64, **kw),
    lambda **kw: tds.SyntheticImages(n=50, size=12, **kw),
    lambda **kw: tds.SyntheticTabular(n=50, n_features=6, **kw),
    lambda **kw: tds.SyntheticTabular(n=50, n_features=6, n_targets=3, task="classification", **kw),
]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("make", GENERATORS)
def test_deterministic_by_seed_and_index(make):
    a, b, c = make(seed=1), make(seed=1), make(seed=2)
    assert len(a) == 50
    assert all(same(a[i], b[i]) for i in (0, 7, 49))
    assert not same(a[7], c[7]) and not same(a[7], a[8])
    with pytest.raises(IndexError):
        a[50]


def test_shapes_dtypes_and_sizes():
    img = tds.SyntheticImages(n=4, size=20, channels=1, dtype=torch.uint8)[0]
    assert img["x"].shape == (1, 20, 20) and img["x"].dtype == torch.uint8 and img["y"].dtype == torch.int64
    f = tds.SyntheticImages(n=4, size=8)[3]["x"]
    assert f.dtype == torch.float32 and 0.0 <= float(f.min()) and float(f.max()) <= 1.0
    reg = tds.SyntheticTabular(n=4, n_features=5, n_targets=2)[1]
    assert reg["x"].shape == (5,) and reg["y"].shape == (2,) and reg["y"].dtype == torch.float32
    cls = tds.SyntheticTabular(n=4, n_targets=3, task="classification")[1]["y"]
    assert cls.dtype == torch.int64 and 0 <= int(cls) < 3


def test_tabular_target_is_learnable():
    """The labels follow the features (a least-squares fit explains most of the variance)."""
    ds = tds.SyntheticTabular(n=400, n_features=8, n_targets=2, noise=0.1)
    x = torch.stack([ds[i]["x"] for i in range(400)]).double()
    y = torch.stack([ds[i]["y"] for i in range(400)]).double()
    w = torch.linalg.lstsq(x, y).solution
    residual = (y - x @ w).var() / y.var()
    assert residual < 0.1


@pytest.mark.parametrize("make", GENERATORS)
def test_cost_knobs_spend_per_sample(make, monkeypatch):
    """cpu_ms goes to busy work and sleep_ms to an idle wait, once per sample (no timing)."""
    calls = []
    monkeypatch.setattr(cost, "burn_cpu", lambda s: calls.append(("cpu", s)))
    monkeypatch.setattr(cost.time, "sleep", lambda s: calls.append(("sleep", s)))
    ds = make(cpu_ms=3.0, sleep_ms=5.0)
    ds[0], ds[1]
    assert calls == [("cpu", 0.003), ("sleep", 0.005)] * 2
    calls.clear()
    make()[0]
    assert calls == []


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="must be >= 0"):
        tds.SyntheticImages(cpu_ms=-1)
    with pytest.raises(ValueError, match="task must be"):
        tds.SyntheticTabular(task="ranking")
    with pytest.raises(ValueError, match="dtype"):
        tds.SyntheticImages(dtype=torch.float16)


def test_burn_cpu_returns():
    cost.burn_cpu(0.001)  # holds a core for ~1 ms and returns


def test_shipped_samples_match_the_generators_and_stay_small():
    files = resources.files("tpkit.datasets") / "samples"
    assert tds.samples() == ["images", "tabular", "tokens"]
    from tpkit.datasets.shipped import make_samples

    made = make_samples()
    for name in tds.samples():
        f = files / f"{name}.npz"
        assert f.is_file() and len(f.read_bytes()) < 20_000
        arrays = tds.load_sample(name)
        assert arrays.keys() == made[name].keys()
        for k in arrays:
            np.testing.assert_array_equal(arrays[k], made[name][k])
    ds = tds.sample_dataset("tabular")
    assert len(ds) == 256 and ds[3]["x"].shape == (8,) and ds[3]["y"].shape == (2,)
    with pytest.raises(FileNotFoundError, match="samples are"):
        tds.load_sample("audio")


def test_samples_load_from_the_installed_package_outside_the_checkout(tmp_path):
    code = ("import tpkit.datasets as d; a = d.load_sample('images'); "
            "print(d.samples(), a['x'].shape, a['x'].dtype, d.reference_runs())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith("['images', 'tabular', 'tokens'] (16, 3, 16, 16) uint8")


def test_reference_runs_listing_and_a_clear_error():
    names = tds.reference_runs()
    assert isinstance(names, list)
    for name in names:  # every shipped reference run loads and names its machine
        run = tds.load_reference_run(name)
        assert len(run.steps) and run.meta.get("host")
    with pytest.raises(FileNotFoundError, match="no reference run"):
        tds.load_reference_run("no-such-run")
