"""``PageStore``: KV pages shared by instances through a Valkey/Redis server, one value per page.

Keys are the chained page hashes of :func:`kvpool.page_hashes` (the keys KV events announce):
``<prefix>:<fingerprint>:<hash as 16 hex digits>``. The fingerprint names the model and the
pool's layout, so pools that cannot read each other's bytes never share a key. Eviction is the
server's: run it with ``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lru`` (``MGET``
refreshes a key's LRU clock, so prefixes in use stay); the store sets no TTL unless asked.

Value format (version 1; every integer little-endian)::

    magic      b"KVPS"                                          4 bytes
    version    u16 = 1                                          2 bytes
    header_len u32                                              4 bytes
    header     UTF-8 JSON, sorted keys, no spaces (below)       header_len bytes
    tokens     the page's token ids, int32                      4 * page_size bytes
    prefix     XXH3-128 (seeded) of the whole prefix, below     16 bytes
    scales     the pool's per-tensor scale buffers, fp32        4 * header["scales"] bytes
    data       the page's bytes of every per-page buffer        header["page_bytes"] bytes
    checksum   XXH3-128 (seed 0) of every byte before it        16 bytes (xxhash's digest)

The *description* of a pool (:attr:`PageStore.description`) is a JSON object: ``format``
(``"kvpool.page"``), ``version``, ``model`` (default ``plan.spec.name``), ``dtype`` (the plan's
KV dtype), ``layer_dtypes``, ``page_size``, ``nvfp4_recipe``, ``tp_size``, ``tp_rank``,
``checksum`` (``"xxh3_128"``), ``page_bytes``, ``sections`` (``[name, torch dtype, per-page
shape, bytes]`` of each per-page buffer, in ``plan.buffers`` order; see :mod:`kvpool.page_io`)
and ``scales`` (the per-tensor scale buffers' names, in order). The *fingerprint* is the
XXH3-64 (seed 0) hex digest of the description's canonical JSON (sorted keys, no spaces):
everything that decides what a page's bytes mean, and nothing of the pool's size, so pools of
one model and layout share pages whatever their budgets. Each value's header is the
description without ``layer_dtypes``, ``sections`` and ``scales`` (replaced by their count),
plus ``fingerprint``; the whole description (plus ``fingerprint``) is stored once under
``<prefix>:<fingerprint>:layout`` by the first put.

``prefix`` is XXH3-128, seeded with the store's seed, over ``le_u64(h[j]) || le_i32(tokens of
page j)`` for every page ``j`` up to and including this one (``h`` = the page hashes). A
value is used only when its header equals this pool's, its checksum, its tokens, its prefix
digest and its per-tensor scales all match; anything else (a 64-bit key collision, a value from
another model or layout, a truncated or corrupt value, other scales) is a miss, logged with
its reason, never wrong KV.

Connection faults never stall the caller beyond the socket timeouts: a failed command is
logged as a warning and the store is skipped (every call a miss or a no-op) for
``retry_after`` seconds; the client does not retry.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool._core import page_hashes
from kvpool._deps import require_redis, require_xxhash
from kvpool._torch import torch

if TYPE_CHECKING:
    from kvpool.pool import KVPool

logger = logging.getLogger("kvpool.store")

MAGIC = b"KVPS"
VERSION = 1
_FIXED = struct.Struct("<4sHI")  # magic, version, header length
_DIGEST = 16
#: Description fields kept out of each value's header (in the ``layout`` key instead)
_LONG = ("layer_dtypes", "sections", "scales")


def connect(url: str, *, socket_timeout: float = 0.5, socket_connect_timeout: float = 0.5) -> Any:
    """A ``redis`` client for ``url``, with the given timeouts (seconds) and no retries.

    ``redis://[[user]:password@]host:port/db``, ``rediss://...`` (TLS) and ``unix://path``
    give a :class:`redis.Redis`; ``redis+cluster://host:port`` (``rediss+cluster://`` for TLS)
    gives a :class:`redis.cluster.RedisCluster` that discovers the other nodes from that one.

    Raises
    ------
    ValueError
        A scheme other than those.
    ImportError
        The ``redis`` package is missing (``pip install 'kvpool[store]'``).
    """
    redis = require_redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = dict(
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        retry=Retry(NoBackoff(), 0),
    )
    scheme, rest = _scheme(url)
    if scheme.endswith("+cluster"):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(f"{scheme.split('+')[0]}://{rest}", **kw)
    return redis.Redis.from_url(url, **kw)


_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def _scheme(url: Any) -> tuple[str, str]:
    if not isinstance(url, str):
        raise ValueError(f"`url` must be a string, got {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ValueError(
            f"`url` = {url!r}: the scheme must be one of {', '.join(s + '://' for s in _SCHEMES)}"
        )
    return scheme, rest


@dataclass
class StorePrefix:
    """What :meth:`PageStore.get_prefix` found: the pages after ``start_page`` up to the first miss.

    Attributes
    ----------
    start_page : int
        Index (in pages of the token sequence) of the first page looked up.
    hashes : numpy.ndarray
        uint64 ``[num_pages]``: the page hashes of the pages found.
    rows : list of numpy.ndarray
        One uint8 ``[page_bytes]`` array per page found: its bytes as
        :meth:`kvpool.page_io.PageLayout.read` gives them (views of the values received).
    stop : str
        Why the lookup stopped: ``"end"`` (every page asked for was found), ``"absent"`` (the next
        key is not in the store), ``"skipped"`` (store unavailable), or the reason a value was
        refused (``"checksum mismatch"``, ``"tokens differ"``, ...).
    page_bytes : int
        Bytes of one page (the width of :attr:`data`).
    """

    start_page: int
    hashes: np.ndarray
    rows: list[np.ndarray]
    stop: str
    page_bytes: int = 0

    @property
    def num_pages(self) -> int:
        """Pages found."""
        return len(self.hashes)

    def num_tokens(self, page_size: int) -> int:
        """Tokens in the pages found (``num_pages * page_size``)."""
        return self.num_pages * page_size

    @property
    def data(self) -> torch.Tensor:
        """uint8 ``[num_pages, page_bytes]`` on the CPU: the rows as one tensor (a copy)."""
        if not self.rows:
            return torch.empty((0, self.page_bytes), dtype=torch.uint8)
        return torch.from_numpy(np.stack(self.rows))


@dataclass
class _Stats:
    puts: int = 0
    put_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    refused: int = 0
    errors: int = 0
    skipped: int = 0


class PageStore:
    """KV pages of a :class:`~kvpool.KVPool` in a Valkey/Redis server, shared by instances.

    Not thread-safe as one object (its staging buffer); the ``redis`` client is, so a put may run
    on a second ``PageStore`` of the same pool in a background thread.

    Parameters
    ----------
    pool : KVPool
        The pool whose pages are stored and loaded (any device; bytes cross through the CPU).
    url : str, optional
        Server URL (see :func:`connect`); or give ``client``.
    seed : int
        The page-hash seed (:func:`kvpool.page_hashes`), the same on every instance that
        shares the store (and on the router that reads the events).
    client : redis.Redis or redis.cluster.RedisCluster, optional
        A ready client instead of ``url`` (its own timeouts and retries apply).
    model : str, optional
        Names the weights (default ``pool.plan.spec.name``); instances with different weights
        of one geometry must use different names.
    tp_rank : int
        This rank's index in its tensor-parallel group (each rank stores its own KV heads).
    prefix : str
        First part of every key.
    socket_timeout, socket_connect_timeout : float
        Seconds a command / a connection may take before the store is skipped (``url`` only).
    retry_after : float
        Seconds the store is skipped after a failed command.
    ttl : float, optional
        Expire values after this many seconds (default: none; the server's LRU evicts).

    Attributes
    ----------
    server : str
        The server as log lines name it: the URL without its password (or the client's repr).
    layout : kvpool.page_io.PageLayout
        The pool's per-page buffers (``pool.page_layout``).
    fingerprint : str
        16 hex digits naming the model and layout (see the module docstring).
    description : dict
        The pool's description, whose digest is the fingerprint (module docstring).
    header : dict
        The JSON header every value carries.
    value_bytes : int
        Bytes of one stored value.
    stats : dict
        Counters: ``puts``/``put_bytes`` (pages and value bytes written), ``lookups``,
        ``hits``/``misses`` (pages found / lookups that stopped on an absent key),
        ``refused`` (values refused: corrupt, truncated, foreign), ``errors`` (failed
        commands), ``skipped`` (calls skipped while the server was unavailable).

    Raises
    ------
    ValueError
        Neither or both of ``url`` and ``client``; a pool with buffers outside the primary page
        space (see :class:`kvpool.page_io.PageLayout`); a bad URL scheme.
    """

    #: Pages per chunk of :meth:`put_pages` reads and :meth:`load` writes (the staging rows).
    STAGING_PAGES = 16

    def __init__(
        self,
        pool: KVPool,
        url: str | None = None,
        *,
        seed: int,
        client: Any = None,
        model: str | None = None,
        tp_rank: int = 0,
        prefix: str = "kvpool",
        socket_timeout: float = 0.5,
        socket_connect_timeout: float = 0.5,
        retry_after: float = 5.0,
        ttl: float | None = None,
    ):
        if (url is None) == (client is None):
            raise ValueError("give exactly one of `url` and `client`")
        self._xxh = require_xxhash()
        plan = pool.plan
        self.pool = pool
        self.layout = pool.page_layout
        self.page_size = plan.page_size
        self.seed = int(seed)
        page_hashes(np.zeros(0, np.int32), 1, seed=self.seed)  # checks the seed's range
        if url is not None:
            _scheme(url)  # a bad URL fails here, not at the first command
        self._url = url
        self.server = _redact(url) if url is not None else repr(client)
        self._timeouts = dict(
            socket_timeout=socket_timeout, socket_connect_timeout=socket_connect_timeout
        )
        self._client = client
        self.retry_after = float(retry_after)
        self.ttl = ttl
        self._down_until = 0.0
        desc = {
            "format": "kvpool.page",
            "version": VERSION,
            "model": plan.spec.name if model is None else model,
            "dtype": plan.dtype,
            "layer_dtypes": list(plan.layer_dtypes),
            "page_size": plan.page_size,
            "nvfp4_recipe": plan.nvfp4_recipe,
            "tp_size": plan.tp_size,
            "tp_rank": int(tp_rank),
            "checksum": "xxh3_128",
            "page_bytes": self.layout.page_bytes,
            "sections": [
                [s.name, s.dtype, list(s.page_shape), s.nbytes] for s in self.layout.sections
            ],  # fmt: skip
            "scales": list(self.layout.scales),
        }
        self.fingerprint = self._xxh.xxh3_64_hexdigest(_canonical(desc))
        self.description = desc | {"fingerprint": self.fingerprint}
        self.header = {k: v for k, v in self.description.items() if k not in _LONG} | {
            "scales": len(self.layout.scales)
        }
        hdr = _canonical(self.header)
        self._lead = _FIXED.pack(MAGIC, VERSION, len(hdr)) + hdr
        self._described = False
        self._key_prefix = f"{prefix}:{self.fingerprint}:"
        n_scales = len(self.layout.scales)
        self._tok_off = len(self._lead)
        self._dig_off = self._tok_off + 4 * self.page_size
        self._scale_off = self._dig_off + _DIGEST
        self._data_off = self._scale_off + 4 * n_scales
        self.value_bytes = self._data_off + self.layout.page_bytes + _DIGEST
        self._stats = _Stats()
        self._staging: torch.Tensor | None = None

    @property
    def layout_key(self) -> str:
        """The key holding :attr:`description` as JSON (written with the first put, ``NX``)."""
        return self._key_prefix + "layout"

    # --- keys ---------------------------------------------------------------------------

    def hashes(self, tokens: np.ndarray, namespace: Any = None) -> np.ndarray:
        """The page hashes of ``tokens`` (uint64, one per whole page) under the store's seed."""
        return page_hashes(_tokens(tokens), self.page_size, seed=self.seed, namespace=namespace)

    def key(self, page_hash: int) -> str:
        """The key of the page with hash ``page_hash``."""
        return f"{self._key_prefix}{int(page_hash):016x}"

    def _prefix_digests(self, tokens: np.ndarray, hashes: np.ndarray, n: int) -> list[bytes]:
        h = self._xxh.xxh3_128(seed=self.seed)
        out = []
        ps = self.page_size
        for j in range(n):
            h.update(struct.pack("<Q", int(hashes[j])))
            h.update(tokens[j * ps : (j + 1) * ps].tobytes())
            out.append(h.digest())
        return out

    # --- the connection and its faults -----------------------------------------------------

    @property
    def client(self) -> Any:
        """The ``redis`` client (made at first use from ``url``: a cluster client connects then).

        Raises
        ------
        redis.exceptions.RedisError, OSError
            The connection failed (the store's own calls catch these and skip).
        """
        if self._client is None:
            self._client = connect(self._url, **self._timeouts)
        return self._client

    def _is_cluster(self) -> bool:
        from redis.cluster import RedisCluster

        return isinstance(self.client, RedisCluster)

    def _available(self) -> bool:
        if time.monotonic() < self._down_until:
            self._stats.skipped += 1
            return False
        return True

    def _failed(self, what: str, e: Exception) -> None:
        self._stats.errors += 1
        self._down_until = time.monotonic() + self.retry_after
        logger.warning(
            "page store %s: %s failed (%s: %s); the store is skipped for %.1f s",
            self.server, what, type(e).__name__, e, self.retry_after,
        )  # fmt: skip

    def _errors(self) -> tuple[type[BaseException], ...]:
        from redis.exceptions import RedisClusterException, RedisError

        return (RedisError, RedisClusterException, OSError)

    # --- put / get ------------------------------------------------------------------------

    def put_pages(
        self, tokens: np.ndarray, pages: np.ndarray, *, namespace: Any = None, start_page: int = 0
    ) -> int:
        """Store the whole pages of ``tokens`` from ``start_page`` on, read from ``pages``.

        ``tokens``: 1-D int32/int64 from the start of the sequence; ``pages``: int page ids,
        one per page of ``tokens`` (``len(tokens) // page_size``, or one more for a partial last
        page, which is not stored), as ``RadixCache.insert`` takes them. One gather per buffer
        of the pool per ``STAGING_PAGES`` pages, then one pipeline of ``SET`` commands. Returns
        the pages written (0 when the server is unavailable: the failure is logged, nothing is
        raised).

        Raises
        ------
        ValueError
            ``pages`` has the wrong length or bad page ids; ``start_page`` out of range.
        """
        tokens = _tokens(tokens)
        pages = np.asarray(pages).reshape(-1)
        n = len(tokens) // self.page_size
        if len(pages) not in (n, n + (len(tokens) % self.page_size > 0)):
            raise ValueError(
                f"`pages` has {len(pages)} ids for {len(tokens)} tokens of page size "
                f"{self.page_size} ({n} whole pages)"
            )
        if not 0 <= start_page <= n:
            raise ValueError(f"`start_page` = {start_page}: must be in 0..{n}")
        self.layout.check_pages(pages[start_page:n])
        if start_page == n or not self._available():
            return 0
        hashes = self.hashes(tokens, namespace)
        digests = self._prefix_digests(tokens, hashes, n)
        scales = self.layout.scale_bytes()
        try:
            pipe = self.client.pipeline(transaction=False)
            if not self._described:
                pipe.set(self.layout_key, _canonical(self.description), nx=True)
            px = None if self.ttl is None else int(self.ttl * 1000)
            for lo in range(start_page, n, self.STAGING_PAGES):  # read in chunks
                hi = min(n, lo + self.STAGING_PAGES)
                data = self._read(pages[lo:hi])
                for j in range(lo, hi):
                    value = self._encode(tokens, j, digests[j], scales, data[j - lo])
                    pipe.set(self.key(hashes[j]), value, px=px)
            pipe.execute()
        except self._errors() as e:
            self._failed(f"put of {n - start_page} pages", e)
            return 0
        self._described = True
        self._stats.puts += n - start_page
        self._stats.put_bytes += (n - start_page) * self.value_bytes
        return n - start_page

    def _encode(
        self, tokens: np.ndarray, j: int, digest: bytes, scales: bytes, data: np.ndarray
    ) -> memoryview:
        ps = self.page_size
        buf = bytearray(self.value_bytes)
        view = memoryview(buf)
        view[: self._tok_off] = self._lead
        view[self._tok_off : self._dig_off] = tokens[j * ps : (j + 1) * ps].tobytes()
        view[self._dig_off : self._scale_off] = digest
        view[self._scale_off : self._data_off] = scales
        view[self._data_off : -_DIGEST] = data.data
        view[-_DIGEST:] = self._xxh.xxh3_128_digest(view[:-_DIGEST])
        return view

    def get_prefix(
        self,
        tokens: np.ndarray,
        *,
        namespace: Any = None,
        start_page: int = 0,
        max_pages: int | None = None,
    ) -> StorePrefix:
        """The stored pages of ``tokens`` from ``start_page`` on, up to the first miss.

        One ``MGET`` (``mget_nonatomic`` on a cluster) of every whole page from ``start_page``
        (at most ``max_pages``); values are checked in order and the first absent or refused one
        ends the prefix (a refused value is logged with its reason). Never raises on a server
        fault: the result is then empty with ``stop == "skipped"``.

        Raises
        ------
        ValueError
            ``start_page`` or ``max_pages`` negative.
        """
        tokens = _tokens(tokens)
        if start_page < 0 or (max_pages is not None and max_pages < 0):
            raise ValueError(f"`start_page` = {start_page}, `max_pages` = {max_pages}: >= 0")
        hashes = self.hashes(tokens, namespace)
        end = len(hashes) if max_pages is None else min(len(hashes), start_page + max_pages)
        self._stats.lookups += 1
        if start_page >= end:
            return self._prefix(start_page, hashes[:0], [], "end")
        if not self._available():
            return self._prefix(start_page, hashes[:0], [], "skipped")
        keys = [self.key(h) for h in hashes[start_page:end]]
        try:
            mget = self.client.mget_nonatomic if self._is_cluster() else self.client.mget
            values = mget(keys)
        except self._errors() as e:
            self._failed(f"lookup of {len(keys)} pages", e)
            return self._prefix(start_page, hashes[:0], [], "skipped")
        digests = self._prefix_digests(tokens, hashes, end)
        scales = self.layout.scale_bytes()
        found: list[np.ndarray] = []
        stop = "end"
        for j, v in zip(range(start_page, end), values, strict=True):
            if v is None:
                stop = "absent"
                self._stats.misses += 1
                break
            why = self._check(v, tokens, j, digests[j], scales)
            if why is not None:
                stop = why
                self._stats.refused += 1
                key = keys[j - start_page]
                logger.warning("page store: value of %s refused (%s): a miss", key, why)
                break
            found.append(np.frombuffer(v, np.uint8, self.layout.page_bytes, self._data_off))
        self._stats.hits += len(found)
        return self._prefix(start_page, hashes[start_page : start_page + len(found)], found, stop)

    def _prefix(self, start: int, hashes: np.ndarray, rows: list, stop: str) -> StorePrefix:
        return StorePrefix(start, hashes, rows, stop, self.layout.page_bytes)

    def _check(
        self, v: bytes, tokens: np.ndarray, j: int, digest: bytes, scales: bytes
    ) -> str | None:
        """Why value ``v`` cannot be page ``j`` of ``tokens`` here, or None when it can."""
        if len(v) < _FIXED.size:
            return f"truncated: {len(v)} bytes"
        magic, version, hlen = _FIXED.unpack_from(v)
        if magic != MAGIC:
            return f"not a kvpool page (magic {magic!r})"
        if version != VERSION:
            return f"format version {version}, this reader reads {VERSION}"
        lead = memoryview(v)[: self._tok_off]
        if lead != self._lead:
            try:
                other = json.loads(bytes(v[_FIXED.size : _FIXED.size + hlen]))
                fp = other.get("fingerprint")
                return (
                    f"foreign: fingerprint {fp} (model {other.get('model')!r}, dtype "
                    f"{other.get('dtype')!r}), this pool's is {self.fingerprint}"
                )
            except (ValueError, UnicodeDecodeError, AttributeError):
                return "corrupt header"
        if len(v) != self.value_bytes:
            return f"truncated: {len(v)} bytes, a page is {self.value_bytes}"
        if self._xxh.xxh3_128_digest(memoryview(v)[:-_DIGEST]) != v[-_DIGEST:]:
            return "checksum mismatch"
        ps = self.page_size
        if v[self._tok_off : self._dig_off] != tokens[j * ps : (j + 1) * ps].tobytes():
            return "tokens differ (page hash collision)"
        if v[self._dig_off : self._scale_off] != digest:
            return "prefix digest differs (page hash collision)"
        if v[self._scale_off : self._data_off] != scales:
            return "per-tensor scales differ from this pool's"
        return None

    def load(self, found: StorePrefix, pages: np.ndarray) -> None:
        """Write the pages of ``found`` into page ids ``pages`` of the pool (one per page).

        Through a staging tensor of at most ``STAGING_PAGES`` pages, kept by the store (so
        its memory is touched once): per chunk one copy per page into it, then one scatter per
        buffer (:meth:`kvpool.page_io.PageLayout.write`).

        Raises
        ------
        ValueError
            ``pages`` does not hold ``found.num_pages`` valid, distinct ids (nothing written).
        """
        pages = np.asarray(pages).reshape(-1)
        if len(pages) != found.num_pages:
            raise ValueError(f"`pages` has {len(pages)} ids, `found` {found.num_pages} pages")
        self.layout.check_pages(pages)
        if len(np.unique(pages)) != len(pages):
            raise ValueError(f"`pages` repeats a page id: {pages.tolist()}")
        staging = self._stage()
        stage = staging.numpy()
        for lo in range(0, len(pages), self.STAGING_PAGES):
            chunk = found.rows[lo : lo + self.STAGING_PAGES]
            for i, row in enumerate(chunk):
                stage[i] = row
            self.layout.write(pages[lo : lo + len(chunk)], staging[: len(chunk)])

    def _stage(self) -> torch.Tensor:
        if self._staging is None:
            shape = (self.STAGING_PAGES, self.layout.page_bytes)
            self._staging = torch.empty(shape, dtype=torch.uint8)
        return self._staging

    def _read(self, pages: np.ndarray) -> np.ndarray:
        """The bytes of ``pages`` (at most ``STAGING_PAGES``) on the CPU, in the staging rows."""
        if self.pool.device.type == "cpu":
            return self.layout.read(pages, out=self._stage()).numpy()
        stage = self._stage()[: len(pages)]
        stage.copy_(self.layout.read(pages))
        return stage.numpy()

    @property
    def stats(self) -> dict[str, int]:
        """The counters (see the class docstring), as a dict."""
        return asdict(self._stats)


def _redact(url: str) -> str:
    """``url`` with the password of its user part replaced by ``***``."""
    scheme, _, rest = url.partition("://")
    auth, at, host = rest.rpartition("@")
    if not at:
        return url
    user = auth.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in auth else f"{scheme}://***@{host}"


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _tokens(tokens: Any) -> np.ndarray:
    t = np.asarray(tokens)
    if t.ndim != 1 or not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"`tokens` must be a 1-D integer array, got {t.dtype} {t.shape}")
    if t.size and (t.min() < np.iinfo(np.int32).min or t.max() > np.iinfo(np.int32).max):
        raise ValueError("`tokens` holds ids beyond int32")
    return np.ascontiguousarray(t, dtype="<i4")
