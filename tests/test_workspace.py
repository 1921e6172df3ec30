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
    patched,
    patched_config,
    split_constexprs,
    split_rows,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from fused_norm import layer_norm_fn, ops, rms_norm_fn, workspace

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


@settings(max_examples=8, deadline=None)
@given(
    rows=st.lists(st.integers(1, 6), min_size=3, max_size=5),
    n=st.integers(41, 200),
    dtype=st.sampled_from([FP32, BF16]),
    is_rms_norm=st.booleans(),
    prenorm_dropout=st.booleans(),
)
def test_calls_in_sequence_reset_each_others_words(rows, n, dtype, is_rms_norm,
                                                   prenorm_dropout):  # fmt: skip
    """Calls of changing row counts (more and fewer words than the call before) through the
    split forward (64-byte parts) and the backward's exchanging column blocks (32 columns a
    block, rows wider than a block and a quarter, two programs walking the rows): each call
    against the fp64 reference, and after each the
    buffers the next calls take hold the fill value wherever the host counts them clean. The
    pairs are made once.
    (On a GPU the backward runs in autograd's device thread, whose pairs are its own: this
    thread sees the forward's.)"""
    dev = _device(DEVICE)
    want = {0, -1} if dev.type == "cpu" else {0}
    made = None
    with split_rows(64), max_block_bytes(64), few_programs(2), patched_config(EXCHANGE=True):
        for i, m in enumerate(rows):
            case = Case(
                shape=(m, n), dtype=dtype, is_rms_norm=is_rms_norm, has_bias=not is_rms_norm,
                residual_dtype=dtype if prenorm_dropout else None, prenorm=prenorm_dropout,
                dropout_p=0.1 if prenorm_dropout else 0.0, seed=1000 * i + m,
            )  # fmt: skip
            check_case(case, "fn", device=DEVICE)
            plans = [(key[0], plan) for key, plan in ops._PLANS.items()]
            assert any(d == "fwd" and p.split > 1 for d, p in plans), "not split"
            assert any(d == "bwd" and p.exchange for d, p in plans), "not exchanging"
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
    with patched(workspace, SELF_CLEARING=False):
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
    of stale words (99) longer than the launch's; keeps what each launch asked for."""

    def __init__(self, dev):
        self.dev, self.asked = dev, {}

    def __call__(self, dev, words, fill):
        nxt = torch.full((words + 9,), 99, dtype=torch.int64, device=self.dev)
        self.asked.setdefault(fill, []).append((words, nxt))
        return torch.full((words,), fill, dtype=torch.int64, device=self.dev), nxt, None

    def check(self, fill, rows):
        """One launch took a workspace of ``fill`` for more words than rows, and set exactly
        the words it published to ``fill`` in the next buffer."""
        assert len(self.asked.get(fill, ())) == 1, f"fill {fill}: {self.asked.keys()}"
        words, nxt = self.asked[fill][0]
        assert words > rows, f"fill {fill}: {words} words for {rows} rows: not exchanging"
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        assert torch.all(nxt[:words] == fill) and torch.all(nxt[words:] == 99)


def test_kernels_set_the_next_workspace_words(monkeypatch):
    """The split forward (64-byte parts) and the exchanging backward (64-byte column blocks,
    two programs walking the rows) of one RMSNorm call: each launch, given a next buffer of
    stale words, sets exactly the words it publishes, and no others, to the fill value (and
    normalises, and differentiates, as ever)."""
    dev = _device(DEVICE)
    m, n = 3, 100
    x = torch.randn(m, n, device=dev, requires_grad=True)
    w = torch.ones(n, device=dev)
    dy = torch.randn(m, n, device=dev)
    fake = _FakeTake(dev)
    monkeypatch.setattr(workspace, "take", fake)
    with split_rows(64), max_block_bytes(64), few_programs(2), patched_config(EXCHANGE=True):
        y = rms_norm_fn(x, w, None, eps=1e-5)
        fake.check(0, m)
        (dx,) = torch.autograd.grad(y, x, dy)
        fake.check(-1, m)
    xr = x.detach().double().requires_grad_()
    yr = xr * torch.rsqrt(xr.square().mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(y.double(), yr, rtol=1e-5, atol=1e-5)
    (dx_ref,) = torch.autograd.grad(yr, xr, dy.double())
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# GPU: production widths (split forward parts, the Gluon backward's slices), streams, CUDA graphs.


def _gpu_case(m, seed, n=131072):
    """Dropout + add + LayerNorm, prenorm, bf16 at 131072 columns: a split forward and an
    exchanging backward on an H100/H200 (asserted by the callers that need it)."""
    return Case(shape=(m, n), dtype=BF16, residual_dtype=BF16, dropout_p=0.1, prenorm=True,
                seed=seed)  # fmt: skip


@pytest.mark.gpu
def test_gpu_calls_in_sequence_reset_each_others_words():
    """Row counts that grow and shrink, each call against the fp64 reference (forward in this
    thread, backward in autograd's device thread), the forward's next buffer checked clean."""
    dev = _device("cuda")
    for i, m in enumerate((3, 17, 5, 40, 2)):
        check_case(_gpu_case(m, seed=i), "fn", device="cuda")
        splits = [p.split for k, p in ops._PLANS.items() if k[0] == "fwd" and k[2].n == 131072]
        assert splits and max(splits) > 1, "not split"
        _assert_next_clean(dev)


@pytest.mark.gpu
def test_gpu_two_streams_interleaved():
    """Calls on two streams issued alternately without synchronising: each stream's pair is
    its own, and every result equals the same call's result run alone."""
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


@pytest.mark.gpu
def test_gpu_prefetch_changes_no_bits():
    """The split forward's L2 prefetch of its row's exchange words (inline PTX: WS_PREFETCH)
    changes no output and no gradient: split rows with it and without, bitwise (no dropout),
    for LayerNorm and RMSNorm."""
    n = 65536
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(24, n, device="cuda", dtype=BF16, generator=gen)
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(BF16)
    b = (0.1 * torch.randn(n, device="cuda", generator=gen)).to(BF16)
    gy = torch.randn(24, n, device="cuda", dtype=BF16, generator=gen)

    def run(rms):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = layer_norm_fn(*leaves, eps=1e-5, is_rms_norm=rms)
        plans = [p for k, p in ops._PLANS.items() if k[0] == "fwd"]
        assert plans and all(p.split > 1 for p in plans), "not split"
        return [y.detach()] + list(torch.autograd.grad(y, leaves, gy))

    for rms in (False, True):
        runs = []
        for prefetch in (False, True):
            with split_constexprs(WS_PREFETCH=prefetch):
                runs.append(run(rms))
        for name, a, c in zip(("y", "dx", "dw", "db"), *runs):
            assert torch.equal(a, c), (rms, name)
