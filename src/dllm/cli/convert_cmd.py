"""`dllm convert`: Hugging Face folders in (`--from-hf`) and out (`--to-hf`); GGUF files in (`--from-gguf`);
DFlash drafter folders between dllm's format and the public layout (models/dflash_io.py).

Every output folder is staged next to its place and renamed into place (dllm/staging.py), so a failure
leaves nothing, and carries MARKER, which lists the files convert wrote: only such a folder, holding
nothing else, is ever replaced (--overwrite), and never a folder the command reads from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from dllm.cli.common import QUIET_OPTION, THREADS_OPTION, apply_threads, check_output_folder, info, model_folder
from dllm.cli.outputs import MODEL, check_output_place
from dllm.errors import ConfigError
from dllm.staging import OutputKind, staged_folder

MARKER = ".dllm-convert.json"
_FORMAT = "dllm-convert"


def convert(
    from_hf: str = typer.Option(
        None,
        "--from-hf",
        help="A Hugging Face model folder, or a hub id org/name[@revision], to import (or a public "
        "DFlash drafter, with --target, to write in dllm's drafter format).",
    ),
    to: Path = typer.Option(None, "--to", help="Where to write the dllm model (or drafter) folder (with --from-hf)."),
    to_hf: Path = typer.Option(None, "--to-hf", help="Where to write a Hugging Face folder."),
    run: Path = typer.Option(None, "--run", help="Export the newest checkpoint of this run (with --to-hf)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="Export this checkpoint (with --to-hf)."),
    model: Path = typer.Option(
        None,
        "--model",
        help="Export this dllm model folder, or a drafter folder in dllm's format to the public "
        "DFlash layout (with --to-hf).",
    ),
    adapter_only: bool = typer.Option(
        False, "--adapter-only", help="With --to-hf and a LoRA run: write a PEFT adapter folder, not merged weights."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier output of dllm convert."),
    from_gguf: Path = typer.Option(
        None, "--from-gguf", help="A GGUF model file (llama.cpp's format; llama architecture) to import (with --to)."
    ),
    target: str = typer.Option(
        None,
        "--target",
        help="With --from-hf of a public DFlash drafter: the target model (folder or hub id) it "
        "drafts for, checked against it and recorded.",
    ),
    threads: str = THREADS_OPTION,
    quiet: bool = QUIET_OPTION,
) -> None:
    """Import a Hugging Face checkpoint or a GGUF file as a dllm model folder, export a run / model to one, or
    convert a DFlash drafter folder between dllm's format and the public DFlash layout."""
    apply_threads(threads)  # reading, dequantizing, merging and casting weights run on torch's threads
    if from_gguf is not None:
        others = {"--from-hf": from_hf, "--to-hf": to_hf, "--run": run, "--checkpoint": checkpoint, "--model": model}
        _import_gguf(from_gguf, to, overwrite, [flag for flag, v in others.items() if v is not None], quiet)
        return
    if (from_hf is None) == (to_hf is None):
        raise ConfigError("give --from-hf DIR --to OUT, or --to-hf OUT with --run, --checkpoint or --model")
    if from_hf is not None and (run or checkpoint or model or adapter_only):
        raise ConfigError("--run, --checkpoint, --model and --adapter-only go with --to-hf; --from-hf reads its folder")
    if target is not None and from_hf is None:
        raise ConfigError("--target goes with --from-hf DRAFTER (a public DFlash drafter to write in dllm's format)")
    out = to if from_hf is not None else to_hf
    if out is None:
        raise ConfigError("--from-hf needs --to OUT (the dllm model folder to write)")
    flag = "--to" if from_hf is not None else "--to-hf"
    check_output_folder(out, flag, [("--from-hf", from_hf), ("--run", run), ("--checkpoint", checkpoint),
                                    ("--model", model)], own=MODEL)  # fmt: skip
    src = _hf_source(from_hf) if from_hf is not None else None
    target_dir = _drafter_import_target(src, target, from_hf)
    reads = [src, *([target_dir] if target_dir else [])] if src is not None else _export_sources(run, checkpoint, model)
    _check_apart(out, flag, reads)  # type: ignore[arg-type]
    with staged_folder(out, CONVERT, overwrite) as stage:
        if target_dir is not None:
            said = _import_drafter(src, target_dir, stage, out)  # type: ignore[arg-type]
        elif src is not None:
            said = _import(src, stage, out, quiet)
        elif adapter_only:
            said = _export_adapter(stage, out, run, checkpoint)
        else:
            said = _export(stage, out, run, checkpoint, model)
        _mark(stage)
    for line in said:
        info(line)


def _convert_files(folder: Path) -> set[str] | None:
    """The files a previous convert wrote into `folder` (its MARKER); None: not a convert output."""
    try:
        body = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    files = body.get("files") if isinstance(body, dict) and body.get("format") == _FORMAT else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return {*files, MARKER}


CONVERT = OutputKind(what="an output of dllm convert", marker=f"no {MARKER}", files_of=_convert_files,
                     error=ConfigError)  # fmt: skip


def _mark(stage: Path) -> None:
    """MARKER: the files written, so that --overwrite replaces this folder and nothing a user put in it."""
    body = {"format": _FORMAT, "version": 1, "files": sorted(os.listdir(stage))}
    (stage / MARKER).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")


def _export_sources(run: Path | None, checkpoint: Path | None, model: Path | None) -> list[Path]:
    """The folders an export reads: the model folder, or the run and its checkpoint (and a drafter's target)."""
    from dllm.checkpoint.loading import resolve_checkpoint

    if model is not None:
        return [model]
    run_dir, ckpt = resolve_checkpoint(run, checkpoint)
    target = _drafter_target(run, checkpoint)
    return [run_dir, ckpt, *([target] if target is not None else [])]


def _check_apart(out: Path, flag: str, sources: list[Path]) -> None:
    """The output must not be, hold, or lie inside a folder the command reads (links resolved), once those
    named only through a run, a hub id or a drafter's target are known."""
    check_output_place(out, flag, [("the folder", src) for src in sources], folder=True, own=MODEL)


def _hf_source(text: str) -> Path:
    """The folder --from-hf names: a local folder wins, else a hub id through the hub cache."""
    folder = model_folder(text, "--from-hf")
    assert folder is not None
    return folder


def _import(src: Path, stage: Path, out: Path, quiet: bool) -> list[str]:
    """Write the dllm model folder of a Hugging Face folder into `stage`; returns what to tell about `out`."""
    from dllm.checkpoint.loading import derive_profile
    from dllm.config.data import TokenizerConfig
    from dllm.config.profile import write_profile
    from dllm.models.hf_io import import_hf, model_config_from_hf
    from dllm.models.pretrained import pretrained_tokenizer, save_model_folder
    from dllm.tokenization import build_tokenizer
    from dllm.training.progress import CountBar

    cfg = model_config_from_hf(src)
    tok_cfg = pretrained_tokenizer(src) or TokenizerConfig()
    tok = build_tokenizer(tok_cfg)
    _check_chat_template(tok, None)
    cfg = cfg.model_copy(update={"vocab_size": max(cfg.vocab_size or 0, tok.vocab_size)})
    with CountBar("weights read", 0, enabled=not quiet, every_s=5.0) as bar:
        state = import_hf(src, cfg, bar.count)  # every check (config, headers, shapes, memory) before the first write
    profile = derive_profile(None, cfg, tok, src)  # as config.json says it decodes, else a masked model
    save_model_folder(stage, state, cfg, tok_cfg)
    write_profile(profile, stage)
    return [
        *_save_tokenizer(tok, stage, out),
        f"wrote {out}: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
        f"use it with model.init_from: {out}, or dllm generate --model {out}",
    ]


def _import_gguf(src: Path, out: Path | None, overwrite: bool, conflicting: list[str], quiet: bool) -> None:
    """A GGUF file as a dllm model folder (weights dequantized to float32, its tokenizer and chat template),
    staged like every convert output."""
    from dllm.checkpoint.loading import derive_profile
    from dllm.config.data import TokenizerConfig
    from dllm.config.profile import write_profile
    from dllm.models.gguf_io import import_gguf
    from dllm.models.hf_io import resize_vocab
    from dllm.models.pretrained import save_model_folder
    from dllm.tokenization import build_tokenizer
    from dllm.tokenization.gguf import save_gguf_tokenizer
    from dllm.training.progress import CountBar

    if conflicting:
        raise ConfigError(f"--from-gguf FILE --to OUT imports a GGUF file; drop {', '.join(conflicting)}")
    if out is None:
        raise ConfigError("--from-gguf needs --to OUT (the dllm model folder to write)")
    reads = [("--from-gguf", src)] if src.is_file() else []  # anything else is refused as no GGUF file below
    check_output_folder(out, "--to", reads, own=MODEL)
    with CountBar("weights dequantized", 0, enabled=not quiet, every_s=5.0) as bar:
        imported = import_gguf(src, bar.count)  # every check of the file and its weights before the first write
    with staged_folder(out, CONVERT, overwrite) as stage:
        save_gguf_tokenizer(src, stage)
        tok_cfg = TokenizerConfig(kind="hf", path=stage)
        tok = build_tokenizer(tok_cfg)  # adds a mask token when the vocabulary has none
        _check_chat_template(tok, f"--from-gguf: {src} (tokenizer.chat_template)")
        cfg = imported.cfg.model_copy(update={"vocab_size": max(imported.cfg.vocab_size or 0, tok.vocab_size)})
        assert cfg.vocab_size is not None
        save_model_folder(stage, resize_vocab(imported.state, cfg.vocab_size), cfg, tok_cfg)
        said = _save_tokenizer(tok, stage, out)
        write_profile(derive_profile(None, cfg, tok), stage)  # decodes as its family does (causal for llama)
        _mark(stage)
    for line in said:
        info(line)
    info(f"wrote {out}: {cfg.family} ({imported.name or imported.architecture}) from {src.name}, {cfg.num_layers} "
         f"layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, float32")  # fmt: skip
    info(f"use it with dllm generate --model {out} --ar --chat, or dllm chat --model {out} --ar")


def _export(stage: Path, out: Path, run: Path | None, checkpoint: Path | None, model: Path | None) -> list[str]:
    from dllm.checkpoint.loading import load_for_inference
    from dllm.config.profile import write_profile
    from dllm.models.hf_io import export_hf

    if model is None and _drafter_target(run, checkpoint) is not None:
        return _export_drafter(stage, out, run, checkpoint)
    if model is not None and _drafter_format(model) is not None:
        return _export_drafter_folder(stage, out, model)
    loaded = load_for_inference(run, checkpoint, model_dir=model)
    objective = loaded.spec.objective if loaded.spec is not None else None
    export_hf(loaded.model.state_dict(), loaded.model_cfg, stage, profile=loaded.profile, objective=objective)
    write_profile(loaded.profile, stage)  # sampling the exported folder decodes as the run did
    return [*_save_tokenizer(loaded.tokenizer, stage, out),
            f"wrote {out} ({loaded.model_cfg.family}) from {loaded.source}"]  # fmt: skip


def _drafter_target(run: Path | None, checkpoint: Path | None) -> Path | None:
    """The target a drafter run (objective dflash_distillation) reads; None for any other run."""
    from dllm.checkpoint.loading import RUN_CONFIG, resolve_checkpoint
    from dllm.config.loading import load_config
    from dllm.config.spec import RunSpec

    run_dir, _ = resolve_checkpoint(run, checkpoint)
    objective = load_config(RunSpec, run_dir / RUN_CONFIG).objective
    return Path(objective.target) if objective.name == "dflash_distillation" else None  # type: ignore[union-attr]


def _export_drafter(stage: Path, out: Path, run: Path | None, checkpoint: Path | None) -> list[str]:
    """A DFlash drafter folder: the public layout when the drafter has one (architecture dflash), else dllm's."""
    from dllm.checkpoint.loading import load_drafter_run
    from dllm.models.dflash_io import public_layout_problem, save_drafter

    drafter, target, spec = load_drafter_run(run, checkpoint)
    save_drafter(stage, drafter, target_name=str(spec.objective.target))  # type: ignore[union-attr]
    problem = public_layout_problem(drafter.dcfg)
    return [f"wrote {out}: a DFlash drafter in {_LAYOUT[problem is None]} (block size {drafter.block_size}, target "
            f"layers {list(drafter.target_layer_ids)}) for the target {target.source}",
            *([f"{out}: not the public layout: {problem}"] if problem else []),
            f"use it with dllm generate --model TARGET --draft {out}"
            + ("; to serve it with SGLang or vLLM see docs/speculative.md" if problem is None else "")]  # fmt: skip


_LAYOUT = {True: "the public DFlash layout (SGLang, vLLM and the dflash package load it)", False: "dllm's format"}


def _drafter_format(folder: Path) -> str | None:
    from dllm.models.dflash_io import drafter_format

    return drafter_format(folder)


def _export_drafter_folder(stage: Path, out: Path, model: Path) -> list[str]:
    """A drafter folder in dllm's format rewritten in the public layout (refused when it has none)."""
    from dllm.models.dflash_io import convert_dllm_folder

    if _drafter_format(model) == "public":
        raise ConfigError(f"--model {model}: already a drafter in the public DFlash layout; use that folder as it is")
    drafter = convert_dllm_folder(model, stage)
    return [f"wrote {out}: the DFlash drafter of {model} in {_LAYOUT[True]} (block size {drafter.block_size}, "
            f"target layers {list(drafter.target_layer_ids)})"]  # fmt: skip


def _drafter_import_target(src: Path | None, target: str | None, from_hf: str | None) -> Path | None:
    """The target folder of a public drafter import (--from-hf DRAFTER --target TARGET); None for a model import."""
    public = src is not None and _drafter_format(src) == "public"
    if public and target is None:
        raise ConfigError(f"--from-hf {from_hf}: a DFlash drafter; give --target TARGET, the model it drafts for "
                          "(its dllm drafter folder records it)")  # fmt: skip
    if target is not None and not public:
        raise ConfigError(f"--target: --from-hf {from_hf} is not a public DFlash drafter; --target goes with one")
    return model_folder(target, "--target") if public else None


def _import_drafter(src: Path, target_dir: Path, stage: Path, out: Path) -> list[str]:
    """A public-layout drafter written in dllm's drafter format, checked against and recording its target."""
    from dllm.checkpoint.loading import load_target
    from dllm.models.dflash_io import load_drafter, save_dllm, target_identity

    target = load_target(target_dir)
    drafter = load_drafter(src, target.model)  # type: ignore[arg-type]
    save_dllm(stage, drafter, target_identity(target.model, str(target_dir)))  # type: ignore[arg-type]
    return [f"wrote {out}: the DFlash drafter of {src} in {_LAYOUT[False]} (block size {drafter.block_size}, target "
            f"layers {list(drafter.target_layer_ids)}) for the target {target_dir}",
            f"use it with dllm generate --model {target_dir} --draft {out}"]  # fmt: skip


def _export_adapter(stage: Path, out: Path, run: Path | None, checkpoint: Path | None) -> list[str]:
    """A PEFT adapter folder whose module paths are those of the family's Hugging Face model."""
    from dllm.checkpoint.loading import load_for_inference
    from dllm.config.registries import FAMILIES
    from dllm.models.families.base import module_path_to_hf
    from dllm.models.lora import save_adapter

    loaded = load_for_inference(run, checkpoint, merge=False)
    if loaded.spec is None or loaded.spec.lora is None:
        raise ConfigError("--adapter-only needs a run trained with a lora section")
    family, cfg = FAMILIES.resolve(loaded.model_cfg.family), loaded.model_cfg
    architecture = family.exported_architecture(cfg)  # the base it adapts must have a layout (refused otherwise)
    base = str(cfg.init_from) if cfg.init_from else None
    save_adapter(loaded.model, stage, loaded.spec.lora, base_model_name_or_path=base,
                 rename_module=lambda path: module_path_to_hf(family, path, cfg))  # fmt: skip
    return [f"wrote {out}: a LoRA adapter for a {architecture} (peft.PeftModel.from_pretrained)"]


def _check_chat_template(tok, source: str | None) -> None:
    """A chat template the Jinja sandbox refuses is refused at import, not at the model's first chat; `source`
    names where it came from (default: the tokenizer folder's file)."""
    check = getattr(tok, "check_chat_template", None)  # the byte tokenizer's template is dllm's own
    if check is not None:
        check(source)


def _save_tokenizer(tok, stage: Path, out: Path) -> list[str]:
    save = getattr(tok, "save", None)
    if save is not None:
        save(stage)  # the HF tokenizer files, the added mask token included
        return []
    return [f"{out}: the byte tokenizer needs no files (tokenizer.kind: byte)"]
