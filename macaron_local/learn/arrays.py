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

        self._xp = mx

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self._xp.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return self._xp.zeros_like(x)

    def exp(self, x: Any) -> Any:
        return self._xp.exp(x)

    def minimum(self, a: Any, b: Any) -> Any:
        return self._xp.minimum(a, b)

    def clip(self, x: Any, low: float | None, high: float | None) -> Any:
        return self._xp.clip(x, low, high)

    def mean(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._xp.mean(x, axis=axis, keepdims=keepdims)

    def std(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._xp.std(x, axis=axis, keepdims=keepdims, ddof=0)

    def all(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._xp.all(x, axis=axis, keepdims=keepdims)

    def stop_gradient(self, x: Any) -> Any:
        return self._xp.stop_gradient(x)

    def cast_like(self, x: Any, like: Any) -> Any:
        return x.astype(like.dtype)

    def log_softmax(self, x: Any, axis: int = -1) -> Any:
        return x - self._xp.logsumexp(x, axis=axis, keepdims=True)

    def take_last_axis(self, x: Any, index: Any) -> Any:
        return self._xp.take_along_axis(x, self._xp.expand_dims(index, -1), axis=-1).squeeze(-1)

    def expand_dims(self, x: Any, axis: int) -> Any:
        return self._xp.expand_dims(x, axis)

    def broadcast_like(self, x: Any, like: Any) -> Any:
        return self._xp.broadcast_to(x, like.shape)

    def log_sigmoid(self, x: Any) -> Any:
        return -self._xp.logaddexp(self._xp.zeros_like(x), -x)


class NumpyOps(MlxOps):
    """Plain NumPy, with no gradients: for what is computed on the machine and not trained
    through, such as the group advantages a remote trainer is sent (learn/remote_run.py). Until
    this existed, NumPy arrays were handed torch's spelling and that call failed. MLX spells
    its operations as NumPy does, so only what NumPy lacks differs: gradients and logsumexp."""

    def __init__(self) -> None:
        import numpy as np

        self._xp = np

    def stop_gradient(self, x: Any) -> Any:
        return x

    def log_softmax(self, x: Any, axis: int = -1) -> Any:
        shifted = x - self._xp.max(x, axis=axis, keepdims=True)
        return shifted - self._xp.log(self._xp.sum(self._xp.exp(shifted), axis=axis, keepdims=True))


Ops = TorchOps | MlxOps | NumpyOps


@functools.cache
def _ops(library: str) -> Ops:
    return {"mlx": MlxOps, "numpy": NumpyOps}.get(library, TorchOps)()


def ops_for(x: Any) -> Ops:
    """The operations for the library `x` belongs to (an MLX array, a NumPy array or a torch
    tensor)."""
    module = type(x).__module__
    return _ops("mlx" if module.startswith("mlx") else "numpy" if module == "numpy" else "torch")
