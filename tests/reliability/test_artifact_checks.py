"""Reliability hardening, artifacts: `launch` (and `data validate`) check the artifact instead of trusting it.

Each corruption is one line naming the file, exit 2, no traceback; none trains silently. The launch
check reads the maxima the manifest records; a file changed after preparation is caught by the
loader at the batch that reads it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dllm.cli.main import main
from dllm.data.artifact import MANIFEST, open_artifact
from dllm.data.loader import StepLoader
from dllm.errors import DataError

Corruption = Callable[[Path], str]  # corrupts the artifact folder, returns the file the error must name


def _edit_manifest(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = folder / MANIFEST
    manifest = json.loads(path.read_text(encoding="utf-8"))
    edit(manifest)
    path.write_text(json.dumps(manifest), encoding="utf-8")


def _poke(folder: Path, name: str, dtype: str, index: int, value: int, *, forget_max: bool = True) -> str:
    """Write `value` at `index` of an array; the manifest then records no maximum (an older artifact)."""
    path = folder / f"{name}.bin"
    values = np.fromfile(path, dtype=dtype)
    values[index] = value
    values.tofile(path)
    if forget_max:
        _edit_manifest(folder, lambda m: [entry.pop("max", None) for entry in m["files"].values()])
    return path.name


def _reverse_doc_starts(folder: Path) -> str:
    path = folder / "doc_starts.bin"
    starts = np.fromfile(path, dtype="<u8")
    starts[1], starts[2] = starts[2], starts[1]
    starts.tofile(path)
    return path.name


def _truncate(folder: Path) -> str:
    path = folder / "tokens.bin"
    path.write_bytes(path.read_bytes()[:-10])
    return path.name


def _set_entry(name: str, named: str = MANIFEST, **values: Any) -> Corruption:
    def corrupt(folder: Path) -> str:
        _edit_manifest(folder, lambda m: m["files"][name].update(values))
        return named

    return corrupt


def _outside(absolute: bool) -> Corruption:
    def corrupt(folder: Path) -> str:
        outside = folder.parent / "outside.bin"
        shutil.copy(folder / "tokens.bin", outside)  # same size: only the location is wrong
        _set_entry("tokens", file=str(outside) if absolute else "../outside.bin")(folder)
        return MANIFEST

    return corrupt


def _symlink_outside(folder: Path) -> str:
    outside = folder.parent / "outside.bin"
    shutil.move(folder / "tokens.bin", outside)
    os.symlink(outside, folder / "tokens.bin")
    return MANIFEST


def _count(folder: Path) -> str:
    _edit_manifest(folder, lambda m: m.update(num_sequences=m["num_sequences"] + 1))
    return MANIFEST


CORRUPTIONS: dict[str, Corruption] = {
    "token-above-vocab": lambda f: _poke(f, "tokens", "<u2", 7, 300),
    "token-above-vocab-recorded": _set_entry("tokens", max=300),
    "loss-mask-2": lambda f: _poke(f, "loss_mask", "u1", 3, 2),
    "loss-mask-255": lambda f: _poke(f, "loss_mask", "u1", 40, 255),
    "doc-starts-reversed": _reverse_doc_starts,
    "doc-starts-beyond-tokens": lambda f: _poke(f, "doc_starts", "<u8", -1, 10**9, forget_max=False),
    "tokens-truncated": _truncate,
    "count-wrong": _set_entry("loss_mask", "loss_mask.bin", count=17),
    "count-not-a-number": _set_entry("tokens", count="many"),
    "count-boolean": _set_entry("doc_starts", count=True),
    "num-sequences-wrong": _count,
    "dtype-wrong": _set_entry("tokens", "tokens.bin", dtype="<u4"),
    "dtype-float": _set_entry("tokens", dtype="<f2"),
    "dtype-garbage": _set_entry("loss_mask", dtype="not a dtype"),
    "dtype-object": _set_entry("doc_starts", dtype="|O"),
    "file-relative-outside": _outside(absolute=False),
    "file-absolute-outside": _outside(absolute=True),
    "file-symlink-outside": _symlink_outside,
    "file-missing": lambda f: (f / "loss_mask.bin").unlink() or "loss_mask.bin",
    "file-entry-not-object": _set_entry("tokens", file=["tokens.bin"]),
    "file-name-nul": _set_entry("tokens", file="tokens\x00.bin"),
    "file-name-too-long": _set_entry("tokens", file="t" * 5000),
    "layout-unknown": lambda f: _edit_manifest(f, lambda m: m.update(layout="zigzag")) or MANIFEST,
}


def _one_line_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllm: error: "), err[-3000:]
    return lines[0]


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_launch_refuses_a_corrupt_artifact(train_yaml: Path, kind: str, capsys: pytest.CaptureFixture[str]):
    folder = train_yaml.parent / "data" / "prepared"
    names = CORRUPTIONS[kind](folder)
    line = _one_line_error(["launch", "--config", str(train_yaml)], capsys)
    assert "data.path: " in line and names in line, line
    assert not (train_yaml.parent / "runs").exists()  # nothing trained, nothing written


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_validate_names_the_file(workdir: Path, kind: str, capsys: pytest.CaptureFixture[str]):
    folder = workdir / "data" / "prepared"
    names = CORRUPTIONS[kind](folder)
    line = _one_line_error(["data", "validate", "--no-checksums", str(folder)], capsys)
    assert names in line, line


@pytest.mark.parametrize(("name", "dtype", "value"), [("tokens", "<u2", 300), ("loss_mask", "u1", 2)])
def test_loader_catches_a_file_changed_after_preparation(workdir: Path, name: str, dtype: str, value: int):
    folder = workdir / "data" / "prepared"
    _poke(folder, name, dtype, 5, value, forget_max=False)  # the manifest still records a valid maximum
    loader = StepLoader(open_artifact(folder), global_batch_size=4, micro_batch_size=4, shuffle=False)
    with pytest.raises(DataError, match=rf"{name}\.bin: "):
        loader.next_step()


def test_a_fresh_artifact_records_its_maxima_and_launches(train_yaml: Path):
    from dllm.training.preflight import resolve_run_spec
    from tests.helpers import load_spec

    files = open_artifact(train_yaml.parent / "data" / "prepared").manifest["files"]
    tokens = np.fromfile(train_yaml.parent / "data" / "prepared" / "tokens.bin", dtype="<u2")
    assert files["tokens"]["max"] == int(tokens.max()) and files["loss_mask"]["max"] == 1
    resolve_run_spec(load_spec(train_yaml))  # passes


@pytest.mark.parametrize(
    "text", ['{"format": ' + "[" * 100_000 + "]" * 100_000 + "}", '{"seq_len": ' + "9" * 5000 + "}", "\udcff"]
)
def test_an_unreadable_manifest_is_one_line(train_yaml: Path, text: str, capsys: pytest.CaptureFixture[str]):
    (train_yaml.parent / "data" / "prepared" / MANIFEST).write_bytes(text.encode("utf-8", "surrogateescape"))
    assert MANIFEST in _one_line_error(["launch", "--config", str(train_yaml)], capsys)


# -- dllm data inspect --tokenizer ---------------------------------------------------------------------------
def _prepared(root: Path, tokenizer: dict[str, Any] | None = None) -> Path:
    (root / "a.jsonl").write_text('{"text": "the cat sees a map"}\n')
    extra = f"tokenizer: {json.dumps(tokenizer)}\n" if tokenizer else ""
    (root / "prepare.yaml").write_text(f"{extra}sources: [{{path: a.jsonl}}]\noutput: out\nseq_len: 16\n")
    assert main(["data", "prepare", "--config", str(root / "prepare.yaml"), "-q"]) == 0
    return root / "out"


def test_inspect_warns_that_a_tokenizer_has_no_effect_on_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """`--tokenizer /etc` was ignored without a word on an artifact of the byte tokenizer."""
    art = _prepared(tmp_path)
    capsys.readouterr()
    assert main(["data", "inspect", str(art), "--tokenizer", "/etc"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dllm: warning:")]
    assert len(warnings) == 1 and "--tokenizer /etc: no effect" in warnings[0] and "byte" in warnings[0], warnings


def test_inspect_refuses_a_tokenizer_flag_that_is_no_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from tests.helpers import save_bpe

    art = _prepared(tmp_path, {"kind": "hf", "path": str(save_bpe(tmp_path / "bpe"))})
    capsys.readouterr()
    for bad in ("/etc", "/etc/hostname", str(tmp_path / "missing")):
        assert main(["data", "inspect", str(art), "--tokenizer", bad]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dllm: error: --tokenizer: ") and bad in lines[0], lines
    assert main(["data", "inspect", str(art), "--tokenizer", str(tmp_path / "bpe")]) == 0
