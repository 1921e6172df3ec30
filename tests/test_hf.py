"""The Hugging Face drop-in (fused_norm/hf.py): replace_norms / restore_norms on tiny random
transformers models built from their own config classes (no downloads).

What is compared. For each model family, the same model three times: the unpatched model in
the working dtype (``base``), the patched one (``got``), and the unpatched model in fp64
(``truth``; where transformers' code casts to fp32 inside a norm, it does so here too). Logits,
loss and every parameter gradient (by name) must satisfy the three-way rule of STYLE.md:

    max|got - truth| <= 2 * max|base - truth| + atol,   atol = 4 * eps(dtype) * max(1, max|truth|)

The patched model computes the same function with different rounding (the kernels round once
where Llama's norm rounds twice, see hf.py), so it must be about as close to exact arithmetic
as the original; the factor 2 leaves room for two equally good roundings that differ, and
atol for values where the original happens to be exact. A wrong eps, a missed ``1 + weight``, a
dropped residual gradient or a lost parameter gradient is orders of magnitude over the bound
(the embeddings' std of 0.02 keeps the mean square of the residual stream near 1e-3, where an
eps of 1e-5 instead of 1e-6 changes the output by about 1%; norm weights are randomised).

CPU: the pure-PyTorch backend for every family, and the Triton kernels in the interpreter for
two (slow: one decoder shape each, 8 tokens). GPU (``gpu`` marker): the kernels in fp32 and bf16,
eager and torch.compile, with gradient checkpointing, fuse_residual on and off.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from _helpers import perturb_params
from torch import nn

transformers = pytest.importorskip(
    "transformers", reason="the HF drop-in tests need transformers (pip install fused_norm[hf])"
)

from fused_norm.hf import replace_norms, restore_norms  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# conftest sets TRITON_INTERPRET=1 before fused_norm is imported where there is no GPU.
INTERPRETED = not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1"
VOCAB = 128

_LLAMA_LIKE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
# Mixture of experts, through transformers' eager experts loop (grouped_mm has no fp64).
_MIXTRAL = {"num_local_experts": 4, "experts_implementation": "eager"}
# family -> (config class, model class, config overrides, decoder shape fuse_residual fuses)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, True),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}, True),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}, True),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}, True),
    # Not named anywhere in hf.py: recognised by its code (Llama's norm and layer shape).
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", _MIXTRAL, True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, False),  # residual dropout: not fused
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, False),  # norms after each branch
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", None, False),
}
_GPT2 = dict(
    n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, layer_norm_epsilon=1e-4,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def build(family: str, dtype=torch.float32, device="cpu", seed=0, **overrides) -> nn.Module:
    """A tiny random ``family`` model with randomised norm weights, in train mode."""
    cfg_name, model_name, extra, _ = FAMILIES[family]
    kwargs = dict(_GPT2) if extra is None else {**_LLAMA_LIKE, **extra}
    kwargs.update(overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    config._attn_implementation = "eager"  # same attention code on every device and dtype
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    perturb_params(model, ("norm", ".ln_"))
    return model.to(device=device, dtype=dtype).train()


def batch(device="cpu", b=2, t=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, t), generator=g).to(device)
    return ids


def run(model, ids, params_of=None):
    """Logits, loss and {name: grad} of one forward/backward with labels = ids (grads named as
    in ``params_of``, default ``model``: pass the module a torch.compile wrapper wraps)."""
    params_of = model if params_of is None else params_of
    params_of.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in params_of.named_parameters() if p.requires_grad}
    return out, grads


def checkpointing_on(model):
    """``gradient_checkpointing_enable()``: in transformers 5.17 and 5.24 (where it is a
    deprecated alias of ``activation_checkpointing_enable``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()


def assert_three_way(name, got, truth, base, atol_ulps=4.0):
    """``max|got - truth| <= 2 * max|base - truth| + atol`` (module docstring); the message
    gives the worst element."""
    assert got is not None, f"{name}: no value"
    assert got.shape == truth.shape, f"{name}: shape {tuple(got.shape)} != {tuple(truth.shape)}"
    g, t, b = (v.detach().to("cpu", torch.float64) for v in (got, truth, base))
    diff = (g - t).abs()
    err, err_base = diff.max().item(), (b - t).abs().max().item()
    atol = atol_ulps * torch.finfo(got.dtype).eps * max(1.0, t.abs().max().item())
    bound = 2.0 * err_base + atol
    if not err <= bound:  # written so that NaN fails
        i = tuple(torch.unravel_index(torch.nan_to_num(diff, nan=float("inf")).argmax(), g.shape))
        raise AssertionError(
            f"{name}: max|got - truth| = {err:.3g} > bound {bound:.3g} (2 * base error "
            f"{err_base:.3g} + atol {atol:.3g}); worst at {tuple(int(j) for j in i)}: "
            f"got {g[i].item():.6g}, truth {t[i].item():.6g}, base {b[i].item():.6g}"
        )


def compare(family, fuse_residual, dtype=torch.float32, device="cpu", ids=None, compile=False,
            checkpointing=False):  # fmt: skip
    """Patch a copy of a tiny ``family`` model and hold its logits, loss and gradients to the
    three-way rule against the unpatched model (fp64 copy as the truth); returns the names
    replace_norms gave."""
    base = build(family, dtype, device)
    truth = copy.deepcopy(base).double()
    got = copy.deepcopy(base)
    names = replace_norms(got, fuse_residual=fuse_residual)
    if checkpointing:
        checkpointing_on(base)
        checkpointing_on(got)
    ids = batch(device) if ids is None else ids
    runner = torch.compile(got) if compile else got
    out_t, g_t = run(truth, ids)
    out_b, g_b = run(base, ids)
    out_g, g_g = run(runner, ids, params_of=got)
    assert_three_way(f"{family} logits", out_g.logits, out_t.logits, out_b.logits)
    assert_three_way(f"{family} loss", out_g.loss, out_t.loss, out_b.loss)
    assert g_g.keys() == g_b.keys()
    for name in g_b:
        assert_three_way(f"{family} grad {name}", g_g[name], g_t[name], g_b[name])
    return names, got


def _is_fused(module) -> bool:
    return "_fused_norm_original" in type(module).__dict__


def _norm_modules(model):
    """Names of the fused norms (fused decoder layers have no ``_fused_norm_kind``)."""
    return [n for n, m in model.named_modules() if hasattr(type(m), "_fused_norm_kind")]


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("FUSED_NORM_BACKEND", "torch")


# ----------------------------------------------------------------------------------------------
# CPU: the pure-PyTorch backend
# ----------------------------------------------------------------------------------------------


# Mixtral (slow: fp64 experts loop) only with fuse_residual, which replaces its norms too.
CPU_CASES = [
    (f, fuse) for f in FAMILIES for fuse in (False, True) if (f, fuse) != ("mixtral", False)
]


@pytest.mark.parametrize(
    "family, fuse_residual",
    CPU_CASES,
    ids=[f"{f}-{'fused_residual' if r else 'norms'}" for f, r in CPU_CASES],
)
def test_matches_unpatched(family, fuse_residual, torch_backend):
    fusable = FAMILIES[family][3]
    if fuse_residual and not fusable:
        with pytest.warns(UserWarning, match="no decoder layer of a shape it knows"):
            names, got = compare(family, fuse_residual)
    else:
        names, got = compare(family, fuse_residual)
    layers = [n for n in names if n.endswith(tuple(f"layers.{i}" for i in range(2)))]
    assert len(layers) == (2 if fuse_residual and fusable else 0), names
    # Every norm of the model was swapped: none of transformers' norm classes remains.
    left = [n for n, m in got.named_modules() if "Norm" in type(m).__name__ and not _is_fused(m)]
    assert not left, left
    assert set(_norm_modules(got)) == set(names) - set(layers)


def test_qwen3_per_head_norms(torch_backend):
    model = build("qwen3")
    names = replace_norms(model)
    for i in range(2):
        assert {f"model.layers.{i}.self_attn.q_norm", f"model.layers.{i}.self_attn.k_norm"} <= set(
            names
        )
    # On a (batch, seq, heads, head_dim) tensor, as the attention calls it.
    q_norm = model.model.layers[0].self_attn.q_norm
    x = torch.randn(2, 5, 4, 16, dtype=torch.float64, requires_grad=True)
    y = q_norm(x)
    restore_norms(model)
    y_ref = q_norm(x)
    torch.testing.assert_close(y, y_ref)


def test_parameters_kept(torch_backend):
    model = build("gemma2").to(torch.bfloat16)
    model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    before = {n: p for n, p in model.named_parameters()}
    flags = {n: (p.dtype, p.device, p.requires_grad) for n, p in before.items()}
    keys = list(model.state_dict())
    names = replace_norms(model, fuse_residual=True)
    assert names and replace_norms(model, fuse_residual=True) == []  # idempotent
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert {n: (p.dtype, p.device, p.requires_grad) for n, p in after.items()} == flags
    assert list(model.state_dict()) == keys


def test_second_call_adds_fusion_only(torch_backend):
    model = build("llama")
    norms = replace_norms(model)
    assert len(norms) == 5 and replace_norms(model) == []
    assert replace_norms(model, fuse_residual=True) == ["model.layers.0", "model.layers.1"]
    assert replace_norms(model, fuse_residual=True) == []


def test_restore_round_trip(torch_backend):
    model = build("qwen3")
    classes = {n: type(m) for n, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = batch()
    out0, grads0 = run(model, ids)
    names = replace_norms(model, fuse_residual=True)
    run(model, ids)  # a patched step in between changes nothing that restore must undo
    restored = restore_norms(model)
    assert sorted(restored) == sorted(names) and restore_norms(model) == []
    assert {n: type(m) for n, m in model.named_modules()} == classes
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    out1, grads1 = run(model, ids)
    assert torch.equal(out1.logits, out0.logits) and torch.equal(out1.loss, out0.loss)
    assert all(torch.equal(grads1[n], grads0[n]) for n in grads0)


def test_unknown_norm_warns_once(torch_backend):
    class MyFancyNorm(nn.Module):  # norm-like, with a weight: named, left alone
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.weight

    class ChannelsFirstLayerNorm(nn.LayerNorm):  # a known base with its own forward
        def forward(self, x):
            return super().forward(x.transpose(1, -1)).transpose(1, -1)

    class ConvNormLayer(nn.Module):  # a wrapper named "Norm" with no parameters of its own
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

    model = nn.Sequential(MyFancyNorm(), ChannelsFirstLayerNorm(8), ConvNormLayer(), nn.RMSNorm(8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = replace_norms(model)
    assert names == ["2.norm", "3"]
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "MyFancyNorm" in message and "ChannelsFirstLayerNorm" in message
    assert "ConvNormLayer" not in message
    assert type(model[0]) is MyFancyNorm and type(model[1]) is ChannelsFirstLayerNorm


def test_instance_forward_left_alone(torch_backend):
    """accelerate's hooks replace ``module.forward`` on the instance: a class swap would not
    take effect, so such modules are named in the warning instead."""
    model = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))
    original = model[1].forward
    model[1].forward = lambda x: original(x)
    with pytest.warns(UserWarning, match="overridden on the instance"):
        assert replace_norms(model) == ["0"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LayerNorm(12, eps=1e-3),
        lambda: nn.LayerNorm(12, bias=False),
        lambda: nn.LayerNorm(12, elementwise_affine=False),
        lambda: nn.LayerNorm((3, 4)),
        lambda: nn.RMSNorm(12),  # eps=None: fp32's eps, as torch uses
        lambda: nn.RMSNorm((3, 4), eps=1e-4),
    ],
    ids=["ln_eps", "ln_nobias", "ln_noaffine", "ln_2d", "rms_eps_none", "rms_2d"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_torch_nn_norms(make, dtype, torch_backend):
    """torch.nn norms against torch's own, on a small input scale where eps matters (a wrong
    default eps shows). fp32 and bf16 by the three-way rule against the fp64 module (the input
    gradient cancels: a bf16 element can be 15% off in both); fp64 against torch's fp64."""
    torch.manual_seed(0)
    ref = make().to(dtype)
    perturb_params(ref)
    got = copy.deepcopy(ref)
    assert len(replace_norms(got)) == 1
    truth = copy.deepcopy(ref).double()
    shape = (5, 12) if len(ref.normalized_shape) == 1 else (5, 3, 4)
    x = (1e-3 * torch.randn(shape, dtype=dtype)).requires_grad_()
    gy = torch.randn(shape, dtype=dtype)
    outs = {}
    for name, module, inp in (("base", ref, x), ("got", got, x), ("truth", truth, x.double())):
        y = module(inp)
        (dx,) = torch.autograd.grad(y, inp, gy.to(y.dtype))
        outs[name] = (y, dx)
    for i, what in enumerate(("y", "dx")):
        if dtype == torch.float64:
            torch.testing.assert_close(outs["got"][i], outs["base"][i], rtol=1e-10, atol=1e-10)
        else:
            assert_three_way(what, outs["got"][i], outs["truth"][i], outs["base"][i])


@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2"])
def test_output_dtype_follows_original(family, torch_backend):
    """Llama returns promote_types(weight, x) (fp32 for an fp32 weight and bf16 input, as under
    autocast's fp32 parameters); Gemma and OLMo-2 return x's dtype."""
    model = build(family)  # fp32 weights
    norm = model.model.layers[0].post_attention_layernorm
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = norm(x)
    replace_norms(model)
    y = norm(x)
    assert y.dtype == want.dtype
    # The kernel rounds once; Llama's original rounds xhat to bf16 first: one bf16 ulp apart.
    torch.testing.assert_close(y.float(), want.float(), rtol=2**-7, atol=1e-6)


def test_output_hidden_states_and_checkpointing(torch_backend):
    """fuse_residual keeps every decoder layer's output (what output_hidden_states records),
    and gradient checkpointing still recomputes the fused layers in backward."""
    base = build("llama")
    got = copy.deepcopy(base)
    replace_norms(got, fuse_residual=True)
    ids = batch()
    ref = base(input_ids=ids, output_hidden_states=True).hidden_states
    out = got(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(out) == len(ref) == 3
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    calls = []
    layer = got.model.layers[0]
    layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
    checkpointing_on(got)
    checkpointing_on(base)
    out_g, grads_g = run(got, ids)
    assert len(calls) == 2, "the fused layer was not recomputed: checkpointing was bypassed"
    out_b, grads_b = run(base, ids)
    torch.testing.assert_close(out_g.loss, out_b.loss, rtol=1e-5, atol=1e-6)
    for n in grads_b:
        torch.testing.assert_close(grads_g[n], grads_b[n], rtol=1e-4, atol=1e-6, msg=n)


def test_compile_fullgraph(torch_backend):
    """No graph break from the patch layer: the whole patched model in one graph
    (aot_eager: dynamo and autograd tracing without the C++ compile)."""
    base = build("qwen3")
    got = copy.deepcopy(base)
    replace_norms(got, fuse_residual=True)
    compiled = torch.compile(got, fullgraph=True, backend="aot_eager")
    ids = batch()
    out_b, grads_b = run(base, ids)
    out_c, grads_c = run(compiled, ids, params_of=got)
    torch.testing.assert_close(out_c.logits, out_b.logits, rtol=1e-5, atol=1e-6)
    for n in grads_b:
        torch.testing.assert_close(grads_c[n], grads_b[n], rtol=1e-4, atol=1e-6, msg=n)


# ----------------------------------------------------------------------------------------------
# CPU: the Triton kernels in the interpreter
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="the GPU tests run the kernels")
@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 before fused_norm import")
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_interpreter_matches_unpatched(family, monkeypatch):
    """The kernels themselves (fp32; 8 tokens: the interpreter runs each program in Python):
    Llama's decoder shape, and Gemma 3's sandwich layers with zero-centred per-head norms."""
    monkeypatch.setenv("FUSED_NORM_BACKEND", "triton")
    names, _ = compare(family, fuse_residual=True, ids=batch(b=1, t=8))
    assert "model.layers.1" in names


# ----------------------------------------------------------------------------------------------
# GPU: the kernels
# ----------------------------------------------------------------------------------------------

GPU_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("fuse_residual", [False, True], ids=["norms", "fused_residual"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "gemma3", "olmo2", "gpt2"])
def test_gpu_matches_unpatched(family, dtype, fuse_residual, monkeypatch):
    monkeypatch.setenv("FUSED_NORM_BACKEND", "triton")
    if fuse_residual and not FAMILIES[family][3]:
        pytest.skip(f"{family} has no decoder shape that fuse_residual fuses")
    compare(family, fuse_residual, dtype=dtype, device="cuda", ids=batch("cuda", b=4, t=32))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "family, fuse_residual", [("llama", False), ("llama", True), ("gemma3", True)]
)
def test_gpu_compile(family, fuse_residual, monkeypatch):
    monkeypatch.setenv("FUSED_NORM_BACKEND", "triton")
    torch._dynamo.reset()
    compare(family, fuse_residual, dtype=torch.bfloat16, device="cuda",
            ids=batch("cuda", b=4, t=32), compile=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp32", "bf16"])
def test_gpu_gradient_checkpointing(dtype, monkeypatch):
    monkeypatch.setenv("FUSED_NORM_BACKEND", "triton")
    compare("qwen3", True, dtype=dtype, device="cuda", ids=batch("cuda", b=4, t=32),
            checkpointing=True)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The example
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_example_runs(tmp_path, torch_backend):
    """examples/hf_llama.py end to end (3 steps of the tiny preset, fp32 on CPU): every variant
    trains, and the patched ones follow the unpatched loss curve to fp32 rounding (two correct
    fp32 norms give per-step losses within 1.3e-5 of each other over 50 steps of the GPT
    example, tests/test_train_gpt.py; 1e-4 is the bound used there)."""
    pytest.importorskip("tqdm", reason="the example imports train_gpt, which needs tqdm")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import hf_llama

    out = tmp_path / "summary.json"
    summary = hf_llama.main(["--preset", "tiny", "--steps", "3", "--device", "cpu",
                             "--out", str(out)])  # fmt: skip
    assert out.exists()
    results = {r["variant"]: r for r in summary["results"]}
    assert set(results) == {"transformers", "fused", "fused_residual"}
    assert results["transformers"]["replaced"] == 0
    assert results["fused"]["replaced"] == 5 and results["fused_residual"]["replaced"] == 7
    for name in ("fused", "fused_residual"):
        assert len(results[name]["losses"]) == 3
        assert results[name]["max_abs_loss_diff"] <= 1e-4, results[name]
