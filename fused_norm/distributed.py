"""DTensor inputs (tensor and sequence parallelism) for the functional API: :func:`dtensor_call`
normalises each rank's local rows and wraps the results with the input's placements; the weight's
gradient comes back ``Partial()`` on mesh dims where the input is sharded, as torch's own DTensor
norms give it. Shardings that would need communication inside the norm (a sharded hidden dim, a
``Partial`` input, a sharded weight) raise a ``ValueError`` naming the argument. docs/hf.md,
"Tensor and sequence parallelism", says more, dropout under sharding included.
"""

from __future__ import annotations

import functools
import inspect

import torch

try:  # torch built without distributed support (some macOS / mobile builds)
    from torch.distributed.tensor import DTensor, Partial, Replicate
except ImportError:  # pragma: no cover - exercised only on such builds
    DTensor = Partial = Replicate = None

try:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
except ImportError:  # pragma: no cover
    AsyncCollectiveTensor = None

__all__ = ["dtensor_aware", "dtensor_call", "has_dtensor"]

# Argument names of the functional API, by role. Row arguments are shaped like x (..., N) and
# share its sharding; column arguments are (N,) vectors that every row uses.
_ROW_ARGS = ("x", "x0", "residual", "x1", "rowscale")
_COL_ARGS = ("weight", "bias", "weight0", "bias0", "weight1", "bias1", "layerscale")
_BUFFER_ARGS = ("out", "residual_out")


def has_dtensor(*args, **kwargs) -> bool:
    """Whether any positional or keyword argument is a DTensor."""
    if DTensor is None:
        return False
    return any(isinstance(a, DTensor) for a in args) or any(
        isinstance(v, DTensor) for v in kwargs.values()
    )


def dtensor_aware(fn):
    """Decorate a functional entry point so that DTensor arguments go through
    :func:`dtensor_call`; calls without DTensors go straight to ``fn``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if has_dtensor(*args, **kwargs):
            return dtensor_call(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


@functools.cache
def _param_names(fn) -> tuple:
    return tuple(inspect.signature(fn).parameters)


class _Waited(torch.autograd.Function):
    """Identity that hands the kernels plain tensors in both directions. DTensor
    redistributions return ``AsyncCollectiveTensor``s (forward and backward), which wait for
    their collective only when a torch op touches them; the kernels read memory directly."""

    @staticmethod
    def forward(ctx, t):
        return t.wait() if _is_async(t) else t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.wait() if _is_async(grad) else grad


def _is_async(t) -> bool:
    return AsyncCollectiveTensor is not None and isinstance(t, AsyncCollectiveTensor)


def _plain(t):
    """``t``, waited on (and still differentiable) if it is an asynchronous collective's."""
    return _Waited.apply(t) if _is_async(t) else t


def _placements_text(t) -> str:
    return ", ".join(repr(p) for p in t.placements)


def _check_row_ref(name, x):
    """The input that sets the layout: sharded on leading dims or replicated, never Partial."""
    for p in x.placements:
        if p.is_partial():
            raise ValueError(
                f"{name} is a DTensor with a Partial placement ({_placements_text(x)}): a norm "
                "needs the summed value; redistribute it to Shard or Replicate first"
            )
        if p.is_shard() and p.dim % x.ndim == x.ndim - 1:
            raise ValueError(
                f"{name} is a DTensor sharded on its last (hidden) dim ({_placements_text(x)}): "
                "each row must lie on one rank; shard a leading dim (e.g. Shard(1), the "
                "sequence) or replicate it"
            )


def _local(name, value, ref_name, mesh, placements, grad_placements) -> torch.Tensor:
    """The local tensor of argument ``name`` (a row or a column argument) beside the input's
    ``mesh`` and ``placements``, or a ValueError naming a layout the norm cannot serve."""
    row = name in _ROW_ARGS
    if not isinstance(value, DTensor):
        raise ValueError(
            f"{name} is a plain tensor but {ref_name} is a DTensor: pass {name} as a DTensor "
            f"on {ref_name}'s mesh (" + ("with its placements)" if row else
                                        "Replicate, e.g. via SequenceParallel)")
        )  # fmt: skip
    if value.device_mesh != mesh:
        raise ValueError(f"{name} is on device mesh {value.device_mesh}, {ref_name} on {mesh}")
    if row:
        if tuple(value.placements) != placements:
            # The same global tensor, laid out like x (a Replicate residual beside a
            # sequence-sharded x only drops the other ranks' rows: no communication).
            _check_row_ref(name, value)
            value = value.redistribute(mesh, placements)
        return _plain(value.to_local())
    if not all(p.is_replicate() for p in value.placements):
        raise ValueError(
            f"{name} must be replicated (Replicate() on every mesh dim), got "
            f"({_placements_text(value)}): a sharded {name} splits each row's columns"
        )
    return _plain(value.to_local(grad_placements=grad_placements))


def dtensor_call(fn, *args, **kwargs):
    """Call ``fn`` (``layer_norm_fn``, ``rms_norm_fn`` or a ``dropout_add_*`` function), some of
    whose tensor arguments are DTensors, on each rank's local tensors.

    Args:
        fn: the functional entry point; its parameter names say each argument's role
            (``x``/``x0``, ``residual``, ``x1``, ``rowscale``: rows; ``weight``, ``bias``, ...,
            ``layerscale``: per-column vectors).
        *args, **kwargs: ``fn``'s arguments. The input (``x`` or ``x0``) must be a DTensor,
            ``Shard(d)`` with ``d`` not its last dim, or ``Replicate()``, on each mesh dim; the
            other row arguments DTensors on the same mesh (redistributed to the input's
            placements where theirs differ); the vectors
            ``Replicate()`` DTensors on the same mesh. ``out=`` / ``residual_out=`` buffers are
            not supported with DTensors.

    Returns:
        ``fn``'s return value with each tensor (outputs, residual stream, dropout masks) a
        DTensor with the input's mesh and placements. Gradients flow to the DTensor inputs:
        rows with their own placements, vectors as ``Partial()`` on the mesh dims where the
        input is sharded (torch's DTensor norms do the same).

    Raises:
        ValueError: a sharding the norm cannot serve locally, naming the argument and placement.
    """
    names = _param_names(fn)
    if len(args) > len(names):
        raise TypeError(f"{fn.__name__}() takes {len(names)} arguments, got {len(args)}")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    ref_name = "x" if "x" in bound else "x0"
    x = bound.get(ref_name)
    if not isinstance(x, DTensor):
        others = [n for n, v in bound.items() if isinstance(v, DTensor)]
        raise ValueError(
            f"{ref_name} is a {type(x).__name__}, but {', '.join(others)} is a DTensor: pass "
            f"{ref_name} as a DTensor too (e.g. through SequenceParallel), or all as tensors"
        )
    _check_row_ref(ref_name, x)
    mesh, placements = x.device_mesh, tuple(x.placements)
    # On mesh dims where the rows are split, each rank's vector gradient is a partial sum.
    grad_placements = [Partial() if p.is_shard() else Replicate() for p in placements]
    local = dict(bound)
    for name, value in bound.items():
        if name in _BUFFER_ARGS and value is not None:
            raise ValueError(f"{name}= buffers are not supported with DTensor inputs")
        if name != ref_name and isinstance(value, torch.Tensor) and name in _ROW_ARGS + _COL_ARGS:
            local[name] = _local(name, value, ref_name, mesh, placements, grad_placements)
    local[ref_name] = _plain(x.to_local())
    result = fn(**local)

    # Every tensor fn returns (y, y1, residual_out, masks) is shaped like x and sharded alike.
    shape = x.shape
    stride = _contiguous_strides(shape)

    def wrap(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.requires_grad:  # its gradient arrives through from_local's backward, maybe async
            t = _Waited.apply(t)
        return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)

    if isinstance(result, tuple):
        return tuple(wrap(t) for t in result)
    return wrap(result)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
