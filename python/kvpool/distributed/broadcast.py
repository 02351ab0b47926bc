"""Per-step batch metadata from the scheduler rank to every rank: one broadcast of one buffer.

The allocator and the radix cache run on one rank; every rank's kernels need the same page
table, seq_lens, slots and cu_seqlens of the step. One collective per tensor would cost a
collective's latency four or more times a step, so :class:`StepBroadcaster` packs every array
into one int32 buffer: a header of names and shapes, then the data.

Capacity. Every rank must post a broadcast of the same size, and receivers cannot know this
step's size before receiving it. Rather than broadcast a header first (two collectives every
step), each message is of a size every rank already knows: the first of ``capacity`` words, and
each message's header states the size of the next one. When a step does not fit, the sender
first sends a short "grow" message (of the size announced) that announces the larger size, then
the step itself: two collectives on the steps that grow, one on every other step. A grown size
is the step's size plus a quarter, in whole KiB (:func:`fitted_size`): each growth is by at
least a quarter (a few in a run), and the buffer never carries much more than the step (a
power of two could nearly double every broadcast's bytes). After ``shrink_after`` steps that
used under a quarter of the size, the header announces a fitted smaller one, so a burst of long
prefills does not make every later decode step broadcast the burst's size.

Header (int32 words): ``magic, version, step, kind, next_size, header_words, data_words,
num_arrays``; per array ``name_bytes, ndim, dims...``; then the names' UTF-8 bytes padded to
whole words. Data follows in array order, each C-contiguous.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvpool._core import ArrayTypeError
from kvpool.distributed import _collective as col

MAGIC = 0x4B565042  # "KVPB"
VERSION = 1
_DATA, _GROW, _CLOSE = 0, 1, 2
_FIXED = 8  # fixed header words
_MAX_WORDS = (1 << 31) - 1


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def fitted_size(need: int) -> int:
    """Words of a message grown or shrunk to a step of ``need`` words: +25%, whole KiB."""
    return min(-(-(need + need // 4) // 256) * 256, _MAX_WORDS)


def _as_int32(name: str, a: Any) -> np.ndarray:
    """``a`` (numpy array or CPU tensor, int32) as a numpy array; ArrayTypeError otherwise."""
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise ArrayTypeError(
                f"`{name}` is on {a.device}: send host arrays (the scheduler's numpy arrays)"
            )
        a = a.detach().numpy()
    if not isinstance(a, np.ndarray):
        raise ArrayTypeError(f"`{name}` must be a numpy int32 array, got {type(a).__name__}")
    if a.dtype != np.int32:
        raise ArrayTypeError(f"`{name}` must be int32 (page ids, lengths, slots), got {a.dtype}")
    return a


def pack_header(step: int, kind: int, next_size: int, arrays: dict[str, np.ndarray]) -> list[int]:
    """The header words of one message (see the module docstring)."""
    names = b"".join(n.encode() for n in arrays)
    words: list[int] = []
    for n, a in arrays.items():
        words += [len(n.encode()), a.ndim, *a.shape]
    pad = -len(names) % 4
    name_words = np.frombuffer(names + b"\0" * pad, dtype=np.int32).tolist()
    data = sum(a.size for a in arrays.values())
    head = _FIXED + len(words) + len(name_words)
    # (the step number wraps at 2^31: a server at 1,000 steps/s passes it in 25 days)
    return [MAGIC, VERSION, step & _MAX_WORDS, kind, next_size, head, data, len(arrays), *words,
            *name_words]  # fmt: skip


def parse_header(head: np.ndarray, size: int, step: int) -> tuple[int, int, int, list]:
    """``(kind, next_size, header_words, [(name, shape), ...])`` of a message of ``size`` words.

    ``head`` holds at least the header's words (the whole buffer on the CPU).

    Raises
    ------
    CollectiveError
        Not a message of this protocol, or of another step (ranks out of step).
    """
    if head.size < _FIXED:
        raise col.CollectiveError(f"broadcast buffer of {head.size} words holds no header")
    magic, version, got, kind, next_size, words, data, n = (int(x) for x in head[:_FIXED])
    if magic != MAGIC or version != VERSION:
        raise col.CollectiveError(
            f"received a buffer that is not a StepBroadcaster message (magic {magic:#x}, "
            f"version {version}): ranks use different broadcasters or capacities"
        )
    if got != step & _MAX_WORDS:
        raise col.CollectiveError(f"received step {got}, expected step {step}: ranks out of step")
    if not _FIXED <= words <= min(size - data, head.size) or next_size < _FIXED:
        raise col.CollectiveError(f"corrupt header: {words} + {data} words in {size}")
    dims: list[tuple[int, tuple[int, ...]]] = []
    i = _FIXED
    for _ in range(n):
        nb, nd = int(head[i]), int(head[i + 1])
        dims.append((nb, tuple(int(x) for x in head[i + 2 : i + 2 + nd])))
        i += 2 + nd
    names = head[i:words].tobytes()
    meta, pos = [], 0
    for nb, shape in dims:
        meta.append((names[pos : pos + nb].decode(), shape))
        pos += nb
    return kind, next_size, words, meta


def views(buf: Any, words: int, meta: list) -> dict[str, Any]:
    """The arrays of a message as views into ``buf`` (numpy array or torch tensor)."""
    out: dict[str, Any] = {}
    off = words
    for name, shape in meta:
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = buf[off : off + size].reshape(shape)
        off += size
    return out


class StepBroadcaster:
    """Send each step's int32 batch metadata from rank ``src`` to every rank of ``group``.

    Every rank constructs it with the same arguments (a collective: the ranks check that they
    did); rank ``src`` calls :meth:`send` once per step, every other rank :meth:`recv`.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        Default: the whole world. A gloo group broadcasts host memory (what SGLang does with its
        CPU group); an NCCL group broadcasts a CUDA buffer (the sender packs on the host and
        copies it over; receivers read the header back, one small device-to-host copy).
    src : int
        The sending rank, as a rank of ``group``.
    capacity : int
        Words (int32) of the first message; grown and shrunk as described in the module
        docstring. Default 16,384 words (64 KiB).
    shrink_after : int
        Steps of low use before the size shrinks (0: never shrink).

    Attributes
    ----------
    step : int
        Steps sent (or received) so far.
    size : int
        Words of the next message.
    collectives : int
        Broadcasts issued so far (``step`` plus one per growth).

    Raises
    ------
    RankMismatchError
        Ranks gave different ``src``, ``capacity``, ``shrink_after`` or devices.
    CollectiveError
        The construction's all-gather failed (a rank died or never came).
    """

    def __init__(
        self,
        group: Any = None,
        src: int = 0,
        *,
        capacity: int = 1 << 14,
        shrink_after: int = 256,
    ):
        self.rank, world, backend = col.group_info(group)
        self.group = group
        self.src = src
        self.is_src = self.rank == src
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        mine = None
        try:
            if not (isinstance(src, int) and 0 <= src < world):
                raise ValueError(f"`src` = {src!r} is not a rank of the group (0..{world - 1})")
            for name, v, lo in (("capacity", capacity, 64), ("shrink_after", shrink_after, 0)):
                if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= _MAX_WORDS:
                    raise ValueError(f"`{name}` must be an integer in {lo}..{_MAX_WORDS}: {v!r}")
        except ValueError as e:
            mine = e
        fields = {"src": src, "capacity": capacity, "shrink_after": shrink_after,
                  "device": self.device.type, "version": VERSION}  # fmt: skip
        rows = col.all_gather(group, {"fields": fields, "error": mine and col.error_of(mine)},
                              "StepBroadcaster")  # fmt: skip
        diffs = col.mismatches([r["fields"] for r in rows], list(fields))
        if diffs:
            raise col.RankMismatchError("StepBroadcaster: ranks disagree: " + "; ".join(diffs))
        col.raise_errors([r["error"] for r in rows], "StepBroadcaster", mine)
        self._src_global = src if group is None else dist.get_global_rank(group, src)
        self.capacity = capacity
        self.shrink_after = shrink_after
        self.size = capacity
        self.step = 0
        self.collectives = 0
        self._low = 0  # consecutive steps of low use (sender)
        self._closed = False
        self._broken: str | None = None
        self._host = np.empty(0, dtype=np.int32)  # sender's packing buffer, grown on demand

    # ------------------------------------------------------------------ both sides
    def _usable(self, want_src: bool, what: str) -> None:
        if self._broken:
            raise col.CollectiveError(f"StepBroadcaster is broken since an earlier failure: "
                                      f"{self._broken}")  # fmt: skip
        if self._closed:
            raise col.CollectiveError(f"StepBroadcaster.{what}: closed")
        if want_src != self.is_src:
            who = f"rank {self.src} (src)" if want_src else f"ranks other than {self.src}"
            raise RuntimeError(f"StepBroadcaster.{what} is for {who}; this is rank {self.rank}")

    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        try:
            dist.broadcast(t, self._src_global, group=self.group)
        except RuntimeError as e:
            self._broken = f"{what} at step {self.step}: {e}"
            raise col.CollectiveError(
                f"StepBroadcaster.{what}: the broadcast of step {self.step} failed (a rank "
                f"died, or did not reach it within the group's timeout): {e}"
            ) from e
        self.collectives += 1

    # ------------------------------------------------------------------ sender
    def _message(self, words: list[int], arrays: dict[str, np.ndarray], size: int) -> None:
        """Pack the header and data into a ``size``-word buffer and broadcast it."""
        if self._host.size < size:
            self._host = np.empty(_pow2(size), dtype=np.int32)
        buf = self._host[:size]
        head = len(words)
        buf[:head] = words
        off = head
        for a in arrays.values():
            buf[off : off + a.size] = a.reshape(-1)
            off += a.size
        t = torch.from_numpy(buf)
        if self.device.type != "cpu":
            t = t.to(self.device)
        self._broadcast(t, "send")

    def send(self, **arrays: Any) -> int:
        """Broadcast this step's arrays (rank ``src`` only); returns the step number.

        Parameters
        ----------
        **arrays : numpy.ndarray or torch.Tensor
            int32 host arrays of any shape, by name, e.g. ``page_table`` ``[B, max_pages]``,
            ``seq_lens`` ``[B]``, ``slots`` ``[T]``, ``cu_seqlens`` ``[B + 1]``, and the host
            parts of attention plans (``ExtendPlan.work`` ``[n, 2]``, ``max_seq_len`` ``[1]``).
            Receivers get the same names in the same order.

        Raises
        ------
        ArrayTypeError
            An array that is not an int32 host array (nothing is sent).
        ValueError
            The step does not fit 2^31 - 1 words.
        CollectiveError
            The broadcast failed (a rank died); the broadcaster cannot be used afterwards.
        """
        self._usable(True, "send")
        arrs = {n: _as_int32(n, a) for n, a in arrays.items()}
        words = pack_header(self.step, _DATA, 0, arrs)
        need = len(words) + words[6]
        if need > _MAX_WORDS:
            raise ValueError(f"step of {need} int32 words exceeds {_MAX_WORDS}")
        if need > self.size:
            grown = fitted_size(need)
            self._message(pack_header(self.step, _GROW, grown, {}), {}, self.size)
            self.size, self._low = grown, 0
        self._low = self._low + 1 if 4 * need <= self.size else 0
        nxt = self.size
        if self.shrink_after and self._low >= self.shrink_after and self.size > self.capacity:
            nxt, self._low = max(self.capacity, fitted_size(need)), 0
        words[4] = nxt
        self._message(words, arrs, self.size)
        self.size = nxt
        self.step += 1
        return self.step - 1

    def close(self) -> None:
        """Tell every receiver that no more steps come (their :meth:`recv` returns None)."""
        self._usable(True, "close")
        self._message(pack_header(self.step, _CLOSE, self.size, {}), {}, self.size)
        self._closed = True

    # ------------------------------------------------------------------ receivers
    def recv(self) -> dict[str, Any] | None:
        """The arrays of the next step, as rank ``src`` sent them; None once the sender has closed.

        Returns
        -------
        dict of str to numpy.ndarray (gloo) or torch.Tensor (NCCL), or None
            int32 views into this step's received buffer (no copy). Each step receives into a
            fresh buffer, so the views stay valid after later steps.

        Raises
        ------
        CollectiveError
            The broadcast failed (the sender died, or the group's timeout passed), or the ranks
            are out of step; the broadcaster cannot be used afterwards.
        """
        self._usable(False, "recv")
        while True:
            t = torch.empty(self.size, dtype=torch.int32, device=self.device)
            self._broadcast(t, "recv")
            if self.device.type == "cpu":
                buf = head = t.numpy()
            else:  # read the header back (one small copy); the data stays on the device
                buf, head = t, t[: min(self.size, 1024)].cpu().numpy()
                if head.size >= _FIXED and int(head[5]) > head.size:
                    head = t[: min(int(head[5]), self.size)].cpu().numpy()
            try:
                kind, nxt, words, meta = parse_header(head, self.size, self.step)
            except col.CollectiveError as e:
                self._broken = str(e)
                raise
            self.size = nxt
            if kind == _GROW:
                continue
            if kind == _CLOSE:
                self._closed = True
                return None
            self.step += 1
            return views(buf, words, meta)
