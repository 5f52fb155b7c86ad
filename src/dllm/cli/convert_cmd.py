"""`dllm convert`: Hugging Face folders in (`--from-hf`) and out (`--to-hf`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

from dllm.cli.common import check_output_folder, info, model_folder
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
) -> None:
    """Import a Hugging Face checkpoint as a dllm model folder, or export a run / model to one."""
    if (from_hf is None) == (to_hf is None):
        raise ConfigError("give --from-hf DIR --to OUT, or --to-hf OUT with --run, --checkpoint or --model")
    if from_hf is not None and (run or checkpoint or model or adapter_only):
        raise ConfigError("--run, --checkpoint, --model and --adapter-only go with --to-hf; --from-hf reads its folder")
    out = to if from_hf is not None else to_hf
    if out is None:
        raise ConfigError("--from-hf needs --to OUT (the dllm model folder to write)")
    if from_hf is not None:
        check_output_folder(out, "--to")
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
    created = not out.exists()
    try:
        folder = save_model_folder(out, state, cfg, tok_cfg)
        _save_tokenizer(tok, folder)
        write_profile(profile, folder)
    except OSError as e:  # a full disk: no half-written model folder is left
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise ConfigError(f"--to: cannot write {out} ({e.strerror or type(e).__name__}); nothing was kept") from None
    info(f"wrote {folder}: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    info(f"use it with model.init_from: {folder}, or dllm generate --model {folder}")


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
