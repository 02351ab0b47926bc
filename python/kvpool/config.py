"""Model geometry from a Hugging Face ``config.json`` (file, model directory, bundled name or dict).

Rules (each learnt from a fault seen in peer engines):

- ``head_dim`` is taken as declared; only when it is absent or ``null`` is it
  ``hidden_size / num_attention_heads``, which must divide exactly.
- ``num_key_value_heads`` defaults to ``num_attention_heads`` (multi-head attention).
- The language model's fields nested under ``text_config`` / ``language_config`` /
  ``llm_config`` / ``thinker_config`` are searched before the top level, whose fields may
  describe a vision tower.
- A field absent from the file takes the transformers class default of the language model's
  ``model_type`` (:mod:`kvpool.config_defaults`), as transformers itself does on load; a field
  set to ``null`` stays null.
- ``layer_types`` wins over ``full_attention_interval`` and over sliding-window patterns.
- MLA (``kv_lora_rank``) stores one latent of ``kv_lora_rank + qk_rope_head_dim`` values per
  token and layer; a sparse-attention indexer cache (``index_head_dim``) is refused explicitly.
- ``num_kv_shared_layers`` (Gemma-3n): the last layers own no KV and read an earlier layer's.
- A field that is needed, missing and without a class default, or inconsistent with the others
  (layer counts, windows, shared layers, linear-attention heads), raises
  :class:`kvpool.ModelConfigError` naming it.
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
from kvpool.config_defaults import ALIASES, DEFAULTS, SLIDING_PERIOD, table_entry

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
    """Field lookup: nested language-model config, top level, then the class defaults.

    The defaults (:mod:`kvpool.config_defaults`, by the language model's ``model_type``) serve
    only a field absent from every scope.
    """

    def __init__(self, config: dict[str, Any], *, defaults: bool = True):
        self.scopes = _scopes(config)
        # the innermost scope that names its model_type says which class the fields belong to
        types = [s["model_type"] for s in self.scopes if "model_type" in s]
        self.table = table_entry(types[0]) if defaults and types else None
        self.defaults = DEFAULTS.get(self.table, {}) if self.table else {}
        #: names of the fields served from the defaults table, in lookup order
        self.defaulted: dict[str, None] = {}

    def get(self, name: str, default: Any = None) -> Any:
        present = False
        for scope in self.scopes:
            if name in scope:
                present = True
                if scope[name] is not None:
                    return scope[name]
        # a field the file sets to null is null, as transformers reads it; only an absent one
        # takes the class default
        if not present and name in self.defaults:
            self.defaulted[name] = None
            return self.defaults[name]
        return default

    def has(self, name: str) -> bool:
        return self.get(name) is not None

    def int(self, name: str, *, default: int | None = None) -> int:
        v = self.get(name)
        if v is None:
            if default is not None:
                return default
            if self.table is None:
                raise ModelConfigError(f"model config lacks `{name}`")
            raise ModelConfigError(
                f"model config lacks `{name}`, which has no transformers default for "
                f"`model_type` `{self.table}` either"
            )
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
        ``"full"``, ``"sliding"``, ``"linear"`` or ``"shared"`` per layer (``linear`` keeps
        per-request state, no KV pages; ``shared`` owns no KV at all, see ``kv_shared_sources``).
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
    linear_attention : dict
        Gated DeltaNet dims of the ``linear`` layers (empty when there are none): ``num_key_heads``,
        ``num_value_heads``, ``key_head_dim``, ``value_head_dim``, ``conv_kernel``,
        ``ssm_dtype_bytes``.
    sliding_head_dim, sliding_v_head_dim : int or None
        K and V values per head of the ``sliding`` layers when they differ from ``head_dim`` /
        ``v_head_dim`` (config ``swa_head_dim`` / ``swa_v_head_dim``, GGUF
        ``<arch>.attention.key_length_swa`` / ``value_length_swa``);
        ``None`` means the same as the full layers (and always when there are no sliding layers).
    kv_shared_sources : dict of int to int
        ``{layer: source_layer}`` for the layers of kind ``"shared"``, which own no KV and attend
        over the KV of ``source_layer`` (Gemma-3n ``num_kv_shared_layers``: the last N layers read
        the last earlier layer of the same attention type, sliding or full). Empty for most models.
    num_nextn_predict_layers : int
        Multi-token-prediction (MTP) layers the checkpoint carries beside the decoder layers
        (DeepSeek-V3/R1 and Kimi-K2 declare 1; Qwen3.5 names it ``mtp_num_hidden_layers``).
        SGLang's NEXTN speculative decoding runs them with their own KV; they are not in
        ``layer_kinds``.
    defaults_from : str or None
        The :data:`kvpool.config_defaults.DEFAULTS` entry (a ``model_type``) whose transformers
        class defaults stand in for fields the config leaves out; ``None`` when none applies
        (unknown ``model_type``, or a GGUF file, whose metadata llama.cpp defaults differently).
    defaulted_fields : tuple of str
        The fields ``from_dict`` took from that entry, in the order it read them.
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
    sliding_head_dim: int | None = None
    sliding_v_head_dim: int | None = None
    kv_shared_sources: dict[int, int] = field(default_factory=dict)
    num_nextn_predict_layers: int = 0
    defaults_from: str | None = None
    defaulted_fields: tuple[str, ...] = ()
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
        defaults: bool = True,
    ) -> ModelSpec:
        """Build a spec from a parsed ``config.json``.

        Parameters
        ----------
        config : dict
            The parsed config (nested ``text_config`` etc. searched first).
        name : str
            What the spec is called (``ModelSpec.name``).
        dtype : str, optional
            The compute dtype, overriding the config's ``torch_dtype``.
        path : Path, optional
            The model directory (for the checkpoint's weight size).
        defaults : bool
            Fill fields absent from the config with the Hugging Face transformers class
            defaults of its ``model_type`` (:mod:`kvpool.config_defaults`), as transformers does
            when it loads the file. Fields without such a default must be in the config.

        Raises
        ------
        ModelConfigError
            Missing or inconsistent fields, named in the message.
        """
        if not isinstance(config, dict):
            raise ModelConfigError(f"model config must be a dict, got {type(config).__name__}")
        f = _Fields(config, defaults=defaults)
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
            if kv_lora_rank == 0:
                raise ModelConfigError("`kv_lora_rank` must be positive, got 0")
        kinds, window = _layer_kinds(f, num_layers)
        swa_k, swa_v = _sliding_head_dims(f, kinds, heads, kv_heads, head_dim, v_head_dim)
        shared = _kv_shared_sources(f, kinds)
        for i in shared:
            kinds[i] = "shared"
        model_dtype, source = _model_dtype(f, dtype)
        linear = _linear_attention(f) if "linear" in kinds else {}
        nextn = f.int("num_nextn_predict_layers", default=0) or f.int(
            "mtp_num_hidden_layers", default=0
        )
        return cls(
            name=name,
            layer_kinds=tuple(kinds),
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            sliding_window=window,
            sliding_head_dim=swa_k,
            sliding_v_head_dim=swa_v,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope,
            dtype=model_dtype,
            dtype_source=source,
            linear_attention=linear,
            kv_shared_sources=shared,
            num_nextn_predict_layers=nextn,
            defaults_from=f.table,
            defaulted_fields=tuple(f.defaulted),
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
        """Field lookup over the raw config (nested language config first, then the defaults)."""
        return _Fields(self.config, defaults=self.defaults_from is not None)

    def geometry(self, tp_size: int = 1) -> ModelGeometry:
        """The Rust-side geometry on one of ``tp_size`` ranks, as sizing builds it.

        Layer kinds (shared layers with their sources), sliding head dims and the
        linear-attention state shapes sharded for ``tp_size`` (see ``kvpool.sizing``).
        """
        from kvpool.sizing import _geometry  # (sizing imports this module)

        return _geometry(self, tp_size)

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
    elif window is not None and _use_sliding_window(f):
        kinds = _sliding_pattern(f, num_layers)
    else:
        kinds = ["full"] * num_layers
    if "sliding" in kinds:
        if not window:
            raise ModelConfigError("sliding-window layers but no positive `sliding_window`")
    else:
        window = None
    return kinds, window


def _sliding_head_dims(
    f: _Fields, kinds: list[str], heads: int, kv_heads: int, head_dim: int, v_head_dim: int
) -> tuple[int | None, int | None]:
    """Head sizes of the sliding layers where the config gives them their own (else ``None``).

    transformers 5.23.0 names them ``swa_head_dim`` (models/inkling/configuration_inkling.py;
    V the same size, there being no ``swa_v_head_dim`` in it; MiMo-V2's remote config adds
    ``swa_v_head_dim``). Per-kind head *counts* (``swa_num_key_value_heads``) and Gemma-4's
    full-layer geometry (``global_head_dim``, ``num_global_key_value_heads``) are refused: the spec
    holds one KV head count, and guessing would under-size the pool.
    """
    for name, same in (("swa_num_key_value_heads", kv_heads), ("swa_num_attention_heads", heads)):
        if f.has(name) and f.int(name) != same:
            raise ModelConfigError(
                f"`{name}` = {f.get(name)} differs from the full layers' {same}; kvpool does not "
                "size sliding layers with their own head counts yet"
            )
    for name in ("global_head_dim", "num_global_key_value_heads"):
        if f.has(name):
            raise ModelConfigError(
                f"`{name}` = {f.get(name)}: full layers with their own head geometry (Gemma-4 "
                "style) are not sized yet; refusing rather than mis-counting their bytes"
            )
    if not f.has("swa_head_dim") or "sliding" not in kinds:
        return None, None
    k = f.int("swa_head_dim")
    v = f.int("swa_v_head_dim") if f.has("swa_v_head_dim") else k
    for name, x in (("swa_head_dim", k), ("swa_v_head_dim", v)):
        if x == 0:
            raise ModelConfigError(f"`{name}` must be positive, got 0")
    return (None if k == head_dim else k), (None if v == v_head_dim else v)


def _kv_shared_sources(f: _Fields, kinds: list[str]) -> dict[int, int]:
    """Layers that reuse an earlier layer's KV: ``{layer: source}`` (Gemma-3n).

    The rule of transformers 5.23.0 (models/gemma3n/configuration_gemma3n.py,
    ``Gemma3nTextConfig.kv_sharing_modes``; the same in ``modeling_gemma3n.py`` of 4.53): the last
    ``num_kv_shared_layers`` layers compute no K/V and read those of the last layer before them
    that has the same ``layer_types`` entry; every type among the shared layers needs one.
    """
    n = f.int("num_kv_shared_layers", default=0)
    if n == 0:
        return {}
    first = len(kinds) - n
    if first <= 0:
        raise ModelConfigError(
            f"`num_kv_shared_layers` = {n} leaves no layer of the {len(kinds)} "
            "(`num_hidden_layers`) to own the KV they share"
        )
    out = {}
    for i in range(first, len(kinds)):
        kind = kinds[i]
        if kind == "linear":
            raise ModelConfigError(
                f"`num_kv_shared_layers` = {n} makes linear-attention layer {i} share KV; "
                "only attention layers share KV"
            )
        sources = [j for j in range(first) if kinds[j] == kind]
        if not sources:
            raise ModelConfigError(
                f"`num_kv_shared_layers` = {n}: shared layer {i} is {kind} attention, but no "
                f"layer before layer {first} is, so none owns KV for it to share"
            )
        out[i] = sources[-1]
    return out


def _use_sliding_window(f: _Fields) -> bool:
    use = f.get("use_sliding_window", True)
    if not isinstance(use, bool):
        raise ModelConfigError(f"`use_sliding_window` must be true, false or null, got {use!r}")
    return use


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
    period = SLIDING_PERIOD.get(ALIASES.get(model_type, model_type))
    if period is not None:
        # the fixed pattern transformers builds for these architectures (Gemma 2, gpt-oss:
        # even layers sliding, odd full; Gemma-3n: every 5th full), whatever else the config says
        return ["full" if (i + 1) % period == 0 else "sliding" for i in range(num_layers)]
    pattern = f.get("sliding_window_pattern")
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ModelConfigError(
                f"`sliding_window_pattern` must be a positive integer, got {pattern!r}"
            )
        # Gemma 3, Cohere 2: every `pattern`-th layer is global.
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


_MAX_LINEAR_DIM = 1 << 16


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
        # (state bytes multiply four of these: bounded, they cannot overflow 64 bits)
        if dims[name] > _MAX_LINEAR_DIM:
            raise ModelConfigError(
                f"`{name}` = {dims[name]} exceeds {_MAX_LINEAR_DIM}; no real model is that large"
            )
    kh, vh = dims["linear_num_key_heads"], dims["linear_num_value_heads"]
    if vh % kh:
        # Gated DeltaNet repeats each Q/K head over num_value_heads / num_key_heads V heads
        raise ModelConfigError(
            f"`linear_num_value_heads` = {vh} is not a multiple of `linear_num_key_heads` = {kh}"
        )
    return {
        "num_key_heads": dims["linear_num_key_heads"],
        "num_value_heads": dims["linear_num_value_heads"],
        "key_head_dim": dims["linear_key_head_dim"],
        "value_head_dim": dims["linear_value_head_dim"],
        "conv_kernel": dims["linear_conv_kernel_dim"],
        "ssm_dtype_bytes": DTYPE_BYTES[ssm_dtype],
    }
