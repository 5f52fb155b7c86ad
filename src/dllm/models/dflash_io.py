"""DFlash drafter folders: the public DFlash layout, which SGLang, vLLM and the dflash package load, and
dllm's own format; `load_drafter` reads either, `save_drafter` writes the public layout when the drafter
has one.

The public layout (z-lab's DFlashDraftModel; architectures ["DFlashDraftModel"], model_type "qwen3"):
config.json is a Qwen3 config of the drafter's blocks (num_hidden_layers = drafter blocks, their widths,
heads, RoPE and norm epsilon) plus num_target_layers, block_size, layer_types and a
`dflash_config` block {block_size, target_layer_ids, mask_token_id}; model.safetensors holds fc,
hidden_norm, layers.N.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, mlp.{gate,up,down}_proj} and norm, which are dllm's drafter's own parameter names.
The embedding and LM head are the target's, never stored. dllm adds a `dllm` entry (its version and the
target's identity, checked on load); the public readers ignore keys they do not know.

What the public code computes, and how dllm's drafter maps onto it:
- target_layer_ids index block outputs from 0: the reference reads Hugging Face's hidden_states[i + 1]
  (entry 0 is the embeddings), SGLang captures the input of block i + 1; dllm captures block i's output.
  The last entry of hidden_states is taken after the target's final norm, so the last block is refused
  (DFlashConfig).
- context: fc over the concatenated features, then hidden_norm; each block projects it to keys/values
  with its own k/v projections (k norm, RoPE at the context positions) without its input norm. dllm's
  first drafters (architecture dllm) normalise it with each block's input norm first: a per-token scale
  that no weight of the public layout can hold, so they stay in dllm's format and are refused here.
- blocks: Qwen3 decoder layers (per-head q/k RMSNorm, SwiGLU, one attention_bias for q, k, v and o),
  queries from the block [anchor, MASK x (b-1)] embedded by the target's embedding alone, attending to the
  context and the whole block (not causal); final norm, then the target's LM head; block row k predicts
  position anchor + k. dllm's `dflash` architecture computes exactly this.

DFlash2 (z-lab's DFlash2DraftModel; architectures ["DFlash2DraftModel"]): the same, plus in `dflash_config`
conv_kernel_size, conv_group_size, selector_rank and selector_top_k, and in model.safetensors
layers.N.{attention_conv,mlp_conv}.{base_kernel,kernel_projection.weight} and
candidate_selector.{hidden_projection.weight,predecessor_codebook,successor_codebook} (the codebooks without
`.weight`, as the public checkpoints store them; a `.weight` suffix, which transformers' save_pretrained of the
reference module writes, is read too). Either layout's input_embedding_scale, output_multiplier and
final_logit_softcapping (in `dflash_config` or at the top level) are read, and written when not 1, 1, none.
layer_types (full_attention or sliding_attention, with the top-level sliding_window) and the top-level
is_causal are read as the reference reads them (DFlashConfig.layer_kind); a config without layer_types but
with use_sliding_window is refused (the reference's attention follows layer_types alone).

dllm's format (model_type "dflash"): config.json with the block size, the target layer ids, the
architecture, the drafter and target architectures and the target's identity; model.safetensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

import dllm
from dllm.config.drafter import DFlashConfig
from dllm.config.model import ModelConfig
from dllm.config.registries import FAMILIES
from dllm.errors import CheckpointError, ConfigError
from dllm.models.dflash import DFlashDrafter
from dllm.models.dflash2 import build_drafter
from dllm.models.factory import cast_weights
from dllm.models.hf_io import hf_weight_shapes, load_hf_state_dict
from dllm.models.transformer import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "dflash"  # dllm's format
PUBLIC_ARCHITECTURE = "DFlashDraftModel"
PUBLIC_ARCHITECTURES = {"dflash": PUBLIC_ARCHITECTURE, "dflash2": "DFlash2DraftModel"}  # by DFlashConfig.architecture
PUBLIC_DEFAULT_BLOCK = 16  # the reference's block size when a config names none


# -- the target's identity -------------------------------------------------------------------------
# fields that say how a model is loaded or computed, not what it is: an exported target and its run agree
_NOT_IDENTITY = ("init_from", "preset", "attention_backend", "flex_compile", "init_std", "max_seq_len")


def target_identity(target: Transformer, name: str | None = None) -> dict[str, Any]:
    """What a drafter records of its target: the SHA-256 of its architecture, its embedding shape, a
    fingerprint of its weights (a strided sample of the embedding and final norm, rounded to bfloat16 so a
    bf16 copy of the same weights matches) and its path or name (for messages)."""
    arch = {k: v for k, v in target.cfg.model_dump(mode="json").items() if k not in _NOT_IDENTITY}
    emb = target.embed_tokens.weight.detach()
    flat = emb.reshape(-1)
    sample = [flat[:: max(1, flat.numel() // 65536)]]
    if target.norm is not None and hasattr(target.norm, "weight"):
        sample.append(target.norm.weight.detach().reshape(-1))
    digest = hashlib.sha256()
    for t in sample:
        digest.update(t.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return {
        "config_sha256": hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest(),
        "embedding_shape": list(emb.shape),
        "weights_sha256": digest.hexdigest(),
        "name": name,
    }


def check_target(saved: dict[str, Any], target: Transformer, where: str) -> None:
    """One-line CheckpointError when `target` is not the model the drafter was trained for."""
    given = target_identity(target)
    for key, what in (("config_sha256", "architecture"), ("embedding_shape", "embedding shape"),
                      ("weights_sha256", "weights")):  # fmt: skip
        if saved.get(key) != given[key]:
            raise CheckpointError(
                f"{where}: this drafter was trained for target {saved.get('name') or '(unnamed)'}, and the given "
                f"target's {what} differs; pass that target, or train a drafter for this one (dflash_distillation)"
            )


# -- writing -----------------------------------------------------------------------------------------
def public_layout_problem(dcfg: DFlashConfig) -> str | None:
    """Why a drafter has no exact public DFlash layout; None: it has one."""
    if dcfg.architecture not in PUBLIC_ARCHITECTURES:
        return ("its blocks normalise the fused target context with their input norms (architecture dllm, the first "
                "dllm drafters), which the public DFlash drafter does not; train with objective.architecture: "
                "dflash for a drafter SGLang and vLLM load")  # fmt: skip
    return None


def save_drafter(folder: Path, drafter: DFlashDrafter, target_name: str | None = None) -> Path:
    """The drafter's folder: the public layout when it has one, else dllm's format."""
    identity = target_identity(drafter.target, target_name)
    if public_layout_problem(drafter.dcfg) is None:
        return save_public(folder, drafter, identity)
    return save_dllm(folder, drafter, identity)


def _write(folder: Path, config: dict[str, Any], drafter: DFlashDrafter) -> Path:
    """config.json + model.safetensors (the drafter's own weights; the target's are never written)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


# DFlashConfig fields of the public architectures that dllm's format records as they are
_PUBLIC_SETTINGS = ("conv", "selector", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                    "layer_types", "sliding_window", "causal")  # fmt: skip


def save_dllm(folder: Path, drafter: DFlashDrafter, identity: dict[str, Any]) -> Path:
    """dllm's drafter format (either architecture); `identity`: its target's (`target_identity`)."""
    d = drafter.dcfg
    config = {
        "model_type": MODEL_TYPE,
        "architectures": ["DFlashDrafter"],
        "architecture": d.architecture,
        "block_size": d.block_size,
        "target_layer_ids": list(d.target_layer_ids),
        "num_layers": d.num_layers,
        "hidden_size": d.hidden_size,
        "mask_id": d.mask_id,
        "blocks": None if d.blocks is None else d.blocks.model_dump(mode="json", exclude={"init_from"}),
        "target_config": d.target.model_dump(mode="json", exclude={"init_from"}),
        **d.model_dump(mode="json", include=set(_PUBLIC_SETTINGS)),
        "target": identity,
        "dllm_version": dllm.__version__,
    }
    return _write(folder, config, drafter)


def save_public(folder: Path, drafter: DFlashDrafter, identity: dict[str, Any]) -> Path:
    """The public DFlash layout; refused (one line) for a drafter that has none (`public_layout_problem`)."""
    problem = public_layout_problem(drafter.dcfg)
    if problem is not None:
        raise CheckpointError(f"{folder}: no public DFlash layout for this drafter: {problem}")
    return _write(folder, public_config(drafter, identity), drafter)


def public_config(drafter: DFlashDrafter, identity: dict[str, Any]) -> dict[str, Any]:
    """config.json of the public layout: the blocks' Qwen3 config and the DFlash entries."""
    d, blocks, target = drafter.dcfg, drafter.cfg, drafter.dcfg.target
    dflash = {"block_size": d.block_size, "target_layer_ids": list(d.target_layer_ids), "mask_token_id": d.mask_id,
              **_public_extras(d)}  # fmt: skip
    dtype = str(drafter.fc.weight.dtype).removeprefix("torch.")
    return {
        **FAMILIES.resolve("qwen3").config_to_hf(blocks),
        "architectures": [PUBLIC_ARCHITECTURES[d.architecture]],
        "model_type": "qwen3",
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,  # the drafter has no embedding or head of its own
        "attention_dropout": 0.0,
        "initializer_range": blocks.init_std,
        "layer_types": list(d.layer_types or ["full_attention"] * d.num_layers),
        "sliding_window": d.sliding_window,
        "use_sliding_window": "sliding_attention" in (d.layer_types or ()),
        "max_window_layers": d.num_layers,
        **({} if d.causal is None else {"is_causal": d.causal}),
        "dtype": dtype,
        "num_target_layers": target.num_layers,
        "block_size": d.block_size,
        "dflash_config": dflash,
        "dllm": {"version": dllm.__version__, "target": identity},
    }


def _public_extras(d: DFlashConfig) -> dict[str, Any]:
    """The `dflash_config` entries beyond DFlash's: DFlash2's parts, the embedding and logit settings if set."""
    extras: dict[str, Any] = {}
    if d.conv is not None and d.selector is not None:
        extras |= {"conv_kernel_size": d.conv.kernel_size, "conv_group_size": d.conv.group_size,
                   "selector_rank": d.selector.rank, "selector_top_k": d.selector.top_k}  # fmt: skip
    for key, off in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        if getattr(d, key) != off:
            extras[key] = getattr(d, key)
    return extras


def convert_dllm_folder(src: Path, dst: Path) -> DFlashDrafter:
    """A drafter folder in dllm's format rewritten in the public layout (no target needed: the folder records
    its architecture and identity); refused for a drafter that has no public layout."""
    saved = read_config(src)
    where = Path(src) / CONFIG_FILE
    if is_public(saved) or saved.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{where}: not a drafter folder in dllm's format (model_type {MODEL_TYPE})")
    try:
        target_cfg = ModelConfig.model_validate(saved.get("target_config"))
    except ValueError as e:
        raise CheckpointError(f"{where}: target_config is invalid ({e!s:.160}); re-export the drafter") from None
    dcfg = dllm_drafter_config(saved, target_cfg, where)
    problem = public_layout_problem(dcfg)
    if problem is not None:
        raise CheckpointError(f"{where}: no public DFlash layout for this drafter: {problem}")
    drafter = build_drafter(dcfg)
    _load_weights(Path(src), drafter)
    save_public(dst, drafter, saved.get("target") or {})
    return drafter


# -- reading -----------------------------------------------------------------------------------------
def read_config(folder: Path) -> dict[str, Any]:
    """A drafter folder's config.json; one line when it is missing or not a JSON object."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: not a drafter folder (no {CONFIG_FILE}); export one with "
                              "dllm convert --to-hf OUT --run DRAFTER_RUN")  # fmt: skip
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError) as e:
        why = " ".join(str(e).split())[:120]
        raise CheckpointError(f"{path}: not valid JSON ({why}); re-export the drafter") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, not a {type(config).__name__}; re-export the drafter")
    return config


def drafter_format(folder: Path) -> str | None:
    """ "public" or "dllm" for a drafter folder in that format; None for any other folder."""
    try:
        config = read_config(folder)
    except CheckpointError:
        return None
    return "public" if is_public(config) else "dllm" if config.get("model_type") == MODEL_TYPE else None


def is_public(config: dict[str, Any]) -> bool:
    """A public-layout folder (DFlash or DFlash2)."""
    archs = config.get("architectures")
    return isinstance(archs, list) and bool(set(PUBLIC_ARCHITECTURES.values()) & set(map(str, archs)))


def load_drafter(path: Path, target: Transformer, block_size: int | None = None) -> DFlashDrafter:
    """The drafter in folder `path` (public layout or dllm's format), attached to `target` after checking
    that it fits it (and, when the folder records one, that it is the target it was trained for);
    `block_size` (if given) must be the one it was trained with."""
    folder = Path(path)
    config = read_config(folder)
    if is_public(config):
        dcfg = public_drafter_config(config, target, folder / CONFIG_FILE)
        saved = (config.get("dllm") or {}).get("target") if isinstance(config.get("dllm"), dict) else None
    elif config.get("model_type") == MODEL_TYPE:
        dcfg = dllm_drafter_config(config, target.cfg, folder / CONFIG_FILE)
        saved = config.get("target") or {}
    else:
        raise CheckpointError(f"{folder / CONFIG_FILE}: neither a public DFlash drafter (architectures "
                              f"[{PUBLIC_ARCHITECTURE}]) nor dllm's (model_type {MODEL_TYPE}); --draft takes a DFlash "
                              "drafter folder")  # fmt: skip
    if saved is not None:
        check_target(saved if isinstance(saved, dict) else {}, target, str(folder / CONFIG_FILE))
    if block_size is not None and block_size != dcfg.block_size:
        raise CheckpointError(
            f"block size {block_size}: the drafter in {folder} was trained for block size {dcfg.block_size}; "
            "use that, or train a drafter with objective.block_size set to it"
        )
    drafter = build_drafter(dcfg)
    _load_weights(folder, drafter)
    w = target.embed_tokens.weight
    cast_weights(drafter.to(device=w.device), w.dtype)  # the target's dtype (bfloat16 decoding: --dtype)
    drafter.eval()
    return drafter.attach(target)


def dllm_drafter_config(saved: dict[str, Any], target: ModelConfig, where: Path) -> DFlashConfig:
    """The DFlashConfig of a folder in dllm's format for a target of `target` (folders written before
    `architecture` existed: dllm)."""
    from pydantic import ValidationError

    try:
        blocks = saved.get("blocks")
        return DFlashConfig(
            num_layers=saved["num_layers"], block_size=saved["block_size"], target_layer_ids=saved["target_layer_ids"],
            mask_id=saved["mask_id"], target=target, architecture=saved.get("architecture", "dllm"),
            blocks=None if blocks is None else _with_backend(ModelConfig.model_validate(blocks), target),
            **{k: saved[k] for k in _PUBLIC_SETTINGS if k in saved},
        )  # fmt: skip
    except (KeyError, TypeError, ValidationError) as e:
        raise CheckpointError(f"{where}: incomplete or invalid drafter config ({e!s:.200}); re-export it") from None


def _with_backend(cfg: ModelConfig, target: ModelConfig) -> ModelConfig:
    """The blocks run on the target's attention backend (how a model computes, not what it is)."""
    return cfg.model_copy(update={"attention_backend": target.attention_backend, "flex_compile": target.flex_compile})


def _load_weights(folder: Path, drafter: DFlashDrafter) -> None:
    """model.safetensors (or its shards) into the drafter: names and shapes checked before any tensor is read;
    a `model.` prefix (some writers add one) is dropped, RoPE buffers are ignored."""
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / f"{WEIGHTS_FILE}.index.json").is_file():
        raise CheckpointError(f"{folder}: no {WEIGHTS_FILE} (safetensors only); re-export the drafter")
    try:
        shapes = {_native(k): v for k, v in hf_weight_shapes(folder).items() if not k.endswith("rotary_emb.inv_freq")}
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    wrong = [f"{k} {shapes[k]} (expected {expected[k]})" for k in sorted(set(expected) & set(shapes))
             if shapes[k] != expected[k]]  # fmt: skip
    if missing or unexpected or wrong:
        raise CheckpointError(f"{folder / WEIGHTS_FILE}: weights do not fit the drafter config (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}, shapes {wrong[:2]}); re-export it")  # fmt: skip
    state = {_native(k): v for k, v in load_hf_state_dict(folder).items() if _native(k) in expected}
    drafter.load_state_dict(state)


def _native(name: str) -> str:
    """A stored weight's name in the drafter: no `model.` prefix, DFlash2's codebooks without `.weight`."""
    name = name.removeprefix("model.")
    if name.startswith("candidate_selector.") and name.endswith("_codebook.weight"):
        return name.removesuffix(".weight")
    return name


# -- the public config -------------------------------------------------------------------------------
def public_drafter_config(hf: dict[str, Any], target: Transformer, where: Path) -> DFlashConfig:
    """The DFlashConfig of a public-layout config.json for `target`: what dllm does not compute is refused,
    and so is a drafter whose blocks, hidden size or target layers do not fit the target (one line each)."""
    from pydantic import ValidationError

    block = _dflash_value(hf, "block_size", PUBLIC_DEFAULT_BLOCK)
    ids, mask_id = _dflash_value(hf, "target_layer_ids"), _dflash_value(hf, "mask_token_id")
    _refuse_unsupported(hf, where)
    num_target = _dflash_value(hf, "num_target_layers")
    if num_target is not None and num_target != len(target.layers):
        raise CheckpointError(f"{where}: this drafter reads a target of {num_target} layers (num_target_layers); the "
                              f"given target has {len(target.layers)}; pass the target it was trained for")  # fmt: skip
    blocks = _public_blocks(hf, target.cfg, where)
    if ids is None:  # the reference's default: spread over the target (one layer: the middle one)
        ids = default_layer_ids(num_target or len(target.layers), blocks.num_layers)
    if mask_id is None:
        raise CheckpointError(f"{where}: no dflash_config.mask_token_id; add the mask token id the drafter was "
                              "trained with")  # fmt: skip
    try:
        return DFlashConfig(num_layers=blocks.num_layers, block_size=block, target_layer_ids=ids, mask_id=mask_id,
                            target=target.cfg, blocks=blocks, **_public_parts(hf, where))  # fmt: skip
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        about_target = "target" in msg and not msg.startswith("architecture")
        fix = "; this drafter does not fit the given target: pass the target it was trained for" if about_target else ""
        raise CheckpointError(f"{where}: {field + ': ' if field else ''}{msg}{fix}") from None


def _dflash_value(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    """An entry of `dflash_config`, else the top-level key (where some writers put it), else `default`."""
    block = hf.get("dflash_config")
    block = block if isinstance(block, dict) else {}
    return block.get(key, hf.get(key, default))


_DFLASH2_KEYS = {"conv_kernel_size": ("conv", "kernel_size"), "conv_group_size": ("conv", "group_size"),
                 "selector_rank": ("selector", "rank"), "selector_top_k": ("selector", "top_k")}  # fmt: skip


def _public_parts(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """DFlashConfig's architecture, DFlash2 parts and embedding/logit settings of a public config.json (the
    reference reads a missing scale or multiplier as 1 and a softcapping of none or <= 0 as none)."""
    parts: dict[str, Any] = {"architecture": "dflash"}
    if "DFlash2DraftModel" in (hf.get("architectures") or []):
        missing = [key for key in _DFLASH2_KEYS if _dflash_value(hf, key) is None]
        if missing:
            raise CheckpointError(f"{where}: a DFlash2 drafter without {', '.join(missing)} in dflash_config; "
                                  "re-export it with its convolution and selector sizes")  # fmt: skip
        parts = {"architecture": "dflash2", "conv": {}, "selector": {}}
        for key, (section, field) in _DFLASH2_KEYS.items():
            parts[section][field] = _dflash_value(hf, key)
    for key in ("input_embedding_scale", "output_multiplier"):
        if _dflash_value(hf, key) is not None:
            parts[key] = _dflash_value(hf, key)
    cap = _dflash_value(hf, "final_logit_softcapping")
    if isinstance(cap, int | float) and cap > 0:
        parts["final_logit_softcapping"] = cap
    return parts | _layer_settings(hf, where)


def _layer_settings(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """DFlashConfig's layer_types, sliding_window and causal of a public config.json (top-level keys)."""
    types = hf.get("layer_types")
    if types is None and hf.get("use_sliding_window"):
        raise CheckpointError(f"{where}: use_sliding_window without layer_types; give layer_types (full_attention or "
                              "sliding_attention per drafter block)")  # fmt: skip
    if types is not None and (
        not isinstance(types, list) or any(t not in ("full_attention", "sliding_attention") for t in types)
    ):
        raise CheckpointError(f"{where}: layer_types {types!r}: dllm's drafter has full_attention and "
                              "sliding_attention blocks only")  # fmt: skip
    out: dict[str, Any] = {"layer_types": types, "causal": hf.get("is_causal")}
    if types is not None and "sliding_attention" in types:
        out["sliding_window"] = hf.get("sliding_window")
    return out


# public settings dllm's drafter does not compute, with the values that mean "off"
_OFF: dict[str, tuple[Any, ...]] = {
    "causal": (None, False), "use_swa": (None, False), "attention_sink_bias": (None, False),
}  # fmt: skip


def _refuse_unsupported(hf: dict[str, Any], where: Path) -> None:
    for key, off in _OFF.items():
        value = _dflash_value(hf, key)
        if value not in off:
            raise CheckpointError(f"{where}: {key}={value!r} is not supported by dllm's drafter; use a drafter "
                                  "without it")  # fmt: skip
    if hf.get("draft_vocab_size") not in (None, hf.get("vocab_size")):
        raise CheckpointError(f"{where}: a reduced draft vocabulary (draft_vocab_size) is not supported; the drafter "
                              "must propose over the target's vocabulary")  # fmt: skip


def _public_blocks(hf: dict[str, Any], target: ModelConfig, where: Path) -> ModelConfig:
    """The blocks' ModelConfig from the Qwen3 fields of a public config.json."""
    from pydantic import ValidationError

    try:
        fields = {k: v for k, v in FAMILIES.resolve("qwen3").config_from_hf(hf).items() if v is not None}
        fields.update(vocab_size=target.vocab_size, tie_embeddings=False)
        return _with_backend(ModelConfig(family="qwen3", **fields), target)
    except KeyError as e:
        raise CheckpointError(f"{where}: missing or unsupported {e.args[0]!r} for the drafter's Qwen3 blocks") from None
    except ConfigError as e:  # e.g. a RoPE scaling the native blocks do not compute
        raise CheckpointError(f"{where}: {str(e).split(': ', 1)[-1]}") from None
    except (TypeError, ValueError, AttributeError, ValidationError) as e:
        why = " ".join(str(e).split())[:160]
        raise CheckpointError(f"{where}: the drafter's Qwen3 config is invalid ({why})") from None


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a public config without target_layer_ids reads (the reference's rule): the middle
    one for one drafter block, else one per block spread evenly from the second to the third-last."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
