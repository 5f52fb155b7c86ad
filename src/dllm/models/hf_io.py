"""Hugging Face checkpoint folders in and out (local disk only; safetensors or weights_only loading).

A folder is recognised by its config.json `model_type`; weights come from model.safetensors, a sharded
model.safetensors.index.json, or (weights_only) pytorch_model.bin. Export writes config.json,
model.safetensors and the tokenizer files, so that `transformers` loads causal families with
AutoModelForCausalLM (and BERT with BertForMaskedLM) and gives the same logits. No remote code is
ever needed: LLaDA and Dream folders are read with their own name maps.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from dllm import __version__
from dllm.config.model import ModelConfig
from dllm.config.profile import DecodeProfile
from dllm.config.registries import FAMILIES
from dllm.errors import ConfigError
from dllm.models import sizing
from dllm.models.families.base import Family, StateDict, native_to_hf_name, state_from_hf, state_to_hf
from dllm.models.sizing import count_params, format_bytes

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "vocab.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip

Progress = Callable[[int, int], None]
"""(weights done, weights in all), counted in parameters, after each tensor read: a command's progress display."""


def is_hf_folder(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def read_hf_config(folder: Path) -> dict[str, Any]:
    """config.json as a dict; a missing, unreadable or malformed file is one line naming it."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.init_from: {folder} has no config.json (not a Hugging Face model folder)")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, an integer past Python's digit limit
        raise ConfigError(f"{path}: unreadable ({' '.join(str(e).split())[:120]})") from None
    except RecursionError:
        raise ConfigError(f"{path}: unreadable (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of model settings, not a {type(data).__name__}")
    return data


def family_of(hf_config: dict[str, Any], where: str = "model.init_from") -> Family:
    model_type = hf_config.get("model_type")
    families: list[Family] = [FAMILIES.resolve(name) for name in FAMILIES]
    architectures = hf_config.get("architectures")
    for family in families:  # an architecture that shares its model_type with another family (LLaDA-MoE)
        if isinstance(architectures, list) and set(map(str, architectures)) & set(family.architectures_read):
            return family
    for family in families:
        if model_type in family.model_types:
            return family
    known = ", ".join(t for family in families for t in family.model_types)
    raise ConfigError(f"{where}: model_type {model_type!r} is not supported; supported: {known}")


def decode_facts_from_hf(folder: Path) -> dict[str, Any]:
    """The decode facts (DecodeProfile fields) a Hugging Face folder's config.json records for its family; {} for
    a family whose folders record none."""
    hf = read_hf_config(folder)
    family = family_of(hf)
    if family.decode_from_hf is None:
        return {}
    try:
        return family.decode_from_hf(hf)
    except ValueError as e:  # pydantic's ValidationError among them
        msg = e.errors(include_url=False)[0]["msg"] if isinstance(e, ValidationError) else str(e)
        raise ConfigError(f"{Path(folder) / 'config.json'}: {msg}") from None


def model_config_from_hf(folder: Path) -> ModelConfig:
    """The native ModelConfig of a Hugging Face folder (architecture fields only)."""
    hf = read_hf_config(folder)
    family = family_of(hf)
    path = Path(folder) / "config.json"
    _check_dtype(hf, path)
    _check_finite_numbers(hf, path)
    try:
        fields = {k: v for k, v in family.config_from_hf(hf).items() if v is not None}
    except KeyError as e:
        key = e.args[0]
        problem = f"missing key {key!r}" if key not in hf.values() else f"unsupported value {key!r}"
        raise ConfigError(f"{path}: {problem} for a {family.name} model") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: a value of the wrong type ({e})") from None
    try:
        return ModelConfig(family=family.name, **fields)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or "model"
        got = f" (got {err['input']!r})" if not isinstance(err.get("input"), dict) else ""
        raise ConfigError(f"{path}: {field}: {str(err['msg']).removeprefix('Value error, ')}{got}") from None


def _check_dtype(hf: dict[str, Any], path: Path) -> None:
    """`torch_dtype` (`dtype` in newer folders) names a floating-point dtype torch has, or `auto`: another value
    (float128, a typo) says the folder was not written for torch."""
    for key in ("torch_dtype", "dtype"):
        value = hf.get(key)
        if value is None or value == "auto":
            continue
        dtype = getattr(torch, value, None) if isinstance(value, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(
                f"{path}: {key}: {value!r} is not a floating-point dtype of torch (float32, float16, bfloat16, ...)"
            )


def _check_finite_numbers(hf: dict[str, Any], path: Path) -> None:
    """No NaN or infinity anywhere in config.json (Python's json reads them): a value read now or by another
    tool (transformers reads rope_theta where dllm reads rope_parameters) would make the model compute NaN."""
    stack: list[tuple[str, Any]] = list(hf.items())
    while stack:  # iterative: a config may nest as deep as json reads
        key, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise ConfigError(f"{path}: {key}: {node} is not a finite number; fix the config")
        if isinstance(node, dict):
            stack.extend((f"{key}.{k}", v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((f"{key}.{i}", v) for i, v in enumerate(node))


def check_weight_values(state: StateDict, where: Path, file_name: Callable[[str], str] = str) -> None:
    """Refuse weights that are not floating point (a quantized or damaged checkpoint: they would be cast to
    float as if they were weights) or hold NaN or infinity, naming the first such tensor."""
    for key, t in state.items():
        if not t.is_floating_point():
            raise ConfigError(
                f"{where}: weight {file_name(key)} is {str(t.dtype).removeprefix('torch.')}, not floating point "
                "(a quantized checkpoint?); convert a float16, bfloat16 or float32 checkpoint"
            )
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ConfigError(
                f"{where}: weight {file_name(key)} holds {bad:,} NaN or infinite value(s) of {t.numel():,}; "
                "the checkpoint is corrupt: re-download or re-export it"
            )


def _safetensors_files(folder: Path) -> list[Path] | None:
    """model.safetensors, or the shards a model.safetensors.index.json names (inside the folder); None: neither."""
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{index}: expected a JSON object with a weight_map of tensor name -> shard file")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if Path(shard).name != shard or shard in ("", ".", "..") or not (folder / shard).is_file():
            raise ConfigError(f"{index}: shard {shard!r} is not a file in {folder}")
    return [folder / shard for shard in shards]


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header, without reading (or allocating) any tensor."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{path}: not a valid safetensors file ({' '.join(str(e).split())})") from None


def _load_bin(path: Path) -> StateDict:
    """pytorch_model.bin with weights_only (memory-mapped when the format allows); anything else refused."""

    try:
        try:
            state = load_plain(path, map_location="cpu", mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = load_plain(path, map_location="cpu")  # the legacy (non-zip) format
    except Exception as e:  # the weights-only unpickler raises many types on junk (struct.error, KeyError, ...)
        raise ConfigError(
            f"{path}: refused: not a plain tensor file ({_pickle_reason(e)}); its code was not run; "
            "convert it to safetensors with a tool you trust"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{path}: expected a mapping of tensor names to tensors")
    return state


def load_plain(source: Any, **kwargs: Any) -> Any:
    """torch.load through torch's `weights_only` unpickler, which builds tensors and plain data only. Quietly:
    it warns about a pickle protocol other than torch's before refusing what it cannot build, and a refusal
    is the caller's one line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(source, weights_only=True, **kwargs)


def _pickle_reason(e: BaseException) -> str:
    """The line of a torch.load error that says what was refused (torch wraps it in a page of advice)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return ((named or lines or [type(e).__name__])[0])[:160]


def hf_weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape by its Hugging Face name, read from the headers before any weight is loaded."""
    folder = Path(folder)
    files = _safetensors_files(folder)
    if files is None:
        if (folder / "pytorch_model.bin").is_file():
            return {k: tuple(v.shape) for k, v in _load_bin(folder / "pytorch_model.bin").items()}
        raise ConfigError(f"model.init_from: {folder} holds no model.safetensors, shard index or pytorch_model.bin")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        shapes.update(safetensors_shapes(path))
    return shapes


def load_hf_state_dict(folder: Path, progress: Progress | None = None) -> StateDict:
    """All tensors of a checkpoint folder, by their Hugging Face names; `progress(done, total)` (parameters) after
    each tensor read from safetensors files."""
    from safetensors import safe_open

    folder = Path(folder)
    files = _safetensors_files(folder)
    if files is None:
        return _load_bin(folder / "pytorch_model.bin")
    total = sum(math.prod(s) for s in hf_weight_shapes(folder).values()) if progress is not None else 0
    out: StateDict = {}
    done = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (not a dict)
                out[key] = f.get_tensor(key)
                done += out[key].numel()
                if progress is not None:
                    progress(done, total)
    return out


def check_hf_weights(folder: Path, family: Family, src_cfg: ModelConfig, cfg: ModelConfig) -> None:
    """Refuse weights that do not belong to config.json, or a model that cannot fit in memory, before
    loading anything: the sizes from the headers, then the family's name map run on meta tensors."""
    shapes = hf_weight_shapes(folder)

    def to_native() -> dict[str, tuple[int, ...]]:
        try:
            with torch.device("meta"):
                native = state_from_hf(family, {k: torch.empty(s) for k, s in shapes.items()}, src_cfg)
        except (KeyError, IndexError, RuntimeError, ValueError) as e:
            raise ConfigError(f"{folder}: the weights do not fit a {family.name} model ({e})") from None
        return {k: tuple(v.shape) for k, v in native.items()}

    check_weight_shapes(
        Path(folder) / "config.json", src_cfg, cfg, shapes, to_native, lambda k: _hf_name(family, k, src_cfg)
    )


def check_weight_shapes(
    config_file: Path,
    src_cfg: ModelConfig,
    cfg: ModelConfig,
    stored: dict[str, tuple[int, ...]],
    to_native: Callable[[], dict[str, tuple[int, ...]]],
    file_name: Callable[[str], str] = str,
) -> None:
    """The stored tensors (`stored`: shapes by file name) must be exactly the model `src_cfg` describes, and the
    model `cfg` (its vocabulary possibly grown) must fit in memory; the count is checked first, so a config
    describing an absurd model is refused before a meta model of it is built."""
    described, num_stored = count_params(src_cfg), sum(math.prod(s) for s in stored.values())
    if described > num_stored:
        raise ConfigError(
            f"{config_file} describes {described:,} parameters but the weight files hold {num_stored:,} values; "
            "the config and the weights do not belong together"
        )
    need, have = 4 * count_params(cfg), sizing.host_memory_bytes()  # the loaded weights are float32
    if have and need > have:
        raise ConfigError(
            f"{config_file.parent}: {count_params(cfg):,} parameters need {format_bytes(need)} in float32, more "
            f"than this machine's {format_bytes(have)} of memory"
        )
    native = to_native()
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in _meta_model(src_cfg).state_dict().items()}
    where = config_file.parent
    missing, unexpected = sorted(expected.keys() - native.keys()), sorted(native.keys() - expected.keys())
    if missing:
        raise ConfigError(f"{where}: no weight {file_name(missing[0])} ({len(missing)} missing in all)")
    if unexpected:
        raise ConfigError(
            f"{where}: weight {file_name(unexpected[0])} has no place in the model {config_file.name} describes"
        )
    for key, shape in expected.items():
        if native[key] != shape:
            raise ConfigError(
                f"{where}: {file_name(key)} has shape {list(native[key])} but {config_file.name} implies "
                f"{list(shape)}; the config and the weights do not belong together"
            )


def _meta_model(cfg: ModelConfig) -> torch.nn.Module:
    from dllm.models.transformer import Transformer  # the heavy module, only when a folder is checked

    return Transformer(cfg)


def _hf_name(family: Family, native_key: str, cfg: ModelConfig) -> str:
    try:
        return native_to_hf_name(family, native_key, cfg)
    except KeyError:
        return native_key


def import_hf(folder: Path, cfg: ModelConfig, progress: Progress | None = None) -> StateDict:
    """Native, float32 weights of a Hugging Face folder for a model built from `cfg`; embeddings are
    grown to cfg.vocab_size when a tokenizer needed more ids (an added mask token). `progress(done, total)`
    counts the parameters read."""
    family = family_of(read_hf_config(folder))
    src_cfg = model_config_from_hf(folder)
    check_hf_weights(folder, family, src_cfg, cfg)
    native = state_from_hf(family, load_hf_state_dict(folder, progress), src_cfg)
    check_weight_values(native, folder, lambda k: _hf_name(family, k, src_cfg))
    native = {k: v.float() for k, v in native.items()}
    assert cfg.vocab_size is not None
    return resize_vocab(native, cfg.vocab_size)


def resize_vocab(native: StateDict, vocab_size: int) -> StateDict:
    """New token rows (e.g. an added mask token) start at the mean embedding, a common choice that
    keeps their initial logits ordinary (Hewitt 2021, "Initializing new word embeddings")."""
    for key in ("embed_tokens.weight", "lm_head.weight", "head_bias"):
        t = native.get(key)
        if t is None or t.shape[0] >= vocab_size:
            continue
        extra = vocab_size - t.shape[0]
        fill = t.mean(0, keepdim=True).expand(extra, *t.shape[1:]) if t.ndim > 1 else t.new_zeros(extra)
        native[key] = torch.cat([t, fill], dim=0)
    return native


def export_hf(
    state: StateDict, cfg: ModelConfig, folder: Path, tokenizer_dir: Path | None = None,
    profile: DecodeProfile | None = None, objective: object | None = None,
) -> Path:  # fmt: skip
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer files). With the model's decode
    `profile` (and its run's `objective` section), config.json also records them as the family's folders do."""
    from safetensors.torch import save_file

    family: Family = FAMILIES.resolve(cfg.family)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_state = state_to_hf(family, {k: v.detach().cpu().contiguous() for k, v in state.items()}, cfg)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    config = {
        "model_type": family.model_types[0],
        "architectures": [family.architecture],
        "torch_dtype": "float32",
        "dllm_version": __version__,
        **family.config_to_hf(cfg),
        **(family.decode_to_hf(profile, objective) if family.decode_to_hf and profile is not None else {}),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, folder)
    return folder


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file() and Path(src).resolve() != Path(dst).resolve():
            shutil.copy2(Path(src) / name, Path(dst) / name)
