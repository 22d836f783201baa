"""tpkit.kernels: Triton kernels for the hot spots of transformer training, with autograd.

    import tpkit.kernels as K
    y = K.rms_norm(x, weight, eps)               # x [..., C], weight [C]
    y = K.swiglu(gate, up)                       # silu(gate) * up
    q, k = K.rope(q, k, cos, sin)                # [B, H, T, D], cos/sin [T, D/2]
    loss = K.fused_linear_cross_entropy(h, W, y) # never holds the [tokens x vocab] logits
    swapped = K.patch(model); K.unpatch(model)   # swap matching modules in place, and back

Each op runs compiled Triton on a GPU, Triton's interpreter on the CPU when
TRITON_INTERPRET=1, and otherwise its torch reference (with a one-time notice): see
``backend.py``. triton itself is optional (``pip install tpkit[triton]``). Inputs are
checked as torch checks them; errors are ``tpkit.errors.TpkitError`` subclasses that keep
torch's builtin base (``errors.py``).
"""

from .backend import force_backend, reference_only, select_backend
from .errors import KernelArgumentError, KernelBackendError, KernelError, KernelIndexError, KernelTensorError, KernelTypeError
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .patch import Swap, kernels_enabled, patch, patched, unpatch
from .rms_norm import rms_norm
from .rope import rope
from .swiglu import swiglu

__all__ = [
    "rms_norm",
    "swiglu",
    "rope",
    "fused_linear_cross_entropy",
    "patch",
    "unpatch",
    "patched",
    "kernels_enabled",
    "Swap",
    "select_backend",
    "force_backend",
    "reference_only",
    "KernelError",
    "KernelTensorError",
    "KernelArgumentError",
    "KernelIndexError",
    "KernelTypeError",
    "KernelBackendError",
]
