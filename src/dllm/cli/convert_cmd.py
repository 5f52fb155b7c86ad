"""`dllm convert`: Hugging Face folders in (`--from-hf`) and out (`--to-hf`); GGUF files in (`--from-gguf`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from dllm.cli.common import info, model_folder
from dllm.errors import ConfigError


def convert(
    from_hf: str = typer.Option(
        None, "--from-hf", help="A Hugging Face model folder, or a hub id org/name[@revision], to import."
    ),
    to: Path = typer.Option(None, "--to", help="Where to write the dllm model folder (with --from-hf)."),
    to_hf: Path = typer.Option(None, "--to-hf", help="Where to write a Hugging Face folder."),
    run: Path = typer.Option(None, "--run", help="Export the newest checkpoint of this run (with --to-hf)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="Export this checkpoint (with --to-hf)."),
    model: Path = typer.Option(None, "--model", help="Export this dllm model folder (with --to-hf)."),
    adapter_only: bool = typer.Option(
        False, "--adapter-only", help="With --to-hf and a LoRA run: write a PEFT adapter folder, not merged weights."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
    from_gguf: Path = typer.Option(
        None, "--from-gguf", help="A GGUF model file (llama.cpp's format; llama architecture) to import (with --to)."
    ),
) -> None:
    """Import a Hugging Face checkpoint or a GGUF file as a dllm model folder, or export a run / model to one."""
    if from_gguf is not None:
        others = {"--from-hf": from_hf, "--to-hf": to_hf, "--run": run, "--checkpoint": checkpoint, "--model": model}
        _import_gguf(from_gguf, to, overwrite, [flag for flag, v in others.items() if v is not None])
        return
    if (from_hf is None) == (to_hf is None):
        raise ConfigError("give --from-hf DIR --to OUT, or --to-hf OUT with --run, --checkpoint or --model")
    out = to if from_hf is not None else to_hf
    if out is None:
        raise ConfigError("--from-hf needs --to OUT (the dllm model folder to write)")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} is not empty; pass --overwrite to replace its files")
    if from_hf is not None:
        _import(_hf_source(from_hf), out)
    elif adapter_only:
        _export_adapter(out, run, checkpoint)
    else:
        _export(out, run, checkpoint, model)


def _hf_source(text: str) -> Path:
    """The folder --from-hf names: a local folder wins, else a hub id through the hub cache."""
    folder = model_folder(text, "--from-hf")
    assert folder is not None
    return folder


def _import(src: Path, out: Path) -> None:
    from dllm.checkpoint.inference import derive_profile
    from dllm.config.data import TokenizerConfig
    from dllm.config.profile import write_profile
    from dllm.models.hf_io import import_hf, model_config_from_hf
    from dllm.models.pretrained import pretrained_tokenizer, save_model_folder
    from dllm.tokenization import build_tokenizer

    cfg = model_config_from_hf(src)
    tok_cfg = pretrained_tokenizer(src) or TokenizerConfig()
    tok = build_tokenizer(tok_cfg)
    cfg = cfg.model_copy(update={"vocab_size": max(cfg.vocab_size or 0, tok.vocab_size)})
    state = import_hf(src, cfg)  # every check (config, headers, shapes, memory) before the first write
    profile = derive_profile(None, cfg, tok)  # a masked model until trained otherwise
    folder = save_model_folder(out, state, cfg, tok_cfg)
    _save_tokenizer(tok, folder)
    write_profile(profile, folder)
    info(f"wrote {folder}: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    info(f"use it with model.init_from: {folder}, or dllm generate --model {folder}")


def _import_gguf(src: Path, out: Path | None, overwrite: bool, conflicting: list[str]) -> None:
    """A GGUF file as a dllm model folder (weights dequantized to float32, its tokenizer and chat template),
    written in a staging folder next to `out` and renamed into place: never a half-written folder."""
    from dllm.checkpoint.inference import derive_profile
    from dllm.config.data import TokenizerConfig
    from dllm.config.profile import write_profile
    from dllm.models.gguf_io import import_gguf
    from dllm.models.hf_io import resize_vocab
    from dllm.models.pretrained import save_model_folder
    from dllm.tokenization import build_tokenizer
    from dllm.tokenization.gguf import save_gguf_tokenizer

    if conflicting:
        raise ConfigError(f"--from-gguf FILE --to OUT imports a GGUF file; drop {', '.join(conflicting)}")
    if out is None:
        raise ConfigError("--from-gguf needs --to OUT (the dllm model folder to write)")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--to: {out} is a file; give a folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} is not empty; pass --overwrite to replace its files")
    imported = import_gguf(src)  # every check of the weights before the first write
    with _staging(out) as stage:
        save_gguf_tokenizer(src, stage)
        tok_cfg = TokenizerConfig(kind="hf", path=stage)
        tok = build_tokenizer(tok_cfg)  # adds a mask token when the vocabulary has none
        cfg = imported.cfg.model_copy(update={"vocab_size": max(imported.cfg.vocab_size or 0, tok.vocab_size)})
        assert cfg.vocab_size is not None
        save_model_folder(stage, resize_vocab(imported.state, cfg.vocab_size), cfg, tok_cfg)
        _save_tokenizer(tok, stage)
        write_profile(derive_profile(None, cfg, tok), stage)  # decodes as its family does (causal for llama)
    info(f"wrote {out}: {cfg.family} ({imported.name or imported.architecture}) from {src.name}, {cfg.num_layers} "
         f"layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, float32")  # fmt: skip
    info(f"use it with dllm generate --model {out} --ar --chat, or dllm chat --model {out} --ar")


@contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A fresh folder next to `out`; on success it replaces `out` (an old one is moved aside, then removed),
    on any error it is removed and `out` is left as it was."""
    import shutil
    import uuid

    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:12]}"
    stage.mkdir()  # (the umask's permissions, unlike mkdtemp's private ones: it becomes the output)
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
        out.rename(old)
    stage.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _export(out: Path, run: Path | None, checkpoint: Path | None, model: Path | None) -> None:
    from dllm.checkpoint.inference import load_for_inference
    from dllm.config.profile import write_profile
    from dllm.models.hf_io import export_hf

    if model is None and _is_drafter_run(run, checkpoint):
        _export_drafter(out, run, checkpoint)
        return
    loaded = load_for_inference(run, checkpoint, model_dir=model)
    folder = export_hf(loaded.model.state_dict(), loaded.model_cfg, out)
    _save_tokenizer(loaded.tokenizer, folder)
    write_profile(loaded.profile, folder)  # sampling the exported folder decodes as the run did
    info(f"wrote {folder} ({loaded.model_cfg.family}) from {loaded.source}")


def _is_drafter_run(run: Path | None, checkpoint: Path | None) -> bool:
    from dllm.checkpoint.inference import RUN_CONFIG, resolve_checkpoint
    from dllm.config.loading import load_config
    from dllm.config.spec import RunSpec

    run_dir, _ = resolve_checkpoint(run, checkpoint)
    return load_config(RunSpec, run_dir / RUN_CONFIG).objective.name == "dflash_distillation"


def _export_drafter(out: Path, run: Path | None, checkpoint: Path | None) -> None:
    """A DFlash drafter folder: config.json (block size, target layers, the target's identity) and its own weights."""
    from dllm.checkpoint.inference import load_drafter_run
    from dllm.models.dflash import save_drafter

    drafter, target, spec = load_drafter_run(run, checkpoint)
    folder = save_drafter(out, drafter, target_name=str(spec.objective.target))  # type: ignore[union-attr]
    info(f"wrote {folder}: a DFlash drafter (block size {drafter.block_size}, target layers "
         f"{list(drafter.target_layer_ids)}) for the target {target.source}")  # fmt: skip
    info(f"use it with dllm generate --model TARGET --draft {folder}")


def _export_adapter(out: Path, run: Path | None, checkpoint: Path | None) -> None:
    """A PEFT adapter folder whose module paths are those of the family's Hugging Face model."""
    from dllm.checkpoint.inference import load_for_inference
    from dllm.config.registries import FAMILIES
    from dllm.models.families.base import module_path_to_hf
    from dllm.models.lora import save_adapter

    loaded = load_for_inference(run, checkpoint, merge=False)
    if loaded.spec is None or loaded.spec.lora is None:
        raise ConfigError("--adapter-only needs a run trained with a lora section")
    family = FAMILIES.resolve(loaded.model_cfg.family)
    base = str(loaded.model_cfg.init_from) if loaded.model_cfg.init_from else None
    save_adapter(loaded.model, out, loaded.spec.lora, base_model_name_or_path=base,
                 rename_module=lambda path: module_path_to_hf(family, path))  # fmt: skip
    info(f"wrote {out}: a LoRA adapter for a {family.architecture} (peft.PeftModel.from_pretrained)")


def _save_tokenizer(tok, folder: Path) -> None:
    save = getattr(tok, "save", None)
    if save is not None:
        save(folder)  # the HF tokenizer files, the added mask token included
    else:
        info(f"{folder}: the byte tokenizer needs no files (tokenizer.kind: byte)")
