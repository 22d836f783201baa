"""CPUOffloadAdamW against torch.optim.AdamW: same weights after 20 steps on the same data
(plain, clipping, accumulation, offloaded or kept gradients, both host kernels), state dicts
both ways, layout errors, the DeepSpeed fallback, DPU and bf16 moments, the offload phase
in a profiled slice, and loops that change or add gradients behind the optimizer's back."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", "build",
                                                           "torch_extensions"))

import tpkit as tp
from tpkit.offload import CPUOffloadAdamW, ExtraBackwardError, GradientChangedError, OffloadError, StateDictLayoutError, kernels

STEPS = 20
RTOL, ATOL = 1e-5, 1e-6  # fp32: the kernels order their flops differently


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 48),
                               torch.nn.GELU(), torch.nn.Linear(48, 4))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, accum: int = 1, torch_clip: float | None = None,
          steps: int = STEPS) -> list[float]:
    losses = []
    for k, (x, y) in enumerate(batches(steps * accum)):
        loss = torch.nn.functional.mse_loss(model(x), y) / accum
        loss.backward()
        losses.append(float(loss.detach()))
        if (k + 1) % accum == 0:
            if torch_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
            opt.step()
            opt.zero_grad()
    return losses


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


CASES = {
    "plain": dict(),
    "clipping": dict(max_grad_norm=0.05),  # small enough that every step clips
    "accumulation": dict(accumulation_steps=3),
    "accumulation+clipping": dict(accumulation_steps=2, max_grad_norm=0.05),
    "grads kept in p.grad": dict(offload_gradients=False),
    "grads kept, accumulation": dict(offload_gradients=False, accumulation_steps=2),
    "not streaming": dict(streaming=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_adamw_after_20_steps(case):
    kw = CASES[case]
    accum = kw.get("accumulation_steps", 1)
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05), accum=accum,
          torch_clip=kw.get("max_grad_norm"))
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.05, kernel="torch", **kw) as opt:
        train(model, opt, accum=accum)
        assert opt.counters["steps"] == STEPS
        if "max_grad_norm" in kw:
            assert opt.last_grad_norm is not None and opt.last_grad_norm > kw["max_grad_norm"]
        if kw.get("offload_gradients", True):
            assert all(p.grad is None for p in model.parameters())  # gradients left the device
    assert_same_weights(ref, model)


def test_deepspeed_kernel_matches_torch_adamw():
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), torch_clip=0.05)
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="deepspeed", max_grad_norm=0.05) as opt:
        assert opt.kernel.name == "deepspeed", opt.kernel_reason
        train(model, opt)
    assert_same_weights(ref, model, rtol=1e-4, atol=1e-5)


def test_param_groups_and_no_grad_params():
    ref, model = make_model(), make_model()
    def groups(m):
        ps = list(m.parameters())
        return [{"params": ps[:2], "lr": 3e-3}, {"params": ps[2:], "weight_decay": 0.0}]
    for p in (list(ref.parameters())[0], list(model.parameters())[0]):
        p.requires_grad_(False)  # frozen: no gradient, no update
    train(ref, torch.optim.AdamW(groups(ref), lr=1e-2))
    with CPUOffloadAdamW(groups(model), lr=1e-2, kernel="torch") as opt:
        train(model, opt)
        assert 0 not in opt.state_dict()["state"]
    assert_same_weights(ref, model)


def test_state_dict_round_trips_both_ways_exactly():
    # ours -> AdamW -> ours
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch") as opt:
        train(model, opt, steps=5)
        sd = opt.state_dict()
    ref = make_model()
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    adamw.load_state_dict(sd)
    back = adamw.state_dict()
    with CPUOffloadAdamW(make_model().parameters(), lr=1.0, kernel="torch") as opt2:
        opt2.load_state_dict(back)
        assert_state_dicts_equal(opt2.state_dict(), sd)
    # AdamW -> ours -> AdamW
    ref = make_model()
    adamw = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.1)
    train(ref, adamw, steps=5)
    sd_ref = adamw.state_dict()
    with CPUOffloadAdamW(make_model().parameters(), kernel="torch") as opt3:
        opt3.load_state_dict(sd_ref)
        mine = opt3.state_dict()
    adamw2 = torch.optim.AdamW(make_model().parameters())
    adamw2.load_state_dict(mine)
    assert_state_dicts_equal(adamw2.state_dict(), sd_ref)


def test_resumed_training_continues_like_adamw():
    """Train 5 steps with AdamW, move model + state to the offloader, train 5 more: same as 10
    steps of AdamW."""
    ref = make_model()
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(ref, adamw, steps=10)
    half = make_model()
    adamw_h = torch.optim.AdamW(half.parameters(), lr=1e-2)
    data = batches(10)
    for x, y in data[:5]:
        torch.nn.functional.mse_loss(half(x), y).backward()
        adamw_h.step()
        adamw_h.zero_grad()
    with CPUOffloadAdamW(half.parameters(), kernel="torch") as opt:
        opt.load_state_dict(adamw_h.state_dict())
        for x, y in data[5:]:
            torch.nn.functional.mse_loss(half(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert_same_weights(ref, half)


def assert_state_dicts_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for name, t in a["state"][k].items():
            assert torch.equal(t, b["state"][k][name]), (k, name)
            assert t.dtype == b["state"][k][name].dtype


def test_wrong_layout_is_refused_and_nothing_changes():
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch") as opt:
        train(model, opt, steps=3)
        before = opt.state_dict()
        other = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Linear(48, 4))
        o = torch.optim.AdamW(other.parameters())
        train(other, o, steps=1)
        with pytest.raises(StateDictLayoutError, match="parameters in the state dict"):
            opt.load_state_dict(o.state_dict())
        # same count, shapes permuted: caught before anything is written
        bad = opt.state_dict()
        bad["state"][0]["exp_avg"] = torch.zeros(3, 3)
        bad["state"][1]["exp_avg"].fill_(123.0)
        with pytest.raises(StateDictLayoutError, match="shape"):
            opt.load_state_dict(bad)
        with pytest.raises(StateDictLayoutError, match="groups"):
            opt.load_state_dict({"state": {}, "param_groups": []})
        assert_state_dicts_equal(opt.state_dict(), before)


def test_missing_or_broken_deepspeed_falls_back_with_a_message(monkeypatch):
    kernels._reset_cache_for_tests()

    def no_deepspeed():
        raise ImportError("No module named 'deepspeed'")

    monkeypatch.setattr(kernels, "_build_deepspeed_op", no_deepspeed)
    with pytest.warns(UserWarning, match="deepspeed is not installed.*Falling back to torch"):
        choice = kernels.select_kernel("auto")
    assert choice.kernel.name == "torch" and "fallback" in choice.reason
    kernels._reset_cache_for_tests()

    def bad_build():
        raise RuntimeError("Error building extension 'cpu_adam': c++ exited with 1")

    monkeypatch.setattr(kernels, "_build_deepspeed_op", bad_build)
    with pytest.warns(UserWarning, match="failed to build.*Error building extension"):
        model = make_model()
        with CPUOffloadAdamW(model.parameters(), kernel="deepspeed") as opt:
            assert opt.kernel.name == "torch"
            train(model, opt, steps=2)  # the fallback trains
    kernels._reset_cache_for_tests()


def test_auto_kernel_is_measured():
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    kernels._reset_cache_for_tests()
    choice = kernels.select_kernel("auto", probe_numel=1 << 18)
    assert choice.kernel.name in ("torch", "deepspeed")
    assert "measured" in choice.reason and "deepspeed" in choice.reason and "torch fused" in choice.reason
    getattr(choice.kernel, "close", lambda: None)()


def test_delayed_update_is_one_step_stale_and_converges():
    """DPU: after n step() calls the weights hold n-1 updates; flush() applies the last. The
    update of step t equals AdamW's update on the gradient computed with weights t-1."""
    data = batches(STEPS)
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch", delayed_update=True) as opt:
        w0 = [p.detach().clone() for p in model.parameters()]
        x, y = data[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(a, p) for a, p in zip(w0, model.parameters()))  # not applied yet
        opt.flush()
        assert not all(torch.equal(a, p) for a, p in zip(w0, model.parameters()))
    # loss difference against exact AdamW over 20 steps: small, and both learn
    exact = make_model()
    l_exact = train(exact, torch.optim.AdamW(exact.parameters(), lr=1e-2))
    delayed = make_model()
    with CPUOffloadAdamW(delayed.parameters(), lr=1e-2, kernel="torch", delayed_update=True) as opt:
        l_dpu = train(delayed, opt)
    assert l_dpu[-1] < l_dpu[0] and l_exact[-1] < l_exact[0]
    assert abs(sum(l_dpu[-5:]) - sum(l_exact[-5:])) / sum(l_exact[-5:]) < 0.25


def test_bf16_moments_halve_moment_bytes_and_stay_close():
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, moments_dtype=torch.bfloat16) as opt:
        assert opt.kernel.name == "torch"
        train(model, opt)
        st = opt.state[next(iter(model.parameters()))]
        assert st["exp_avg"].dtype == torch.bfloat16
        n = sum(p.numel() for p in model.parameters())
        assert opt.host_state_bytes() == 2 * 2 * n + 4 * len(list(model.parameters()))  # + step counters
        sd = opt.state_dict()
        assert sd["state"][0]["exp_avg"].dtype == torch.float32
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    assert 0 < diff < 2e-2  # measurably different, still close after 20 steps


def test_offload_phase_and_meta_in_a_profiled_slice():
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch", delayed_update=True) as opt:
        data = batches(40)

        def one_step():
            x, y = data[one_step.k % 40]
            one_step.k += 1
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        one_step.k = 0
        run = tp.profile_fn(one_step, steps=6, warmup=2, name="offload", progress=False, clocks=False)
    m = run.measured_steps
    assert len(m) == 6 and (m["offload_s"] > 0).all()
    assert set(run.spans[run.spans["phase"] == "offload"]["source"]) == {"CPUOffloadAdamW"}
    off = run.meta["offload"]
    assert off["mode"] == "delayed" and off["kernel"] == "torch" and off["steps"] == 8
    assert off["host_step_s"] > 0 and 0 <= off["overlap_share"] <= 1
    n = sum(p.numel() for p in model.parameters())
    assert off["host_state_bytes"] >= 12 * n  # moments + separate master copy (DPU)
    assert off["pinned_bytes"] == 0  # no GPU here
    # the memory probe counts the host state as optimizer state
    opt_rows = run.memory[run.memory["category"] == "optimizer_state"]
    if not opt_rows.empty:  # moments + master copies + step counters, nothing else
        assert opt_rows["bytes"].max() == off["host_state_bytes"] == 12 * n + 4 * len(list(model.parameters()))


def test_worker_thread_stops(no_leftovers):
    import threading
    model = make_model()
    opt = CPUOffloadAdamW(model.parameters(), kernel="torch")
    train(model, opt, steps=2)
    assert any(t.name.startswith("tpkit-offload") for t in threading.enumerate())
    opt.close()
    opt.close()  # idempotent
    assert not any(t.name == f"tpkit-offload-{id(opt):x}" for t in threading.enumerate())


@pytest.mark.parametrize("kw", [dict(), dict(offload_gradients=False), dict(delayed_update=True)])
def test_no_phantom_leak_under_the_memory_probe(kw):
    """Gradients the worker thread consumed are freed on the main thread at step(): torch's
    profiler (the CPU memory probe's source) misses frees made on other threads, which would
    show as a leak of one set of gradients per step."""
    model = make_model()
    data = batches(40)
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch", **kw) as opt:
        with tp.profile(steps=8, warmup=1, progress=False, clock_hz=0, name="leak") as prof:
            for x, y in data:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    run = prof.run
    assert not [n for n in run.summary().notes if "grew" in n]
    other = run.memory[(run.memory["category"] == "other") & (run.memory["event"] == "exit")
                       & (run.memory["phase"] == "optimizer")].groupby("step")["bytes"].last()
    if len(other) > 2:
        assert other.iloc[-1] - other.iloc[1] < 4 * sum(p.numel() for p in model.parameters())


# -- loops that change or add gradients after the optimizer took them (issue 15) --------------------

def initial_weights(seed: int = 0) -> list[torch.Tensor]:
    return [p.detach().clone() for p in make_model(seed).parameters()]


def assert_weights_equal(model: torch.nn.Module, weights: list[torch.Tensor]) -> None:
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p.detach(), w)


MODES = {"streaming": dict(), "grads kept": dict(offload_gradients=False), "not streaming": dict(streaming=False),
         "delayed": dict(delayed_update=True), "max_grad_norm": dict(max_grad_norm=10.0)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_torch_clipping_in_the_loop_is_refused_on_the_first_step(mode, clip):
    """clip_grad_norm_ / clip_grad_value_ between backward and step: refused at the first step()
    before any weight changed, with the option to use instead; the optimizer then trains a
    correct loop exactly like AdamW."""
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch", **MODES[mode]) as opt:
        x, y = batches(1)[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)  # not even clipping: still a write
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        with pytest.raises(tp.TpkitError, match="max_grad_norm=" if clip == "norm" else "max_grad_value=") as e:
            opt.step()
        assert isinstance(e.value, GradientChangedError) and isinstance(e.value, RuntimeError)
        assert "nothing was updated" in str(e.value)
        assert_weights_equal(model, initial_weights())
        assert opt.state_dict()["state"] == {}  # no moment was touched either
        opt.zero_grad()
        if mode == "delayed":
            return  # DPU is one step stale by design: no AdamW parity to check
        train(model, opt)  # the corrected loop
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), torch_clip=MODES[mode].get("max_grad_norm"))
    assert_same_weights(ref, model)


def test_clipping_that_starts_later_is_refused_where_the_gradient_stays_in_p_grad():
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch", offload_gradients=False) as opt:
        train(model, opt, steps=3)
        x, y = batches(1, seed=5)[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with pytest.raises(GradientChangedError, match="already streamed keep it"):
            opt.step()


def test_a_gradient_set_again_after_it_was_offloaded_is_refused():
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch") as opt:
        train(model, opt, steps=2)
        x, y = batches(1, seed=5)[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        last = list(model.parameters())[-1]
        assert last.grad is None  # offloaded by its hook
        last.grad = torch.ones_like(last)
        with pytest.raises(GradientChangedError, match=r"#5 \(4,\)"):
            opt.step()


@pytest.mark.parametrize("kw", [dict(max_grad_value=0.01), dict(max_grad_value=0.01, offload_gradients=False),
                                dict(max_grad_value=0.01, accumulation_steps=2)])
def test_max_grad_value_matches_torch_clip_grad_value(kw):
    accum = kw.get("accumulation_steps", 1)
    ref = make_model()
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for k, (x, y) in enumerate(batches(STEPS * accum)):
        (torch.nn.functional.mse_loss(ref(x), y) / accum).backward()
        if (k + 1) % accum == 0:
            torch.nn.utils.clip_grad_value_(ref.parameters(), kw["max_grad_value"])
            adamw.step()
            adamw.zero_grad()
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch", **kw) as opt:
        assert opt.streaming  # value clipping keeps the streamed update
        train(model, opt, accum=accum)
    assert_same_weights(ref, model)


def test_two_backward_before_step_is_refused_and_the_optimizer_is_not_broken():
    """Streaming (default): the second backward() of a step is refused at step() with the
    option to use; a correct loop afterwards trains exactly like AdamW."""
    model = make_model()
    data = batches(2, seed=9)
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch") as opt:
        for x, y in data:
            torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(tp.TpkitError, match=r"2 backward\(\) calls.*accumulation_steps=2") as e:
            opt.step()
        assert isinstance(e.value, ExtraBackwardError) and "nothing was updated" in str(e.value)
        assert_weights_equal(model, initial_weights())
        opt.zero_grad()
        train(model, opt)
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    assert_same_weights(ref, model)


def test_two_backward_in_a_later_step_keep_the_first_update_and_training_goes_on():
    """After the check step the first backward's update has streamed: step() refuses, the
    parameters hold exactly AdamW's update from that first gradient, and later steps go on
    like AdamW (no AttributeError from the worker, no broken state)."""
    data = batches(8, seed=3)
    extra = batches(1, seed=4)[0]
    ref = make_model()
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in data:
        torch.nn.functional.mse_loss(ref(x), y).backward()
        adamw.step()
        adamw.zero_grad()
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch") as opt:
        for k, (x, y) in enumerate(data):
            torch.nn.functional.mse_loss(model(x), y).backward()
            if k == 3:
                torch.nn.functional.mse_loss(model(extra[0]), extra[1]).backward()
                with pytest.raises(ExtraBackwardError, match="hold the update made from the first 1"):
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()
    assert_same_weights(ref, model)


@pytest.mark.parametrize("kw", [dict(streaming=False), dict(max_grad_norm=0.05)])
def test_two_backward_before_step_are_summed_when_updates_wait_for_step(kw):
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), accum=2, torch_clip=kw.get("max_grad_norm"))
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch", **kw) as opt:
        train(model, opt, accum=2)  # accumulation_steps left at 1
    assert_same_weights(ref, model)


def test_a_failed_host_update_leaves_a_working_optimizer(monkeypatch):
    model = make_model()
    with CPUOffloadAdamW(model.parameters(), lr=1e-2, kernel="torch") as opt:
        train(model, opt, steps=1)
        real, calls = opt.kernel.step, []

        def fails_once(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected")
            return real(*a, **k)
        monkeypatch.setattr(opt.kernel, "step", fails_once)
        x, y = batches(1, seed=7)[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(OffloadError, match="injected"):
            opt.step()
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        train(model, opt, steps=2)
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert opt.state_dict()["state"][0]["step"] >= 2


def test_offload_errors_are_tpkit_errors_with_their_builtin_base():
    assert issubclass(StateDictLayoutError, tp.TpkitError) and issubclass(StateDictLayoutError, ValueError)
    for cls in (OffloadError, GradientChangedError, ExtraBackwardError):
        assert issubclass(cls, tp.TpkitError) and issubclass(cls, RuntimeError)
    with pytest.raises(tp.TpkitError):
        CPUOffloadAdamW(make_model().parameters(), max_grad_value=-1.0)
    with pytest.raises(ValueError, match="kernel must be"):
        CPUOffloadAdamW(make_model().parameters(), kernel="fast")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_delayed_update_with_kept_gradients_is_not_raced_by_the_next_backward(set_to_none):
    """DPU with offload_gradients=False: the update of step t runs behind step t+1's backward,
    which zeroes and accumulates into p.grad in place when set_to_none=False; the update must
    still use step t's gradient (same weights as with gradients offloaded)."""
    def run(**kw):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        g = torch.Generator().manual_seed(1)
        with CPUOffloadAdamW(m.parameters(), lr=1e-2, kernel="torch", delayed_update=True, **kw) as opt:
            for _ in range(6):
                m(torch.randn(32, 256, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
            opt.flush()
        return list(m.parameters())
    for a, b in zip(run(), run(offload_gradients=False)):
        assert torch.equal(a, b)


# -- the CUDA path through stand-ins at the torch.cuda boundary (issue 17, items 8, 9, 13) --------

from tpkit.offload.arena import HostArena, plan_arena  # noqa: E402
from tpkit.offload.streams import CopyStreams  # noqa: E402


class FakeCuda:
    """torch.cuda's streams, events and device switching, recording who did what where."""

    def __init__(self) -> None:
        import threading
        self.main = threading.get_ident()
        self.current = 0  # the current device index
        self.streams: list = []  # every Stream() made: (device asked, device current when made)
        self.syncs: list[tuple[str, bool]] = []  # (what, on the main thread)
        self.waits: list[str] = []
        self.compute: dict = {}
        fake = self

        class Event:
            def __init__(self) -> None:
                self.stream = None

            def record(self, stream=None) -> None:
                self.stream = stream if stream is not None else fake.current_stream()

            def synchronize(self) -> None:
                fake.syncs.append(("event", fake.on_main()))

        class Stream:
            def __init__(self, device=None, priority=0) -> None:
                self.device = device
                fake.streams.append((device, fake.current))

            def wait_event(self, ev) -> None:
                fake.waits.append("wait_event")

            def wait_stream(self, s) -> None:
                fake.waits.append("wait_stream")

            def synchronize(self) -> None:
                fake.syncs.append(("stream", fake.on_main()))

        self.Event, self.Stream = Event, Stream

    def on_main(self) -> bool:
        import threading
        return threading.get_ident() == self.main

    def device(self, dev):
        import contextlib

        @contextlib.contextmanager
        def switch():
            before, self.current = self.current, (dev.index if isinstance(dev, torch.device) else dev)
            try:
                yield
            finally:
                self.current = before
        return switch()

    def stream(self, s):
        import contextlib
        return contextlib.nullcontext()

    def current_stream(self, dev=None):
        key = dev if dev is not None else self.current
        if key not in self.compute:
            self.compute[key] = object.__new__(self.Stream)  # not counted among made streams
            self.compute[key].device = key
        return self.compute[key]

    def install(self, monkeypatch) -> "FakeCuda":
        for name in ("Event", "Stream", "device", "stream", "current_stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None)
        return self


class HostAsDevice(CPUOffloadAdamW):
    """The optimizer's CUDA path with CPU tensors standing for device tensors."""

    accelerator_type = "cpu"


def test_copy_streams_and_events_are_made_on_the_parameters_device(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    dev = torch.device("cuda", 1)
    cs = CopyStreams([dev, dev])  # two parameters on cuda:1, the current device is 0
    assert fake.streams == [(dev, 1)]  # one stream, made while cuda:1 was current
    assert fake.current == 0  # and the current device is left alone
    fake.current_stream(1)  # the compute stream of cuda:1
    ev = cs.compute_event(dev)
    assert ev.stream is fake.compute[dev]  # recorded on cuda:1's compute stream, not cuda:0's
    assert 0 not in fake.compute  # nothing touched device 0


def test_delayed_update_never_synchronises_the_training_thread(monkeypatch):
    """DPU through the CUDA path (stand-in streams): the training thread never waits on the
    host for a copy (was copy_stream.synchronize() every step); the worker waits where it
    reads a gradient or overwrites a master a copy still reads; weights equal the host DPU."""
    fake = FakeCuda().install(monkeypatch)
    steps = 6
    ref, dev = make_model(), make_model()
    with CPUOffloadAdamW(ref.parameters(), lr=1e-2, kernel="torch", delayed_update=True) as a:
        train(ref, a, steps=1)
        train(ref, a, steps=steps - 1)  # the same batches as below
        a.flush()
    with HostAsDevice(dev.parameters(), lr=1e-2, kernel="torch", delayed_update=True, pin_memory=False) as b:
        n_params = len(b.param_groups[0]["params"])
        assert len(fake.streams) == 1 and b.pinned_bytes == 0
        train(dev, b, steps=1)  # the check step: gradients taken at step() on this thread
        fake.syncs.clear()
        train(dev, b, steps=steps - 1)
        b.flush()
        main = [s for s in fake.syncs if s[1]]
        worker = [s for s in fake.syncs if not s[1]]
    assert main == []
    # one wait per gradient copied out, one per update that overwrites masters still being copied
    assert worker.count(("stream", False)) == n_params * (steps - 1)
    assert worker.count(("event", False)) == steps - 1
    assert_same_weights(ref, dev, rtol=0, atol=0)


def test_streaming_through_the_cuda_path_matches_adamw(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    ref, dev = make_model(), make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    with HostAsDevice(dev.parameters(), lr=1e-2, kernel="torch", pin_memory=False) as opt:
        train(dev, opt)
        # separate host masters, as for parameters on a GPU
        assert all(opt.state[p]["master_param"].data_ptr() != p.data_ptr() for p in dev.parameters())
    assert_same_weights(ref, dev)
    assert [s for s in fake.syncs if s[1]] == [("stream", True)] * 6  # only the check step's 6 gradients


def test_host_arena_layout_is_aligned_packed_and_truthful():
    specs = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((0,), torch.float32), ((1000,), torch.float16),
             ((64, 65), torch.float32), ((1,), torch.int64)]
    arena = HostArena(specs, pin_memory=torch.cuda.is_available(), min_buffer_bytes=4096)
    lay = arena.layout
    nbytes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in specs]
    assert [p.nbytes for p in lay.placements] == nbytes
    assert all(p.offset_bytes % 512 == 0 for p in lay.placements)
    assert lay.used_bytes == sum(-(-n // 512) * 512 for n in nbytes)
    assert lay.requested_bytes == sum(lay.buffer_bytes) == sum(b.numel() for b in arena.buffers)
    assert all(b & (b - 1) == 0 for b in lay.buffer_bytes)  # powers of two: the allocator adds nothing
    by_buffer: dict[int, list[tuple[int, int]]] = {}
    for p in lay.placements:
        by_buffer.setdefault(p.buffer, []).append((p.offset_bytes, p.offset_bytes + p.nbytes))
    for spans in by_buffer.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    for k, v in enumerate(arena.views):  # views hold their own values: nothing overlaps
        v.fill_(k + 1)
    for k, ((shape, dtype), v) in enumerate(zip(specs, arena.views)):
        assert v.shape == torch.Size(shape) and v.dtype == dtype and bool((v == k + 1).all())
    assert arena.pinned_bytes == (lay.requested_bytes if torch.cuda.is_available() else 0)


def test_arena_pins_about_what_a_large_master_needs():
    """A 2.1 GB fp32 master as GPT-2-sized tensors: one pinned block each would pin the sum of
    their powers of two; the arena pins less than 64 MiB over what the tensors hold."""
    sizes = [50257 * 1600 * 4] + [1600 * 6400 * 4] * 2 * 24 + [1600 * 4800 * 4] * 24 + [1600 * 1600 * 4] * 24
    sizes += [1600 * 4] * 200
    total = sum(sizes)
    lay = plan_arena(sizes)
    assert lay.used_bytes >= total and lay.requested_bytes - lay.used_bytes < 2 ** 26 + 2 ** 28
    per_tensor = sum(1 << (n - 1).bit_length() for n in sizes)
    assert lay.requested_bytes < per_tensor


@pytest.mark.parametrize("made_in_slice", [False, True], ids=["before-the-slice", "inside-the-slice"])
def test_a_rescale_by_one_is_no_change_to_the_gradients(made_in_slice, monkeypatch):
    """``clip_grad_norm_(params, inf)`` (a Hugging Face Trainer logs the norm so at every step)
    multiplies every gradient by exactly 1: no change, so no GradientChangedError; also after a
    slice in which the optimizer was made (the slice's own patch of torch's clip had been put back
    over the skip, and the loop then raised). A real clip is still refused."""
    import math

    from torch.nn.utils import clip_grad

    # as in a fresh process: torch's own rescale (an earlier optimizer here had set the skip)
    monkeypatch.setattr(clip_grad, "_clip_grads_with_norm_", torch.nn.utils.clip_grads_with_norm_)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)

    def step(opt, max_norm: float) -> None:  # noqa: ANN001
        model(torch.randn(4, 8)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()

    def make():  # noqa: ANN202
        return CPUOffloadAdamW(model.parameters(), lr=1e-3, offload_gradients=False)

    opt = None if made_in_slice else make()
    with tp.profile(steps=3, warmup=1, progress=False, memory=False, clock_hz=0):
        opt = opt or make()
        for _ in range(10):
            step(opt, math.inf)
    for _ in range(3):
        step(opt, math.inf)  # after the slice too
    with pytest.raises(GradientChangedError):
        for _ in range(3):
            step(opt, 1e-6)
