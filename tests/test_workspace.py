"""The exchange workspaces that clear themselves (fused_norm/workspace.py).

A split forward publishes into a workspace of zeros and an exchanging backward into one of -1s;
each launch sets the words it publishes to those values in the other buffer of its pair too,
for the next launch on its stream, and the host fills what a growing launch needs beyond them.
A missed word would leave an earlier call's published word where the next call waits for its
own: under the interpreter (and on a GPU) that call would take the stale statistics or row sums
and its outputs or gradients would be wrong, which the reference comparisons here catch; the
tests also read the buffer the next launch takes and check every word the host counts clean.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _helpers import (
    DEVICE,
    Case,
    check_case,
    few_programs,
    max_block_bytes,
    patched_config,
    split_rows,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from fused_norm import config, layer_norm_fn, ops, workspace

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _device(name) -> torch.device:
    """``name`` with its index, as the keys of the pairs hold it."""
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _pairs() -> dict:
    """This thread's pairs: (device, stream, fill) -> workspace._Pair."""
    return getattr(workspace._LOCAL, "pairs", {})


def _assert_next_clean(device) -> None:
    """Every word of the buffer each of this thread's pairs on ``device`` hands out next holds
    its fill value, but those the host counts as possibly dirty (when a launch needs them, it
    fills them first)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for (dev, _stream, fill), pair in _pairs().items():
        if dev == device and fill in (0, -1):
            cur = pair.cur
            buf = pair.bufs[cur].clone()
            if pair.lo[cur] < pair.hi[cur]:
                buf[pair.lo[cur] : pair.hi[cur]] = fill
            stale = (buf != fill).nonzero().flatten()
            assert stale.numel() == 0, f"fill {fill}: words {stale[:8].tolist()} not reset"


@settings(max_examples=12, deadline=None)
@given(
    rows=st.lists(st.integers(1, 6), min_size=3, max_size=5),
    n=st.integers(33, 200),
    dtype=st.sampled_from([FP32, BF16]),
    is_rms_norm=st.booleans(),
    prenorm_dropout=st.booleans(),
)
def test_calls_in_sequence_reset_each_others_words(rows, n, dtype, is_rms_norm,
                                                   prenorm_dropout):  # fmt: skip
    """Calls of changing row counts (more and fewer words than the call before) through the
    split forward (64-byte parts) and the backward's exchanging column blocks (64-byte blocks,
    two programs walking the rows): each call against the fp64 reference, and after each the
    buffers the next calls take hold the fill value wherever the host counts them clean. The
    pairs are made once.
    (On a GPU the backward runs in autograd's device thread, whose pairs are its own: this
    thread sees the forward's.)"""
    dev = _device(DEVICE)
    want = {0, -1} if dev.type == "cpu" else {0}
    made = None
    with split_rows(64), max_block_bytes(64), few_programs(2), patched_config(BWD_EXCHANGE=True):
        for i, m in enumerate(rows):
            case = Case(
                shape=(m, n), dtype=dtype, is_rms_norm=is_rms_norm, has_bias=not is_rms_norm,
                residual_dtype=dtype if prenorm_dropout else None, prenorm=prenorm_dropout,
                dropout_p=0.1 if prenorm_dropout else 0.0, seed=1000 * i + m,
            )  # fmt: skip
            check_case(case, "fn", device=DEVICE)
            _assert_next_clean(dev)
            pairs = {k: id(p) for k, p in _pairs().items() if k[0] == dev}
            assert want <= {k[2] for k in pairs}, "a launch took no workspace"
            if made is None:
                made = pairs
            assert pairs == made, "a pair was made again (a fill) between calls"


def _launch(ws, ws_next, words, fill):
    """What a launch does to the pair's buffers: publishes ``words`` words into ``ws`` and
    sets the same words of ``ws_next`` to the fill value."""
    assert torch.all(ws[:words] == fill), "handed a workspace whose words are not clean"
    ws[:words] = 123
    ws_next[:words] = fill


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 700), min_size=1, max_size=12))
def test_host_hands_out_clean_words(sizes):
    """Any sequence of launch sizes (growing, shrinking, past the pair's capacity), launches
    simulated on the buffers: every buffer handed out is clean where the launch needs it
    (the host fills what the launch before did not clean), and a repeated size needs no fill.
    (Fill 7: a pair of its own, no kernel's.)"""
    dev = _device(DEVICE)
    prev = None
    for words in sizes:
        stream = torch._C._cuda_getCurrentRawStream(dev.index) if dev.type == "cuda" else 0
        pair = _pairs().get((dev, stream, 7))
        if pair is not None and words == prev and pair.bufs.shape[1] >= words:
            lo, hi = pair.lo[pair.cur], pair.hi[pair.cur]
            assert not lo < min(hi, words), "a repeated size would need a fill"
        ws, ws_next, pair = workspace.take(dev, words, 7)
        _launch(ws, ws_next, words, 7)
        workspace.done(pair)
        prev = words


def test_unfinished_launch_gets_a_fresh_pair():
    """A launch that took a buffer and was never reported enqueued (it raised, or was
    interrupted) leaves its pair refused: the next take makes a fresh, filled one. Reported
    launches alternate the two buffers. (Fill 7: a pair of its own.)"""
    dev = _device(DEVICE)
    ws, ws_next, pair = workspace.take(dev, 10, 7)
    assert ws.data_ptr() != ws_next.data_ptr()
    ws[:10] = 123  # what a launch that then raised may have published
    ws2, ws2_next, pair2 = workspace.take(dev, 10, 7)
    assert pair2 is not pair and torch.all(ws2 == 7) and torch.all(ws2_next == 7)
    _launch(ws2, ws2_next, 10, 7)
    workspace.done(pair2)
    ws3, _, pair3 = workspace.take(dev, 10, 7)
    assert pair3 is pair2 and ws3.data_ptr() == ws2_next.data_ptr()
    workspace.done(pair3)


def test_off_gives_fresh_buffers_per_call():
    with patched_config(WS_SELF_CLEARING=False):
        ws, ws_next, pair = workspace.take(_device(DEVICE), 5, -1)
    assert pair is None and ws.data_ptr() != ws_next.data_ptr()
    assert ws.numel() >= 5 and torch.all(ws == -1)
    workspace.done(pair)  # nothing to do


def test_threads_keep_pairs_of_their_own():
    """Two threads issuing on one stream could enqueue in another order than they took
    buffers: each thread has its own pairs."""
    dev = _device(DEVICE)
    got = {}

    def worker(name):
        ws, _, pair = workspace.take(dev, 4, 5)
        workspace.done(pair)
        got[name] = (pair, ws.data_ptr())

    threads = [threading.Thread(target=worker, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["a"][0] is not got["b"][0] and got["a"][1] != got["b"][1]


class _FakeTake:
    """Stands in for workspace.take: a fresh workspace, and as the next launch's one a buffer
    of stale words (99) longer than the launch's."""

    def __init__(self, dev):
        self.dev, self.asked, self.next = dev, [], None

    def __call__(self, dev, words, fill):
        self.asked.append((words, fill))
        self.next = torch.full((words + 9,), 99, dtype=torch.int64, device=self.dev)
        return torch.full((words,), fill, dtype=torch.int64, device=self.dev), self.next, None

    def check(self, fill):
        """The launch set exactly the words it published to ``fill`` in the next buffer."""
        assert len(self.asked) == 1 and self.asked[0][1] == fill, self.asked
        words = self.asked[0][0]
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        assert torch.all(self.next[:words] == fill) and torch.all(self.next[words:] == 99)


def test_kernels_set_the_next_workspace_words(monkeypatch):
    """The split forward and the exchanging backward, by hand: a launch given a next buffer
    of stale words sets exactly the words it publishes, and no others, to the fill value
    (and normalises, and differentiates, as ever)."""
    dev = _device(DEVICE)
    m, n = 3, 100
    x = torch.randn(m, n, device=dev)
    w = torch.ones(n, device=dev)
    fake = _FakeTake(dev)
    monkeypatch.setattr(workspace, "take", fake)
    with split_rows(64):
        y, _, _, _, rstd, _, _ = ops.fused_norm_fwd(
            x, w, None, None, None, None, None, None, None, None, 1e-5, 0.0, True, False,
            x.dtype, x.dtype, False,
        )  # fmt: skip
    assert fake.asked[0][0] > m, f"not a split launch: {fake.asked}"
    fake.check(0)
    ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    fake.asked = []
    dy = torch.randn(m, n, device=dev)
    with max_block_bytes(64), few_programs(2), patched_config(BWD_EXCHANGE=True):
        dx = ops.fused_norm_bwd(dy, x, w, None, None, None, None, rstd, is_rms_norm=True)[0]
    assert fake.asked and fake.asked[0][0] > m, f"no exchange: {fake.asked}"
    fake.check(-1)
    xr = x.double().requires_grad_()
    yr = xr * torch.rsqrt(xr.square().mean(-1, keepdim=True) + 1e-5)
    (dx_ref,) = torch.autograd.grad(yr, xr, dy.double())
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# GPU: production widths (split forward parts, smem_kernels' slices), streams, CUDA graphs.


def _gpu_case(m, seed, n=131072):
    """Dropout + add + LayerNorm, prenorm, bf16 at 131072 columns: a split forward and a
    sliced backward on an H100/H200 (asserted by the callers that need it)."""
    return Case(shape=(m, n), dtype=BF16, residual_dtype=BF16, dropout_p=0.1, prenorm=True,
                seed=seed)  # fmt: skip


@pytest.mark.gpu
def test_gpu_calls_in_sequence_reset_each_others_words():
    """Row counts that grow and shrink, each call against the fp64 reference (forward in this
    thread, backward in autograd's device thread), the forward's next buffer checked clean."""
    dev = _device("cuda")
    assert config.fwd_split(131072, 2, dev, dropout=True)[1] > 1, "not split"
    for i, m in enumerate((3, 17, 5, 40, 2)):
        check_case(_gpu_case(m, seed=i), "fn", device="cuda")
        _assert_next_clean(dev)


@pytest.mark.gpu
def test_gpu_two_streams_interleaved():
    """Calls on two streams issued alternately without synchronising: each stream's pair is
    its own, and every result equals the same call's result run alone."""
    from fused_norm import layer_norm_fn

    dev = "cuda"
    xs = [torch.randn(m, 65536, device=dev, dtype=BF16) for m in (7, 3, 11, 5)]
    w = torch.rand(65536, device=dev, dtype=BF16) + 0.5
    b = torch.randn(65536, device=dev, dtype=BF16)
    alone = [layer_norm_fn(x, w, b, eps=1e-5) for x in xs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for rep in range(3):
        for i, x in enumerate(xs):
            with torch.cuda.stream(streams[(i + rep) % 2]):
                outs.append((i, layer_norm_fn(x, w, b, eps=1e-5)))
    torch.cuda.synchronize()
    for i, y in outs:
        assert torch.equal(y, alone[i]), f"input {i}: differs from its call alone"


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_with_split_rows():
    """A forward + backward with a split forward and a sliced backward captured into a CUDA
    graph (under capture each call fills a fresh workspace, captured with it) replays three
    times on new data, with eager calls of other row counts on the same stream between
    replays (which take that stream's pairs): every replay against the fp64 reference of its
    inputs and masks, at bf16's tolerance."""
    from fused_norm import layer_norm_fn

    torch.manual_seed(0)
    dev = "cuda"
    m, n = 4, 131072
    x = torch.randn(m, n, device=dev, dtype=BF16, requires_grad=True)
    res = torch.randn(m, n, device=dev, dtype=BF16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device=dev)).to(BF16).requires_grad_()
    b = (0.1 * torch.randn(n, device=dev)).to(BF16).requires_grad_()
    gy = torch.randn(m, n, device=dev, dtype=BF16)
    leaves = (x, res, w, b)

    def step():
        y, _s, mask = layer_norm_fn(x, w, b, residual=res, eps=1e-5, dropout_p=0.1,
                                    prenorm=True, return_dropout_mask=True)[:3]  # fmt: skip
        (y.float() * gy.float()).sum().backward()
        return y, mask

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
            for t in leaves:
                t.grad = None
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            y, mask = step()
        for rep in range(3):
            with torch.no_grad():
                x.copy_(torch.randn_like(x))
                res.copy_(torch.randn_like(res))
            graph.replay()
            torch.cuda.synchronize()
            snap = [t.detach().clone() for t in (x, res, y, mask)]
            grads = [t.grad.detach().clone() for t in leaves]
            for rows in (rep + 1, 9):  # eager calls between replays, on the capture stream
                check_case(_gpu_case(rows, seed=100 + rep), "fn", device="cuda")
            x0, r0, y0, mask0 = snap
            # fp64 truth of the stream the kernel normalised: dropout(x) + residual rounded to
            # bf16 as stored (residual_out), then LayerNorm and its gradients
            keep = mask0.double() / 0.9
            s_ref = (x0.double() * keep + r0.double()).to(BF16).double().requires_grad_()
            lw, lb = (t.detach().double().requires_grad_() for t in (w, b))
            y_ref = torch.nn.functional.layer_norm(s_ref, (n,), lw, lb, eps=1e-5)
            ds, dw, db = torch.autograd.grad(y_ref, (s_ref, lw, lb), gy.double())
            refs = (y_ref, ds * keep, ds, dw, db)
            for name, a, ref in zip(("y", "x", "residual", "weight", "bias"), [y0] + grads, refs):
                # bf16 storage: a few of its ulps (2**-8 relative) and a floor near zero
                torch.testing.assert_close(a.double(), ref.detach(), rtol=3e-2, atol=2e-2,
                                           msg=lambda e, k=f"replay {rep}: {name}": f"{k}: {e}")  # fmt: skip


def test_rule_keeps_the_fill_for_wide_fp32_rms_rows():
    """config.fwd_ws_reset through ops' plan: split forwards reset the next workspace, but
    RMSNorm rows of 4-byte elements wider than 64K columns (where the store cost registers
    and time, bench/NOTES.md #76) fill a fresh one; the plan of an unsplit row has none."""
    gpu = torch.device("cuda", 0)
    bf16, fp32 = torch.bfloat16, torch.float32
    with patched_config(sm_count=lambda device: 132, split_rows_ok=lambda device: True):

        def plan(n, dtype, rms, stream=None):
            return ops._fwd_plan(gpu, n, dtype, dtype, stream, None, stream, not rms, False,
                                 False, False, False, False, False, rms, False)  # fmt: skip

        for n in (65536, 131072, 262144):
            assert plan(n, bf16, True).split > 1 and plan(n, bf16, True).ws_reset
            assert plan(n, bf16, False).ws_reset and plan(n, fp32, False).ws_reset
            assert plan(n, bf16, True, stream=fp32).ws_reset == (n <= 65536)  # fp32 stream
            assert plan(n, fp32, True).ws_reset == (n <= 65536)
        assert plan(4096, bf16, True).split == 1 and not plan(4096, bf16, True).ws_reset


def test_sweep_reads_the_forward_plan():
    """bench/sweep.py's description of the plan a variant ran reads ops' forward plan (a new
    entry, ws_reset, broke its positional unpacking once; it reads the fields by name now)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import sweep

    dev = torch.device(DEVICE)
    x = torch.randn(2, 100, device=dev)
    w = torch.ones(100, device=dev)
    config.settings_changed()  # ops' plan caches then hold this call's plan only
    with split_rows(64):
        ops.fused_norm_fwd(x, w, None, None, None, None, None, None, None, None, 1e-5, 0.0, True,
                           False, x.dtype, x.dtype, False)  # fmt: skip
        desc = sweep.plan_desc("fwd", "auto")
    assert "ws_reset=True" in desc and "x1 " not in desc, desc


def test_prefetch_rules_through_the_plans():
    """config.fwd_ws_prefetch / BWD_SMEM_WS_PREFETCH through ops' plans (bench/NOTES.md #77):
    a split forward's parts prefetch their row's words on an NVIDIA GPU, but RMSNorm of x alone
    in more than 32 parts, the x1 path in more than 64 and fp16 LayerNorm 256K with a bias
    (#108), and no unsplit row or interpreted launch does; the sliced Gluon backward prefetches
    its row block's words, the whole-row one has none to."""
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    bf16 = torch.bfloat16
    with patched_config(sm_count=lambda device: 132, split_rows_ok=lambda device: True):

        def fwd(n, dtype, rms, dev=gpu, residual=None, x1=False, bias=True):
            p = ops._fwd_plan(
                dev, n, dtype, dtype, residual, dtype if x1 else None, residual, bias and not rms,
                x1, x1, False, False, False, False, rms, False,
            )  # fmt: skip
            return p.split, p.constexprs["WS_PREFETCH"]

        for n in (65536, 131072, 262144):
            assert fwd(n, bf16, False) == (n // 4096, True)  # LayerNorm: 4K-column parts
            assert fwd(n, bf16, True, residual=bf16)[1]  # add + RMSNorm
            split, pre = fwd(n, bf16, True)
            assert pre == (split <= config.FWD_WS_PREFETCH_RMS_MAX_PARTS), (n, split)
        assert fwd(131072, FP32, True) == (64, False)  # 4-byte rows: 2K-column parts
        assert fwd(131072, FP32, False, residual=FP32, x1=True) == (64, True)  # the x1 path
        assert fwd(262144, BF16, False, residual=FP32, x1=True) == (128, False)
        assert fwd(262144, BF16, False, residual=BF16, x1=True) == (64, True)
        # fp16 LayerNorm 256K with a bias takes none (FWD_WS_PREFETCH_SKIP, #108); without a
        # bias, at 128K or in bf16 it does
        assert fwd(262144, torch.float16, False) == (64, False)
        assert fwd(262144, torch.float16, False, bias=False) == (64, True)
        assert fwd(131072, torch.float16, False)[1] and fwd(262144, bf16, False)[1]
        with patched_config(FWD_WS_PREFETCH_SKIP=frozenset()):
            assert fwd(262144, torch.float16, False) == (64, True)
        assert fwd(4096, bf16, False) == (1, False)  # unsplit: no words
        assert not fwd(131072, bf16, False, dev=cpu)[1]  # the interpreter: no inline PTX
        with patched_config(FWD_WS_PREFETCH=False):
            assert fwd(131072, bf16, False) == (32, False)

        def smem(n, sliced_bytes):  # LayerNorm with a bias, bf16: s and dy staged, 4 B a column
            return ops.smem_flags(n, 2, False, True, False, sliced_bytes=sliced_bytes)

        assert smem(131072, 4)["WS_PREFETCH"] and smem(131072, 4)["SPLIT"] == 8
        assert not smem(16384, 0)["WS_PREFETCH"]  # a whole row: no exchange
        with patched_config(BWD_SMEM_WS_PREFETCH=False):
            assert not smem(131072, 4)["WS_PREFETCH"]


@pytest.mark.gpu
def test_gpu_prefetch_changes_no_bits():
    """The L2 prefetches of the exchange words (inline PTX) change no output and no gradient:
    a split forward and a sliced backward, with them and without, bitwise (no dropout)."""
    dev = torch.device("cuda")
    n = 65536
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sliced Gluon backward runs on Hopper")
    assert config.fwd_split(n, 2, dev)[1] > 1 and config.bwd_smem_sliced(n, 2), "not exchanging"
    gen = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(24, n, device=dev, dtype=BF16, generator=gen)
    w = (1 + 0.1 * torch.randn(n, device=dev, generator=gen)).to(BF16)
    b = (0.1 * torch.randn(n, device=dev, generator=gen)).to(BF16)
    gy = torch.randn(24, n, device=dev, dtype=BF16, generator=gen)

    def run(rms):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = layer_norm_fn(*leaves, eps=1e-5, is_rms_norm=rms)
        return [y.detach()] + list(torch.autograd.grad(y, leaves, gy))

    for rms in (False, True):
        with patched_config(FWD_WS_PREFETCH=False, BWD_SMEM_WS_PREFETCH=False):
            off = run(rms)
        on = run(rms)
        for name, a, c in zip(("y", "dx", "dw", "db"), on, off):
            assert torch.equal(a, c), (rms, name)
