"""GGUF files in (`dllm convert --from-gguf`): the architecture from the file's metadata, the weights
read and dequantized to float32 by the `gguf` package (llama.cpp's own reader, `gguf.dequantize`),
renamed through gguf's tensor-name map onto the family's Hugging Face names and from there onto the
native ones (families/), so a GGUF import and a Hugging Face import share every name and check.

Supported: llama-architecture files (LLaMA, SmolLM, Mistral-style dense models) with default RoPE.
llama.cpp's converter reorders the rows of q and k of a llama model for its interleaved RoPE
(convert_hf_to_gguf.py, `LlamaModel.permute`); `_unpermute` undoes that reordering, as transformers'
GGUF loader does, so the weights use the rotate-half layout of the Hugging Face model.

The tokenizer is not read here (tokenization/gguf.py).

Shapes: V vocabulary, E hidden width; GGUF lists a tensor's dimensions fastest first, numpy (and
here) slowest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dllm.config.model import ModelConfig
from dllm.config.registries import FAMILIES
from dllm.errors import ConfigError
from dllm.models.families.base import Family, native_to_hf_name
from dllm.models.gguf_header import check_header
from dllm.models.hf_io import Progress, check_weight_shapes

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = {"llama": "llama"}
"""GGUF `general.architecture` -> the dllm family its weights are read as."""
INSTALL_HINT = "pip install 'dllm[real]' (or: pip install gguf)"
MAX_WIDTH = 1 << 20
"""The largest width, head count or head size a GGUF's metadata may give (the largest models are ~2**15 wide)."""
MAX_VOCAB = MAX_POSITIONS = 1 << 24
"""The largest vocabulary and context length it may give (vocabularies hold ~2**18 tokens)."""


@dataclass
class GGUFModel:
    """What a GGUF file holds for dllm: the architecture and native float32 weights."""

    cfg: ModelConfig
    state: dict[str, torch.Tensor]
    architecture: str
    """The file's `general.architecture`."""
    name: str | None
    """The file's `general.name`, when it has one."""


def import_gguf(path: Path, progress: Progress | None = None) -> GGUFModel:
    """Read a GGUF file: every check (format, architecture, names, shapes, memory) before any tensor is
    dequantized; one ConfigError naming the file for anything it cannot import. `progress(done, total)` (in
    parameters) after each tensor dequantized."""
    path = Path(path)
    reader = open_gguf(path)
    arch = str(field_value(reader, "general.architecture") or "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"--from-gguf: {path} holds a {arch or 'unnamed'!s} model; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family: Family = FAMILIES.resolve(SUPPORTED_ARCHITECTURES[arch])
    tensors = {t.name: t for t in reader.tensors}
    hf = hf_config(reader, path, arch, tensors)
    check_token_ids(reader, path)
    try:
        fields = {k: v for k, v in family.config_from_hf(hf).items() if v is not None}
        cfg = ModelConfig(family=family.name, **fields)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"--from-gguf: {path}: its metadata describes no valid {arch} model ({e})") from None
    names = gguf_names(family, cfg, arch, path)
    stored = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in tensors.items()}

    def to_native() -> dict[str, tuple[int, ...]]:
        extra = sorted(stored.keys() - names.keys())
        if extra:
            raise ConfigError(f"--from-gguf: {path}: tensor {extra[0]} has no place in a {family.name} model")
        return {names[g]: s for g, s in stored.items()}

    check_weight_shapes(path, cfg, cfg, stored, to_native, lambda k: _gguf_name_of(names, k))
    state: dict[str, torch.Tensor] = {}
    total, done = sum(math.prod(stored[g]) for g in names), 0
    for g, native in names.items():
        state[native] = _dequantize(tensors[g], g, arch, cfg, path)
        done += state[native].numel()
        if progress is not None:
            progress(done, total)
    return GGUFModel(cfg, state, arch, _optional_str(field_value(reader, "general.name")))


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` over the file; a missing package, a file that is not GGUF or one cut short is
    one line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--from-gguf: {path} is not a file; give a .gguf model file")
    try:
        import gguf
    except ImportError:
        raise ConfigError(f"--from-gguf: reading GGUF files needs the gguf package: {INSTALL_HINT}") from None
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConfigError(f"--from-gguf: {path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    check_header(path)  # every count in bounds before gguf's reader loops over it
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        size = path.stat().st_size
        raise ConfigError(
            f"--from-gguf: {path} is a truncated or damaged GGUF file ({size:,} bytes; the reader says: "
            f"{' '.join(str(e).split())[:120]}); download or copy it again"
        ) from None


def field_value(reader: Any, key: str) -> Any:
    """A metadata value: a str, a number, a list of them; None when absent."""
    import gguf

    field = reader.fields.get(key)
    if field is None or not field.types:
        return None
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [_scalar(field.parts[i], field.types[-1]) for i in field.data]
    return _scalar(field.parts[field.data[0]], field.types[0])


def _scalar(part: np.ndarray, kind: Any) -> Any:
    import gguf

    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0]


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def hf_config(reader: Any, path: Path, arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config.json keys of a llama-architecture GGUF, from its `{arch}.*` metadata (llama.cpp's
    key names, gguf/constants.py `Keys`). Settings the native model does not compute are refused."""

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None and required and default is None:
            raise ConfigError(f"--from-gguf: {path}: no {arch}.{key} in its metadata; not a complete model file")
        return default if value is None else value

    def count(key: str, default: int | None = None, upper: int = MAX_WIDTH, why: str = "") -> int:
        return _count(get(key, default), f"{arch}.{key}", upper, path, why)

    def number(key: str, default: float) -> float:
        return _positive_number(get(key, default), f"{arch}.{key}", path)

    _refuse_unsupported(get, path, arch, tensors)
    heads, hidden = count("attention.head_count"), count("embedding_length")
    head_dim = count("attention.key_length", max(hidden // heads, 1))
    rotary = count("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ConfigError(f"--from-gguf: {path}: RoPE over {rotary} of {head_dim} head features is not supported yet")
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:  # older files: the vocabulary's length
        vocab = len(field_value(reader, "tokenizer.ggml.tokens") or []) or get("vocab_size")
    return {
        "model_type": arch,
        "vocab_size": _count(vocab, f"{arch}.vocab_size", MAX_VOCAB, path),
        "hidden_size": hidden,
        "num_hidden_layers": count("block_count", upper=len(tensors), why=f" (the file holds {len(tensors)} tensors)"),
        "num_attention_heads": heads,
        "num_key_value_heads": count("attention.head_count_kv", heads, upper=heads),
        "head_dim": head_dim,
        "intermediate_size": count("feed_forward_length"),
        "max_position_embeddings": count("context_length", 2048, upper=MAX_POSITIONS),
        "rope_theta": number("rope.freq_base", 10000.0),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-5),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "hidden_act": "silu",
    }


def _refuse_unsupported(get: Any, path: Path, arch: str, tensors: dict[str, Any]) -> None:
    """Settings the native model does not compute: scaled RoPE, experts."""
    for key, bad in (("rope.scaling.type", lambda v: v not in (None, "none")),
                     ("expert_count", lambda v: v not in (None, 0))):  # fmt: skip
        value = get(key, required=False)
        if bad(value):
            raise ConfigError(f"--from-gguf: {path}: {arch}.{key} = {value!r} is not supported yet (dense models "
                              "with default RoPE only)")  # fmt: skip
    if "rope_freqs.weight" in tensors:
        raise ConfigError(f"--from-gguf: {path}: rope_freqs.weight (scaled RoPE frequencies) is not supported yet")


def check_token_ids(reader: Any, path: Path) -> None:
    """The special token ids of `tokenizer.ggml.*` name tokens of its vocabulary (transformers indexes its list
    of tokens with them when it rebuilds the tokenizer)."""
    num_tokens = len(field_value(reader, "tokenizer.ggml.tokens") or [])
    for key in reader.fields:
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            _count(field_value(reader, key), key, num_tokens - 1, path, f" (its {num_tokens} tokens)", lower=0)


def _count(value: Any, key: str, upper: int, path: Path, why: str = "", lower: int = 1) -> int:
    """A count from the metadata: an integer (not a bool) from `lower` to `upper`, checked before anything is sized
    or indexed by it."""
    if isinstance(value, bool) or not isinstance(value, int) or not lower <= value <= upper:
        raise ConfigError(f"--from-gguf: {path}: {key} is {_shown(value)}, not a whole number from {lower} to "
                          f"{upper:,}{why}; the file is damaged")  # fmt: skip
    return value


def _positive_number(value: Any, key: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"--from-gguf: {path}: {key} is {_shown(value)}, not a positive number; the file is damaged")
    return float(value)


def _shown(value: Any) -> str:
    """A metadata value in a message: short values as they are, else their type and size."""
    if isinstance(value, list | str) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value):,} items"
    return repr(value)


def gguf_names(family: Family, cfg: ModelConfig, arch: str, path: Path) -> dict[str, str]:
    """GGUF tensor name -> native parameter name for a model built from `cfg`: native -> Hugging Face
    (the family's map) -> GGUF (gguf's own `TensorNameMap`, the table llama.cpp's converter writes with)."""
    import gguf

    from dllm.models.transformer import Transformer  # the heavy module, only when a file is read

    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise ConfigError(f"--from-gguf: {path}: this gguf package does not know {arch!r}; pip install -U gguf")
    table = gguf.get_tensor_name_map(arch_id, cfg.num_layers)
    with torch.device("meta"):
        native_keys = list(Transformer(cfg).state_dict())
    out: dict[str, str] = {}
    for native in native_keys:
        hf = native_to_hf_name(family, native, cfg)
        base, _, suffix = hf.rpartition(".")
        name = table.get_name(base)
        if name is None:
            raise ConfigError(f"--from-gguf: {path}: no GGUF name for {hf} (gguf {gguf.__name__} tensor map)")
        out[f"{name}.{suffix}"] = native
    return out


def _gguf_name_of(names: dict[str, str], native: str) -> str:
    return next((g for g, n in names.items() if n == native), native)


def _dequantize(tensor: Any, name: str, arch: str, cfg: ModelConfig, path: Path) -> torch.Tensor:
    """One tensor as float32, by gguf's dequantization of its type; q and k rows back in rotate-half order."""
    import gguf

    try:
        weights = np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError:
        kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
        raise ConfigError(f"--from-gguf: {path}: tensor {name} is stored as {kind}, which this gguf package "
                          "cannot dequantize; upgrade it: pip install -U gguf") from None  # fmt: skip
    weights = weights.reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))
    if arch == "llama" and name.endswith((".attn_q.weight", ".attn_q.bias")):
        weights = _unpermute(weights, cfg.num_heads)
    elif arch == "llama" and name.endswith((".attn_k.weight", ".attn_k.bias")):
        weights = _unpermute(weights, cfg.kv_heads)
    return torch.from_numpy(np.require(weights, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))  # owns its memory


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of llama.cpp's `permute`: per head, rows (pair i, half j) were stored as (i, j) from
    the rotate-half layout's (j, i); rows [H * D] (and the input width) keep their shape."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
