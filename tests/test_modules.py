"""The nn.Module wrappers: initialisation, reset_parameters, extra_repr, train/eval dropout,
state_dict round trips, .to(dtype), and prenorm chains of several blocks against a reference
chain (outputs and parameter gradients under the three-way tolerance rule)."""

from __future__ import annotations

import pytest
import torch
from _helpers import DEVICE, INTERPRETED, assert_three_way
from torch import nn

from fused_norm import (
    DropoutAddLayerNorm,
    DropoutAddRMSNorm,
    LayerNorm,
    RMSNorm,
    layer_norm_ref,
    rms_norm_ref,
)

H = 48  # hidden size

# (class, has bias, reference, constructor kwargs for dropout p)
MODULES = {
    "LayerNorm": (LayerNorm, True, layer_norm_ref, "dropout_p"),
    "RMSNorm": (RMSNorm, False, rms_norm_ref, "dropout_p"),
    "DropoutAddLayerNorm": (DropoutAddLayerNorm, True, layer_norm_ref, "p"),
    "DropoutAddRMSNorm": (DropoutAddRMSNorm, False, rms_norm_ref, "p"),
}


@pytest.fixture(params=list(MODULES))
def kind(request):
    return request.param


def _make(kind, p=0.0, residual_in_fp32=False, **kw):
    """A module of ``kind``; the DropoutAdd* ones in prenorm mode (their forward's only way)."""
    cls, _, _, p_name = MODULES[kind]
    if kind.startswith("DropoutAdd"):
        kw.update(prenorm=True, residual_in_fp32=residual_in_fp32)
    return cls(H, **{p_name: p}, **kw)


def _forward(kind, module, x, residual=None, residual_in_fp32=False):
    """(y, residual_out) from any of the four modules in prenorm mode."""
    if kind.startswith("DropoutAdd"):
        assert module.prenorm and module.residual_in_fp32 == residual_in_fp32
        return module(x, residual)
    return module(x, residual, prenorm=True, residual_in_fp32=residual_in_fp32)


def _randomise(module, gen):
    with torch.no_grad():
        for prm in module.parameters():
            prm.copy_(
                torch.randn(prm.shape, generator=gen) * 0.2 + (1.0 if prm is module.weight else 0.0)
            )


def test_init_like_torch_nn(kind):
    cls, has_bias, _, _ = MODULES[kind]
    m = cls(H, device=DEVICE, dtype=torch.bfloat16)
    assert isinstance(m.weight, nn.Parameter) and m.weight.shape == (H,)
    assert m.weight.dtype == torch.bfloat16 and m.weight.device.type == torch.device(DEVICE).type
    assert bool((m.weight == 1).all())
    if has_bias:
        assert isinstance(m.bias, nn.Parameter) and bool((m.bias == 0).all())
    else:
        assert m.bias is None
    assert sorted(m.state_dict()) == (["bias", "weight"] if has_bias else ["weight"])


def test_init_variants():
    assert bool((LayerNorm(H, zero_centered_weight=True).weight == 0).all())
    assert bool((RMSNorm(H, zero_centered_weight=True).weight == 0).all())
    assert LayerNorm(H, bias=False).bias is None
    assert LayerNorm(H).eps == 1e-5 and RMSNorm(H, eps=1e-6).eps == 1e-6
    m = DropoutAddLayerNorm(H, prenorm=True, p=0.1, eps=1e-6, residual_in_fp32=True)
    assert (m.prenorm, m.p, m.eps, m.residual_in_fp32) == (True, 0.1, 1e-6, True)


def test_reset_parameters(kind):
    m = _make(kind)
    with torch.no_grad():
        for prm in m.parameters():
            prm.fill_(3.0)
    m.reset_parameters()
    assert bool((m.weight == 1).all())
    if m.bias is not None:
        assert bool((m.bias == 0).all())
    z = LayerNorm(H, zero_centered_weight=True)
    with torch.no_grad():
        z.weight.fill_(3.0)
    z.reset_parameters()
    assert bool((z.weight == 0).all())


def test_extra_repr(kind):
    text = repr(_make(kind, p=0.25, eps=1e-6))
    assert str(H) in text and "1e-06" in text and "0.25" in text, text


def test_train_eval_dropout(kind, device):
    """Eval: no dropout, the reference's result. Train with p > 0: a different result;
    train with p = 0: the eval result."""
    _, _, ref, _ = MODULES[kind]
    gen = torch.Generator().manual_seed(0)
    m = _make(kind, p=0.5).to(device)
    _randomise(m, gen)
    x = torch.randn(4, 5, H, generator=gen).to(device)
    residual = torch.randn(4, 5, H, generator=gen).to(device)

    m.eval()
    y_eval, _ = _forward(kind, m, x, residual)
    expected = ref(x.double(), m.weight.double(), None if m.bias is None else m.bias.double(),
                   residual=residual.double(), eps=m.eps)  # fmt: skip
    torch.testing.assert_close(y_eval.double(), expected, rtol=1e-5, atol=1e-5)

    m.train()
    y_train, _ = _forward(kind, m, x, residual)
    assert not torch.allclose(y_train, y_eval), "training with p = 0.5 did not drop anything"

    m0 = _make(kind, p=0.0).to(device)
    m0.load_state_dict(m.state_dict())
    y0, _ = _forward(kind, m0.train(), x, residual)
    assert torch.equal(y0, y_eval)


def test_state_dict_round_trip(kind, device):
    gen = torch.Generator().manual_seed(1)
    a = _make(kind).to(device)
    _randomise(a, gen)
    b = _make(kind).to(device)
    b.load_state_dict(a.state_dict())
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    x = torch.randn(3, H, generator=gen).to(device)
    for u, v in zip(_forward(kind, a.eval(), x), _forward(kind, b.eval(), x)):
        assert torch.equal(u, v)


def test_to_dtype(kind, device):
    """.to(bf16) converts the parameters; the module then runs on bf16 inputs."""
    _, _, ref, _ = MODULES[kind]
    m = _make(kind, residual_in_fp32=True).to(device=device, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    x = torch.randn(3, 7, H, device=device, dtype=torch.bfloat16)
    y, res = _forward(kind, m.eval(), x, residual_in_fp32=True)
    assert y.dtype == torch.bfloat16 and res.dtype == torch.float32
    expected = ref(x.double(), m.weight.double(), None, eps=m.eps)
    torch.testing.assert_close(y.double(), expected, rtol=2**-6, atol=2**-6)


# ----------------------------------------------------------------------------------------------
# A prenorm chain: hidden, residual = norm(hidden, residual); hidden = linear(hidden)
# ----------------------------------------------------------------------------------------------


def _chain(norm_fns, linears, x0):
    """hidden, residual = norm_i(hidden, residual); hidden = hidden @ linear_i.T, for each i."""
    hidden, residual = x0, None
    for norm_fn, lin in zip(norm_fns, linears):
        hidden, residual = norm_fn(hidden, residual)
        hidden = hidden @ lin.t()
    return hidden, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_prenorm_chain(kind, dtype, backend, device, monkeypatch):
    """Four blocks of modules in prenorm mode (residual stream in fp32) against the same
    chain through the reference: final hidden state, stream, and every gradient (modules'
    weights and biases, the linear weights, the input) under the three-way rule."""
    monkeypatch.setenv("FUSED_NORM_BACKEND", backend)
    _, _, ref, _ = MODULES[kind]
    gen = torch.Generator().manual_seed(2)
    n_blocks = 4
    norms = [_make(kind, residual_in_fp32=True) for _ in range(n_blocks)]
    for m in norms:
        _randomise(m, gen)
        m.to(device=device, dtype=dtype).eval()
    linears = [(torch.randn(H, H, generator=gen) / H**0.5).to(device, dtype).requires_grad_()
               for _ in range(n_blocks)]  # fmt: skip
    x0 = torch.randn(3, 5, H, generator=gen).to(device, dtype).requires_grad_()
    g_hidden = torch.randn(3, 5, H, generator=gen).to(device, dtype)
    g_res = torch.randn(3, 5, H, generator=gen).to(device, dtype)
    norm_params = [list(m.parameters()) for m in norms]

    def run(norm_fns, params, lins, x):
        hidden, residual = _chain(norm_fns, lins, x)
        leaves = [x, *lins, *(p for ps in params for p in ps)]
        ups = [g_hidden.to(hidden.dtype), g_res.to(residual.dtype)]
        return [hidden, residual, *torch.autograd.grad([hidden, residual], leaves, ups)]

    module_fns = [lambda h, r, m=m: _forward(kind, m, h, r, residual_in_fp32=True)
                  for m in norms]  # fmt: skip
    got = run(module_fns, norm_params, linears, x0)

    def reference(cast):
        params = [[cast(p) for p in ps] for ps in norm_params]
        fns = [lambda h, r, ps=ps: ref(h, ps[0], ps[1] if len(ps) > 1 else None, residual=r,
                                       eps=1e-5, prenorm=True)
               for ps in params]  # fmt: skip
        return run(fns, params, [cast(w) for w in linears], cast(x0))

    truth = reference(lambda t: t.detach().double().requires_grad_())
    base = reference(lambda t: t.detach().clone().requires_grad_())
    factor = 4.0 if INTERPRETED and backend == "auto" and dtype == torch.bfloat16 else 2.0
    names = ["hidden", "residual", "grad x0"] + [f"grad linear{i}" for i in range(n_blocks)]
    names += [f"grad norm{i}.{n}" for i, m in enumerate(norms) for n, _ in m.named_parameters()]
    assert len(names) == len(got) == len(truth)
    for name, k, t, b in zip(names, got, truth, base):
        assert_three_way(name, k, t, b, factor)
    assert got[1].dtype == torch.float32, "residual_in_fp32: the stream stays fp32"


def test_prenorm_chain_in_training(kind, device):
    """With dropout in training mode the chain runs, and differs from eval mode."""
    norms = [_make(kind, p=0.2).to(device) for _ in range(3)]
    x0 = torch.randn(4, H, device=device, requires_grad=True)
    eye = torch.eye(H, device=device)
    fns = [lambda h, r, m=m: _forward(kind, m, h, r) for m in norms]

    h_train, _ = _chain(fns, [eye] * 3, x0)
    h_train.sum().backward()
    assert x0.grad is not None and bool(torch.isfinite(x0.grad).all())
    for m in norms:
        m.eval()
    h_eval, _ = _chain(fns, [eye] * 3, x0)
    assert not torch.allclose(h_train, h_eval)


# ----------------------------------------------------------------------------------------------
# Constructor arguments and input widths are checked as torch.nn checks them
# ----------------------------------------------------------------------------------------------

# (argument, bad value, exception): hidden_size, eps and the dropout probability (named p or
# dropout_p after the module's own parameter).
BAD_ARGUMENTS = [
    ("hidden_size", 0, ValueError),
    ("hidden_size", -3, ValueError),
    ("hidden_size", 4.0, TypeError),
    ("hidden_size", "48", TypeError),
    ("hidden_size", None, TypeError),
    ("hidden_size", True, TypeError),
    ("eps", -1e-5, ValueError),
    ("eps", float("nan"), ValueError),
    ("eps", float("inf"), ValueError),
    ("eps", "1e-5", TypeError),
    ("eps", None, TypeError),
    ("p", -0.1, ValueError),
    ("p", 1.0, ValueError),
    ("p", 1.5, ValueError),
    ("p", float("nan"), ValueError),
    ("p", "0.1", TypeError),
    ("p", None, TypeError),
]


@pytest.mark.parametrize("arg, value, exc", BAD_ARGUMENTS,
                         ids=[f"{a}={v!r}" for a, v, _ in BAD_ARGUMENTS])  # fmt: skip
def test_constructor_refuses_bad_arguments(kind, arg, value, exc):
    """A bad hidden size, eps or dropout probability raises at construction, a TypeError for
    the wrong type and a ValueError for a value out of range, naming the argument (the
    dropout probability by the module's own name for it: ``p`` or ``dropout_p``)."""
    cls, _, _, p_name = MODULES[kind]
    name = p_name if arg == "p" else arg
    kwargs = {"hidden_size": H, name: value}
    with pytest.raises(exc) as info:
        cls(**kwargs)
    assert name in str(info.value), f"the {exc.__name__} does not name {name!r}: {info.value}"


@pytest.mark.parametrize("value", [0.0, 0.5, 0.999])
def test_constructor_accepts_valid_probabilities(kind, value):
    cls, _, _, p_name = MODULES[kind]
    m = cls(H, **{p_name: value}, eps=0.0)
    assert getattr(m, p_name) == value and m.eps == 0.0


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("shape", [(3, H + 1), (2, 5, H // 2), (4, 1)],
                         ids=["wider", "narrower-3d", "one-column"])  # fmt: skip
def test_wrong_input_width_names_the_hidden_size(kind, shape, backend, device, monkeypatch):
    """An input whose last dimension is not the module's hidden size raises a ValueError that
    gives the module's hidden size and the input's shape, not a weight the caller never passed;
    a non-tensor input is a TypeError."""
    monkeypatch.setenv("FUSED_NORM_BACKEND", backend)
    m = _make(kind).to(device)
    x = torch.randn(*shape, device=device)
    with pytest.raises(ValueError) as info:
        _forward(kind, m, x)
    text = str(info.value)
    assert str(H) in text and str(tuple(shape)) in text, text
    assert "weight" not in text, f"the message speaks of the weight: {text}"
    with pytest.raises(TypeError):
        _forward(kind, m, [[1.0] * H])
    # and a good call still works after them
    y, _ = _forward(kind, m, torch.randn(2, H, device=device))
    assert y.shape == (2, H)


def test_zero_dim_input_is_a_value_error(kind, device):
    """A 0-d input has no hidden dimension: a ValueError naming the module's hidden size."""
    m = _make(kind).to(device)
    with pytest.raises(ValueError, match=str(H)):
        _forward(kind, m, torch.tensor(1.0, device=device))
