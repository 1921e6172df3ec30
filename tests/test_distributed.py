"""DTensor inputs (fused_norm/distributed.py) and fused norms under tensor/sequence parallelism
and FSDP2.

One process (a world-1 gloo group on CPU): what :func:`dtensor_call` returns (DTensors with the
input's placements, the values of the plain call, ``Partial`` weight gradients for a sharded
input) and the shardings it refuses. Two processes (``_worker``; gloo on CPU with the PyTorch backend, NCCL on two GPUs with
the kernels): a transformers Llama with fused norms, ``fuse_residual=True`` and not, under

* tensor + sequence parallelism (torch's ``parallelize_module``: Colwise/Rowwise projections,
  ``SequenceParallel`` on every norm, the residual stream a sequence-sharded DTensor),
* FSDP2 (``fully_shard`` per decoder layer, data parallel over both ranks),
* both on a 2-D mesh (dp 1 x tp 2: FSDP2's path for DTensor parameters),

and, first, ``torch.nn.RMSNorm`` / ``LayerNorm`` under ``SequenceParallel`` must give the
gradients of torch's own DTensor norms, placements included (on a one-rank mesh torch 2.11
replicates everything, so that comparison needs two).

must match the same model on one device in loss and every parameter gradient (DTensor gradients
gathered with ``full_tensor()``). All runs are fp32 (TF32 off): the parallel runs differ from
the single one only in the order of fp32 sums (matmuls split over ranks, the reductions of the
collectives), a few ulps times sqrt(K) ~ 1e-6 relative here; the bound 1e-4 of each tensor's
largest value is 100x that, and 1e3x below what it catches (an unreduced Partial weight gradient
is off by the other rank's share, O(1); a wrong sharding fails on shapes).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist

if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402
from _helpers import perturb_params  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import (  # noqa: E402
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

import fused_norm  # noqa: E402
from fused_norm.distributed import dtensor_aware, dtensor_call  # noqa: E402

N = 16
REL_TOL = 1e-4  # of each tensor's largest value; derivation in the module docstring


def rms_norm_dt(*args, **kwargs):
    """The thin wrapper the lead's one-line hook stands for: rms_norm_fn through dtensor_call."""
    return dtensor_call(fused_norm.rms_norm_fn, *args, **kwargs)


def close(name, got, want, rel=REL_TOL):
    got = got.full_tensor() if isinstance(got, DTensor) else got
    want = want.full_tensor() if isinstance(want, DTensor) else want
    assert got is not None and got.shape == want.shape, f"{name}: {got} vs shape {want.shape}"
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= rel * max(scale, 1e-30), f"{name}: max error {err:.3g}, largest value {scale:.3g}"


@pytest.fixture(scope="module")
def mesh1(tmp_path_factory):
    """A world-1 gloo group and its 1-D CPU mesh (the default group is torn down after)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("FUSED_NORM_BACKEND", "torch")


# ----------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", [Shard(1), Shard(0), Replicate()], ids=str)
def test_dtensor_call_matches_plain_call(mesh1, placement, torch_backend):
    x, res, w = torch.randn(2, 6, N), torch.randn(2, 6, N), 1 + 0.1 * torch.randn(N)
    xd = distribute_tensor(x, mesh1, [placement]).requires_grad_()
    rd = distribute_tensor(res, mesh1, [placement]).requires_grad_()
    wd = distribute_tensor(w, mesh1, [Replicate()]).requires_grad_()
    y, s = rms_norm_dt(xd, wd, None, residual=rd, prenorm=True, eps=1e-5)
    for t in (y, s):
        assert isinstance(t, DTensor) and t.placements == (placement,) and t.shape == x.shape
    gy, gs = torch.randn_like(x), torch.randn_like(x)
    (y.to_local() * gy).sum().add((s.to_local() * gs).sum()).backward()

    xp, rp, wp = (t.clone().requires_grad_() for t in (x, res, w))
    y_ref, s_ref = fused_norm.rms_norm_fn(xp, wp, None, residual=rp, prenorm=True, eps=1e-5)
    ((y_ref * gy).sum() + (s_ref * gs).sum()).backward()
    close("y", y, y_ref)
    close("residual_out", s, s_ref)
    assert xd.grad.placements == (placement,) and rd.grad.placements == (placement,)
    close("dx", xd.grad, xp.grad)
    close("dresidual", rd.grad, rp.grad)
    # A sharded input's weight gradient is each rank's partial sum, as torch's own rms_norm.
    want = Partial() if placement.is_shard() else Replicate()
    assert wd.grad.placements == (want,)
    close("dweight", wd.grad.to_local(), wp.grad)


def test_refused_shardings(mesh1, torch_backend):
    x, w = torch.randn(2, 6, N), torch.randn(N)
    wd = distribute_tensor(w, mesh1, [Replicate()])
    xd = distribute_tensor(x, mesh1, [Shard(1)])
    with pytest.raises(
        ValueError, match=r"x is a DTensor sharded on its last .*(Shard\(dim=2\)|S\(2\))"
    ):
        rms_norm_dt(distribute_tensor(x, mesh1, [Shard(2)]), wd, None)
    with pytest.raises(ValueError, match=r"x is a DTensor with a Partial placement"):
        rms_norm_dt(DTensor.from_local(x, mesh1, [Partial()]), wd, None)
    with pytest.raises(ValueError, match=r"weight must be replicated .*(Shard\(dim=0\)|S\(0\))"):
        rms_norm_dt(xd, distribute_tensor(w, mesh1, [Shard(0)]), None)
    with pytest.raises(ValueError, match=r"weight is a plain tensor but x is a DTensor"):
        rms_norm_dt(xd, w, None)
    with pytest.raises(ValueError, match=r"x is a Tensor, but weight is a DTensor"):
        rms_norm_dt(x, wd, None)
    with pytest.raises(ValueError, match=r"residual is a DTensor with a Partial placement"):
        rms_norm_dt(xd, wd, None, residual=DTensor.from_local(x, mesh1, [Partial()]))
    with pytest.raises(ValueError, match=r"out= buffers are not supported"):
        rms_norm_dt(xd, wd, None, out=distribute_tensor(torch.empty_like(x), mesh1, [Shard(1)]))


def test_residual_redistributed_to_input_layout(mesh1, torch_backend):
    """A replicated residual beside a sequence-sharded input (a transformers layer's first
    residual under SequenceParallel) is laid out like the input."""
    x, res, w = torch.randn(2, 6, N), torch.randn(2, 6, N), torch.randn(N)
    y, s = rms_norm_dt(
        distribute_tensor(x, mesh1, [Shard(1)]), distribute_tensor(w, mesh1, [Replicate()]),
        None, residual=distribute_tensor(res, mesh1, [Replicate()]), prenorm=True,
    )  # fmt: skip
    assert y.placements == s.placements == (Shard(1),)
    close("residual_out", s, x + res)


def test_decorator_and_legacy_names(mesh1, torch_backend):
    fn = dtensor_aware(fused_norm.dropout_add_rms_norm)
    assert (
        fn.__name__ == "dropout_add_rms_norm" and fn.__wrapped__ is fused_norm.dropout_add_rms_norm
    )
    x0, res, w = torch.randn(2, 6, N), torch.randn(2, 6, N), torch.randn(N)
    plain = fn(x0, res, w, None, 0.0, 1e-5, prenorm=True)
    assert not any(isinstance(t, DTensor) for t in plain)
    dt = fn(
        distribute_tensor(x0, mesh1, [Shard(1)]), distribute_tensor(res, mesh1, [Shard(1)]),
        distribute_tensor(w, mesh1, [Replicate()]), None, 0.0, 1e-5, prenorm=True,
    )  # fmt: skip
    assert all(isinstance(t, DTensor) and t.placements == (Shard(1),) for t in dt)
    for a, b in zip(dt, plain):
        close("dropout_add_rms_norm", a, b)


def test_replaced_norm_under_sequence_parallel(mesh1, torch_backend):
    """A norm swapped by replace_norms, then given SequenceParallel: DTensor in, DTensor out."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from fused_norm.hf import replace_norms

    ref = torch.nn.RMSNorm(N, eps=1e-5)
    norm = copy.deepcopy(ref)
    assert replace_norms(norm) == [""]
    parallelize_module(norm, mesh1, SequenceParallel())
    x = torch.randn(2, 6, N)
    y = norm(x)
    assert isinstance(y, DTensor) and y.placements == (Shard(1),)
    close("y", y, ref(x))


# ----------------------------------------------------------------------------------------------
# Two processes
# ----------------------------------------------------------------------------------------------


def _llama(device, fuse_residual):
    from transformers import LlamaConfig, LlamaForCausalLM

    from fused_norm.hf import replace_norms

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    perturb_params(model, ("norm",))
    replace_norms(model, fuse_residual=fuse_residual)
    return model.to(device)


def _tensor_parallel(model, mesh):
    """Megatron-style TP with sequence parallelism on a transformers Llama.

    The residual stream is a DTensor throughout: the embedding's output replicated (so that the
    model's own code, which sizes position ids and masks from it, sees the global sequence
    length), each branch's output sequence-sharded (reduce-scatter), every norm given
    ``SequenceParallel`` (its input sequence-sharded, its weight replicated)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })  # fmt: skip
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })  # fmt: skip
    return model


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _check_step(name, model, ref, ids_local, ids_full):
    """One forward/backward of ``model`` (this rank's batch) against ``ref`` (the full batch on
    this device): loss and every gradient."""
    print(f"[rank {dist.get_rank()}] {name}", flush=True)  # where a crash happened
    out = model(input_ids=ids_local, labels=ids_local)
    out.loss.backward()
    want = ref(input_ids=ids_full, labels=ids_full)
    want.loss.backward()
    loss = out.loss.detach()
    if ids_local.shape != ids_full.shape:  # data parallel: the mean of the ranks' means
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    close(f"{name} loss", loss, want.loss.detach())
    got = dict(model.named_parameters())
    assert got.keys() == dict(ref.named_parameters()).keys()
    for pname, p in ref.named_parameters():
        close(f"{name} grad {pname}", got[pname].grad, p.grad)


def _worker(rank, world, store_path, device_type):
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast on the shared GPU hosts
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    if device_type == "cpu":
        os.environ["FUSED_NORM_BACKEND"] = "torch"  # the interpreter would take minutes
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    backend = "nccl" if device_type == "cuda" else "gloo"
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh(device_type, (world,))
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 128, (world, 16), generator=g).to(device)

        # torch.nn norms, native DTensor ops against the fused ones, sequence-sharded.
        from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

        from fused_norm.hf import replace_norms

        for make in (lambda: torch.nn.RMSNorm(N, eps=1e-5), lambda: torch.nn.LayerNorm(N)):
            torch.manual_seed(0)
            native = make().to(device)
            perturb_params(native)
            fused = copy.deepcopy(native)
            replace_norms(fused)
            x = torch.randn(2, 4 * world, N, device=device)
            gy = torch.randn_like(x)
            for m in (native, fused):
                parallelize_module(m, mesh, SequenceParallel())
                xl = x.chunk(world, dim=1)[rank]
                (m(xl).to_local() * gy.chunk(world, dim=1)[rank]).sum().backward()
            for (pname, a), b in zip(native.named_parameters(), fused.parameters()):
                assert a.grad.placements == b.grad.placements, pname
                close(f"{type(native).__name__}.{pname} grad", b.grad.to_local(), a.grad.to_local())

        for fuse in (False, True):
            ref = _llama(device, fuse)
            tp = _tensor_parallel(copy.deepcopy(ref), mesh)
            _check_step(f"TP+SP fuse_residual={fuse}", tp, ref, ids, ids)

        ref = _llama(device, True)
        dp = _fsdp(copy.deepcopy(ref), mesh)
        _check_step("FSDP2", dp, ref, ids[rank : rank + 1], ids)

        mesh2 = init_device_mesh(device_type, (1, world), mesh_dim_names=("dp", "tp"))
        ref = _llama(device, True)
        both = _fsdp(_tensor_parallel(copy.deepcopy(ref), mesh2["tp"]), mesh2["dp"])
        _check_step("FSDP2 + TP (dp 1 x tp 2)", both, ref, ids, ids)
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, device_type):
    pytest.importorskip("transformers", reason="the model tests build a transformers Llama")
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), device_type), nprocs=2, join=True)


@pytest.mark.slow
def test_two_processes_cpu_gloo(tmp_path):
    """Everything of the two-GPU test on two CPU processes (gloo, the PyTorch backend)."""
    _spawn(tmp_path, "cpu")


@pytest.mark.multigpu
@pytest.mark.xdist_group(name="two_gpu_processes")
def test_two_gpus_nccl(tmp_path):
    """Tensor + sequence parallel, FSDP2, and both, on two GPUs with the kernels (fp32)."""
    _spawn(tmp_path, "cuda")
