"""The functional API, its autograd Functions and the backend switch.

``layer_norm_fn`` / ``rms_norm_fn`` are call-compatible with flash-attn's Triton layer norm,
``dropout_add_*`` with its CUDA-era wrappers; all end in :func:`fused_norm`, which returns
``(y, y1, residual_out, mask, mask1)``. A call's key (docs/design.md, "The hot path") finds its
``ops.KernelCall``; under ``torch.compile`` the call is traced through ``_TracedNorm`` instead.
"""

from __future__ import annotations

import os

import torch

from .checks import Flags, check_args
from .reference import layer_norm_ref, rms_norm_ref

try:  # the Triton kernels; without Triton only the PyTorch path runs
    from . import ops, traced
except ImportError as e:  # pragma: no cover - exercised where Triton has no wheel
    ops = traced = None
    _NO_KERNELS = e

try:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor as _ASYNC
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = _ASYNC = None

__all__ = [
    "fused_norm",
    "layer_norm_fn",
    "rms_norm_fn",
    "dropout_add_layer_norm",
    "dropout_add_rms_norm",
    "dropout_add_layer_norm_parallel_residual",
    "dropout_add_rms_norm_parallel_residual",
]

BACKEND_ENV = "FUSED_NORM_BACKEND"
_KERNEL_DEVICE_TYPES = ("cuda", "xpu")
# Keys of calls seen (_spec); bounded so that a stream of new shapes cannot grow it for ever.
_CALLS: dict = {}
_MAX_CALLS = 4096
if ops is not None:
    ops.CACHES.append(_CALLS)


# The environment's raw mapping (POSIX: bytes -> bytes), read per call for the cache key: a
# quarter of the time of os.environ.get, which encodes the key and decodes the value.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(BACKEND_ENV) if hasattr(os.environ, "encodekey") else None


def _backend_value():
    if _ENV_DATA is not None and _ENV_KEY is not None:
        return _ENV_DATA.get(_ENV_KEY)
    return os.environ.get(BACKEND_ENV)


def _backend(value) -> str:
    backend = (value or "auto").strip().lower() or "auto"
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"{BACKEND_ENV} must be 'auto', 'triton' or 'torch', got {value!r}")
    return backend


def use_kernels(x: torch.Tensor, value=None) -> bool:
    """Whether the Triton kernels serve ``x`` under ``FUSED_NORM_BACKEND`` (``value``; read
    from the environment when None)."""
    backend = _backend(os.environ.get(BACKEND_ENV) if value is None else value)
    if backend == "torch":
        return False
    if ops is None:
        if backend == "triton":
            raise RuntimeError(f"{BACKEND_ENV}=triton, but Triton is not importable: {_NO_KERNELS}")
        return False
    runnable = x.device.type in _KERNEL_DEVICE_TYPES or ops.INTERPRETED
    if backend == "triton" and not runnable:
        raise RuntimeError(
            f"{BACKEND_ENV}=triton, but the Triton kernels cannot run on {x.device}: "
            "use a GPU tensor, or set TRITON_INTERPRET=1 before importing fused_norm"
        )
    return runnable


def _spec(t):
    """What a call's validation and launch depend on of one tensor argument."""
    if t is None:
        return None
    return (type(t), t.dtype, t.shape, t.stride(), t.device, t.requires_grad, t.data_ptr() & 15)


def _no_signature(tensors):
    return None


# The tensors' part of the key, packed in C++ where the fast path is built (a fifth of the
# time of the _spec tuples and their hash: 0.8 against 4.0 µs); None sends a call to _spec.
_signature = _no_signature if ops is None or ops._FAST is None else ops._FAST.signature


def _residual_dtype(x, residual, residual_in_fp32):
    if isinstance(residual, torch.Tensor):
        return residual.dtype
    return torch.float32 if residual_in_fp32 else getattr(x, "dtype", None)


def fused_norm(
    x, weight, bias=None, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
    dropout_p=0.0, rowscale=None, layerscale=None, prenorm=False, residual_in_fp32=False,
    zero_centered_weight=False, is_rms_norm=False, return_dropout_mask=False, out_dtype=None,
    out=None, residual_out=None,
):  # fmt: skip
    """The one entry point: ``(y, y1, residual_out, mask, mask1)``, absent parts None.

    Arguments as :func:`layer_norm_fn`, plus ``layerscale`` (an ``(N,)`` per-column scale of
    x before dropout, differentiated: the legacy API's)."""
    if not prenorm:
        residual_out = None
    if DTensor is not None and (
        type(x) is DTensor or type(weight) is DTensor or type(residual) is DTensor
    ):  # tensor / sequence parallelism: the local shards (distributed.py)
        from .distributed import dtensor_call

        return dtensor_call(fused_norm, x, weight, bias, residual, x1, weight1, bias1, eps,
                            dropout_p, rowscale, layerscale, prenorm, residual_in_fp32,
                            zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype, out,
                            residual_out)  # fmt: skip
    if _ASYNC is not None and (type(x) is _ASYNC or type(residual) is _ASYNC or type(x1) is _ASYNC):
        # A collective's result still in flight (tensor parallelism's async outputs): the
        # kernels read memory, so wait for it first (differentiably).
        x, residual, x1 = (t if type(t) is not _ASYNC else torch.ops._c10d_functional.wait_tensor(t)
                           for t in (x, residual, x1))  # fmt: skip
    tensors = (x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, out,
               residual_out)  # fmt: skip
    if torch.compiler.is_compiling():
        return _traced(tensors, eps, dropout_p, prenorm, residual_in_fp32, zero_centered_weight,
                       is_rms_norm, return_dropout_mask, out_dtype)  # fmt: skip
    try:
        key = (_signature(tensors) or tuple(map(_spec, tensors)), eps, type(eps), dropout_p,
               type(dropout_p), prenorm, residual_in_fp32, zero_centered_weight, is_rms_norm,
               return_dropout_mask, out_dtype, torch.is_grad_enabled(), _backend_value())  # fmt: skip
        call = _CALLS.get(key)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, or unhashable scalars
        key = call = None
    if call is None:
        call = _new_call(tensors, eps, dropout_p, prenorm, residual_in_fp32, zero_centered_weight,
                         is_rms_norm, return_dropout_mask, out_dtype)  # fmt: skip
        if key is not None:
            if len(_CALLS) >= _MAX_CALLS:
                _CALLS.clear()
            _CALLS[key] = call
    return call(*tensors)


def _validate(tensors, eps, dropout_p, prenorm, residual_in_fp32, zero_centered_weight,
              is_rms_norm, return_dropout_mask, out_dtype):  # fmt: skip
    """``(kernels, flags)`` of a call: whether the Triton kernels serve it, and its scalars;
    raises on bad input (checks.check_args)."""
    x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, out, res_out = tensors
    residual_dtype = _residual_dtype(x, residual, residual_in_fp32)
    kernels = isinstance(x, torch.Tensor) and use_kernels(x)
    check_args(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, layerscale,
        out_dtype, out, res_out, residual_dtype, kernel=kernels,
    )  # fmt: skip
    flags = Flags(float(eps), float(dropout_p), bool(prenorm), residual_dtype,
                  bool(zero_centered_weight), bool(is_rms_norm), bool(return_dropout_mask),
                  out_dtype or x.dtype)  # fmt: skip
    return kernels, flags


def _new_call(tensors, eps, dropout_p, prenorm, residual_in_fp32, zero_centered_weight,
              is_rms_norm, return_dropout_mask, out_dtype):  # fmt: skip
    """Validate a call (raising on bad input) and build the object that runs calls like it."""
    kernels, flags = _validate(tensors, eps, dropout_p, prenorm, residual_in_fp32,
                               zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype)  # fmt: skip
    graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors[:7] + (tensors[8],)
    )
    if not kernels:
        return _TorchCall(flags)
    return ops.KernelCall(tensors, flags, graph, _FusedNorm)


class _FusedNorm(torch.autograd.Function):
    """Forward and backward of an eager call through its ``ops.KernelCall``: the arguments are
    the call object and the tensors given; the outputs, those the call makes."""

    @staticmethod
    def forward(ctx, call, *given):
        ctx.set_materialize_grads(False)
        return call.forward_graph(ctx, *given)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.call.backward_graph(ctx, *grads))


class _TracedNorm(torch.autograd.Function):
    """The same under torch.compile: no cached call objects; ``flags`` is a tuple of
    constants that Dynamo can trace."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, flags):
        ctx.set_materialize_grads(False)
        return traced.traced_forward(ctx, x, weight, bias, residual, x1, weight1, bias1, rowscale,
                                  layerscale, Flags(*flags))  # fmt: skip

    @staticmethod
    def backward(ctx, dy, dy1, dresidual_out, _dmask, _dmask1):
        return (*traced.traced_backward(ctx, dy, dy1, dresidual_out), None)


def _traced(tensors, eps, dropout_p, prenorm, residual_in_fp32, zero_centered_weight,
            is_rms_norm, return_dropout_mask, out_dtype):  # fmt: skip
    x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, out, res_out = tensors
    kernels, flags = _validate(tensors, eps, dropout_p, prenorm, residual_in_fp32,
                               zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype)  # fmt: skip
    if not kernels:
        return _TorchCall(flags)(*tensors)
    y, y1, s, mask, mask1 = _TracedNorm.apply(
        x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, tuple(flags)
    )
    # Caller buffers are filled by a copy here (a traced graph allocates its own outputs).
    if out is not None:
        y = out.copy_(y)
    if res_out is not None and s is not None:
        s = res_out.copy_(s)
    return y, y1, s, mask, mask1


class _TorchCall:
    """The pure-PyTorch path: the reference, in fp32 (fp64 for fp64 inputs)."""

    def __init__(self, flags):
        self.flags = flags

    def __call__(self, x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, out,
                 residual_out):  # fmt: skip
        f = self.flags
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        if layerscale is not None:
            x = x * layerscale
        mask = mask1 = None
        if f.dropout_p > 0.0:
            # Contiguous masks: the draw must not depend on the inputs' memory layout.
            keep = 1.0 - f.dropout_p
            mask = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(keep)
            if x1 is not None:
                mask1 = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(keep)

        def up(t):
            return t.to(compute) if t is not None else None

        ref = rms_norm_ref if f.is_rms_norm else layer_norm_ref
        outs = ref(
            up(x), up(weight), up(bias), up(residual), up(x1), up(weight1), up(bias1), f.eps,
            f.dropout_p, up(rowscale), prenorm=True, zero_centered_weight=f.zero_centered_weight,
            dropout_mask=mask, dropout_mask1=mask1,
        )  # fmt: skip
        y = outs[0].to(f.out_dtype)
        y1 = outs[1].to(f.out_dtype) if weight1 is not None else None
        s = outs[-1].to(f.residual_dtype) if f.prenorm else None
        if out is not None:
            y = out.copy_(y)
        if residual_out is not None and s is not None:
            s = residual_out.copy_(s)
        return y, y1, s, mask, mask1


def _pack(y, y1, res_out, mask, mask1, has_w1, prenorm, return_dropout_mask):
    outs = [y]
    if has_w1:
        outs.append(y1)
    if prenorm:
        outs.append(res_out)
    if return_dropout_mask:
        outs += [mask, mask1]
    return outs[0] if len(outs) == 1 else tuple(outs)


def layer_norm_fn(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
    rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
    is_rms_norm=False, return_dropout_mask=False, out_dtype=None, out=None, residual_out=None,
):  # fmt: skip
    """Fused ``[rowscale] -> dropout -> (+ dropout(x1)) -> (+ residual) -> LayerNorm/RMSNorm``.

    Args:
        x: ``(..., N)`` input (fp32, fp16 or bf16; also fp64 on the PyTorch backend).
        weight: ``(N,)`` scale; bias: ``(N,)`` or None.
        residual: ``(..., N)`` residual added after dropout, or None.
        x1: ``(..., N)`` second input, dropped out with its own mask and added; weight1 /
            bias1: ``(N,)`` second scale/shift giving a second output from the same statistics.
        eps: variance epsilon (finite, >= 0). dropout_p: drop probability in [0, 1).
        rowscale: ``(...)`` per-row scale of ``x`` before dropout (not differentiated).
        prenorm: also return the pre-norm residual stream ``residual_out``.
        residual_in_fp32: keep the stream in fp32 when no residual is given.
        zero_centered_weight: scale by ``1 + weight``. is_rms_norm: RMSNorm instead.
        return_dropout_mask: also return the bool keep-masks of x and x1.
        out_dtype: dtype of y (default x.dtype). out / residual_out: buffers to write into.

    Returns:
        ``y``, then ``y1`` (with weight1), ``residual_out`` (with prenorm), then
        ``dropout_mask, dropout_mask1`` (with return_dropout_mask); a single ``y`` bare.
    """
    outs = fused_norm(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, None, prenorm,
        residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype,
        out, residual_out,
    )  # fmt: skip
    return _pack(*outs, weight1 is not None, prenorm, return_dropout_mask)


def rms_norm_fn(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
    rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
    return_dropout_mask=False, out_dtype=None, out=None, residual_out=None,
):  # fmt: skip
    """:func:`layer_norm_fn` with RMSNorm: ``y = s / sqrt(mean(s^2) + eps) * w + b``."""
    outs = fused_norm(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, None, prenorm,
        residual_in_fp32, zero_centered_weight, True, return_dropout_mask, out_dtype, out,
        residual_out,
    )  # fmt: skip
    return _pack(*outs, weight1 is not None, prenorm, return_dropout_mask)


def _legacy(x0, x1, residual, weight, bias, weight1, bias1, dropout_p, epsilon, rowscale,
            layerscale, prenorm, residual_in_fp32, return_dropout_mask, is_rms_norm, parallel):  # fmt: skip
    y, y1, res_out, mask, mask1 = fused_norm(
        x0, weight, bias, residual, x1, weight1, bias1, epsilon, dropout_p, rowscale,
        layerscale, prenorm, residual_in_fp32, False, is_rms_norm, return_dropout_mask,
    )  # fmt: skip
    outs = [y, y1] if parallel else [y]
    if prenorm:
        outs.append(res_out)
    if return_dropout_mask:
        outs += [mask, mask1] if parallel else [mask]
    return outs[0] if len(outs) == 1 else tuple(outs)


def dropout_add_layer_norm(
    x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
    prenorm=False, residual_in_fp32=False, return_dropout_mask=False,
):  # fmt: skip
    """``LayerNorm(dropout(x0 * rowscale * layerscale) + residual)`` (flash-attn CUDA-era API).

    Returns ``out``, or ``(out, residual_out)`` with prenorm; with return_dropout_mask the bool
    keep-mask of x0 follows. ``layerscale`` is an ``(N,)`` per-column scale and is differentiated.
    """
    return _legacy(x0, None, residual, weight, bias, None, None, dropout_p, epsilon, rowscale,
                   layerscale, prenorm, residual_in_fp32, return_dropout_mask, False, False)  # fmt: skip


def dropout_add_rms_norm(
    x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
    prenorm=False, residual_in_fp32=False, return_dropout_mask=False,
):  # fmt: skip
    """:func:`dropout_add_layer_norm` with RMSNorm."""
    return _legacy(x0, None, residual, weight, bias, None, None, dropout_p, epsilon, rowscale,
                   layerscale, prenorm, residual_in_fp32, return_dropout_mask, True, False)  # fmt: skip


def dropout_add_layer_norm_parallel_residual(
    x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm=False,
    residual_in_fp32=False, return_dropout_mask=False,
):  # fmt: skip
    """``s = dropout(x0) + dropout(x1) + residual``; ``out0 = LN(s; w0, b0)``,
    ``out1 = LN(s; w1, b1)`` (None when weight1 is None).

    Returns ``(out0, out1)``, then ``residual_out`` with prenorm, then ``(mask0, mask1)`` with
    return_dropout_mask.
    """
    return _legacy(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, None,
                   None, prenorm, residual_in_fp32, return_dropout_mask, False, True)  # fmt: skip


def dropout_add_rms_norm_parallel_residual(
    x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm=False,
    residual_in_fp32=False, return_dropout_mask=False,
):  # fmt: skip
    """:func:`dropout_add_layer_norm_parallel_residual` with RMSNorm."""
    return _legacy(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, None,
                   None, prenorm, residual_in_fp32, return_dropout_mask, True, True)  # fmt: skip
