"""Reliability hardening, overwriting: `dllm data prepare --overwrite` only ever replaces a previous artifact.

Before, `output: .` deleted the whole config folder and `output: data` deleted the inputs, and
replacing a real artifact deleted a file the user had put inside it. Now an output that is not an
artifact, that holds an input, the config or any file the artifact did not write, or is an ancestor
of either, is one line and nothing on disk changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.data.artifact import FORMAT, FORMAT_VERSION, MANIFEST
from tests.helpers import PREPARE, write_corpus, write_yaml


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _plant_manifest(folder: Path) -> None:
    """A manifest of our format where the user keeps other things (a copied or hostile file)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION}))


def _project(root: Path, output: str, source: str = "data/train.jsonl") -> Path:
    write_corpus(root / "data" / "train.jsonl", num_records=20)
    (root / "data" / "notes.txt").write_text("unrelated file next to the inputs")
    (root / "README.md").write_text("keep me")
    (root / "train.yaml").write_text("run: {name: t}\n")
    return write_yaml(root / "prepare.yaml", {**PREPARE, "sources": [{"path": source}], "output": output})


def _refused(config: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    code = main(["data", "prepare", "--config", str(config), "--overwrite", "-q", *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllm: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("output", "plant", "expected"),
    [
        pytest.param(".", None, "not a dllm artifact", id="config-folder"),
        pytest.param("data", None, "not a dllm artifact", id="input-folder"),
        pytest.param("data/train.jsonl", None, "not a dllm artifact", id="input-file"),
        pytest.param("README.md", None, "not a dllm artifact", id="unrelated-file"),
        pytest.param(".", ".", "holds", id="config-folder-with-a-manifest"),
        pytest.param("data", "data", "holds", id="input-folder-with-a-manifest"),
        pytest.param("..", "..", "holds", id="ancestor-of-the-config-with-a-manifest"),
    ],
)
def test_overwrite_never_deletes_what_is_not_an_artifact(
    tmp_path: Path, output: str, plant: str | None, expected: str, capsys: pytest.CaptureFixture[str]
):
    root = tmp_path / "project"
    config = _project(root, output)
    if plant is not None:
        _plant_manifest(root / plant)
    before = _tree(tmp_path)
    line = _refused(config, capsys)
    assert expected in line and "choose another output" in line, line
    assert _tree(tmp_path) == before


def test_overwrite_never_deletes_an_artifact_that_holds_an_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A real artifact, but the user keeps a source inside it: replacing it would delete the input."""
    config = _project(tmp_path, "data/prepared", source="data/prepared/extra.jsonl")
    write_corpus(tmp_path / "data" / "prepared" / "extra.jsonl", num_records=20)
    assert main(["data", "prepare", "--config", str(config), "--output", str(tmp_path / "x"), "-q"]) == 0
    for name in ("manifest.json", "tokens.bin", "loss_mask.bin", "doc_starts.bin"):
        (tmp_path / "x" / name).rename(tmp_path / "data" / "prepared" / name)
    before = _tree(tmp_path)
    line = _refused(config, capsys)
    assert "extra.jsonl" in line, line
    assert _tree(tmp_path) == before


def test_overwrite_still_replaces_an_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = _project(tmp_path, "data/prepared")
    assert main(["data", "prepare", "--config", str(config), "-q"]) == 0
    first = (tmp_path / "data" / "prepared" / "tokens.bin").read_bytes()
    assert main(["data", "prepare", "--config", str(config), "-q", "--overwrite"]) == 0
    assert (tmp_path / "data" / "prepared" / "tokens.bin").read_bytes() == first
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["notes.txt", "prepared", "train.jsonl"]


def test_without_overwrite_a_non_artifact_is_not_offered_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = _project(tmp_path, "data")
    assert main(["data", "prepare", "--config", str(config), "-q"]) == 2
    err = capsys.readouterr().err
    assert "not a dllm artifact" in err and "pass --overwrite" not in err, err


def test_overwrite_never_deletes_a_file_the_user_put_in_the_artifact(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]):  # fmt: skip
    config = _project(tmp_path, "data/prepared")
    assert main(["data", "prepare", "--config", str(config), "-q"]) == 0
    (tmp_path / "data" / "prepared" / "NOTES.md").write_text("what I found in this data")
    before = _tree(tmp_path)
    line = _refused(config, capsys)
    assert "holds NOTES.md" in line and "not part of a dllm artifact" in line and "choose another output" in line, line
    assert _tree(tmp_path) == before
    (tmp_path / "data" / "prepared" / "NOTES.md").unlink()  # moved out: the artifact is replaced again
    assert main(["data", "prepare", "--config", str(config), "-q", "--overwrite"]) == 0
