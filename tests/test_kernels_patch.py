"""patch/unpatch: the built-in model trains the same with kernels, and comes back intact."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tpkit.kernels as K
from tpkit.demo.models import TinyConfig, TinyTransformer


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TPKIT_KERNELS", raising=False)


def tiny(dtype=torch.float32, seed=0) -> TinyTransformer:
    torch.manual_seed(seed)
    cfg = TinyConfig(vocab_size=97, seq_len=16, n_layer=2, n_head=2, d_model=32)
    return TinyTransformer(cfg).to(dtype)


def batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (2, 11), generator=gen), torch.randint(0, 97, (2, 11), generator=gen)


def loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_patched_tiny_transformer_matches_unpatched(dtype, tol):
    model = tiny(dtype)
    x, y = batch()
    loss0, grads0 = loss_and_grads(model, x, y)
    swaps = K.patch(model)
    kinds = sorted(s.kind for s in swaps)
    # 2 blocks x (norm1, norm2, attn, mlp) + final norm + head
    assert kinds == ["lm_head_loss"] + ["rms_norm"] * 5 + ["rope"] * 2 + ["swiglu"] * 2
    loss1, grads1 = loss_and_grads(model, x, y)
    assert loss1.dtype == loss0.dtype
    torch.testing.assert_close(loss1, loss0, rtol=tol, atol=tol)
    assert grads1.keys() == grads0.keys()
    for name in grads0:
        g0, g1 = grads0[name].float(), grads1[name].float()
        # compare relative to the tensor's scale: bf16 grads of tiny params round differently
        torch.testing.assert_close(g1, g0, rtol=tol, atol=tol * g0.abs().max().item(), msg=name)
    with torch.no_grad():  # the logits path (no targets) still returns logits
        logits_patched = model(x)
        K.unpatch(model)
        logits = model(x)
    assert logits_patched.shape == logits.shape == (2, 11, 97)
    torch.testing.assert_close(logits_patched.float(), logits.float(), rtol=tol, atol=tol)


def test_unpatch_restores_the_same_objects_and_parameters():
    model = tiny()
    modules_before = dict(model.named_modules())
    params_before = {n: p for n, p in model.named_parameters()}
    keys_before = list(model.state_dict())
    swaps = K.patch(model)
    # patched: same parameter objects (shared, not copied), same state_dict keys
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params_before.items()}
    assert list(model.state_dict()) == keys_before
    assert model.head.weight is model.embed.weight  # the tie survives
    assert K.patched(model) == swaps
    assert K.patch(model) == []  # patching twice swaps nothing new
    undone = K.unpatch(model)
    assert undone == swaps
    modules_after = dict(model.named_modules())
    assert modules_after.keys() == modules_before.keys()
    assert all(modules_after[n] is m for n, m in modules_before.items())
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert K.patched(model) == [] and K.unpatch(model) == []
    assert len(K.patch(model)) == len(swaps)  # and it can be patched again


def test_optimizer_built_before_patch_still_trains_the_patched_model():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    K.patch(model)
    x, y = batch()
    before = model.blocks[0].mlp.gate.weight.detach().clone()
    model(x, y).backward()
    opt.step()
    assert not torch.equal(model.blocks[0].mlp.gate.weight, before)
    K.unpatch(model)
    assert torch.equal(model.blocks[0].mlp.gate.weight, model.blocks[0].mlp.gate.weight)  # same tensor
    assert not torch.equal(model.blocks[0].mlp.gate.weight, before)


def test_patch_leaves_the_global_rng_alone():
    model = tiny()
    state = torch.get_rng_state()
    K.patch(model)
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- user models
class MyRMSNorm(nn.Module):  # Hugging Face style: variance_epsilon
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))
        self.variance_epsilon = 1e-5

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)


class GemmaLikeRMSNorm(MyRMSNorm):  # scales by 1 + weight: must NOT be swapped
    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (1 + self.weight) * (x * torch.rsqrt(v + self.variance_epsilon))


class HFMLP(nn.Module):
    def __init__(self, c, h, act=F.silu):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(c, h), nn.Linear(c, h)
        self.down_proj = nn.Linear(h, c)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class UserModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = MyRMSNorm(24)
        self.mlp = HFMLP(24, 40)
        self.gemma_norm = GemmaLikeRMSNorm(24)
        self.gelu_mlp = HFMLP(24, 40, act=F.gelu)

    def forward(self, x):
        return self.gelu_mlp(self.gemma_norm(self.mlp(self.norm(x))))


def test_patch_matches_user_modules_by_shape_and_behaviour():
    torch.manual_seed(0)
    model = UserModel()
    x = torch.randn(3, 5, 24)
    ref = model(x)
    ref.sum().backward()
    grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    swaps = K.patch(model)
    assert sorted((s.name, s.kind) for s in swaps) == [("mlp", "swiglu"), ("norm", "rms_norm")]
    out = model(x)
    out.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads0[n], rtol=1e-5, atol=1e-5, msg=n)
    K.unpatch(model)
    assert type(model.norm) is MyRMSNorm and type(model.mlp) is HFMLP


def test_patch_kinds_can_be_chosen():
    model = tiny()
    swaps = K.patch(model, kinds=["rms_norm"])
    assert {s.kind for s in swaps} == {"rms_norm"}
    with pytest.raises(ValueError, match="unknown kinds"):
        K.patch(model, kinds=["flash_attention"])


@pytest.mark.slow
def test_patched_model_under_torch_compile_gives_the_same_loss_and_grads():
    """Users of other kernel libraries report a fused loss that was silently wrong under
    torch.compile. Here the kernels are opaque to compile (a graph break), so compiled and
    eager agree. (~30 s: mostly torch.compile's first compile on the CPU.)"""
    model = tiny()
    model.blocks = model.blocks[:1]  # one block keeps compile time down
    x, y = batch()
    loss0, grads0 = loss_and_grads(model, x, y)
    K.patch(model)
    compiled = torch.compile(model)
    model.zero_grad(set_to_none=True)
    loss1 = compiled(x, y)
    loss1.backward()
    torch.testing.assert_close(loss1.detach(), loss0, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads0[name], rtol=1e-5, atol=1e-5, msg=name)


def test_kernels_enabled_patches_for_a_block_only():
    model = tiny()
    norm = model.norm
    with K.kernels_enabled(model) as swaps:
        assert len(swaps) == 10 and type(model.norm).__name__ == "KernelRMSNorm"
    assert model.norm is norm and K.patched(model) == []
    with pytest.raises(RuntimeError, match="boom"):
        with K.kernels_enabled(model):
            raise RuntimeError("boom")
    assert model.norm is norm
    K.patch(model, kinds=["swiglu"])  # swaps made before the block survive it
    with K.kernels_enabled(model) as swaps:
        assert {s.kind for s in swaps} == {"rms_norm", "rope", "lm_head_loss"}
    assert [s.kind for s in K.patched(model)] == ["swiglu", "swiglu"]
    assert model.norm is norm and type(model.blocks[0].mlp).__name__ == "KernelSwiGLU"


def test_a_tpkit_module_whose_forward_changed_is_left_alone(monkeypatch):
    """The RoPE attention twin re-states tpkit.models.Attention.forward; if that forward
    changes (here: no RoPE at all), the probe sees it and patch leaves the module alone."""
    from tpkit.demo import models

    def no_rope(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    monkeypatch.setattr(models.Attention, "forward", no_rope)
    swaps = K.patch(tiny())
    assert "rope" not in {s.kind for s in swaps} and "lm_head_loss" in {s.kind for s in swaps}
