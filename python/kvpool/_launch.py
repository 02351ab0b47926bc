"""Recorded Triton launches: a kernel launch replayed without Triton's per-call JIT dispatch.

``kernel[grid](*args, **kwargs)`` goes through ``JITFunction.run`` on every call: it binds the
arguments to the kernel's signature, computes each argument's specialization (dtype, 16-byte
alignment, integer divisibility), hashes them into a cache key, looks the compiled kernel up,
checks the kernel's global values and builds launch metadata for the profiler hooks; only then
does the compiled kernel's launcher (``CompiledKernel.run``) call the driver. For the decode
kernels' ~50 arguments that dispatch costs tens of microseconds of host time per launch, several
times the launcher's own cost (issue 22, ``benches/step``).

A :class:`Launch` is made once for one set of everything that decides the specialization (the
callers key their records on it: dtypes, shapes, strides, alignment, the kernel's constexprs)
and is then replayed with the arguments that change from call to call (a layer's ``q`` and
``out``, a step's page table) put in their places:

- on CUDA it resolves the compiled kernel once (``JITFunction.warmup`` with the recorded
  arguments: a cache hit after the first launch) and replays through the compiled kernel's
  launcher with the recorded grid and the full bound argument list (constexprs included, as
  ``JITFunction.run`` passes them in Triton 3.3 .. 3.9: ``kernel.run(grid_0, grid_1, grid_2,
  stream, kernel.function, kernel.packed_metadata, launch_metadata, enter_hook, exit_hook,
  *bound_args)``);
- where that is unavailable (the CPU interpreter, ``TRITON_INTERPRET=1``; an object that is not
  a JIT function, such as a benchmark's stub), or while a Triton launch hook is installed (a
  profiler such as proton needs the metadata), it launches the normal way,
  ``fn[grid](*args, **kwargs)``, with the same substitutions.

A replay through the launcher passes every pointer as an int: the recorded ones (the pool's
buffers, kept alive by the record) resolved once, the per-call ones as ``data_ptr()`` (the
callers read it anyway for the alignment in their keys). Given a tensor, Triton's launcher
calls its ``data_ptr`` method and ``cuPointerGetAttribute`` for every pointer argument on every
launch, a few hundred nanoseconds each for ~10-16 pointers per kernel.

Where the Triton version's launcher is known (:data:`DIRECT_TRITON`), a replay calls the C
launch function under Triton's ``CudaLauncher`` directly, skipping its Python wrapper
(:func:`_direct_launch`).

Module switches: ``FAST`` False makes every record launch the normal way (tests compare both
bit for bit); ``RECORD`` False stops recording (``benches/step/bench_host.py`` times all three);
``DIRECT`` False replays through ``CudaLauncher.__call__`` instead of its C launch.
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

#: Replay through the compiled kernel's launcher where possible (else the normal launch).
FAST = True
#: Device types whose records resolve the compiled kernel (``benches/step/bench_host.py``'s
#: stub mode adds ``"cpu"``, with stand-in kernels and driver, to time the CUDA path's host
#: side on a CPU).
FAST_DEVICE_TYPES = ("cuda",)
#: Record launches at all (False: every call checks and launches from scratch, as before
#: records existed; ``benches/step/bench_host.py`` times the three ways).
RECORD = True
#: Replay through the C launch function under Triton's launcher where the version is known.
DIRECT = True


_RUNTIME: list[Any] = []  # triton.knobs.runtime, imported on first use


def _hooks_idle() -> bool:
    """Whether no Triton launch hook is installed (a profiler needs the normal launch path).

    Triton 3.3+ keeps the hooks as ``HookChain`` objects (idle: no ``calls``); a hook set as a
    plain callable counts as installed.
    """
    if not _RUNTIME:
        try:
            from triton import knobs
        except ImportError:  # (no knobs: Triton < 3.3, whose launcher takes other arguments)
            return False
        _RUNTIME.append(knobs.runtime)
    rt = _RUNTIME[0]
    h = rt.launch_enter_hook
    if h is not None and getattr(h, "calls", True):
        return False
    h = rt.launch_exit_hook
    return h is None or not getattr(h, "calls", True)


_GENERATIONS = itertools.count(1)


class Generation:
    """Mixin of the objects records are made from (layer views, plans).

    Every attribute set gives the object a new generation ``_gen``, unique over all objects,
    so that a record made at generation ``g`` is known valid while the object's ``_gen`` is
    still ``g`` (one int compare per call instead of comparing every field by identity).
    """

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        self.__dict__["_gen"] = next(_GENERATIONS)

    def __deepcopy__(self, memo: dict) -> Any:
        """A deep copy without the records made from this object, at a generation of its own.

        A record holds its buffers' addresses as ints (the fast replay's): copied with the
        generation, a record would still be valid on the copy and replay on the original's
        buffers. (``copy.copy`` keeps both: the copy has the same buffers.)
        """
        import copy

        obj = object.__new__(type(self))
        memo[id(self)] = obj
        d = obj.__dict__
        for k, v in self.__dict__.items():
            if k not in _CACHE_KEYS:
                d[k] = copy.deepcopy(v, memo)
        d["_gen"] = next(_GENERATIONS)
        return obj

    @classmethod
    def fresh(cls, **fields: Any):
        """A new instance of this dataclass from its fields, the fast way.

        Skips the per-field ``__setattr__`` (~0.3 us each) of the generated ``__init__``: what
        the planners use once per step (no ``__post_init__`` runs).
        """
        spec = _FIELDS.get(cls)
        if spec is None:
            spec = _FIELDS[cls] = _field_spec(cls)
        names, required, defaults = spec
        keys = fields.keys()
        if not (keys <= names and required <= keys):
            raise TypeError(
                f"{cls.__name__}.fresh(): unknown fields {sorted(keys - names)}, missing "
                f"{sorted(required - keys)}"
            )
        obj = object.__new__(cls)
        d = obj.__dict__
        d.update(defaults)
        d.update(fields)
        d["_gen"] = next(_GENERATIONS)
        return obj


_FIELDS: dict[type, tuple[frozenset, frozenset, dict]] = {}
# what the launch paths cache in a Generation object's __dict__ (not copied by deepcopy)
_CACHE_KEYS = frozenset(("_gen", "_launch_records", "_launch_key"))


def _field_spec(cls: type) -> tuple[frozenset, frozenset, dict]:
    """(field names, required names, defaults) of dataclass ``cls`` (plain defaults only)."""
    import dataclasses

    fs = dataclasses.fields(cls)
    if any(f.default_factory is not dataclasses.MISSING for f in fs):
        raise TypeError(f"{cls.__name__}: fresh() takes no default factories")
    defaults = {f.name: f.default for f in fs if f.default is not dataclasses.MISSING}
    names = frozenset(f.name for f in fs)
    return names, names - defaults.keys(), defaults


def generation(obj: Any) -> int | None:
    """``obj``'s :class:`Generation` (None for an object without one)."""
    return obj.__dict__.get("_gen")


def call(calls: list | None, fn: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``fn[grid](*args, **kwargs)`` now, or appended to ``calls`` (a list) to be recorded."""
    if calls is None:
        fn[grid](*args, **kwargs)
    else:
        calls.append((fn, grid, args, kwargs))


def records(owner: Any) -> dict:
    """The records kept on ``owner`` (a layer view): a dict stored in its ``__dict__``.

    Kept on the object they replay the buffers of, so that they go when it goes (a record
    holds the buffers' tensors). Bounded: cleared at 1,024 keys (an eager serving loop keeps
    a decode and a write record per batch size it meets).
    """
    d = owner.__dict__.get("_launch_records")
    if d is None or len(d) >= 1024:
        d = owner.__dict__["_launch_records"] = {}
    return d


def tensor_key(t: Any) -> tuple | None:
    """What a kernel is specialized on in a tensor argument, and what the checks read.

    Dtype, shape, strides, device index (-1: CPU) and the address modulo 16; None for None.
    """
    if t is None:
        return None
    return (t.dtype, t.shape, t.stride(), t.get_device(), t.data_ptr() & 15)


class Launch:
    """One kernel launch, replayed with its per-call arguments substituted.

    Parameters
    ----------
    fn : triton JITFunction (or anything launched as ``fn[grid](*args, **kwargs)``)
        The kernel.
    grid : tuple of int
        The launch grid (1 to 3 dims).
    args : sequence
        Positional arguments of the recorded call.
    kwargs : mapping
        Keyword arguments (constexprs and launch options such as ``num_warps``).
    per_call : sequence of torch.Tensor or None
        The arguments that change between calls, in the order :meth:`__call__` takes them.
        Every position holding one of these objects (by identity) is replaced on each call;
        None entries are placeholders with no position. The record keeps no reference to them.
    device : torch.device
        Where the kernel runs (its index picks the stream).

    Notes
    -----
    The caller keys a record on everything the kernel is specialized on: a replay does no
    check of its own, so arguments of another dtype, alignment or integer value (a stride, a
    size) must never reach it (they get another record).
    """

    __slots__ = ("fn", "grid", "pos", "kw", "pos_slots", "full", "subs", "keep", "launcher",
                 "function", "meta", "stream", "dev_index", "direct", "coop", "pdl")  # fmt: skip

    def __init__(
        self,
        fn: Any,
        grid: tuple[int, ...],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        per_call: Sequence[Any],
        device,
    ):
        self.fn, self.grid = fn, tuple(grid) + (1,) * (3 - len(grid))
        self.pos, self.kw = list(args), dict(kwargs)
        self.pos_slots = _slots(self.pos, per_call)
        for idx in self.pos_slots:
            for i in idx:
                self.pos[i] = None
        # a per-call object only in a keyword argument cannot be substituted
        if any(x is not None and any(v is x for v in self.kw.values()) for x in per_call):
            raise ValueError("a per-call argument passed by keyword cannot be replayed")
        self.full = self.subs = self.keep = self.launcher = self.function = self.meta = None
        self.direct = self.coop = self.pdl = None
        self.stream, self.dev_index = None, getattr(device, "index", None)
        if (getattr(device, "type", None) in FAST_DEVICE_TYPES
                and os.environ.get("TRITON_INTERPRET") != "1"):  # fmt: skip
            try:
                self._resolve(list(args), per_call)
            except Exception:  # another Triton's internals: the normal launch still works
                self.full = self.subs = self.keep = self.launcher = self.direct = None

    def _resolve(self, args: list[Any], per_call: Sequence[Any]) -> None:
        """Bind the call to the kernel's signature and find its compiled kernel (CUDA)."""
        sig = getattr(self.fn, "signature", None)
        warmup = getattr(self.fn, "warmup", None)
        if not isinstance(sig, inspect.Signature) or warmup is None:
            return
        names = list(sig.parameters)
        options = {k: v for k, v in self.kw.items() if k not in sig.parameters}
        bound = sig.bind(*args, **{k: v for k, v in self.kw.items() if k in sig.parameters})
        bound.apply_defaults()
        full = [bound.arguments[n] for n in names]
        kernel = warmup(*full, grid=self.grid, **options)
        if hasattr(kernel, "result"):  # (an async compile's future)
            kernel = kernel.result()
        launcher = kernel.run  # (a property: loads the module, makes the launcher)
        if kernel.function is None or not callable(launcher):
            return
        from triton.runtime import driver

        # (position in the argument list, index in per_call) of each per-call pointer
        self.subs = tuple((i, j) for j, idx in enumerate(_slots(full, per_call)) for i in idx)
        for i, _ in self.subs:
            full[i] = None
        # recorded tensors as the ints the launcher would get from them (kept alive here)
        self.keep = tuple(a for a in full if isinstance(a, _tensor_type()))
        full = [a.data_ptr() if isinstance(a, _tensor_type()) else a for a in full]
        self.full, self.launcher = full, launcher
        self.function, self.meta = kernel.function, kernel.packed_metadata
        self.direct = _direct_launch(launcher)
        if self.direct is not None:
            self.coop, self.pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        self.stream = driver.active.get_current_stream
        if self.dev_index is None:
            self.dev_index = driver.active.get_current_device()

    @property
    def fast(self) -> bool:
        """Whether a call replays through the compiled kernel's launcher."""
        return self.launcher is not None and FAST and _hooks_idle()

    def __call__(self, *per_call: Any) -> None:
        """Launch with ``per_call`` (as many as given at recording) in their places."""
        if self.launcher is not None and FAST and _hooks_idle():
            ptrs = [None if x is None else x.data_ptr() for x in per_call]
            self.launch_ptrs(self.stream(self.dev_index), ptrs)
            return
        self.launch_normal(per_call)

    def launch_ptrs(self, stream: int, ptrs: Sequence[int | None]) -> None:
        """The fast replay (only where :attr:`fast`).

        ``ptrs[j]`` is per-call tensor ``j``'s ``data_ptr()`` (None for a placeholder),
        ``stream`` the raw CUDA stream.
        """
        a = self.full.copy()
        for i, j in self.subs:
            a[i] = ptrs[j]
        g = self.grid
        if self.direct is not None and DIRECT:  # (see _direct_launch: no scratch, no hooks)
            self.direct(g[0], g[1], g[2], stream, self.function, self.coop, self.pdl, None, None,
                        self.meta, None, None, None, *a)  # fmt: skip
            return
        self.launcher(g[0], g[1], g[2], stream, self.function, self.meta, None, None, None, *a)

    def launch_normal(self, per_call: Sequence[Any]) -> None:
        """The normal launch, ``fn[grid](*args, **kwargs)`` with ``per_call`` substituted."""
        a = self.pos.copy()
        for idx, x in zip(self.pos_slots, per_call, strict=True):
            for i in idx:
                a[i] = x
        self.fn[self.grid](*a, **self.kw)


def replay(launches: Sequence[Launch], per_call: Sequence[Any], ptrs: Sequence[int | None]) -> None:
    """Launch each record of ``launches`` (all made with the same per-call order).

    ``ptrs``: the per-call tensors' ``data_ptr()`` (None for placeholders), read once by the
    caller for all of them; the stream and the hooks are looked up once too.
    """
    first = launches[0]
    if first.launcher is not None and FAST and _hooks_idle():
        stream = first.stream(first.dev_index)
        for x in launches:
            if x.launcher is None:  # (a record whose kernel did not resolve: the normal way)
                x.launch_normal(per_call)
            else:
                x.launch_ptrs(stream, ptrs)
        return
    for x in launches:
        x.launch_normal(per_call)


_TENSOR: list[type] = []


def _tensor_type() -> type:
    if not _TENSOR:
        from kvpool._torch import torch

        _TENSOR.append(torch.Tensor)
    return _TENSOR[0]


def _slots(args: Sequence[Any], per_call: Sequence[Any]) -> list[tuple[int, ...]]:
    """For each per-call object, the positions of ``args`` holding it (by identity)."""
    return [
        () if x is None else tuple(i for i, a in enumerate(args) if a is x) for x in per_call
    ]


#: Triton versions whose ``CudaLauncher`` calls its C ``launch`` as :func:`_direct_launch`
#: expects (read in Triton 3.6's NVIDIA driver module, ``triton.backends.nvidia.driver``; 3.9
#: passes the kernel's arguments as one tuple and more besides). Others replay through
#: ``CudaLauncher.__call__``.
DIRECT_TRITON = ("3.6.",)


def _direct_launch(launcher: Any) -> Any:
    """The C launch function behind Triton's ``CudaLauncher``, where it can be called directly.

    ``CudaLauncher.__call__`` is a Python wrapper (~1-2 us a launch on the H200's host,
    ``benches/step``) that allocates the global and profile scratch buffers a kernel may ask
    for and then calls ``launch(grid_x, grid_y, grid_z, stream, function, cooperative, pdl,
    global_scratch, profile_scratch, metadata, launch_metadata, enter_hook, exit_hook, *args)``.
    For a kernel that asks for neither scratch buffer (kvpool's), calling ``launch`` with None
    for both is what the wrapper does. None where the Triton version is not one read
    (:data:`DIRECT_TRITON`), the launcher is another class, or a kernel needs scratch.
    """
    if type(launcher).__name__ != "CudaLauncher" or not _direct_version():
        return None
    try:
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        launch = launcher.launch
        launcher.launch_cooperative_grid, launcher.launch_pdl  # noqa: B018  (both present)
    except AttributeError:
        return None
    return launch if callable(launch) else None


_DIRECT_OK: list[bool] = []


def _direct_version() -> bool:
    if not _DIRECT_OK:
        try:
            import triton

            _DIRECT_OK.append(triton.__version__.startswith(DIRECT_TRITON))
        except ImportError:
            _DIRECT_OK.append(False)
    return _DIRECT_OK[0]
