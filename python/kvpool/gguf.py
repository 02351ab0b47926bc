"""GGUF files: geometry from the metadata, weights in Hugging Face names, the tokenizer.

The header (metadata and tensor table) is parsed here with :mod:`struct`, so that
``ModelSpec.from_pretrained("model.gguf")`` needs neither the ``gguf`` package nor a pass over the
weights; big arrays (the vocabulary, merges) are skipped unless asked for. Dequantizing weights
(:func:`load_gguf_weights`) uses the ``gguf`` package (``pip install gguf``), and the tokenizer
(:func:`tokenizer_from_gguf`) the ``tokenizers`` package.

llama.cpp stores the Q and K projection rows of Llama-family models permuted for its RoPE, which
rotates adjacent pairs ``(x[2i], x[2i+1])``; Hugging Face's Llama rotates the two halves
``(x[i], x[i + d/2])``. :func:`unpermute_qk` undoes llama.cpp's permutation, so the weights work
with the half-split RoPE of :mod:`kvpool.llama` and of transformers.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool._core import ModelConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kvpool.config import ModelSpec

_MAGIC = b"GGUF"
# GGUF metadata value types: id -> struct format (scalars); 8 = string, 9 = array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
#: Arrays longer than this are skipped (recorded as ``None``) unless ``arrays=True``.
_BIG_ARRAY = 1024
# Arrays of arrays: llama.cpp refuses them and no writer nests deeper than a level or two, but
# the reader recurses once per level, so a hostile file could nest past Python's recursion limit.
_MAX_DEPTH = 16
# GGML_MAX_DIMS: llama.cpp refuses tensors of more dimensions.
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    ``shape`` as GGUF lists it (fastest dimension first), ``ggml_type`` the GGML type id,
    ``offset`` in bytes from the start of the file.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GGUFHeader:
    """The parsed header of a GGUF file."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def arch(self) -> str:
        """``general.architecture`` (the prefix of the model's metadata keys)."""
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except (struct.error, OverflowError):  # (an offset past 2^63 after a huge length)
            raise ModelConfigError(f"`{self.path}` is truncated (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ModelConfigError(f"`{self.path}` is truncated (string at byte {self.pos})")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, keep_arrays: bool, key: str, depth: int = 0) -> Any:
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= _MAX_DEPTH:
                raise ModelConfigError(
                    f"`{self.path}`: metadata `{key}` nests arrays more than {_MAX_DEPTH} deep "
                    f"(at byte {self.pos})"
                )
            at = self.pos
            etype, n = self.unpack("<I"), self.unpack("<Q")
            # checked here, not at the first element, so that an empty array of a bad type fails too
            if etype not in _SCALAR and etype not in (_STRING, _ARRAY):
                raise ModelConfigError(
                    f"`{self.path}`: metadata `{key}` is an array of unknown GGUF value type "
                    f"{etype} (at byte {at})"
                )
            if n > _BIG_ARRAY and not keep_arrays and etype in _SCALAR:
                self.pos += n * struct.calcsize(_SCALAR[etype])
                return None
            if n > _BIG_ARRAY and not keep_arrays and etype == _STRING:
                for _ in range(n):
                    length = self.unpack("<Q")
                    self.pos += length
                return None
            return [self.value(etype, keep_arrays, key, depth + 1) for _ in range(n)]
        raise ModelConfigError(
            f"`{self.path}`: metadata `{key}` has unknown GGUF value type {vtype} "
            f"(at byte {self.pos})"
        )


def read_header(path: str | os.PathLike[str], *, arrays: bool = False) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (GGUF versions 2 and 3).

    Parameters
    ----------
    path : str or path
        The ``.gguf`` file.
    arrays : bool
        Also decode arrays longer than 1,024 entries (vocabulary, merges); otherwise their value is
        ``None``.

    Raises
    ------
    ModelConfigError
        Unreadable, not GGUF, or truncated.
    """
    p = Path(os.fspath(path))
    try:
        f = open(p, "rb")  # noqa: SIM115 - closed below, the mmap outlives nothing
    except OSError as e:
        raise ModelConfigError(f"cannot read GGUF file `{p}`: {e}") from None
    with f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # empty file
            raise ModelConfigError(f"`{p}` is empty, not a GGUF file") from None
        with buf:
            return _parse(_Cursor(buf, p), p, arrays)


def _parse(c: _Cursor, p: Path, arrays: bool) -> GGUFHeader:
    if bytes(c.buf[:4]) != _MAGIC:
        raise ModelConfigError(f"`{p}` is not a GGUF file (magic {bytes(c.buf[:4])!r})")
    c.pos = 4
    version = c.unpack("<I")
    if version not in (2, 3):
        raise ModelConfigError(f"`{p}`: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.unpack("<I"), arrays, key)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.unpack("<I")
        if n_dims > _MAX_DIMS:
            raise ModelConfigError(
                f"`{p}`: tensor `{name}` has {n_dims} dimensions; GGUF allows at most {_MAX_DIMS}"
            )
        shape = tuple(c.unpack("<Q") for _ in range(n_dims))
        infos.append((name, shape, c.unpack("<I"), c.unpack("<Q")))
    align = _alignment(meta, p)
    data_start = (c.pos + align - 1) // align * align
    tensors = {n: TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos}
    return GGUFHeader(p, version, meta, tensors)


def _alignment(meta: dict[str, Any], p: Path) -> int:
    """``general.alignment``, checked: the data offsets are rounded up to a multiple of it.

    The GGUF spec declares it a uint32 multiple of 8; llama.cpp and the ``gguf`` package refuse
    any value that is not a nonzero power of two (a file with 4 loads there), so that is the rule
    here: zero would divide by zero, and anything else gives offsets no loader agrees with.
    """
    a = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    # bool is an int subclass (GGUF type 7); a string or float is not a count of bytes
    if isinstance(a, bool) or not isinstance(a, int):
        raise ModelConfigError(
            f"`{p}`: `general.alignment` must be an unsigned integer, got {_show(a)}"
        )
    if not 0 < a < 1 << 32 or a & (a - 1):
        raise ModelConfigError(
            f"`{p}`: `general.alignment` must be a power of two in 1..2^31, got {a}"
        )
    return a


def _show(v: Any, limit: int = 80) -> str:
    """``repr`` of a metadata value, cut short: an array may hold thousands of entries."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[: limit - 3]}..."


# ---------------------------------------------------------------------------------- geometry
def config_from_gguf(header: GGUFHeader) -> dict[str, Any]:
    """Build a Hugging Face style ``config.json`` dict from GGUF metadata.

    Raises
    ------
    ModelConfigError
        A field the geometry needs is missing, or per-layer KV head counts differ.
    """
    m, arch = header.metadata, header.arch
    if not arch:
        raise ModelConfigError(f"`{header.path}` has no `general.architecture`")

    def get(key: str, default: Any = None) -> Any:
        v = m.get(f"{arch}.{key}", default)
        if isinstance(v, list):  # per-layer values (some architectures): must agree
            # one scalar per layer; an empty array or an array of arrays is no value at all
            if not v or any(isinstance(x, list) for x in v):
                raise ModelConfigError(
                    f"`{header.path}`: `{arch}.{key}` must be a value or an array of one value "
                    f"per layer, got {_show(v)}"
                )
            if len(set(v)) != 1:
                raise ModelConfigError(
                    f"`{header.path}`: `{arch}.{key}` differs between layers "
                    f"({_show(sorted(set(v)))}); "
                    "kvpool's GGUF reader handles one value for all layers"
                )
            v = v[0]
        return v

    for key in ("block_count", "embedding_length", "attention.head_count"):
        if get(key) is None:
            raise ModelConfigError(f"`{header.path}` lacks the GGUF field `{arch}.{key}`")
    heads = get("attention.head_count")
    vocab = get("vocab_size")
    if vocab is None:
        vocab = _vocab_size(header)
    cfg: dict[str, Any] = {
        "model_type": arch,
        "architectures": [_ARCH_CLASS.get(arch, arch)],
        "num_hidden_layers": get("block_count"),
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
    }
    if get("attention.key_length") is not None:
        cfg["head_dim"] = get("attention.key_length")
    if get("attention.value_length") not in (None, cfg.get("head_dim")):
        cfg["v_head_dim"] = get("attention.value_length")
    if get("rope.dimension_count") is not None:
        cfg["rope_dim"] = get("rope.dimension_count")
    if get("attention.sliding_window") is not None:
        cfg["sliding_window"] = get("attention.sliding_window")
    nextn = get("nextn_predict_layers")
    if nextn:
        # llama.cpp's converter counts the MTP layers in `block_count` (Glm4MoeModel,
        # DeepseekV32Model in convert_hf_to_gguf.py: num_hidden_layers + num_nextn_predict_layers)
        # and writes their number here; the decoder layers are the others.
        blocks = cfg["num_hidden_layers"]
        for key, v in (("nextn_predict_layers", nextn), ("block_count", blocks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ModelConfigError(
                    f"`{header.path}`: `{arch}.{key}` must be a non-negative integer, "
                    f"got {_show(v)}"
                )
        if nextn >= blocks:
            raise ModelConfigError(
                f"`{header.path}`: `{arch}.nextn_predict_layers` = {nextn} leaves no decoder layer "
                f"of the {blocks} in `{arch}.block_count`"
            )
        cfg["num_hidden_layers"] = blocks - nextn
        cfg["num_nextn_predict_layers"] = nextn
    if get("attention.shared_kv_layers"):  # Gemma-3n / Gemma-4 (llama.cpp n_kv_shared_layers)
        cfg["num_kv_shared_layers"] = get("attention.shared_kv_layers")
    elif arch == "gemma3n" and _count(cfg["num_hidden_layers"]) > _GEMMA3N_KV_LAYERS:
        # files without the key: llama.cpp keeps KV for the first 20 layers only
        # (n_layer_kv_from_start = 20), the others share it
        cfg["num_kv_shared_layers"] = cfg["num_hidden_layers"] - _GEMMA3N_KV_LAYERS
    _sliding_layers(header, cfg)
    if get("rope.scaling.type") not in (None, "none"):
        cfg["rope_scaling"] = {
            "type": get("rope.scaling.type"),
            "factor": get("rope.scaling.factor"),
        }
    return {k: v for k, v in cfg.items() if v is not None}


#: llama.cpp's fixed sliding-window period per architecture (``set_swa_pattern(n)`` in
#: ``src/llama-model.cpp``) when the file has no ``sliding_window_pattern``: layer ``i`` slides
#: iff ``i % n < n - 1`` (gemma2, gpt-oss: even layers; gemma3: all but every 6th; cohere2: all
#: but every 4th; gemma3n: all but every 5th).
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "gemma-embedding": 6, "gpt-oss": 2,
               "cohere2": 4}  # fmt: skip
# llama.cpp's window for gemma2 files that do not state one ("default value of gemma 2")
_GEMMA2_WINDOW = 4096
_GEMMA3N_KV_LAYERS = 20


def _count(v: Any) -> int:
    """``v`` if it is a non-negative int (a layer count), else -1 (``from_dict`` names it)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else -1


def _sliding_layers(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Write ``layer_types`` (and the window) for the sliding-window layers, as llama.cpp sees them.

    ``<arch>.attention.sliding_window_pattern`` wins: an array of one bool per layer (true:
    sliding) or a period ``n`` (layer ``i`` slides iff ``n == 0`` or ``i % n < n - 1``;
    ``llama_hparams::set_swa_pattern`` in ``src/llama-hparams.cpp``, ``gguf-py``
    ``add_sliding_window_pattern``). Without it the architectures of :data:`_SWA_PERIOD` use their
    fixed period. A window of 0 means no sliding layers (llama.cpp's gemma3 loader). Other
    architectures keep ``from_dict``'s reading of ``sliding_window``.
    """
    arch, m = header.arch, header.metadata
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = m.get(key)
    n = _count(cfg["num_hidden_layers"])
    if n <= 0:
        return
    if arch == "gemma2" and "sliding_window" not in cfg:
        cfg["sliding_window"] = _GEMMA2_WINDOW
    window = cfg.get("sliding_window")
    if pattern is None and arch not in _SWA_PERIOD:
        return
    if window is None or window == 0:
        cfg.pop("sliding_window", None)
        cfg["layer_types"] = ["full_attention"] * n
        return
    if isinstance(pattern, list):
        blocks = n + cfg.get("num_nextn_predict_layers", 0)
        # one entry per layer of the file; the MTP layers at the end (if counted) never slide
        if len(pattern) not in (n, blocks) or not all(isinstance(x, bool) for x in pattern):
            raise ModelConfigError(
                f"`{header.path}`: `{key}` must be one bool per layer ({n}) or a period, got "
                f"{_show(pattern)}"
            )
        sliding = pattern[:n]
    else:
        period = _SWA_PERIOD.get(arch) if pattern is None else pattern
        if isinstance(period, bool) or not isinstance(period, int) or period < 0:
            raise ModelConfigError(
                f"`{header.path}`: `{key}` must be one bool per layer or a non-negative period, "
                f"got {_show(pattern)}"
            )
        sliding = [period == 0 or i % period < period - 1 for i in range(n)]
    cfg["layer_types"] = ["sliding_attention" if x else "full_attention" for x in sliding]


def _vocab_size(header: GGUFHeader) -> int | None:
    """Vocabulary size when ``{arch}.vocab_size`` is absent: the token list, else the embedding."""
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:  # None also when the list was skipped as big (read_header(arrays=False))
        if not isinstance(tokens, list):
            raise ModelConfigError(
                f"`{header.path}`: `tokenizer.ggml.tokens` must be an array, got {_show(tokens)}"
            )
        return len(tokens)
    emb = header.tensors.get("token_embd.weight")
    if emb is None:
        return None
    # GGUF lists the fastest dimension first: [hidden, vocab]
    if len(emb.shape) != 2:
        raise ModelConfigError(
            f"`{header.path}`: tensor `token_embd.weight` has shape {list(emb.shape)}, not "
            "[hidden, vocab]; no vocabulary size to take from it"
        )
    return emb.shape[1]


_ARCH_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # fmt: skip


def spec_from_gguf(path: str | os.PathLike[str], *, dtype: str | None = None) -> ModelSpec:
    """Model geometry of a GGUF file (what :meth:`ModelSpec.from_pretrained` calls for ``*.gguf``).

    Parameters
    ----------
    path : str or path
        The ``.gguf`` file.
    dtype : str, optional
        The compute dtype of the loaded model. Default ``fp32``: GGUF weights are quantized and
        :func:`load_gguf_weights` dequantizes them to float32, so ``auto`` KV resolves to fp32
        (``dtype_source == "gguf"``).

    Raises
    ------
    ModelConfigError
        Unreadable or malformed file, missing geometry fields.
    """
    from kvpool.config import ModelSpec

    header = read_header(path)
    cfg = config_from_gguf(header)
    try:
        # (no transformers defaults: llama.cpp defaults missing metadata its own way)
        spec = ModelSpec.from_dict(
            cfg, name=str(header.path), dtype=dtype or "fp32", defaults=False
        )
    except ModelConfigError as e:
        # from_dict names the Hugging Face field (`num_key_value_heads`); say which file it was
        if str(header.path) in str(e):
            raise
        raise ModelConfigError(f"`{header.path}`: {e}") from None
    spec = _with_swa_head_dims(header, spec)
    return spec if dtype is not None else replace(spec, dtype_source="gguf")


def _with_swa_head_dims(header: GGUFHeader, spec: ModelSpec) -> ModelSpec:
    """``key_length_swa`` / ``value_length_swa``: K and V head sizes of the sliding layers.

    llama.cpp (``n_embd_head_k_swa`` / ``n_embd_head_v_swa`` in ``src/llama-model.cpp``) takes
    them for the sliding layers and the full-layer sizes when absent. They join the spec here,
    not through the config dict: the one ``config.json`` name for them (``swa_head_dim``, of
    transformers' Inkling) comes with per-kind head counts that GGUF files state otherwise.
    """
    arch = header.arch
    dims = []
    for key, full in (("key_length_swa", spec.head_dim), ("value_length_swa", spec.v_head_dim)):
        v = header.metadata.get(f"{arch}.attention.{key}")
        if v is None:
            dims.append(None)
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ModelConfigError(
                f"`{header.path}`: `{arch}.attention.{key}` must be a positive integer, "
                f"got {_show(v)}"
            )
        dims.append(None if v == full or "sliding" not in spec.layer_kinds else v)
    # (each defaults to its full-layer size on its own, as in llama.cpp)
    return replace(spec, sliding_head_dim=dims[0], sliding_v_head_dim=dims[1])


# ---------------------------------------------------------------------------------- weights
_HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its Hugging Face Llama name.

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises
    ------
    KeyError
        A tensor name with no Llama counterpart.
    """
    if gguf_name in _HF_NAMES:
        return _HF_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _HF_LAYER:
        return f"model.layers.{parts[1]}.{_HF_LAYER[parts[2]]}.{parts[3]}"
    raise KeyError(f"GGUF tensor `{gguf_name}` has no Llama counterpart")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows ``[n_heads * head_dim, ...]``).

    llama.cpp's converter reorders each head's rows from ``[first half, second half]`` to
    interleaved pairs; this puts them back, so RoPE can rotate the two halves of each head.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} Q/K rows cannot be split into {n_heads} heads of pairs")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_weights(
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Dequantize a Llama-family GGUF file into a Hugging Face style state dict.

    Parameters
    ----------
    path : str or path
        The ``.gguf`` file.
    dtype : torch.dtype, optional
        Dtype of the returned tensors (default float32, what dequantization yields).

    Returns
    -------
    (config, state_dict)
        ``config`` as :func:`config_from_gguf` builds it; ``state_dict`` maps Hugging Face names
        (``model.layers.0.self_attn.q_proj.weight``, ...) to CPU tensors, Q/K rows un-permuted.

    Raises
    ------
    ModelConfigError
        Not a Llama-family file, or an unknown tensor.
    ImportError
        The ``gguf`` package is missing.
    """
    import numpy as np
    import torch

    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError as e:
        raise ImportError("reading GGUF weights needs the `gguf` package: pip install gguf") from e
    header = read_header(path)
    if header.arch not in ("llama", "mistral"):
        raise ModelConfigError(
            f"`{header.path}` is a `{header.arch}` model; the weight loader handles Llama-family "
            "GGUF files (`llama`, `mistral`)"
        )
    cfg = config_from_gguf(header)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    raw = np.memmap(header.path, dtype=np.uint8, mode="r")
    out: dict[str, torch.Tensor] = {}
    for info in header.tensors.values():
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelConfigError(
                f"`{header.path}`: tensor `{info.name}` has unknown GGML type {info.ggml_type}"
            ) from None
        try:
            name = hf_name(info.name)
        except KeyError as e:  # the docstring's promise: a ModelConfigError naming the file
            raise ModelConfigError(f"`{header.path}`: {e.args[0]}") from None
        # rows are whole quantization blocks; a bad shape or offset would otherwise surface as a
        # numpy reshape error naming neither the file nor the tensor
        if not info.shape or info.shape[0] % block:
            raise ModelConfigError(
                f"`{header.path}`: tensor `{info.name}` has shape {list(info.shape)}; "
                f"{qtype.name} needs rows of a multiple of {block} values"
            )
        n = int(np.prod(info.shape, dtype=object))
        nbytes = n // block * type_size
        if info.offset + nbytes > raw.size:
            raise ModelConfigError(
                f"`{header.path}` is truncated: tensor `{info.name}` needs bytes "
                f"{info.offset}..{info.offset + nbytes}, the file has {raw.size}"
            )
        data = raw[info.offset : info.offset + nbytes]
        # GGUF lists the fastest dimension first; rows of the byte view follow the reversed shape.
        shape = tuple(reversed(info.shape))
        rows = data.reshape(*shape[:-1], shape[-1] // block * type_size)
        w = dequantize(rows, qtype).astype(np.float32, copy=False).reshape(shape)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, kv_heads)
        t = torch.from_numpy(np.require(w, requirements=["C", "W"]))
        out[name] = t.to(dtype or torch.float32)
    return cfg, out


# ---------------------------------------------------------------------------------- tokenizer
def tokenizer_from_gguf(path: str | os.PathLike[str]) -> Any:
    """Build a ``tokenizers.Tokenizer`` from a GGUF file's byte-level BPE vocabulary.

    Handles ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE); the ``smollm`` / ``starcoder``
    pre-tokenizers also split digits one by one. Control tokens (``token_type == 3``) are special.

    Raises
    ------
    ModelConfigError
        No tokenizer in the file, or a tokenizer model other than ``gpt2``.
    ImportError
        The ``tokenizers`` package is missing.
    """
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError as e:
        raise ImportError("the GGUF tokenizer needs `tokenizers`: pip install tokenizers") from e
    h = read_header(path, arrays=True)
    m = h.metadata
    kind = m.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelConfigError(
            f"`{h.path}`: tokenizer model `{kind}` is not supported (byte-level BPE `gpt2` only)"
        )
    tokens: list[str] = m.get("tokenizer.ggml.tokens")  # type: ignore[assignment]
    merges_raw = m.get("tokenizer.ggml.merges") or []
    # the tokenizers package would fail on anything else with a message naming neither
    for key, v in (("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.merges", merges_raw)):
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ModelConfigError(
                f"`{h.path}`: `{key}` must be an array of strings, got {_show(v)}"
            )
    merges = [tuple(x.split(" ", 1)) for x in merges_raw]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if m.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "codeshell"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = m.get("tokenizer.ggml.token_type") or []
    control = [i for i, t in enumerate(types) if t == 3]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    return tok
