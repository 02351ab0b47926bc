"""The running requests' decode metadata, kept across steps and updated in place.

A decode step of ``B`` requests needs their ``[B, max_pages]`` int32 page table, ``seq_lens``
and the slot of each new token. Rebuilding the table every step from each request's page list
(:func:`kvpool.page_table`) costs host time in proportion to the whole table; between two steps
only a few entries change: a request that starts decoding brings its row, one that ends takes
its row away, and a request whose next token starts a page gains one entry. :class:`RunningBatch`
keeps the arrays and writes only those changes:

- rows ``0 .. n - 1`` are the running requests in batch order (the arrays' first ``n`` rows are
  the step's batch, no gather); :meth:`add` appends a row, :meth:`remove` moves the last row
  into the freed one (its caller renumbers that request);
- :meth:`grow` finds the rows whose next token needs a new page
  and writes the pages given for them after their last ones, in place (one Rust call,
  ``kvpool._core.grow_pages``);
- :meth:`slots` computes the new tokens' slots into a persistent array
  (:func:`kvpool.decode_slots` with ``out=``); :meth:`advance` adds the step's token to every
  row (``seq_lens += 1``) and keeps the sampled ids as the next step's inputs.

Entries of a row past its pages are 0 (the padding page). Arrays are numpy int32 (``next_ids``
int64), what :class:`kvpool.graph.DecodeGraph` and the attention entry points take.

Examples
--------
>>> import numpy as np
>>> from kvpool.running import RunningBatch
>>> rb = RunningBatch(max_rows=4, max_pages=3, page_size=16)
>>> rb.add(np.array([5], np.int32), seq_len=17, next_id=7)  # 16 cached, its 17th is next
0
>>> rb.add(np.array([2, 3], np.int32), seq_len=18, next_id=9)
1
>>> rb.grow(lambda k: np.array([8], np.int32)[:k])  # row 0's 17th token needs a page
(array([0]), array([8], dtype=int32))
>>> rb.slots().tolist()  # page * page_size + offset of each row's next token
[128, 49]
>>> rb.advance(np.array([1, 2]))  # the step ran: one more token each
>>> rb.table[:2].tolist(), rb.seq_lens[:2].tolist()
([[5, 8, 0], [2, 3, 0]], [18, 19])
>>> rb.remove(0)  # row 1 moves into row 0
1
>>> rb.table[:1].tolist(), rb.next_ids[:1].tolist()
([[2, 3, 0]], [2])
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool._core import decode_slots, grow_pages


class RunningBatch:
    """Page table, lengths and next inputs of the running requests (see the module docstring).

    Parameters
    ----------
    max_rows : int
        Requests running at once, at most.
    max_pages : int
        Page table width (pages per request, at most).
    page_size : int
        Tokens per page.

    Attributes
    ----------
    n : int
        Rows in use (the batch size).
    table : numpy.ndarray
        ``[max_rows, max_pages]`` int32; row ``i < n`` holds request ``i``'s pages in order,
        0 past them.
    seq_lens : numpy.ndarray
        ``[max_rows]`` int32: tokens of each request in the cache once the next step has
        written its new token (the new one included), as a decode step takes them.
    num_pages : numpy.ndarray
        ``[max_rows]`` int32: pages in each row.
    next_ids : numpy.ndarray
        ``[max_rows]`` int64: each request's next input token.

    Raises
    ------
    ValueError
        A size < 1.
    """

    def __init__(self, max_rows: int, max_pages: int, page_size: int):
        for name, v in (("max_rows", max_rows), ("max_pages", max_pages),
                        ("page_size", page_size)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` = {v!r}: must be an int >= 1")
        self.page_size = page_size
        self.n = 0
        self.table = np.zeros((max_rows, max_pages), np.int32)
        self.seq_lens = np.zeros(max_rows, np.int32)
        self.num_pages = np.zeros(max_rows, np.int32)
        self.next_ids = np.zeros(max_rows, np.int64)
        self._slots = np.zeros(max_rows, np.int32)

    @property
    def max_rows(self) -> int:
        """Rows the batch can hold."""
        return self.table.shape[0]

    @property
    def max_pages(self) -> int:
        """Width of the page table."""
        return self.table.shape[1]

    def add(self, pages: np.ndarray, seq_len: int, next_id: int) -> int:
        """Append a request (its page ids in order, ``seq_len`` as in ``seq_lens``); its row.

        Raises
        ------
        ValueError
            The batch is full, the pages do not fit the table's width or do not cover
            ``seq_len - 1`` tokens (the ones in the cache before the next step).
        """
        pages = np.asarray(pages, np.int32).reshape(-1)
        if self.n == self.max_rows:
            raise ValueError(f"the batch is full ({self.max_rows} rows)")
        if pages.size > self.max_pages:
            raise ValueError(f"{pages.size} pages do not fit the table's {self.max_pages}")
        if seq_len < 1 or pages.size * self.page_size < seq_len - 1:
            raise ValueError(
                f"`seq_len` = {seq_len}: {pages.size} pages of {self.page_size} tokens must hold "
                "its seq_len - 1 cached tokens, and seq_len >= 1"
            )
        i = self.n
        self.table[i, : pages.size] = pages
        self.table[i, pages.size :] = 0
        self.num_pages[i], self.seq_lens[i], self.next_ids[i] = pages.size, seq_len, next_id
        self.n += 1
        return i

    def remove(self, row: int) -> int | None:
        """Free ``row``; the last row moves into it.

        Returns the moved row's old index (the caller's request at that index is now at
        ``row``), or None when ``row`` was the last.

        Raises
        ------
        IndexError
            ``row`` is not in ``0 .. n - 1``.
        """
        if not 0 <= row < self.n:
            raise IndexError(f"row {row} is not in use (rows 0..{self.n - 1})")
        last = self.n - 1
        self.n = last
        if row == last:
            return None
        for a in (self.table, self.seq_lens, self.num_pages, self.next_ids):
            a[row] = a[last]
        return last

    def grow(self, alloc: Callable[[int], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Give pages to every row whose pages do not hold its next token.

        ``alloc(k)`` returns ``k`` page ids (>= 1), written in row order after those rows'
        pages (``kvpool._core.grow_pages``: one call for the batch).

        Returns ``(rows, pages)``: the rows that grew and their new pages (empty when none).

        Raises
        ------
        ValueError
            A row would exceed the table's width (nothing is written; ``alloc`` is not called);
            ``alloc`` gave the wrong number of pages or page 0 (nothing written; the pages it
            gave are the caller's to free).
        Whatever ``alloc`` raises (e.g. MemoryError) propagates, nothing written.
        """
        n = self.n
        # (one Rust call: the short rows, one alloc call, the pages written after theirs)
        return grow_pages(self.table[:n], self.num_pages[:n], self.seq_lens[:n],
                          self.page_size, lambda k: np.asarray(alloc(k), np.int32))  # fmt: skip

    def slots(self) -> np.ndarray:
        """``[n]`` int32 slot of each row's next token (a view of a persistent array)."""
        n = self.n
        return decode_slots(self.table[:n], self.seq_lens[:n], self.page_size,
                            out=self._slots[:n])  # fmt: skip

    def advance(self, next_ids: np.ndarray) -> None:
        """A step ran: one more token per row, ``next_ids`` (``[n]``) the next inputs."""
        n = self.n
        self.next_ids[:n] = next_ids
        self.seq_lens[:n] += 1
