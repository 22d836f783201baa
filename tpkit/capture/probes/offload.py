"""The offload probe: what offloading optimizers and DeepSpeed engines did during a slice.

Installed in every slice; it never imports DeepSpeed itself (one imported during the slice's
first step is still seen). Two jobs:

- ``CPUOffloadAdamW``: the exposed part of its step is an ``offload`` span (it records that
  itself); the background work (copies out, host step, copies back on its worker thread) is
  not a span, because spans of another thread overlapping backward would steal backward's
  time in the step breakdown. Its totals over the slice, and how much of it overlapped the
  rest of the step, go to ``run.meta["offload"]``.
- DeepSpeed: ``DeepSpeedEngine.step`` is the optimizer phase and ends exactly one step when
  the engine's ``global_steps`` advances (the wrapped torch optimizer's hooks fire inside it,
  once per engine step for ZeRO 1-2 and once per sub-group for ZeRO-3, so they cannot be the
  step boundary); ``DeepSpeedEngine.backward`` is the backward phase (its gradient reduction
  and host copies included). What the engine holds (ZeRO stage, offload device, optimizer
  state, fp32 master partitions, gradient partitions) goes to ``run.meta["deepspeed"]``.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from ..recorder import Recorder
from .patching import Patches


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) state container, each storage counted once."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr() if x.numel() else id(x)
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


#: Attributes of a ZeRO optimizer that hold the engine's gradients between its backward and its
#: step (``deepspeed/runtime/zero/stage_1_and_2.py``, ``stage3.py``): the per-parameter
#: accumulators of ZeRO-1/2 (``all_grad_tensors``, between micro-batches), the partition handed to
#: the step (``averaged_gradients``), ZeRO-2's contiguous partition buffer and ZeRO-3's flat one.
ZERO_GRADIENT_ATTRS = ("all_grad_tensors", "averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer")


def deepspeed_gradient_tensors(engine: Any) -> list[torch.Tensor]:
    """The gradient tensors a DeepSpeed engine holds now, outside the model's ``.grad``: its ZeRO
    optimizer's buffers (``ZERO_GRADIENT_ATTRS``) and the ``.grad`` of the fp32 partitions its
    basic optimizer steps (set inside the step, and under ZeRO-Offload copied there in backward).
    Many are views of one flat storage: count storages, not tensors (``tensor_bytes``)."""
    zero = getattr(engine, "optimizer", None)
    if zero is None:
        return []
    out: list[torch.Tensor] = []
    stack: list[Any] = [getattr(zero, name, None) for name in ZERO_GRADIENT_ATTRS]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        for p in getattr(zero, name, None) or []:
            if isinstance(p, torch.Tensor) and p.grad is not None:
                out.append(p.grad)
    return out


#: ``meta["deepspeed"]["gradient_bytes"]`` is read at every ``engine.step`` enter (one per
#: micro-batch) of the slice's first GRADIENT_READ_STEPS engine steps: every position in an
#: accumulation, and the first step's allocations, are seen; each read walks about two tensors
#: per parameter (~0.7 us each here: 0.2 ms for 300), so not at every micro-batch of the slice.
GRADIENT_READ_STEPS = 2


def _engine_gradient_bytes(engine: Any) -> int:
    """Bytes of the gradient storages a DeepSpeed engine holds now: its own buffers and its
    model's ``.grad`` (ZeRO-1 leaves a micro-batch's there until the accumulation boundary)."""
    module = getattr(engine, "module", None)
    grads = [p.grad for p in module.parameters() if p.grad is not None] if module is not None else []
    return tensor_bytes(deepspeed_gradient_tensors(engine) + grads)


def deepspeed_holdings(engine: Any) -> dict[str, Any]:
    """What a DeepSpeed engine holds, by the categories of ``run.memory``.

    ``optimizer_state_bytes`` is the basic (torch) optimizer's ``state``, e.g. DeepSpeedCPUAdam's
    exp_avg/exp_avg_sq on the host under offload; ``fp32_master_bytes`` the fp32 partitions
    the basic optimizer updates (DeepSpeed's own accounting counts them as optimizer state,
    12 B/param with Adam; ``run.memory`` files them under ``parameters``, being the parameters
    the basic optimizer steps). ``OffloadProbe.meta`` adds ``gradient_bytes``: the most gradient
    bytes the engine held entering ``engine.step`` (``_engine_gradient_bytes``, GRADIENT_READ_STEPS).
    """
    zero = getattr(engine, "optimizer", None)
    basic = getattr(zero, "optimizer", zero)
    out: dict[str, Any] = {
        "engine": type(engine).__name__,
        "zero_stage": int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0,
        "zero_optimizer": type(zero).__name__ if zero is not None else None,
        "basic_optimizer": type(basic).__name__ if basic is not None else None,
        "world_size": int(getattr(engine, "world_size", 1)),
        "global_steps": int(getattr(engine, "global_steps", 0)),
    }
    try:
        out["offload_optimizer"] = bool(engine.zero_cpu_offload())
    except Exception:
        out["offload_optimizer"] = None
    state = getattr(basic, "state", {}) if basic is not None else {}
    out["optimizer_state_bytes"] = tensor_bytes(list(state.values()))
    devices = sorted({t.device.type for s in state.values() for t in s.values() if isinstance(t, torch.Tensor)})
    out["optimizer_state_devices"] = devices
    masters = [p for g in getattr(basic, "param_groups", []) for p in g["params"]] if basic is not None else []
    model_ids = {id(p) for p in engine.module.parameters()} if hasattr(engine, "module") else set()
    masters = [p for p in masters if id(p) not in model_ids]  # ZeRO-0: the basic optimizer owns model params
    out["fp32_master_bytes"] = tensor_bytes(masters)
    out["parameter_bytes"] = tensor_bytes(list(engine.module.parameters())) if hasattr(engine, "module") else 0
    return out


class OffloadProbe:
    """Per-slice view of offloading optimizers and DeepSpeed engines; see the module doc."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self._start: dict[int, dict[str, int]] = {}
        self._patched = Patches()
        self.engines: dict[int, Any] = {}
        self._handles: list[Any] = []
        self.engine_steps = 0
        #: the most gradient bytes an engine held entering its step (GRADIENT_READ_STEPS)
        self.gradient_bytes: dict[int, int] = {}
        self.deepspeed_watched = False  # DeepSpeedEngine's step and backward were wrapped in this slice

    def install(self) -> "OffloadProbe":
        adamw = sys.modules.get("tpkit.offload.adamw")
        if adamw is not None:
            self._start = {id(o): dict(o.counters) for o in adamw.live_optimizers()}
        if not self._patch_deepspeed():
            # deepspeed may be imported inside the profiled cell, before the loop: look again at
            # each phase start of the first step, so engine.step is wrapped before it runs. Not
            # after it: each look is a listener call and a ``tpkit`` span at every boundary
            # (~8 a step, 15-20 us of tpkit_s on a 9 ms CPU step, docs/OVERHEAD.md), and an
            # engine made after the loop's first step is not a loop tpkit has seen (``meta`` notes
            # a DeepSpeed first imported then).
            self.rec.phase_listeners.append(self._late_patch)
            self.rec.step_listeners.append(self._first_step_ended)
        return self

    def _first_step_ended(self, raw_step: int, end_ns: int) -> None:
        if self._late_patch in self.rec.phase_listeners:  # (phase listeners are not running now)
            if not self._patched:
                self._patch_deepspeed()  # imported during the step's last phase
            self.rec.phase_listeners.remove(self._late_patch)
        self.rec.step_listeners.remove(self._first_step_ended)  # once (it had run at every step)

    def _patch_deepspeed(self) -> bool:
        engine_mod = sys.modules.get("deepspeed.runtime.engine")
        if engine_mod is None or not hasattr(engine_mod, "DeepSpeedEngine"):
            return False
        cls = engine_mod.DeepSpeedEngine
        self._patched.set(cls, "step", self._wrap_step(cls.step))
        self._patched.set(cls, "backward", self._wrap_backward(cls.backward))
        self.deepspeed_watched = True
        return True

    def _late_patch(self, phase: str, event: str, raw_step: int) -> None:
        # not removed from the list here: the Recorder is iterating over it
        if event == "enter" and not self._patched:
            self._patch_deepspeed()

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        if self._late_patch in self.rec.phase_listeners:
            self.rec.phase_listeners.remove(self._late_patch)
        if self._first_step_ended in self.rec.step_listeners:
            self.rec.step_listeners.remove(self._first_step_ended)
        self._patched.restore()


    # -- DeepSpeed --------------------------------------------------------------------------
    def _wrap_step(self, fn: Any) -> Any:
        rec, probe = self.rec, self

        def step(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != rec.thread_id:
                return fn(engine, *args, **kwargs)
            rec.explicit_steps = True  # the engine ends steps, not the optimizers inside it
            if id(engine) not in probe.engines:
                probe.engines[id(engine)] = engine
                probe._hook_host_optimizer(engine)
            before = getattr(engine, "global_steps", None)
            if probe.engine_steps < GRADIENT_READ_STEPS:
                held = _engine_gradient_bytes(engine)
                if held > probe.gradient_bytes.get(id(engine), 0):
                    probe.gradient_bytes[id(engine)] = held
            token = rec.enter("optimizer", "DeepSpeedEngine.step")
            try:
                out = fn(engine, *args, **kwargs)
            finally:
                rec.exit(token)
            if before is None or getattr(engine, "global_steps", before) != before:
                probe.engine_steps += 1
                if rec.samples == 0:  # the loop's batches were not seen by a loader probe
                    try:
                        rec.add_samples(int(engine.train_micro_batch_size_per_gpu())
                                        * int(engine.gradient_accumulation_steps()))
                    except Exception:
                        pass
                rec.end_step()  # may raise StopSlice: the optimizer step is complete
            return out

        step.__wrapped__ = fn  # type: ignore[attr-defined]
        return step

    def _hook_host_optimizer(self, engine: Any) -> None:
        """ZeRO-Offload's host step (DeepSpeedCPUAdam.step, inside engine.step) is the
        ``offload`` phase. Instance step hooks run inside the global ones, so the span nests
        inside the optimizer span and takes its time."""
        basic = getattr(getattr(engine, "optimizer", None), "optimizer", None)
        if basic is None or type(basic).__name__ != "DeepSpeedCPUAdam":
            return
        rec, tokens = self.rec, []

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            if threading.get_ident() == rec.thread_id:
                tokens.append(rec.enter("offload", "DeepSpeedCPUAdam.step"))

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            if tokens and threading.get_ident() == rec.thread_id:
                rec.exit(tokens.pop())

        self._handles += [basic.register_step_pre_hook(pre), basic.register_step_post_hook(post)]

    def _wrap_backward(self, fn: Any) -> Any:
        rec = self.rec

        def backward(engine: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != rec.thread_id:
                return fn(engine, loss, *args, **kwargs)
            token = rec.enter("backward", "DeepSpeedEngine.backward")
            try:
                return fn(engine, loss, *args, **kwargs)
            finally:
                rec.exit(token)

        backward.__wrapped__ = fn  # type: ignore[attr-defined]
        return backward

    # -- the Run's meta ---------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        adamw = sys.modules.get("tpkit.offload.adamw")
        # optimizers made inside the slice count from their construction
        opts = [o for o in adamw.live_optimizers() if o.counters["steps"] > self._start.get(id(o), {}).get("steps", 0)
                ] if adamw is not None else []
        if opts:
            tot = dict.fromkeys(("copy_out_ns", "host_step_ns", "copy_back_ns", "exposed_ns", "steps", "grads"), 0)
            for o in opts:
                for k in tot:
                    tot[k] += o.counters[k] - self._start[id(o)].get(k, 0)
            work_s = (tot["copy_out_ns"] + tot["host_step_ns"] + tot["copy_back_ns"]) / 1e9
            exposed_s = tot["exposed_ns"] / 1e9
            overlapped_s = max(0.0, work_s - exposed_s)
            first = opts[0].describe()
            out["offload"] = {
                **first,
                "optimizers": len(opts),
                "steps": tot["steps"],
                "copy_out_s": tot["copy_out_ns"] / 1e9,
                "host_step_s": tot["host_step_ns"] / 1e9,
                "copy_back_s": tot["copy_back_ns"] / 1e9,
                "work_s": work_s,
                "exposed_s": exposed_s,
                "overlapped_s": overlapped_s,
                "overlap_share": overlapped_s / work_s if work_s > 0 else 0.0,
                "host_step_per_step_s": tot["host_step_ns"] / 1e9 / max(1, tot["steps"]),
                "pinned_bytes": sum(o.pinned_bytes for o in opts),
                "host_state_bytes": sum(o.host_state_bytes() for o in opts),
                "torch_threads": torch.get_num_threads(),
            }
            o = out["offload"]
            steps = max(1, tot["steps"])
            self.rec.note(
                f"offload ({o['mode']}, {o['kernel']} kernel, worker {o['worker_threads']} of {o['torch_threads']} "
                f"threads): host step "
                f"{o['host_step_s'] / steps * 1e3:.2f} ms/step, {o['overlap_share']:.0%} of the offload work "
                f"overlapped the rest of the step, {o['exposed_s'] / steps * 1e3:.2f} ms/step exposed; host "
                f"optimizer state {o['host_state_bytes'] / 2**20:.1f} MiB, pinned buffers {o['pinned_bytes'] / 2**20:.1f} MiB")
        if not self.deepspeed_watched and "deepspeed.runtime.engine" in sys.modules:
            self.rec.note("DeepSpeed was first imported after the slice's first step, so tpkit did not watch its "
                          "engines: a DeepSpeed engine's steps and phases may be counted wrong here (ZeRO-3 can "
                          "show a step per parameter sub-group); import deepspeed before the profiled loop starts")
        if self.engines:
            engine = next(iter(self.engines.values()))
            out["deepspeed"] = {**deepspeed_holdings(engine), "engine_steps": self.engine_steps,
                                "engines": len(self.engines),
                                "gradient_bytes": self.gradient_bytes.get(id(engine), 0)}
        return out


def offload_probe(rec: Recorder, cfg: Any) -> OffloadProbe | None:
    """Factory for ``tpkit.profiler.PROBE_FACTORIES``. Always installed: until DeepSpeed shows
    up it looks for it at each phase start of the slice's first step, and imports nothing."""
    return OffloadProbe(rec)
