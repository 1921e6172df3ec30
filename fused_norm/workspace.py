"""Exchange workspaces that clear themselves, so that no fill kernel runs before a launch: each
(thread, device, stream, fill value) keeps a pair of int64 buffers and alternates between them, a
launch cleaning in one the words it publishes in the other (docs/design.md, "Workspaces").

Keys hold the thread because two threads issuing on one stream could otherwise enqueue in another
order than they took buffers. Pairs stay allocated (16 bytes a word, a word per row and part or
slice: 512 KB for 1024 rows of 32 parts). Under CUDA graph capture, and with
``FUSED_NORM_WS_SELF_CLEARING=0``, every call gets a freshly filled buffer and a scratch one.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from . import fast_path

_LOCAL = threading.local()
SELF_CLEARING = os.environ.get("FUSED_NORM_WS_SELF_CLEARING", "1") != "0"


class _Pair:
    """Two workspaces (the rows of ``bufs``), the one the next launch takes (``cur``), per
    buffer the range [lo, hi) of words that may not hold the fill value (empty: lo >= hi), and
    the words of a launch that took a buffer and has not been reported enqueued (``pending``,
    else None)."""

    __slots__ = ("bufs", "cur", "lo", "hi", "pending")

    def __init__(self, words: int, fill: int, dev: torch.device):
        cap = max(256, 1 << (words - 1).bit_length())  # a power of two: 16-byte rows
        self.bufs = torch.full((2, cap), fill, dtype=torch.int64, device=dev)
        self.cur = 0
        self.lo = [0, 0]
        self.hi = [0, 0]
        self.pending = None


def capturing(dev: torch.device) -> bool:
    """Whether ``dev``'s current stream is being captured into a CUDA graph."""
    if dev.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(dev):
        return torch.cuda.is_current_stream_capturing()


def take(dev: torch.device, words: int, fill: int) -> tuple:
    """``(ws, ws_next, pair)`` for one launch publishing ``words`` words: ``ws`` holds them
    equal to ``fill``; the launch sets the same words of ``ws_next`` to ``fill``, and
    :func:`done` is called with ``pair`` once it is enqueued (``pair`` None: a fresh buffer,
    and ``ws_next`` a scratch one that nothing reads)."""
    words = max(words, 1)
    ws, ws_next, pair = _take(dev, words, fill)
    rec = fast_path.current()
    if rec is not None:  # the C++ fast path keeps pairs of its own, the same way
        rec.workspaces.append((ws, ws_next, words, fill))
    return ws, ws_next, pair


def _take(dev: torch.device, words: int, fill: int) -> tuple:
    if not SELF_CLEARING or (dev.type == "cuda" and capturing(dev)):
        both = torch.full((2, (words + 1) & ~1), fill, dtype=torch.int64, device=dev)  # 16 B rows
        return both[0], both[1], None
    stream = 0
    if dev.type == "cuda":
        if dev.index is None:  # (tensors' devices have their index)
            dev = torch.device("cuda", torch.cuda.current_device())
        stream = torch._C._cuda_getCurrentRawStream(dev.index)
    pairs = getattr(_LOCAL, "pairs", None)
    if pairs is None:
        pairs = _LOCAL.pairs = {}
    key = (dev, stream, fill)
    pair: Optional[_Pair] = pairs.get(key)
    if pair is None or pair.bufs.shape[1] < words or pair.pending is not None:
        pair = pairs[key] = _Pair(words, fill, dev)
    cur = pair.cur
    lo, hi = pair.lo[cur], pair.hi[cur]
    if lo < min(hi, words):  # words this launch needs were not cleaned for it
        pair.bufs[cur, lo:hi].fill_(fill)
        pair.lo[cur] = pair.hi[cur] = 0
    pair.pending = words
    return pair.bufs[cur], pair.bufs[1 - cur], pair


def done(pair: Optional[_Pair]) -> None:
    """The launch that took ``pair`` (:func:`take`) is enqueued; it publishes the words it took
    of its buffer and sets the same words of the other one: that one is the next taken."""
    if pair is None:
        return
    words = pair.pending
    cur, other = pair.cur, 1 - pair.cur
    # this buffer: [0, words) published, besides what was dirty beyond them
    pair.hi[cur] = max(words, pair.hi[cur] if pair.lo[cur] < pair.hi[cur] else 0)
    pair.lo[cur] = 0
    # the other: [0, words) cleaned
    pair.lo[other] = max(pair.lo[other], words)
    if pair.lo[other] >= pair.hi[other]:
        pair.lo[other] = pair.hi[other] = 0
    pair.cur = other
    pair.pending = None
