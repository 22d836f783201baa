"""Backend selection: GPU -> Triton, CPU + TRITON_INTERPRET=1 -> interpreter, otherwise the
torch reference with a one-time notice; never Triton's "0 active drivers" error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import tpkit.kernels as K
from tpkit.kernels import backend
from tpkit.kernels import reference as R


@pytest.fixture
def fresh_notices(monkeypatch):
    monkeypatch.setattr(backend, "_noticed", set())
    monkeypatch.delenv("TPKIT_KERNELS", raising=False)


class FakeCuda:
    is_cuda = True


def test_selection_follows_triton_mode_device_and_environment(monkeypatch, fresh_notices):
    cpu = torch.zeros(1)
    # conftest sets TRITON_INTERPRET=1 before anything imports triton: interpreter everywhere
    assert backend.triton_mode() == "interpreted"
    assert K.select_backend(cpu) == "interpreter"
    assert K.select_backend(FakeCuda()) == "interpreter"
    # as on a machine where triton.language was imported compiled (no TRITON_INTERPRET)
    monkeypatch.setattr(backend, "triton_mode", lambda: "compiled")
    assert K.select_backend(cpu, FakeCuda()) == "triton"  # any CUDA tensor: compiled Triton
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.warns(backend.KernelBackendNotice, match="no GPU"):
        assert K.select_backend(cpu) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the notice is given once only
        assert K.select_backend(cpu) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # set too late: triton is already compiled-mode
    with pytest.warns(backend.KernelBackendNotice, match="after triton was imported"):
        assert K.select_backend(cpu) == "reference"


def test_launch_keeps_the_interpreter_when_the_environment_changes_later(monkeypatch):
    """triton.language was imported interpreted; unsetting TRITON_INTERPRET afterwards must not
    break launches (Triton re-reads the variable while launching)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g, u = torch.randn(3, 37), torch.randn(3, 37)
    assert K.select_backend(g) == "interpreter"
    torch.testing.assert_close(K.swiglu(g, u), R.swiglu_reference(g, u))
    from tpkit.kernels.swiglu import _swiglu_fwd_kernel

    assert type(_swiglu_fwd_kernel.jitted()).__name__ == "InterpretedFunction"
    assert os.environ["TRITON_INTERPRET"] == "0"  # restored after the launch


def test_reference_can_be_forced(monkeypatch, fresh_notices):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.zeros(1)
    with K.reference_only():
        assert K.select_backend(cpu, FakeCuda()) == "reference"
    assert K.select_backend(cpu) == "interpreter"
    monkeypatch.setenv("TPKIT_KERNELS", "reference")
    assert K.select_backend(FakeCuda()) == "reference"
    monkeypatch.delenv("TPKIT_KERNELS")
    K.force_backend("reference")
    try:
        assert K.select_backend(cpu) == "reference"
    finally:
        K.force_backend(None)
    assert K.select_backend(cpu) == "interpreter"
    with pytest.raises(ValueError):
        K.force_backend("triton")


NO_INTERPRETER = textwrap.dedent(
    """
    import os, warnings
    import torch
    import tpkit.kernels as K
    from tpkit.kernels import backend, reference as R
    from tpkit.demo.models import TinyConfig, TinyTransformer

    assert backend.triton_mode() == "compiled" and not torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, w = torch.randn(3, 37), torch.randn(37)
        assert torch.equal(K.rms_norm(x, w, 1e-6), R.rms_norm_reference(x, w, 1e-6))
        model = TinyTransformer(TinyConfig(vocab_size=31, seq_len=8, n_layer=1, n_head=2, d_model=16))
        K.patch(model)
        model(torch.randint(0, 31, (2, 8)), torch.randint(0, 31, (2, 8))).backward()
        os.environ["TRITON_INTERPRET"] = "1"  # too late: still the reference, one more notice
        assert torch.equal(K.swiglu(x, x), R.swiglu_reference(x, x))
    notices = [str(c.message) for c in caught if issubclass(c.category, backend.KernelBackendNotice)]
    assert len(notices) == 2, notices
    assert "TRITON_INTERPRET=1 is not set" in notices[0] and "after triton was imported" in notices[1]
    print("OK")
    """
)


def test_cpu_without_interpreter_uses_the_reference_and_never_hits_the_driver_error():
    """No GPU and no TRITON_INTERPRET: launching a kernel would fail with "0 active drivers"."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", NO_INTERPRETER], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "active drivers" not in done.stderr and "OK" in done.stdout


NO_TRITON = textwrap.dedent(
    """
    import importlib.abc, sys, warnings

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("No module named 'triton' (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoTriton())
    import torch
    import tpkit.kernels as K
    from tpkit.kernels import backend, reference as R
    from tpkit.demo.models import TinyConfig, TinyTransformer

    assert not backend.triton_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, w = torch.randn(3, 37), torch.randn(37)
        assert torch.equal(K.rms_norm(x, w, 1e-6), R.rms_norm_reference(x, w, 1e-6))
        model = TinyTransformer(TinyConfig(vocab_size=31, seq_len=8, n_layer=1, n_head=2, d_model=16))
        K.patch(model)
        loss = model(torch.randint(0, 31, (2, 8)), torch.randint(0, 31, (2, 8)))
        loss.backward()
    notices = [str(c.message) for c in caught if issubclass(c.category, backend.KernelBackendNotice)]
    assert len(notices) == 1, notices
    try:
        from tpkit.kernels.rms_norm import _rms_norm_fwd_kernel
        _rms_norm_fwd_kernel.jitted()
        raise SystemExit("jitted() should have raised")
    except ImportError as exc:  # tpkit.errors.MissingExtraError, an ImportError
        assert type(exc).__name__ == "MissingExtraError" and "tpkit[triton]" in str(exc), exc
    print("NOTICE:", notices[0])
    """
)


def test_without_triton_everything_runs_on_the_reference_and_says_what_to_install():
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", NO_TRITON], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pip install tpkit[triton]" in done.stdout
