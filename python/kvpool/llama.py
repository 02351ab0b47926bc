"""A compact torch Llama-family forward whose attention runs through a :class:`~kvpool.KVPool`.

This is the reference client of the pool API: each layer projects Q/K/V, applies RoPE, stores K
(after RoPE, as the cache keeps it) and V with ``pool.write(layer, loc, k, v)`` and attends with
``pool.extend`` (prefill, several new tokens per request) or ``pool.decode`` (one new token per
request; both :mod:`kvpool.attention`), reading every key and value back from the pool. The
attention plan (launch metadata) is made once per step and shared by all layers.
The fidelity harness (:mod:`kvpool.fidelity`), the tests and ``examples/serve.py`` drive it.
It is not a serving engine: no sampling policy, no scheduler, no tensor parallelism; batching
metadata comes from the caller as a :class:`Step`.

:meth:`Llama.forward_reference` runs the same weights with an ordinary contiguous full-precision
cache (plain tensors, :func:`torch.nn.functional.scaled_dot_product_attention`), the yardstick
every KV dtype is judged against.

Loads a GGUF file (dequantized to float32, see :mod:`kvpool.gguf`) or a Hugging Face model
directory (``config.json`` + ``*.safetensors``).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvpool import llama_ops as ops
from kvpool._core import ModelConfigError
from kvpool.config import ModelSpec
from kvpool.llama_ops import Rope

if TYPE_CHECKING:
    from kvpool.pool import KVPool

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Step:
    """Layer-independent metadata of one forward step.

    A batch of ``B`` requests adds ``T`` tokens in total (packed request after request).

    Attributes
    ----------
    positions : torch.Tensor
        ``[T]`` int64, the position of each new token in its sequence.
    out_loc : torch.Tensor
        ``[T]`` int64, the pool slot (``page * page_size + offset``) each new token's K/V goes to.
    page_table : torch.Tensor
        ``[B, max_pages]`` int32, each request's pages in order (unused entries: 0, the padding
        page).
    seq_lens : torch.Tensor
        ``[B]`` int32, tokens of each request in the cache after this step (prefix + new).
    cu_seqlens_q : torch.Tensor
        ``[B + 1]`` int32; request ``b``'s new tokens are rows
        ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
    """

    positions: torch.Tensor
    out_loc: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor

    @property
    def is_decode(self) -> bool:
        """One new token per request: attention goes through ``pool.decode``."""
        return self.positions.numel() == self.seq_lens.numel()

    @property
    def last_index(self) -> torch.Tensor:
        """``[B]`` int64, the row of each request's last new token in the packed ``[T]`` order."""
        return self.cu_seqlens_q[1:].to(torch.int64) - 1

    def to(self, device: torch.device | str) -> Step:
        """Copy the metadata to ``device``."""
        return Step(*(t.to(device, non_blocking=True) for t in self.__dict__.values()))

    @classmethod
    def build(
        cls,
        pages: list[Any],
        prefix_lens: list[int],
        extend_lens: list[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> Step:
        """Build the metadata with kvpool's Rust batch helpers.

        Request ``i`` holds ``pages[i]`` (page ids covering at least
        ``prefix_lens[i] + extend_lens[i]`` tokens) and adds ``extend_lens[i]`` tokens after
        ``prefix_lens[i]`` cached ones.

        Raises
        ------
        ValueError
            A request's pages do not cover its tokens, or the lists differ in length.
        """
        import numpy as np

        from kvpool import extend_slots, page_table

        if not (len(pages) == len(prefix_lens) == len(extend_lens)):
            raise ValueError(
                "`pages`, `prefix_lens` and `extend_lens` must have one entry per request"
            )
        pre = np.asarray(prefix_lens, dtype=np.int64).reshape(-1)
        ext = np.asarray(extend_lens, dtype=np.int64).reshape(-1)
        seq = pre + ext
        rows = [np.asarray(p, dtype=np.int32).reshape(-1) for p in pages]
        for i, r in enumerate(rows):
            if r.size * page_size < seq[i]:
                raise ValueError(
                    f"request {i}: {r.size} pages of {page_size} tokens cannot hold {seq[i]} tokens"
                )
        # Rust batch helpers: the page table and the slots of the new tokens.
        table = page_table(rows, max(max((r.size for r in rows), default=0), 1))
        slots = extend_slots(table, pre, seq, page_size)
        cu = np.zeros(len(rows) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(ext)
        positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - pre, ext)
        step = cls(
            positions=torch.from_numpy(positions),
            out_loc=torch.from_numpy(np.asarray(slots, dtype=np.int64)),
            page_table=torch.from_numpy(table),
            seq_lens=torch.from_numpy(seq.astype(np.int32)),
            cu_seqlens_q=torch.from_numpy(cu),
        )
        return step.to(device) if torch.device(device).type != "cpu" else step


class Llama:
    """Llama-family decoder with its weights as plain tensors.

    SmolLM2, Llama 2/3 without RoPE scaling, Mistral without sliding window.

    Parameters
    ----------
    config : dict
        Hugging Face style config (``hidden_size``, ``num_hidden_layers``, ...).
    weights : dict of str to torch.Tensor
        Hugging Face names (``model.layers.0.self_attn.q_proj.weight``, ...).
    spec : ModelSpec
        Geometry (and compute dtype) of the model, as the pool is sized for it.
    device : str or torch.device
        Where the weights live.
    compile : bool
        Run the per-layer pieces around attention through ``torch.compile`` (:meth:`compile`).

    Attributes
    ----------
    attn_backend : str
        ``backend`` of :func:`kvpool.attention.decode` / ``extend``: ``auto`` (Triton on CUDA,
        the torch reference on CPU), ``triton`` or ``torch``.
    compiled : bool
        Whether :meth:`qkv` and :meth:`finish_layer` run compiled (:meth:`compile`).

    Raises
    ------
    ModelConfigError
        RoPE scaling, partial rotary or biases (not handled by this compact forward), or a
        missing weight (named).
    """

    def __init__(
        self,
        config: dict[str, Any],
        weights: dict[str, torch.Tensor],
        spec: ModelSpec,
        device: str | torch.device = "cpu",
        compile: bool = False,
    ):
        self.config, self.spec = config, spec
        self.dtype = _TORCH_DTYPES[spec.dtype]
        self.device = torch.device(device)
        self.attn_backend = "auto"
        if config.get("rope_scaling") or config.get("rope_dim", spec.head_dim) != spec.head_dim:
            raise ModelConfigError(
                "this compact Llama handles plain RoPE over the whole head only; "
                f"got rope_scaling={config.get('rope_scaling')!r}, "
                f"rope_dim={config.get('rope_dim')}"
            )
        self.num_layers = spec.num_layers
        self.hq, self.hkv, self.d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        theta = float(config.get("rope_theta", 10000.0))
        self.inv_freq = 1.0 / theta ** (
            torch.arange(0, self.d, 2, dtype=torch.int64, device=self.device).float() / self.d
        )
        self.scale = 1.0 / math.sqrt(self.d)
        self.w: dict[str, torch.Tensor] = {}
        for k, v in weights.items():
            if k.endswith(".bias"):
                raise ModelConfigError(f"weight `{k}`: this compact Llama has no biases")
            self.w[k] = v.to(device=self.device, dtype=self.dtype)
        if "lm_head.weight" not in self.w:
            if not config.get("tie_word_embeddings", False):
                raise ModelConfigError("no `lm_head.weight` and `tie_word_embeddings` is false")
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        for i in range(self.num_layers):
            for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                      "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
                if f"model.layers.{i}.{n}.weight" not in self.w:
                    raise ModelConfigError(f"missing weight `model.layers.{i}.{n}.weight`")
        # Fused QKV and gate/up projections: one matmul each.
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            self.w[p + "qkv"] = torch.cat(
                [self.w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], 0
            ).contiguous()
            self.w[p + "gate_up"] = torch.cat(
                [self.w[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")], 0
            ).contiguous()
        # Per layer: (input norm, qkv, o_proj, post-attention norm, gate_up, down_proj).
        self._layer_w = [
            tuple(self.w[f"model.layers.{i}.{n}"] for n in (
                "input_layernorm.weight", "qkv", "self_attn.o_proj.weight",
                "post_attention_layernorm.weight", "gate_up", "mlp.down_proj.weight"))
            for i in range(self.num_layers)
        ]  # fmt: skip
        self.compile(compile)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        dtype: str | None = None,
        device: str | torch.device = "cpu",
        compile: bool = False,
    ) -> Llama:
        """Load a GGUF file or a Hugging Face model directory.

        Parameters
        ----------
        path : str or path
            ``*.gguf`` (dequantized to float32) or a directory with ``config.json`` and
            ``*.safetensors``.
        dtype : str, optional
            Compute dtype (``fp32``, ``bf16``, ``fp16``); default: fp32 for GGUF, the config's
            ``torch_dtype`` for a directory.
        device : str or torch.device
            Where the weights go.
        compile : bool
            :meth:`compile` the per-layer pieces.

        Raises
        ------
        ModelConfigError
            Unreadable model, missing weights, unsupported architecture features.
        """
        p = Path(os.fspath(path))
        spec = ModelSpec.from_pretrained(p, dtype=dtype)
        if p.suffix == ".gguf":
            from kvpool.gguf import load_gguf_weights

            config, weights = load_gguf_weights(p)
        else:
            from safetensors.torch import load_file

            config = json.loads((p / "config.json").read_text())
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise ModelConfigError(f"model directory `{p}` has no *.safetensors files")
            weights = {}
            for f in files:
                weights.update(load_file(f))
        return cls(config, weights, spec, device, compile=compile)

    # ------------------------------------------------------------------ pieces
    def rope(self, positions: torch.Tensor) -> Rope:
        """RoPE factors of ``positions [T]`` (int), made once per step for every layer.

        Hugging Face's rotary embedding: angles ``position * inv_freq`` in float32, duplicated
        over the two halves, cos/sin cast to the compute dtype.
        """
        freqs = positions.to(device=self.device, dtype=torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : self.d // 2].neg_()
        return Rope(emb.cos().to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :])

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor | Rope) -> torch.Tensor:
        """``x [T, H, head_dim]`` (compute dtype, any strides) rotated as :meth:`qkv` rotates.

        ``positions``: ``[T]`` int, or their :meth:`rope` factors.
        """
        rope = positions if isinstance(positions, Rope) else self.rope(positions)
        return ops.apply_rope(x, rope.cos, rope.sin)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` hidden states (compute dtype) of ``[T]`` int64 token ids."""
        return self.w["model.embed_tokens.weight"][input_ids.to(self.device)]

    def qkv(
        self, i: int, h: torch.Tensor, positions: torch.Tensor | Rope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s attention inputs of hidden states ``h [T, hidden]``.

        Returns ``q [T, H_q, head_dim]`` and ``k [T, H_kv, head_dim]`` after RoPE at
        ``positions`` (``[T]`` int, or their :meth:`rope` factors, which a step makes once for
        all layers; the cache keeps K after RoPE) and ``v [T, H_kv, head_dim]``, in the compute
        dtype. All three are strided views (rows of the fused projection); the last dim is
        contiguous.
        """
        rope = positions if isinstance(positions, Rope) else self.rope(positions)
        w = self._layer_w[i]
        if self.compiled:
            ops.mark_tokens(h, rope.cos, rope.sin)
        return self._pre(h, w[0], w[1], rope.cos, rope.sin)

    def finish_layer(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s output ``[T, hidden]`` from its attention output ``attn``.

        ``h`` + o_proj(``attn [T, H_q, head_dim]``), then the MLP block with its residual.
        Eager, ``h`` is updated in place and returned (the residual adds are the matmuls' own
        accumulation); compiled, ``h`` is left as it is.
        """
        w = self._layer_w[i]
        if self.compiled:
            ops.mark_tokens(h, attn)
        return self._post(h, attn, w[2], w[3], w[4], w[5])

    def compile(self, enabled: bool = True, *, mode: str | None = None, **options: Any) -> Llama:
        """Run the per-layer pieces around attention through ``torch.compile``.

        :meth:`qkv` (norm + QKV matmul + RoPE) and :meth:`finish_layer` (o_proj + residual +
        norm + MLP + residual); ``enabled=False``: back to eager. Returns the model.

        One compiled function each serves every layer (the weights are arguments), with the
        token count dynamic: prefill and every decode batch share a compile (a batch of one is
        its own: torch specializes sizes 0 and 1). ``fullgraph=True``: the pieces have no graph
        break, so a decode step stays capturable in :class:`kvpool.graph.DecodeGraph` (its
        warm-up runs, which capture nothing, compile them). Attention and ``pool.write`` stay
        outside. Results differ from eager by bf16/fp16 rounding (the compiler fuses and keeps
        intermediates in float32).

        Parameters
        ----------
        enabled : bool
            Compile (default) or go back to the eager pieces.
        mode : str, optional
            ``torch.compile`` mode; not one that captures CUDA graphs itself
            (``reduce-overhead``, ``max-autotune``: use ``max-autotune-no-cudagraphs``).
        **options
            Further ``torch.compile`` keyword arguments (``backend``, ``options``, ...).

        Raises
        ------
        ValueError
            ``mode`` captures CUDA graphs of its own.
        """
        eps, hq, hkv, d = self.eps, self.hq, self.hkv, self.d
        if not enabled:
            self._pre = functools.partial(ops.pre_layer, eps=eps, hq=hq, hkv=hkv, d=d)
            self._post = functools.partial(ops.post_layer, eps=eps, inplace=True)
            self.compiled = False
            return self
        if mode in ops.CUDAGRAPH_MODES:
            raise ValueError(
                f"compile mode {mode!r} captures CUDA graphs of its own, which cannot nest in "
                "DecodeGraph's capture; use the default mode or 'max-autotune-no-cudagraphs'"
            )

        key = repr((mode, sorted(options.items())))
        cache = self.__dict__.setdefault("_compiled_fns", {})
        if key not in cache:  # (kept: going back and forth does not compile again)

            def pre(h, w_norm, w_qkv, cos, sin):
                return ops.pre_layer(h, w_norm, w_qkv, cos, sin, eps, hq, hkv, d)

            def post(h, attn, w_o, w_norm, w_gate_up, w_down):
                return ops.post_layer(h, attn, w_o, w_norm, w_gate_up, w_down, eps, False)

            kw = dict(options, fullgraph=True, mode=mode)
            cache[key] = torch.compile(pre, **kw), torch.compile(post, **kw)
        self._pre, self._post = cache[key]
        self.compiled = True
        return self

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` float32 logits of hidden states ``[N, hidden]`` (final norm + head)."""
        x = ops.rms_norm(h, self.w["model.norm.weight"], self.eps)
        return (x @ self.w["lm_head.weight"].T).float()

    # ------------------------------------------------------------------ through the pool
    @torch.inference_mode()
    def forward(
        self, pool: KVPool, input_ids: torch.Tensor, step: Step, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Run ``T`` new tokens of ``B`` requests through the model, K/V stored in ``pool``.

        Parameters
        ----------
        pool : KVPool
            Sized for this model (``plan.spec`` geometry), on the model's device.
        input_ids : torch.Tensor
            ``[T]`` int64 token ids, packed in request order.
        step : Step
            The batch metadata (slots, page table, lengths).
        all_logits : bool
            Return logits of every new token (teacher forcing) instead of each request's last.

        Returns
        -------
        torch.Tensor
            ``[B, vocab]`` float32 (``[T, vocab]`` with ``all_logits``).
        """
        from kvpool import attention

        h = self.embed(input_ids)
        view0 = pool.layer(pool.layers[0])
        triton = self.attn_backend == "triton" or (self.attn_backend == "auto" and h.is_cuda)
        kw: dict[str, Any] = {"sm_scale": self.scale, "backend": self.attn_backend}
        if step.is_decode:
            fn = pool.decode
            if triton:
                kw["plan"] = attention.plan_decode(view0, self.hq, step.page_table, step.seq_lens)
            else:
                kw.update(page_table=step.page_table, seq_lens=step.seq_lens)
        else:
            fn = pool.extend
            if triton:
                kw["plan"] = attention.plan_extend(
                    view0, self.hq, step.cu_seqlens_q, step.page_table, step.seq_lens
                )
            else:
                kw.update(
                    cu_seqlens_q=step.cu_seqlens_q, page_table=step.page_table,
                    seq_lens=step.seq_lens,
                )  # fmt: skip
        rope = self.rope(step.positions)  # (once for all layers)
        for i in range(self.num_layers):
            q, k, v = self.qkv(i, h, rope)
            pool.write(i, step.out_loc, k, v)
            o = fn(i, q, **kw)
            h = self.finish_layer(i, h, o)
        return self.logits(h if all_logits else h[step.last_index])

    def graph_step(self, pool: KVPool):
        """The decode step of :class:`kvpool.graph.DecodeGraph` for this model and ``pool``.

        ``step(s)`` reads ``s.inputs["input_ids"]`` (``[batch]`` int64), positions
        ``s.seq_lens - 1``, writes each layer's K/V at ``s.slots`` and attends with
        ``plan=s.plan``: the calls of :meth:`forward`'s decode, on the bucket's static buffers
        (no host sync, no allocation outside the graph's pool). Returns ``[batch, vocab]``
        float32 logits.
        """
        kw: dict[str, Any] = {"sm_scale": self.scale, "backend": self.attn_backend}

        def step(s):
            with torch.inference_mode():
                h = self.embed(s.inputs["input_ids"])
                rope = self.rope(s.seq_lens.to(torch.int64) - 1)
                for i in range(self.num_layers):
                    q, k, v = self.qkv(i, h, rope)
                    pool.write(i, s.slots, k, v)
                    h = self.finish_layer(i, h, pool.decode(i, q, plan=s.plan, **kw))
                return self.logits(h)

        return step

    # ------------------------------------------------------------------ reference cache
    @torch.inference_mode()
    def forward_reference(
        self, input_ids: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One sequence with an ordinary contiguous cache in the compute dtype (no pool).

        Parameters
        ----------
        input_ids : torch.Tensor
            ``[N]`` new token ids.
        past : list of (k, v), optional
            Per layer ``[Hkv, P, D]`` keys (after RoPE) and values of the ``P`` earlier tokens.

        Returns
        -------
        (logits, past)
            ``[N, vocab]`` float32 logits of every new token, and the cache extended by them.
        """
        n0 = 0 if past is None else past[0][0].shape[1]
        ids = input_ids.to(self.device)
        rope = self.rope(torch.arange(n0, n0 + ids.numel(), device=self.device))
        h = self.w["model.embed_tokens.weight"][ids]
        new_past = []
        for i in range(self.num_layers):
            q, k, v = self.qkv(i, h, rope)
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, N, D]
            if past is not None:
                k, v = torch.cat([past[i][0], k], 1), torch.cat([past[i][1], v], 1)
            new_past.append((k, v))
            o = _causal_attention(q.transpose(0, 1), k, v, self.scale)
            h = self.finish_layer(i, h, o.transpose(0, 1))
        return self.logits(h), new_past

    @torch.inference_mode()
    def generate_reference(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation with the reference cache (the yardstick for exactness)."""
        logits, past = self.forward_reference(torch.tensor(prompt, dtype=torch.int64))
        out = [int(logits[-1].argmax())]
        for _ in range(max_new_tokens - 1):
            logits, past = self.forward_reference(torch.tensor(out[-1:]), past)
            out.append(int(logits[-1].argmax()))
        return out


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [Hq, N, D]`` over ``k, v [Hkv, P + N, D]``, query ``j`` seeing keys ``<= P + j``."""
    n, total = q.shape[1], k.shape[1]
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
