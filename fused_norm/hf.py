"""Drop fused norms into existing models: ``replace_norms(model)`` / ``restore_norms(model)``.

A known norm module keeps its identity and parameters: its ``__class__`` becomes ``Fused<Class>``,
whose only override is ``forward``. Classes are known by identity (torch's norms) or by the syntax
tree of their ``forward`` (transformers' templates below); ``fuse_residual=True`` swaps matching
decoder layers too. The how, the numerics and the limits: docs/hf.md.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import math
import textwrap
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from . import distributed as _dist
from .functional import layer_norm_fn

__all__ = ["replace_norms", "restore_norms"]

# ----------------------------------------------------------------------------------------------
# Templates: the code of the transformers modules we know, as transformers writes it.
# ----------------------------------------------------------------------------------------------

_LLAMA_RMS = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""

_OLMO2_RMS = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)
"""

_GEMMA_RMS = """
def forward(self, hidden_states):
    output = self._norm(hidden_states.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(hidden_states)

def _norm(self, hidden_states):
    return hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.eps)
"""

# Decoder layers. The attention call's keyword arguments are compared apart (they differ
# between releases, e.g. ``past_key_values=`` in 5.17 and ``cache=`` in 5.24): each must pass
# one of the forward's own parameters through under its own name.
_LLAMA_LAYER = """
def forward(self, hidden_states, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""

_SANDWICH_LAYER = """
def forward(self, hidden_states, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.pre_feedforward_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""


@dataclass(frozen=True)
class _Norm:
    """What a known norm computes: the arguments of ``layer_norm_fn`` that reproduce it."""

    is_rms: bool
    eps_attr: str  # the module attribute holding eps
    zero_centered: bool = False  # scale by 1 + weight (Gemma)
    promote: bool = False  # output dtype promote_types(weight, x) (Llama), else x's dtype
    torch_nn: bool = False  # torch.nn.LayerNorm / RMSNorm (normalized_shape, optional affine)


_TORCH_LN = _Norm(is_rms=False, eps_attr="eps", torch_nn=True)
_TORCH_RMS = _Norm(is_rms=True, eps_attr="eps", torch_nn=True)
_NORM_TEMPLATES = {
    _LLAMA_RMS: _Norm(is_rms=True, eps_attr="variance_epsilon", promote=True),
    _OLMO2_RMS: _Norm(is_rms=True, eps_attr="variance_epsilon"),
    _GEMMA_RMS: _Norm(is_rms=True, eps_attr="eps", zero_centered=True),
}
# Layer template -> (the norm that takes the attention branch's residual add, the norms the
# fused forward calls with residual=, which must therefore be fused).
_LAYER_TEMPLATES = {
    _LLAMA_LAYER: ("post_attention_layernorm", ("post_attention_layernorm",)),
    _SANDWICH_LAYER: ("pre_feedforward_layernorm", ("pre_feedforward_layernorm",)),
}

# ----------------------------------------------------------------------------------------------
# Recognising code
# ----------------------------------------------------------------------------------------------


def _function_node(fn) -> Optional[ast.FunctionDef]:
    """The syntax tree of a function (decorators unwrapped), or None without source."""
    try:
        src = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    except (OSError, TypeError):
        return None
    node = ast.parse(src).body[0]
    return node if isinstance(node, ast.FunctionDef) else None


def _canonical(node: ast.FunctionDef, passthrough: Optional[str] = None) -> Optional[str]:
    """``ast.dump`` of a function's body with the docstring dropped and its first argument
    after ``self`` renamed ``hidden_states``.

    With ``passthrough`` (an attribute name, e.g. ``"self_attn"``), calls of ``self.<it>`` keep
    only their ``hidden_states=`` keyword and ``**kwargs``; every other keyword must be a
    parameter of the function passed on under its own name (``cache=cache``), and all the
    parameters after the input must be passed so; otherwise None (not the shape we know).
    """
    node = copy.deepcopy(node)  # rewritten below; the caller's tree stays as it was
    args = node.args
    params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if len(params) < 2 or args.vararg is not None:
        return None
    if passthrough is None and (len(params) != 2 or args.kwarg is not None):
        return None  # a norm takes its input only: the fused forward takes nothing else
    first = params[1]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    tree = ast.Module(body=body, type_ignores=[])
    if first != "hidden_states" and any(
        isinstance(sub, ast.Name) and sub.id == "hidden_states" for sub in ast.walk(tree)
    ):
        return None  # renaming the input would merge it with another variable
    passed = set()
    for sub in ast.walk(tree):
        if isinstance(sub, ast.Name) and sub.id == first:
            sub.id = "hidden_states"
        elif isinstance(sub, ast.arg) and sub.arg == first:
            sub.arg = "hidden_states"
        elif isinstance(sub, ast.Call) and ast.unparse(sub.func) == f"self.{passthrough}":
            kept = []
            for kw in sub.keywords:
                name = kw.arg
                if name is None or name == "hidden_states":
                    kept.append(kw)
                elif isinstance(kw.value, ast.Name) and kw.value.id == name and name in params:
                    passed.add(name)
                else:
                    return None
            sub.keywords = kept
    if passthrough and (args.kwarg is None or passed != set(params[2:])):
        return None
    return ast.dump(tree)


def _template_dumps(src: str, passthrough: Optional[str] = None) -> dict:
    return {
        node.name: _canonical(node, passthrough)
        for node in ast.parse(textwrap.dedent(src)).body
        if isinstance(node, ast.FunctionDef)
    }


_NORM_DUMPS = {src: _template_dumps(src) for src in _NORM_TEMPLATES}
_LAYER_DUMPS = {src: _template_dumps(src, "self_attn") for src in _LAYER_TEMPLATES}


def _matches(cls, dumps: dict, passthrough: Optional[str] = None) -> bool:
    for name, want in dumps.items():
        fn = getattr(cls, name, None)
        node = _function_node(fn) if callable(fn) else None
        if node is None or _canonical(node, passthrough) != want:
            return False
    return True


@functools.cache
def _norm_kind(cls) -> Optional[_Norm]:
    """What the norm class ``cls`` computes, or None if it is not one we know."""
    for base, kind in ((nn.LayerNorm, _TORCH_LN), (getattr(nn, "RMSNorm", None), _TORCH_RMS)):
        if base is not None and issubclass(cls, base) and cls.forward is base.forward:
            return kind
    if "Norm" not in cls.__name__:  # cheap filter: only norm-named classes are read
        return None
    for src, dumps in _NORM_DUMPS.items():
        if _matches(cls, dumps):
            return _NORM_TEMPLATES[src]
    return None


@functools.cache
def _layer_kind(cls) -> Optional[str]:
    """The layer template ``cls.forward`` matches, or None."""
    for src, dumps in _LAYER_DUMPS.items():
        if _matches(cls, dumps, "self_attn"):
            return src
    return None


# ----------------------------------------------------------------------------------------------
# The fused classes
# ----------------------------------------------------------------------------------------------


def _norm_call(x, weight, bias, eps, kind: _Norm, residual, prenorm, out_dtype):
    """``layer_norm_fn`` for one module call; DTensors (tensor/sequence parallel) go through
    :func:`fused_norm.distributed.dtensor_call`."""
    DTensor = _dist.DTensor
    if DTensor is not None and (isinstance(x, DTensor) or isinstance(weight, DTensor)):
        # SequenceParallel's hook makes only the first argument a DTensor; a plain residual is
        # the stream that the unpatched model adds to x as local tensors: x's local layout.
        local_residual = residual is not None and not isinstance(residual, DTensor)
        if local_residual and isinstance(x, DTensor):
            residual = DTensor.from_local(residual, x.device_mesh, x.placements, run_check=False,
                                          shape=x.shape, stride=x.stride())  # fmt: skip
        out = _dist.dtensor_call(
            layer_norm_fn, x, weight, bias, residual=residual, eps=eps,
            prenorm=prenorm, zero_centered_weight=kind.zero_centered, is_rms_norm=kind.is_rms,
            out_dtype=out_dtype,
        )  # fmt: skip
        if prenorm and local_residual:
            out = (out[0], out[1].to_local())
        return out
    return layer_norm_fn(
        x, weight, bias, residual=residual, eps=eps, prenorm=prenorm,
        zero_centered_weight=kind.zero_centered, is_rms_norm=kind.is_rms, out_dtype=out_dtype,
    )  # fmt: skip


class _FusedNorm:
    """Mixin put before a transformers norm class: ``forward`` through fused_norm's kernel.

    ``forward(hidden_states, residual=None, prenorm=False)``: the original's output for
    ``hidden_states`` (..., N); with ``residual`` the norm of ``hidden_states + residual``, and
    with ``prenorm`` the tuple ``(normed, hidden_states + residual)`` (the residual stream, in
    ``residual.dtype``).
    """

    _fused_norm_original: type
    _fused_norm_kind: _Norm

    def forward(self, hidden_states, residual=None, prenorm=False):
        kind, weight = self._fused_norm_kind, self.weight
        out_dtype = None
        if kind.promote and weight.dtype != hidden_states.dtype:
            out_dtype = torch.promote_types(weight.dtype, hidden_states.dtype)
        eps = getattr(self, kind.eps_attr)
        return _norm_call(hidden_states, weight, None, eps, kind, residual, prenorm, out_dtype)


class _FusedTorchNorm(_FusedNorm):
    """Mixin for ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``: any ``normalized_shape``
    (flattened into one hidden dim), no affine parameters, no bias, and RMSNorm's ``eps=None``
    (the eps of the fp32 or fp64 computation, as torch does)."""

    def forward(self, input, residual=None, prenorm=False):
        kind, shape = self._fused_norm_kind, tuple(self.normalized_shape)
        k = len(shape)
        if tuple(input.shape[input.dim() - k :]) != shape:
            raise ValueError(
                f"{type(self).__name__}: input of shape {tuple(input.shape)} does not end in "
                f"normalized_shape {shape}"
            )
        weight = self.weight
        if weight is None:  # elementwise_affine=False
            weight = torch.ones(shape, dtype=input.dtype, device=input.device)
        bias = None if kind.is_rms else self.bias
        eps = self.eps
        if eps is None:
            eps = torch.finfo(torch.float64 if input.dtype == torch.float64 else torch.float32).eps
        if k == 1:
            return _norm_call(input, weight, bias, eps, kind, residual, prenorm, None)
        out = _norm_call(
            input.flatten(-k), weight.reshape(-1), bias.reshape(-1) if bias is not None else None,
            eps, kind, residual.flatten(-k) if residual is not None else None, prenorm, None,
        )  # fmt: skip
        if prenorm:
            return tuple(t.unflatten(-1, shape) for t in out)
        return out.unflatten(-1, shape)


def _add_norm(norm, x, residual):
    """``(norm(residual + x), residual + x)``, in one kernel where that computes the same."""
    if torch.promote_types(x.dtype, residual.dtype) != residual.dtype:
        # The unpatched sum would be wider than the stream (e.g. an fp32 branch on a bf16
        # stream), while the kernel stores it in residual.dtype: keep the unfused add.
        s = residual + x
        return norm(s), s
    return norm(x, residual=residual, prenorm=True)


class _FusedLlamaLayer:
    """Mixin for Llama-shaped decoder layers (``_LLAMA_LAYER``)."""

    _fused_norm_original: type
    _fused_norm_arg_names: tuple

    def forward(self, hidden_states, *args, **kwargs):
        kwargs.update(zip(self._fused_norm_arg_names, args))
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        # residual + attention, and the norm of that sum, in one kernel.
        hidden_states, residual = _add_norm(self.post_attention_layernorm, hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class _FusedSandwichLayer(_FusedLlamaLayer):
    """Mixin for Gemma 2/3 decoder layers (``_SANDWICH_LAYER``: norms before and after each
    branch)."""

    def forward(self, hidden_states, *args, **kwargs):
        kwargs.update(zip(self._fused_norm_arg_names, args))
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = self.post_attention_layernorm(hidden_states)
        # residual + normed attention, and the pre-MLP norm of that sum, in one kernel.
        hidden_states, residual = _add_norm(self.pre_feedforward_layernorm, hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return residual + hidden_states


_LAYER_MIXINS = {_LLAMA_LAYER: _FusedLlamaLayer, _SANDWICH_LAYER: _FusedSandwichLayer}


@functools.cache
def _fused_class(cls, mixin, kind=None):
    """``Fused<cls>``: the subclass of ``cls`` whose forward is ``mixin``'s (made once)."""
    attrs = {"_fused_norm_original": cls, "__module__": __name__}
    if kind is not None:
        attrs["_fused_norm_kind"] = kind
    if issubclass(mixin, _FusedLlamaLayer):
        # Positional arguments after the input, by the original forward's parameter names.
        params = list(inspect.signature(cls.forward).parameters.values())[2:]
        attrs["_fused_norm_arg_names"] = tuple(
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
    return type(f"Fused{cls.__name__}", (mixin, cls), attrs)


def _is_fused(cls) -> bool:
    return "_fused_norm_original" in cls.__dict__


# ----------------------------------------------------------------------------------------------
# The public functions
# ----------------------------------------------------------------------------------------------


def _why_not(module, kind: _Norm) -> Optional[str]:
    """Why a module of a known class cannot be swapped, or None."""
    if "forward" in vars(module):
        # accelerate's hooks and kernels' kernelize() set an instance-level forward that holds
        # the original one: a class swap would not take effect.
        return "its forward is overridden on the instance"
    if kind.torch_nn:
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return "its weight is not a 1-D tensor"
    eps = getattr(module, kind.eps_attr, None)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps):
        return f"its {kind.eps_attr} is not a number"
    return None


def _looks_like_norm(module) -> bool:
    """A norm by name that owns parameters or buffers (not a wrapper like ``ConvNormLayer``)."""
    cls = type(module)
    if "Norm" not in cls.__name__ or cls.__module__.startswith("fused_norm."):
        return False
    return bool(module._parameters) or any(b is not None for b in module._buffers.values())


def replace_norms(model: nn.Module, fuse_residual: bool = False) -> list:
    """Swap, in place, every norm module of ``model`` that fused_norm knows for a fused one.

    Known: ``torch.nn.LayerNorm``, ``torch.nn.RMSNorm`` and the transformers norms whose code
    matches Llama's, Gemma's (``1 + weight``) or OLMo-2's RMSNorm (Llama, Mistral, Qwen2/3
    including Qwen3's per-head q/k norms, Gemma 1/2/3, Phi-3, OLMo-2, GPT-2's LayerNorms, ...).
    Each module keeps its class's behaviour, its own eps, and its parameters (the same objects:
    ``state_dict`` keys, dtype, device and ``requires_grad`` unchanged). Call it before
    ``torch.compile``, ``fully_shard`` or ``parallelize_module``.

    Args:
        model: any ``nn.Module``; modified in place.
        fuse_residual: also fuse each Llama- or Gemma-2-shaped decoder layer's residual add
            after attention into the norm that follows it (``prenorm``), with the same outputs.

    Returns:
        The qualified names (as in ``named_modules``) of the norms replaced, then of the decoder
        layers fused by this call; ``[]`` when there was nothing left to do.

    Warns:
        ``UserWarning`` once, naming the norm-like modules (class name containing "Norm") that
        were left alone: classes it does not know, or known ones it cannot swap.
    """
    replaced, skipped = [], {}
    for name, module in model.named_modules():
        cls = type(module)
        if _is_fused(cls):
            continue
        kind = _norm_kind(cls)
        reason = _why_not(module, kind) if kind is not None else None
        if kind is None or reason is not None:
            if kind is not None or _looks_like_norm(module):
                key = (cls.__name__, reason or "a class it does not know")
                skipped.setdefault(key, []).append(name or "<model>")
            continue
        mixin = _FusedTorchNorm if kind.torch_nn else _FusedNorm
        module.__class__ = _fused_class(cls, mixin, kind)
        replaced.append(name)
    if fuse_residual:
        replaced += _fuse_layers(model)
    if skipped:
        lines = [
            f"{cls_name} ({why}): {', '.join(names[:3])}" + (", ..." if len(names) > 3 else "")
            for (cls_name, why), names in skipped.items()
        ]
        warnings.warn(
            "fused_norm.replace_norms left these norm modules alone:\n  " + "\n  ".join(lines),
            UserWarning,
            stacklevel=2,
        )
    return replaced


def _fuse_layers(model: nn.Module) -> list:
    fused, seen_fused, candidates = [], False, set()
    for name, module in model.named_modules():
        cls = type(module)
        if _is_fused(cls):
            seen_fused = seen_fused or issubclass(cls, _FusedLlamaLayer)
            continue
        if not hasattr(module, "self_attn"):
            continue
        candidates.add(cls.__name__)
        template = _layer_kind(cls)
        if template is None or "forward" in vars(module):
            continue
        _, needs = _LAYER_TEMPLATES[template]
        if not all(_is_fused(type(getattr(module, n))) for n in needs):
            continue  # that norm was left alone (and named in the warning)
        module.__class__ = _fused_class(cls, _LAYER_MIXINS[template])
        fused.append(name)
    if not fused and not seen_fused:
        warnings.warn(
            "fused_norm.replace_norms(fuse_residual=True) found no decoder layer of a shape it "
            f"knows (Llama's or Gemma 2's); layers seen: {sorted(candidates) or 'none'}",
            UserWarning,
            stacklevel=3,
        )
    return fused


def restore_norms(model: nn.Module) -> list:
    """Undo :func:`replace_norms`: every fused module gets its original class back (its
    parameters were never changed), decoder layers included.

    Args:
        model: a model patched by :func:`replace_norms` (anything else is left as it is).

    Returns:
        The qualified names of the modules restored, in ``named_modules`` order.

    Warns:
        ``UserWarning`` naming fused modules whose class was wrapped again after patching (e.g.
        by FSDP2's ``fully_shard``): those are left as they are.
    """
    restored, wrapped = [], []
    for name, module in model.named_modules():
        cls = type(module)
        if _is_fused(cls):
            module.__class__ = cls._fused_norm_original
            restored.append(name)
        elif any(_is_fused(base) for base in cls.__mro__[1:]):
            wrapped.append(name or "<model>")
    if wrapped:
        warnings.warn(
            "fused_norm.restore_norms cannot restore modules whose class was wrapped after "
            f"replace_norms (restore before wrapping): {', '.join(wrapped[:5])}",
            UserWarning,
            stacklevel=2,
        )
    return restored
