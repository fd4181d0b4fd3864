"""Half-precision models: cockpit's statistics are computed in at least float32.

bfloat16 keeps 8 significant bits (unit roundoff ``u = 2**-8``), float16 11 bits and
a largest value of 65504. That is enough for one gradient entry, not for the sums
and differences cockpit forms from many of them: ``sum_i ||g_i||^2 - N ||g||^2``
(NormTest, InnerTest, OrthoTest) cancels, Gram matrices and squared norms of float16
gradients overflow, and Lanczos vectors (HessMaxEV) lose their orthogonality.

So wherever an engine hands half-precision results to the quantities (per-sample
gradients, their reductions, curvature diagonals, ``.grad``, parameter snapshots),
they are converted to float32 first (:func:`upcast`), and vectors are built in
:func:`compute_dtype`. The values themselves keep the precision they were computed
with (each per-sample gradient of a bfloat16 model is a bfloat16 number); only what
cockpit derives from them is exact to float32. See ``docs/any_model.md`` ("Mixed
precision").
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Floating dtypes too coarse for cockpit's sums (upcast to float32).
LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype cockpit computes statistics of ``dtype`` values in."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def upcast(tensor: Tensor | None) -> Tensor | None:
    """``tensor`` in float32 if it is half precision, else unchanged (no copy)."""
    if tensor is None or tensor.dtype not in LOW_PRECISION:
        return tensor
    return tensor.to(torch.float32)


def is_low_precision(tensors) -> bool:
    """Whether any of ``tensors`` is half precision (bfloat16 or float16)."""
    return any(t.dtype in LOW_PRECISION for t in tensors)
