"""The handful of array operations the losses need, for each array library a trainer uses.

The losses are written once, as pure functions of arrays, and run unchanged on torch tensors
(the torch backend, CUDA or CPU) and on MLX arrays (Apple silicon). Each backend's arrays get
the matching operations through `ops_for`; the two libraries differ only in spelling
(`dim`/`axis`, `detach`/`stop_gradient`, `clamp`/`clip`), which is all that lives here.
NumPy arrays get the same operations without gradients, for values computed on the machine
and sent elsewhere (a remote trainer's advantages).
"""

from __future__ import annotations

import functools
from typing import Any


class TorchOps:
    def __init__(self) -> None:
        import torch
        import torch.nn.functional as F

        self._torch, self._F = torch, F

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self._torch.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return self._torch.zeros_like(x)

    def exp(self, x: Any) -> Any:
        return self._torch.exp(x)

    def minimum(self, a: Any, b: Any) -> Any:
        return self._torch.minimum(a, b)

    def clip(self, x: Any, low: float | None, high: float | None) -> Any:
        return self._torch.clamp(x, min=low, max=high)

    def mean(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return x.mean(dim=axis, keepdim=keepdims)

    def std(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        """Population standard deviation (divide by N)."""
        return x.std(dim=axis, correction=0, keepdim=keepdims)

    def all(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return x.all(dim=axis, keepdim=keepdims)

    def stop_gradient(self, x: Any) -> Any:
        return x.detach()

    def cast_like(self, x: Any, like: Any) -> Any:
        return x.to(like.dtype)

    def log_softmax(self, x: Any, axis: int = -1) -> Any:
        return self._torch.log_softmax(x, dim=axis)

    def take_last_axis(self, x: Any, index: Any) -> Any:
        """x[..., index[...]]: pick one entry of the last axis per position."""
        return x.gather(-1, index.unsqueeze(-1)).squeeze(-1)

    def expand_dims(self, x: Any, axis: int) -> Any:
        return x.unsqueeze(axis)

    def broadcast_like(self, x: Any, like: Any) -> Any:
        return x.expand_as(like)

    def log_sigmoid(self, x: Any) -> Any:
        return self._F.logsigmoid(x)


class MlxOps:
    def __init__(self) -> None:
        import mlx.core as mx

        self._mx = mx

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self._mx.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return self._mx.zeros_like(x)

    def exp(self, x: Any) -> Any:
        return self._mx.exp(x)

    def minimum(self, a: Any, b: Any) -> Any:
        return self._mx.minimum(a, b)

    def clip(self, x: Any, low: float | None, high: float | None) -> Any:
        return self._mx.clip(x, low, high)

    def mean(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._mx.mean(x, axis=axis, keepdims=keepdims)

    def std(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._mx.std(x, axis=axis, keepdims=keepdims, ddof=0)

    def all(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._mx.all(x, axis=axis, keepdims=keepdims)

    def stop_gradient(self, x: Any) -> Any:
        return self._mx.stop_gradient(x)

    def cast_like(self, x: Any, like: Any) -> Any:
        return x.astype(like.dtype)

    def log_softmax(self, x: Any, axis: int = -1) -> Any:
        return x - self._mx.logsumexp(x, axis=axis, keepdims=True)

    def take_last_axis(self, x: Any, index: Any) -> Any:
        return self._mx.take_along_axis(x, self._mx.expand_dims(index, -1), axis=-1).squeeze(-1)

    def expand_dims(self, x: Any, axis: int) -> Any:
        return self._mx.expand_dims(x, axis)

    def broadcast_like(self, x: Any, like: Any) -> Any:
        return self._mx.broadcast_to(x, like.shape)

    def log_sigmoid(self, x: Any) -> Any:
        return -self._mx.logaddexp(self._mx.zeros_like(x), -x)


class NumpyOps:
    """Plain NumPy, with no gradient: for what is computed on the machine and not trained
    through, such as the group advantages a remote trainer is sent (learn/remote_run.py). Until
    this existed, NumPy arrays were handed torch's spelling and that call failed."""

    def __init__(self) -> None:
        import numpy as np

        self._np = np

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self._np.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return self._np.zeros_like(x)

    def exp(self, x: Any) -> Any:
        return self._np.exp(x)

    def minimum(self, a: Any, b: Any) -> Any:
        return self._np.minimum(a, b)

    def clip(self, x: Any, low: float | None, high: float | None) -> Any:
        return self._np.clip(x, low, high)

    def mean(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._np.mean(x, axis=axis, keepdims=keepdims)

    def std(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._np.std(x, axis=axis, keepdims=keepdims, ddof=0)

    def all(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._np.all(x, axis=axis, keepdims=keepdims)

    def stop_gradient(self, x: Any) -> Any:
        return x

    def cast_like(self, x: Any, like: Any) -> Any:
        return x.astype(like.dtype)

    def log_softmax(self, x: Any, axis: int = -1) -> Any:
        shifted = x - self._np.max(x, axis=axis, keepdims=True)
        return shifted - self._np.log(self._np.sum(self._np.exp(shifted), axis=axis, keepdims=True))

    def take_last_axis(self, x: Any, index: Any) -> Any:
        return self._np.take_along_axis(x, self._np.expand_dims(index, -1), axis=-1).squeeze(-1)

    def expand_dims(self, x: Any, axis: int) -> Any:
        return self._np.expand_dims(x, axis)

    def broadcast_like(self, x: Any, like: Any) -> Any:
        return self._np.broadcast_to(x, like.shape)

    def log_sigmoid(self, x: Any) -> Any:
        return -self._np.logaddexp(self._np.zeros_like(x), -x)


Ops = TorchOps | MlxOps | NumpyOps


@functools.cache
def _ops(library: str) -> Ops:
    return {"mlx": MlxOps, "numpy": NumpyOps}.get(library, TorchOps)()


def ops_for(x: Any) -> Ops:
    """The operations for the library `x` belongs to (an MLX array, a NumPy array or a torch
    tensor)."""
    module = type(x).__module__
    return _ops("mlx" if module.startswith("mlx") else "numpy" if module == "numpy" else "torch")
