"""Every kernel compiles for a real GPU (sm_90, the H100/H200 generation) down to a cubin.

The interpreter runs kernels as numpy and forgives what the compiler does not (loop-carried
type changes, int/float mixes, unsupported ops). This runs Triton's whole compiler (TTIR ->
TTGIR -> LLVM IR -> PTX -> ptxas) ahead of time on the CPU, no GPU needed, at the block
sizes the host functions pick for Llama-scale bf16 shapes. It runs in a subprocess because
triton.language must be imported in compiled mode (the test session imports it interpreted).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia", reason="triton built without its NVIDIA backend")

SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tpkit.kernels.fused_linear_cross_entropy import _ce_rows_kernel
    from tpkit.kernels.rms_norm import _rms_norm_bwd_kernel, _rms_norm_fwd_kernel
    from tpkit.kernels.rope import _rope_kernel
    from tpkit.kernels.swiglu import _swiglu_bwd_kernel, _swiglu_fwd_kernel

    BF16, F32, I32 = "*bf16", "*fp32", "i32"
    CE = dict(LOGITS=BF16, stride_row=I32, TARGETS="*i64", LOSS=F32, n_rows=I32, V=I32,
              ignore_index=I32)
    CASES = {
        "rms_norm_fwd": (_rms_norm_fwd_kernel, dict(X=BF16, W=BF16, Y=BF16, RSTD=F32, n_rows=I32,
                         n_cols=I32, eps="fp32"), dict(BLOCK_M=1, BLOCK_C=4096), 8),
        "rms_norm_bwd": (_rms_norm_bwd_kernel, dict(DY=BF16, X=BF16, W=BF16, RSTD=F32, DX=BF16,
                         DW_PARTIAL=F32, n_rows=I32, n_cols=I32, rows_per_program=I32),
                         dict(BLOCK_M=1, BLOCK_C=4096), 8),
        "swiglu_fwd": (_swiglu_fwd_kernel, dict(G=BF16, U=BF16, Y=BF16, n=I32), dict(BLOCK=1024), 4),
        "swiglu_bwd": (_swiglu_bwd_kernel, dict(DY=BF16, G=BF16, U=BF16, DG=BF16, DU=BF16, n=I32),
                       dict(BLOCK=1024), 4),
        "rope": (_rope_kernel, dict(X=BF16, COS=F32, SIN=F32, Y=BF16, n_rows=I32, seq_len=I32,
                 half=I32, cos_stride=I32, sign="fp32"), dict(BLOCK_M=64, BLOCK_D=64), 4),
        "ce_rows_grad": (_ce_rows_kernel, CE, dict(WRITE_GRAD=True, BLOCK_M=1, BLOCK_V=4096), 8),
        "ce_rows_loss_only": (_ce_rows_kernel, CE, dict(WRITE_GRAD=False, BLOCK_M=1, BLOCK_V=4096), 8),
    }
    for name, (lazy, signature, constexprs, num_warps) in CASES.items():
        fn = lazy.jitted()
        assert type(fn).__name__ == "JITFunction", type(fn)
        signature = {**signature, **{k: "constexpr" for k in constexprs}}
        assert list(signature) == fn.arg_names, (name, "signature out of date", fn.arg_names)
        try:
            k = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": num_warps})
            ok = bool(k.asm["cubin"]) and ".entry" in k.asm["ptx"]
            print(f"COMPILED {name} {ok}", flush=True)
        except Exception as exc:
            print(f"FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
    """
)
KERNELS = ["rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd", "rope", "ce_rows_grad",
           "ce_rows_loss_only"]


@pytest.fixture(scope="module")
def compile_log(tmp_path_factory) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silence triton 3.9's notice about the default
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_for_sm90(compile_log, name):
    assert f"COMPILED {name} True" in compile_log, compile_log
