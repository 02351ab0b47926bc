"""Model geometry from a Hugging Face ``config.json`` (file, model directory, bundled name or dict).

Rules (each learnt from a fault seen in a peer engine, see ``shared/CASES.md``):

- ``head_dim`` is taken as declared; only when it is absent or ``null`` is it
  ``hidden_size / num_attention_heads``, which must divide exactly (KVB-01).
- ``num_key_value_heads`` defaults to ``num_attention_heads`` (multi-head attention).
- The language model's fields nested under ``text_config`` / ``language_config`` /
  ``llm_config`` / ``thinker_config`` are searched before the top level, whose fields may
  describe a vision tower.
- ``layer_types`` wins over ``full_attention_interval`` and over sliding-window patterns.
- MLA (``kv_lora_rank``) stores one latent of ``kv_lora_rank + qk_rope_head_dim`` values per
  token and layer; a sparse-attention indexer cache (``index_head_dim``) is refused explicitly.
- A field that is needed and missing raises :class:`kvpool.ModelConfigError` naming it; nothing
  is defaulted silently.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvpool._core import ModelConfigError, ModelGeometry

_NESTED = ("text_config", "language_config", "llm_config", "thinker_config")
_DTYPE_NAMES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
}
#: Bytes per value of each model compute dtype.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_MAX_FIELD = 1 << 40
_MAX_LAYERS = 1 << 16


@functools.lru_cache(maxsize=1)
def _bundled() -> tuple[str, ...]:
    files = resources.files("kvpool").joinpath("models").iterdir()
    return tuple(
        sorted(
            f.name[: -len(".json")].replace("--", "/", 1) for f in files if f.name.endswith(".json")
        )
    )


def bundled_models() -> list[str]:
    """Hub ids of the bundled ``config.json`` files (``org/name``), sorted."""
    return list(_bundled())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelConfigError(f"cannot read model config `{path}`: {e}") from None
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"model config `{path}` is not UTF-8 text: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"malformed JSON in `{path}`: {e}") from None
    except RecursionError:  # (json nests one Python frame per level)
        raise ModelConfigError(f"`{path}` nests its JSON too deeply to be a model config") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"`{path}` holds a JSON {type(data).__name__}, not an object")
    return data


def _scopes(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Nested language-model configs, innermost first, then ``d`` itself."""
    out: list[dict[str, Any]] = []
    for k in _NESTED:
        if isinstance(d.get(k), dict):
            out += _scopes(d[k])
    return out + [d]


class _Fields:
    """Looks fields up in the nested language-model config first, then the top level."""

    def __init__(self, config: dict[str, Any]):
        self.scopes = _scopes(config)

    def get(self, name: str, default: Any = None) -> Any:
        for scope in self.scopes:
            if scope.get(name) is not None:
                return scope[name]
        return default

    def has(self, name: str) -> bool:
        return self.get(name) is not None

    def int(self, name: str, *, default: int | None = None) -> int:
        v = self.get(name)
        if v is None:
            if default is not None:
                return default
            raise ModelConfigError(f"model config lacks `{name}`")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ModelConfigError(f"`{name}` must be a non-negative integer, got {v!r}")
        if v > _MAX_FIELD:
            raise ModelConfigError(
                f"`{name}` = {v} exceeds {_MAX_FIELD}; no real model is that large"
            )
        return v


@dataclass(frozen=True)
class ModelSpec:
    """Attention geometry and weight-size facts of one model, as sizing needs them.

    Build with :meth:`from_pretrained` (file, directory, bundled name) or :meth:`from_dict`.

    Attributes
    ----------
    name : str
        Hub id or path the spec came from.
    layer_kinds : tuple of str
        ``"full"``, ``"sliding"`` or ``"linear"`` per layer (``linear`` stores no KV pages).
    num_attention_heads, num_kv_heads : int
        Query heads and KV heads (global, before TP).
    head_dim, v_head_dim : int
        Values per head for K and V. For MLA models these are the query/value head dims; the
        cache stores ``kv_lora_rank + qk_rope_head_dim`` values per token instead.
    sliding_window : int or None
        Window in tokens of the sliding layers.
    kv_lora_rank, qk_rope_head_dim : int or None
        MLA latent sizes (DeepSeek-V2/V3, Kimi-K2).
    dtype : str
        The model's compute dtype (``bf16``/``fp16``/``fp32``): what ``auto`` KV resolves to.
    dtype_source : str
        Where ``dtype`` came from (``"config"``, ``"caller"`` or ``"default"``).
    config : dict
        The raw config.
    path : Path or None
        The model directory, when one was given (for the checkpoint's weight size).
    """

    name: str
    layer_kinds: tuple[str, ...]
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sliding_window: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    dtype: str = "bf16"
    dtype_source: str = "default"
    linear_attention: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    path: Path | None = None

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_pretrained(
        cls, model: str | os.PathLike[str], *, dtype: str | None = None
    ) -> ModelSpec:
        """Load a model's geometry.

        Parameters
        ----------
        model : str or path
            A ``config.json`` file, a model directory holding one, a GGUF file, or the hub id of a
            bundled config (e.g. ``"Qwen/Qwen3-8B"``; see :func:`bundled_models`).
        dtype : str, optional
            The loaded model's compute dtype (e.g. ``"fp32"`` for a dequantized GGUF); overrides
            the config's ``torch_dtype``.

        Raises
        ------
        ModelConfigError
            Unknown name, unreadable or malformed file, missing or inconsistent fields.
        """
        if isinstance(model, str) and not model.strip():
            raise ModelConfigError("`model` is an empty string")
        p = Path(os.fspath(model))
        if p.suffix == ".gguf":
            from kvpool.gguf import spec_from_gguf

            return spec_from_gguf(p, dtype=dtype)
        if p.is_dir():
            cfg = p / "config.json"
            if not cfg.is_file():
                raise ModelConfigError(f"model directory `{p}` has no config.json")
            return cls.from_dict(_read_json(cfg), name=str(p), dtype=dtype, path=p)
        if p.is_file():
            return cls.from_dict(_read_json(p), name=str(p), dtype=dtype)
        name = str(model)
        bundled = {b.lower(): b for b in bundled_models()}
        key = name.lower().replace("--", "/", 1)
        matches = [b for k, b in bundled.items() if k == key or k.split("/", 1)[1] == key]
        if len(matches) != 1:
            raise ModelConfigError(
                f"unknown model `{name}`: not a file or directory, and not a bundled config "
                "(`kvpool models` or `kvpool.config.bundled_models()` lists them)"
            )
        res = resources.files("kvpool").joinpath("models", matches[0].replace("/", "--") + ".json")
        try:
            data = json.loads(res.read_text())
        except json.JSONDecodeError as e:  # pragma: no cover - bundled files are valid
            raise ModelConfigError(f"malformed bundled config `{matches[0]}`: {e}") from None
        return cls.from_dict(data, name=matches[0], dtype=dtype)

    @classmethod
    def from_dict(
        cls,
        config: dict[str, Any],
        *,
        name: str = "<dict>",
        dtype: str | None = None,
        path: Path | None = None,
    ) -> ModelSpec:
        """Build a spec from a parsed ``config.json``.

        Raises
        ------
        ModelConfigError
            Missing or inconsistent fields, named in the message.
        """
        if not isinstance(config, dict):
            raise ModelConfigError(f"model config must be a dict, got {type(config).__name__}")
        f = _Fields(config)
        if f.has("index_head_dim"):
            raise ModelConfigError(
                f"`index_head_dim` = {f.get('index_head_dim')}: this model keeps a sparse-"
                "attention "
                "indexer cache (DeepSeek-V3.2 style), which kvpool does not size yet; refusing "
                "rather than under-counting its bytes"
            )
        for key in ("index_n_heads", "index_topk"):
            if f.has(key):
                raise ModelConfigError(
                    f"`{key}` = {f.get(key)}: sparse-attention indexer configs are not sized yet"
                )
        num_layers = f.int("num_hidden_layers")
        if not 0 < num_layers <= _MAX_LAYERS:
            raise ModelConfigError(
                f"`num_hidden_layers` must be in 1..{_MAX_LAYERS}, got {num_layers}"
            )
        heads = f.int("num_attention_heads")
        if heads == 0:
            raise ModelConfigError("`num_attention_heads` must be positive, got 0")
        kv_heads = f.int("num_key_value_heads", default=heads)
        if kv_heads > heads:
            raise ModelConfigError(
                f"`num_key_value_heads` = {kv_heads} exceeds `num_attention_heads` = {heads}"
            )
        if f.has("kv_lora_rank"):
            head_dim = f.int("qk_nope_head_dim", default=0) + f.int("qk_rope_head_dim")
        elif f.has("head_dim"):
            head_dim = f.int("head_dim")
        else:
            hidden = f.int("hidden_size")
            if hidden % heads:
                raise ModelConfigError(
                    f"no `head_dim` and `hidden_size` = {hidden} is not divisible by "
                    f"`num_attention_heads` = {heads}; cannot derive the head size"
                )
            head_dim = hidden // heads
        v_head_dim = f.int("v_head_dim", default=head_dim)
        kv_lora_rank = qk_rope = None
        if f.has("kv_lora_rank"):
            kv_lora_rank = f.int("kv_lora_rank")
            qk_rope = f.int("qk_rope_head_dim")
        kinds, window = _layer_kinds(f, num_layers)
        model_dtype, source = _model_dtype(f, dtype)
        linear = _linear_attention(f) if "linear" in kinds else {}
        return cls(
            name=name,
            layer_kinds=tuple(kinds),
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            sliding_window=window,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope,
            dtype=model_dtype,
            dtype_source=source,
            linear_attention=linear,
            config=config,
            path=path,
        )

    def with_dtype(self, dtype: str) -> ModelSpec:
        """The same spec with the caller's compute dtype (what ``auto`` KV resolves to).

        Raises
        ------
        ModelConfigError
            ``dtype`` is not one of the fp32/bf16/fp16 names.
        """
        d, src = _model_dtype(_Fields({}), dtype)
        return dataclasses.replace(self, dtype=d, dtype_source=src)

    # ------------------------------------------------------------------ derived
    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.layer_kinds)

    @property
    def is_mla(self) -> bool:
        """Whether the model uses multi-head latent attention."""
        return self.kv_lora_rank is not None

    @property
    def fields(self) -> _Fields:
        """Field lookup over the raw config (nested language config first)."""
        return _Fields(self.config)

    def geometry(self, tp_size: int = 1) -> ModelGeometry:
        """The Rust-side geometry; linear-attention state is sharded for ``tp_size`` ranks."""
        conv, ssm = self.linear_state_bytes(tp_size)
        return ModelGeometry(
            layer_kinds=list(self.layer_kinds),
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            sliding_window=self.sliding_window,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            linear_conv_bytes=conv,
            linear_ssm_bytes=ssm,
        )

    def linear_state_bytes(self, tp_size: int = 1) -> tuple[int, int]:
        """Per-request state bytes of one linear-attention layer on one rank: ``(conv, ssm)``.

        Gated DeltaNet (Qwen3-Next, Qwen3.5): the causal conv keeps the last
        ``conv_kernel - 1`` inputs of ``2 * key_dim + value_dim`` channels in the model dtype; the
        recurrent state is ``[num_v_heads, k_head_dim, v_head_dim]`` in ``mamba_ssm_dtype``
        (fp32 unless the config says otherwise). Heads are split over ``tp_size`` ranks.
        """
        la = self.linear_attention
        if not la:
            return (0, 0)
        kh, vh = la["num_key_heads"], la["num_value_heads"]
        for n in (kh, vh):
            if n % tp_size:
                raise ModelConfigError(
                    f"tp_size `{tp_size}` does not divide the {n} linear-attention heads"
                )
        key_dim = kh * la["key_head_dim"] // tp_size
        value_dim = vh * la["value_head_dim"] // tp_size
        conv = (2 * key_dim + value_dim) * (la["conv_kernel"] - 1) * DTYPE_BYTES[self.dtype]
        ssm = (vh // tp_size) * la["key_head_dim"] * la["value_head_dim"] * la["ssm_dtype_bytes"]
        return (conv, ssm)


def _layer_kinds(f: _Fields, num_layers: int) -> tuple[list[str], int | None]:
    window = f.get("sliding_window")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 0
    ):
        raise ModelConfigError(
            f"`sliding_window` must be a non-negative integer or null, got {window!r}"
        )
    types = f.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            n = len(types) if isinstance(types, list) else type(types).__name__
            raise ModelConfigError(
                f"`layer_types` must list one entry per layer ({num_layers}), got {n}"
            )
        kinds = [_layer_type(t, i) for i, t in enumerate(types)]
    elif f.has("full_attention_interval"):
        every = f.int("full_attention_interval")
        if every == 0:
            raise ModelConfigError("`full_attention_interval` must be positive, got 0")
        kinds = ["full" if (i + 1) % every == 0 else "linear" for i in range(num_layers)]
    elif window is not None and f.get("use_sliding_window", True) is not False:
        kinds = _sliding_pattern(f, num_layers)
    else:
        kinds = ["full"] * num_layers
    if "sliding" in kinds:
        if not window:
            raise ModelConfigError("sliding-window layers but no positive `sliding_window`")
    else:
        window = None
    return kinds, window


def _layer_type(t: object, i: int) -> str:
    if not isinstance(t, str):
        raise ModelConfigError(f"`layer_types[{i}]` must be a string, got {t!r}")
    kind = _LAYER_TYPES.get(t.lower())
    if kind is None:
        known = ", ".join(sorted(_LAYER_TYPES))
        raise ModelConfigError(f"unknown layer type `{t}` at `layer_types[{i}]`; known: {known}")
    return kind


# Names seen in published configs' `layer_types`.
_LAYER_TYPES = {
    "full_attention": "full",
    "attention": "full",
    "global": "full",
    "global_attention": "full",
    "sliding_attention": "sliding",
    "sliding_window_attention": "sliding",
    "local": "sliding",
    "local_attention": "sliding",
    "linear_attention": "linear",
    "mamba": "linear",
    "mamba2": "linear",
    "gated_deltanet": "linear",
}


def _sliding_pattern(f: _Fields, num_layers: int) -> list[str]:
    model_type = str(f.get("model_type", ""))
    pattern = f.get("sliding_window_pattern")
    if model_type == "gemma2":
        # Gemma 2 alternates: even layers local (sliding), odd layers global.
        return ["sliding" if i % 2 == 0 else "full" for i in range(num_layers)]
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ModelConfigError(
                f"`sliding_window_pattern` must be a positive integer, got {pattern!r}"
            )
        # Gemma 3: every `pattern`-th layer is global.
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]
    if f.has("max_window_layers") and model_type.startswith("qwen"):
        # Qwen2 with use_sliding_window: layers from max_window_layers on use the window.
        start = f.int("max_window_layers")
        return ["sliding" if i >= start else "full" for i in range(num_layers)]
    return ["sliding"] * num_layers


def _model_dtype(f: _Fields, override: str | None) -> tuple[str, str]:
    if override is not None:
        d = _DTYPE_NAMES.get(str(override).lower())
        if d is None:
            raise ModelConfigError(
                f"model dtype `{override}` is not one of {', '.join(sorted(set(_DTYPE_NAMES)))}"
            )
        return d, "caller"
    raw = f.get("torch_dtype") or f.get("dtype")
    if raw is None:
        return "bf16", "default"
    d = _DTYPE_NAMES.get(str(raw).lower())
    if d is None:
        raise ModelConfigError(f"unknown `torch_dtype` {raw!r} in model config")
    return d, "config"


def _linear_attention(f: _Fields) -> dict[str, Any]:
    raw = f.get("mamba_ssm_dtype", "float32")
    ssm_dtype = _DTYPE_NAMES.get(str(raw).lower())
    if ssm_dtype is None:
        raise ModelConfigError(f"unknown `mamba_ssm_dtype` {raw!r} in model config")
    # (a zero would size a linear-attention layer as holding no state at all)
    dims = {}
    for name in ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim"):  # fmt: skip
        dims[name] = f.int(name)
        if dims[name] == 0:
            raise ModelConfigError(f"`{name}` must be positive, got 0")
    return {
        "num_key_heads": dims["linear_num_key_heads"],
        "num_value_heads": dims["linear_num_value_heads"],
        "key_head_dim": dims["linear_key_head_dim"],
        "value_head_dim": dims["linear_value_head_dim"],
        "conv_kernel": dims["linear_conv_kernel_dim"],
        "ssm_dtype_bytes": DTYPE_BYTES[ssm_dtype],
    }
