"""Data: preparation (deterministic bytes, staged writes, errors), artifact validation, the loader."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dllm.config.loading import load_config
from dllm.config.prepare import PrepareSpec
from dllm.data.artifact import MANIFEST, open_artifact, read_manifest, validate_artifact
from dllm.data.loader import Batch, StepLoader
from dllm.data.prepare import prepare
from dllm.errors import CheckpointError, DataError
from dllm.tokenization import ByteTokenizer
from tests.helpers import PREPARE, write_corpus, write_yaml

TOK = ByteTokenizer()


# --------------------------------------------------------------------------------------------------
# helpers


def _spec(root: Path, **values: Any) -> PrepareSpec:
    return load_config(PrepareSpec, write_yaml(root / "prepare.yaml", {**PREPARE, **values}))


def _project(root: Path, num_records: int = 120, seed: int = 0, **values: Any) -> PrepareSpec:
    write_corpus(root / "data" / "train.jsonl", num_records=num_records, seed=seed)
    return _spec(root, **values)


def _docs(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _array(folder: Path, name: str) -> np.ndarray:
    return np.asarray(open_artifact(folder).array(name))


# --------------------------------------------------------------------------------------------------
# prepare: determinism, manifest, packing


def test_prepare_same_input_same_bytes(workdir: Path):
    spec = load_config(PrepareSpec, workdir / "prepare.yaml")
    first = workdir / "data" / "prepared"
    second = workdir / "again" / "elsewhere"
    manifest = prepare(spec, workdir, output=second)
    assert manifest == read_manifest(first)
    a, b = _folder_bytes(first), _folder_bytes(second)
    assert set(a) == {MANIFEST, "tokens.bin", "loss_mask.bin", "doc_starts.bin"}
    assert a == b
    assert _leftovers(workdir / "again", "elsewhere") == [] and _leftovers(workdir / "data", "prepared") == []


def test_manifest_contents(workdir: Path):
    folder = workdir / "data" / "prepared"
    m = read_manifest(folder)
    assert (m["format"], m["format_version"], m["layout"], m["seq_len"]) == ("dllm-artifact", 1, "packed", 32)
    itemsizes = {"tokens": 2, "loss_mask": 1, "doc_starts": 8}
    assert set(m["files"]) == set(itemsizes)
    for name, entry in m["files"].items():
        path = folder / entry["file"]
        assert entry["file"] == f"{name}.bin"
        assert np.dtype(entry["dtype"]).itemsize == itemsizes[name] and np.dtype(entry["dtype"]).kind == "u"
        assert path.stat().st_size == entry["count"] * itemsizes[name]
        assert entry["sha256"] == _sha(path)
    assert m["files"]["tokens"]["dtype"] == "<u2" and m["files"]["doc_starts"]["dtype"] == "<u8"
    assert m["files"]["tokens"]["count"] == m["num_sequences"] * 32 == m["files"]["loss_mask"]["count"]
    assert len(m["fingerprint"]) == 64 and int(m["fingerprint"], 16) >= 0
    assert m["tokenizer"] == TOK.identity()
    # nothing machine-specific in the config part of the manifest
    assert "output" not in m["prepare_config"]
    assert m["prepare_config"]["sources"][0]["path"] == "train.jsonl"
    assert str(workdir) not in json.dumps(m)
    src = workdir / "data" / "train.jsonl"
    assert m["provenance"]["sources"] == [
        {"file": "data/train.jsonl", "bytes": src.stat().st_size, "sha256": _sha(src)}
    ]
    docs = _docs(src)
    lengths = [len(TOK.encode(d)) + 1 for d in docs]
    st = m["stats"]
    assert st["records_read"] == st["documents"] == len(docs) == 400 and st["records_skipped"] == 0
    assert st["tokens"] == st["supervised_tokens"] == sum(lengths)
    assert st["padding_tokens"] == m["num_sequences"] * 32 - sum(lengths)
    assert 0 <= st["padding_tokens"] < 32
    assert st["doc_length"] == {
        "min": min(lengths),
        "max": max(lengths),
        "mean": round(sum(lengths) / len(docs), 3),
    }
    hist = st["doc_length_histogram"]
    assert sum(hist["counts"]) == len(docs) and len(hist["counts"]) == len(hist["edges"])
    edges = hist["edges"]
    for i, count in enumerate(hist["counts"]):
        hi = edges[i + 1] if i + 1 < len(edges) else float("inf")
        assert count == sum(edges[i] <= n < hi for n in lengths)


def test_packed_rows_decode_to_documents_joined_by_eos(workdir: Path):
    folder = workdir / "data" / "prepared"
    docs = _docs(workdir / "data" / "train.jsonl")
    tokens, mask, starts = (_array(folder, n) for n in ("tokens", "loss_mask", "doc_starts"))
    expected = [i for d in docs for i in [*TOK.encode(d), TOK.eos_id]]
    n = len(expected)
    assert tokens[:n].tolist() == expected
    assert (tokens[n:] == TOK.pad_id).all()
    assert (mask[:n] == 1).all() and (mask[n:] == 0).all()
    offsets = np.cumsum([0] + [len(TOK.encode(d)) + 1 for d in docs[:-1]])
    assert starts.tolist() == offsets.tolist()
    rows = tokens.reshape(-1, 32)
    text = "".join(TOK.decode(row.tolist(), skip_special=False) for row in rows)
    body, _, padding = text.partition("<|pad|>")
    assert body == "".join(f"{d}<|eos|>" for d in docs)
    assert padding.replace("<|pad|>", "") == ""
    assert body.split("<|eos|>")[:-1] == docs


def test_packing_options_bos_and_no_eos(tmp_path: Path):
    spec = _project(tmp_path, num_records=30, add_bos=True, append_eos=False, seq_len=8)
    m = prepare(spec, tmp_path)
    docs = _docs(tmp_path / "data" / "train.jsonl")
    tokens = _array(spec.output, "tokens")
    expected = [i for d in docs for i in [TOK.bos_id, *TOK.encode(d)]]
    assert tokens[: len(expected)].tolist() == expected
    assert TOK.eos_id not in tokens.tolist()
    assert len(expected) == m["stats"]["tokens"]
    # BOS is a fixed marker, not a target: it is never noised or trained on
    assert m["stats"]["supervised_tokens"] == len(expected) - len(docs)
    mask = _array(spec.output, "loss_mask")[: len(expected)]
    assert (mask[tokens[: len(expected)] == TOK.bos_id] == 0).all()
    assert m["num_sequences"] == -(-len(expected) // 8)


def test_empty_documents_are_skipped_by_packing(tmp_path: Path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "ab"}\n\n{"text": ""}\n{"text": "cd"}\n', encoding="utf-8")
    spec = _spec(tmp_path, seq_len=4, append_eos=False)
    m = prepare(spec, tmp_path)
    assert m["stats"]["records_read"] == 3  # the blank line is not a record
    assert _array(spec.output, "tokens").tolist() == TOK.encode("abcd")
    assert _array(spec.output, "doc_starts").tolist() == [0, 2]


def test_glob_sources_read_in_sorted_order(tmp_path: Path):
    for i, name in enumerate(["b.jsonl", "a.jsonl", "c.jsonl"]):
        write_corpus(tmp_path / "data" / "parts" / name, num_records=5, seed=i)
    spec = _spec(tmp_path, sources=[{"path": "data/parts/*.jsonl"}])
    m = prepare(spec, tmp_path)
    parts = tmp_path / "data" / "parts"
    docs = [d for name in ("a.jsonl", "b.jsonl", "c.jsonl") for d in _docs(parts / name)]
    expected = [i for d in docs for i in [*TOK.encode(d), TOK.eos_id]]
    assert _array(spec.output, "tokens")[: len(expected)].tolist() == expected
    assert [s["file"] for s in m["provenance"]["sources"]] == [f"data/parts/{n}.jsonl" for n in "abc"]
    with pytest.raises(DataError, match=r"^sources.path: no file matches 'data/none/\*.jsonl'"):
        prepare(_spec(tmp_path, sources=[{"path": "data/none/*.jsonl"}]), tmp_path, overwrite=True)


def test_nested_text_field(tmp_path: Path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"meta": {"body": "xyz"}}\n', encoding="utf-8")
    spec = _spec(tmp_path, sources=[{"path": "data/train.jsonl", "text_field": "meta.body"}], seq_len=4)
    prepare(spec, tmp_path)
    assert _array(spec.output, "tokens").tolist() == [*TOK.encode("xyz"), TOK.eos_id]


# --------------------------------------------------------------------------------------------------
# fingerprint


def test_fingerprint_is_independent_of_absolute_paths(workdir: Path, tmp_path_factory: pytest.TempPathFactory):
    other = tmp_path_factory.mktemp("moved") / "deeper" / "project"
    other.mkdir(parents=True)
    shutil.copytree(workdir / "data", other / "data", ignore=shutil.ignore_patterns("prepared"))
    shutil.copy(workdir / "prepare.yaml", other / "prepare.yaml")
    assert not (other / "data" / "prepared").exists()
    manifest = prepare(load_config(PrepareSpec, other / "prepare.yaml"), other)
    original = read_manifest(workdir / "data" / "prepared")
    assert manifest["fingerprint"] == original["fingerprint"]
    assert _folder_bytes(other / "data" / "prepared") == _folder_bytes(workdir / "data" / "prepared")


def test_fingerprint_changes_with_content_and_config(tmp_path: Path):
    base = prepare(_project(tmp_path / "a", num_records=40), tmp_path / "a")["fingerprint"]
    # another config
    spec16 = _project(tmp_path / "b", num_records=40, seq_len=16)
    assert prepare(spec16, tmp_path / "b")["fingerprint"] != base
    # one record differs
    spec = _project(tmp_path / "c", num_records=40)
    path = tmp_path / "c" / "data" / "train.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[7] = json.dumps({"text": "something new"})
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert prepare(spec, tmp_path / "c")["fingerprint"] != base
    # spelling out the defaults is the same config
    spec_defaults = _project(tmp_path / "d", num_records=40, add_bos=False, append_eos=True, layout="packed")
    assert prepare(spec_defaults, tmp_path / "d")["fingerprint"] == base


# --------------------------------------------------------------------------------------------------
# staged writes and errors


def test_existing_output_needs_overwrite(workdir: Path):
    spec = load_config(PrepareSpec, workdir / "prepare.yaml")
    folder = workdir / "data" / "prepared"
    before = _folder_bytes(folder)
    with pytest.raises(DataError, match="already exists; pass --overwrite"):
        prepare(spec, workdir)
    assert _folder_bytes(folder) == before
    assert _leftovers(workdir / "data", "prepared") == []
    # with overwrite, a different config replaces it
    m = prepare(spec.model_copy(update={"seq_len": 16}), workdir, overwrite=True)
    assert read_manifest(folder) == m and m["seq_len"] == 16
    assert _folder_bytes(folder) != before
    validate_artifact(folder)
    assert _leftovers(workdir / "data", "prepared") == []


def _corrupt_halfway(path: Path, line: str = "{not json\n") -> int:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    half = len(lines) // 2
    lines.insert(half, line)
    path.write_text("".join(lines), encoding="utf-8")
    return half + 1


def test_bad_json_line_leaves_nothing_behind(tmp_path: Path):
    spec = _project(tmp_path, num_records=120)
    src = tmp_path / "data" / "train.jsonl"
    lineno = _corrupt_halfway(src)
    with pytest.raises(DataError) as info:
        prepare(spec, tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"{src}:{lineno}: invalid JSON")
    assert not spec.output.exists()
    assert _leftovers(spec.output.parent, spec.output.name) == []
    assert sorted(p.name for p in spec.output.parent.iterdir()) == ["train.jsonl"]


def test_failure_with_overwrite_keeps_the_old_artifact(workdir: Path):
    spec = load_config(PrepareSpec, workdir / "prepare.yaml")
    folder = workdir / "data" / "prepared"
    before = _folder_bytes(folder)
    _corrupt_halfway(workdir / "data" / "train.jsonl", '{"text": 5}\n')
    with pytest.raises(DataError, match=r"train\.jsonl:201: field 'text' is int, expected a string"):
        prepare(spec, workdir, overwrite=True)
    assert _folder_bytes(folder) == before
    assert _leftovers(workdir / "data", "prepared") == []


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"body": "x"}\n', "record has no field 'text'"),
        ("[1, 2]\n", "expected a JSON object per line, got list"),
        ('{"text": null}\n', "field 'text' is NoneType"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path: Path, line: str, message: str):
    spec = _project(tmp_path, num_records=20)
    src = tmp_path / "data" / "train.jsonl"
    lineno = _corrupt_halfway(src, line)
    with pytest.raises(DataError) as info:
        prepare(spec, tmp_path)
    assert str(info.value).startswith(f"{src}:{lineno}: ") and message in str(info.value)
    assert not spec.output.exists() and _leftovers(spec.output.parent, spec.output.name) == []


def _insert_line(path: Path, index: int, raw: bytes) -> Path:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([*lines[:index], raw, *lines[index:]]))
    return path


UNDECODABLE = [
    pytest.param(b'{"text": "caf\xe9"}\n', id="invalid-utf8"),
    pytest.param(b'{"text": "\\ud800"}\n', id="lone-surrogate"),
]


@pytest.mark.parametrize("raw", UNDECODABLE)
def test_undecodable_text_leaves_nothing_behind(tmp_path: Path, raw: bytes):
    spec = _project(tmp_path, num_records=20)
    _insert_line(tmp_path / "data" / "train.jsonl", 10, raw)
    with pytest.raises((DataError, UnicodeError)):  # whatever it raises, the staging is cleaned up
        prepare(spec, tmp_path)
    assert not spec.output.exists() and _leftovers(spec.output.parent, spec.output.name) == []


@pytest.mark.parametrize("raw", UNDECODABLE)
def test_undecodable_text_is_a_data_error(tmp_path: Path, raw: bytes):
    spec = _project(tmp_path, num_records=20)
    src = _insert_line(tmp_path / "data" / "train.jsonl", 10, raw)
    with pytest.raises(DataError, match=rf"^{src}:11: "):
        prepare(spec, tmp_path)


def test_interrupted_prepare_leaves_nothing_behind(tmp_path: Path):
    spec = _project(tmp_path, num_records=60)
    seen: list[int] = []

    def progress(records: int, tokens: int) -> None:
        seen.append(records)
        if records == 30:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(spec, tmp_path, progress=progress)
    assert seen == list(range(1, 31))
    assert not spec.output.exists() and _leftovers(spec.output.parent, spec.output.name) == []


def test_stale_temp_folder_is_replaced(tmp_path: Path):
    import os

    spec = _project(tmp_path, num_records=20)
    stale = spec.output.parent / f".{spec.output.name}.tmp-{os.getpid()}"
    stale.mkdir()
    (stale / "junk").write_text("x")
    prepare(spec, tmp_path)
    assert not stale.exists()
    assert {p.name for p in spec.output.iterdir()} == {
        MANIFEST,
        "doc_starts.bin",
        "loss_mask.bin",
        "tokens.bin",
    }


# --------------------------------------------------------------------------------------------------
# validate_artifact


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    spec = _project(tmp_path, num_records=60)
    prepare(spec, tmp_path)
    return spec.output


def _flip_byte(path: Path, offset: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _rewrite_manifest(folder: Path, **file_shas: str) -> None:
    m = read_manifest(folder)
    for name, sha in file_shas.items():
        m["files"][name]["sha256"] = sha
    (folder / MANIFEST).write_text(json.dumps(m), encoding="utf-8")


def test_validate_accepts_a_fresh_artifact(artifact: Path):
    art = validate_artifact(artifact)
    m = read_manifest(artifact)
    assert art.num_sequences == m["num_sequences"] and art.seq_len == 32
    assert art.fingerprint == m["fingerprint"] and art.tokenizer == TOK.identity()
    assert validate_artifact(artifact, checksums=False).manifest == m


@pytest.mark.parametrize("name", ["tokens", "loss_mask", "doc_starts"])
def test_validate_detects_a_flipped_byte(artifact: Path, name: str):
    _flip_byte(artifact / f"{name}.bin", offset=0 if name == "loss_mask" else 2)
    with pytest.raises(DataError, match=rf"{name}\.bin: SHA-256 differs from the manifest"):
        validate_artifact(artifact)


def test_no_checksums_skips_sha_but_checks_sizes(artifact: Path):
    _flip_byte(artifact / "tokens.bin", offset=2)  # the high byte of token 1: id 0x01xx stays < 260
    assert validate_artifact(artifact, checksums=False).num_sequences > 0
    path = artifact / "tokens.bin"
    path.write_bytes(path.read_bytes()[:-2])
    for checksums in (True, False):
        with pytest.raises(DataError, match=r"tokens\.bin: \d+ bytes, the manifest says \d+"):
            validate_artifact(artifact, checksums=checksums)


def test_validate_detects_truncation_and_missing_files(artifact: Path):
    path = artifact / "doc_starts.bin"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(DataError, match=rf"doc_starts\.bin: {size - 8} bytes, the manifest says {size}"):
        validate_artifact(artifact)
    path.unlink()
    with pytest.raises(DataError, match=r"doc_starts\.bin: missing file listed in the manifest"):
        validate_artifact(artifact, checksums=False)


def test_validate_detects_token_outside_vocab(artifact: Path):
    path = artifact / "tokens.bin"
    tokens = np.fromfile(path, dtype="<u2")
    tokens[5] = 300
    tokens.tofile(path)
    with pytest.raises(DataError, match=r"token id 300 is outside the vocabulary \(260\)"):
        validate_artifact(artifact, checksums=False)
    _rewrite_manifest(artifact, tokens=_sha(path))  # a consistent manifest does not hide it
    with pytest.raises(DataError, match=r"token id 300 is outside the vocabulary \(260\)"):
        validate_artifact(artifact)
    tokens[5] = 259  # the largest valid id
    tokens.tofile(path)
    _rewrite_manifest(artifact, tokens=_sha(path))
    validate_artifact(artifact)


def test_validate_detects_bad_mask_and_doc_starts(artifact: Path):
    mask_path = artifact / "loss_mask.bin"
    good_mask = mask_path.read_bytes()
    mask = np.frombuffer(good_mask, dtype="u1").copy()
    mask[0] = 2
    mask.tofile(mask_path)
    _rewrite_manifest(artifact, loss_mask=_sha(mask_path))
    with pytest.raises(DataError, match="loss_mask holds values other than 0 and 1"):
        validate_artifact(artifact)
    mask_path.write_bytes(good_mask)
    _rewrite_manifest(artifact, loss_mask=_sha(mask_path))
    starts_path = artifact / "doc_starts.bin"
    starts = np.fromfile(starts_path, dtype="<u8")
    starts[2] = starts[1]
    starts.tofile(starts_path)
    _rewrite_manifest(artifact, doc_starts=_sha(starts_path))
    with pytest.raises(DataError, match="doc_starts are not increasing"):
        validate_artifact(artifact)


def test_validate_detects_bad_manifests(artifact: Path):
    mf = artifact / MANIFEST
    good = json.loads(mf.read_text())
    for edit, pattern in [
        (lambda m: m.pop("stats"), "missing keys stats"),
        (lambda m: m["files"].pop("doc_starts"), "files.doc_starts is missing"),
        (lambda m: m.update(format_version=2), "format version 2 is not supported"),
        (lambda m: m.update(format="other"), "not a dllm artifact manifest"),
        (
            lambda m: m["files"]["tokens"].update(count=m["files"]["tokens"]["count"] - 32),
            "bytes, the manifest says",
        ),
    ]:
        m = json.loads(json.dumps(good))
        edit(m)
        mf.write_text(json.dumps(m), encoding="utf-8")
        with pytest.raises(DataError, match=pattern):
            validate_artifact(artifact)
    mf.write_text('{"format": "dllm-artifact",\n  oops}', encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{mf}:2: invalid JSON"):
        validate_artifact(artifact)
    mf.unlink()
    with pytest.raises(DataError, match="no manifest.json; prepare the data first"):
        validate_artifact(artifact)


def test_cli_validate_no_checksums(artifact: Path, capsys: pytest.CaptureFixture[str]):
    from dllm.cli.main import main

    assert main(["data", "validate", str(artifact)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {artifact}: ")
    _flip_byte(artifact / "tokens.bin", offset=2)
    assert main(["data", "validate", str(artifact)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm: error: ") and "SHA-256 differs" in err and err.count("\n") == 1
    assert main(["data", "validate", str(artifact), "--no-checksums"]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    path = artifact / "tokens.bin"
    path.write_bytes(path.read_bytes()[:-2])
    assert main(["data", "validate", str(artifact), "--no-checksums"]) == 2
    assert "bytes, the manifest says" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# StepLoader

SEQ = 16


def _indexed_artifact(root: Path, num_rows: int) -> Path:
    """An artifact whose row r holds the digits of r (15 digits + EOS = one row per document)."""
    (root / "data").mkdir(parents=True)
    with open(root / "data" / "train.jsonl", "w", encoding="utf-8") as fh:
        for r in range(num_rows):
            fh.write(json.dumps({"text": f"{r:0{SEQ - 1}d}"}) + "\n")
    spec = _spec(root, seq_len=SEQ)
    m = prepare(spec, root)
    assert m["num_sequences"] == num_rows and m["stats"]["padding_tokens"] == 0
    return spec.output


def _row_ids(batch: Batch) -> list[int]:
    return [int(TOK.decode(row[:-1].tolist())) for row in batch.tokens_BL]


@pytest.fixture
def indexed(tmp_path: Path) -> Path:
    return _indexed_artifact(tmp_path, num_rows=20)


def _loader(path: Path, **kwargs: Any) -> StepLoader:
    args = {"global_batch_size": 8, "micro_batch_size": 2, **kwargs}
    return StepLoader(open_artifact(path), **args)


def _cat(batches: list[Batch]) -> Batch:
    return Batch(
        torch.cat([b.tokens_BL for b in batches]),
        torch.cat([b.loss_mask_BL for b in batches]),
        torch.cat([b.sample_ids_B for b in batches]),
    )


def _assert_same(a: Batch, b: Batch) -> None:
    assert torch.equal(a.tokens_BL, b.tokens_BL)
    assert torch.equal(a.loss_mask_BL, b.loss_mask_BL)
    assert torch.equal(a.sample_ids_B, b.sample_ids_B)


def test_step_shapes_and_contents(indexed: Path):
    loader = _loader(indexed)
    batches = loader.next_step()
    assert len(batches) == 4
    for b in batches:
        assert b.tokens_BL.shape == (2, SEQ) and b.tokens_BL.dtype == torch.int64
        assert b.loss_mask_BL.shape == (2, SEQ) and b.loss_mask_BL.dtype == torch.bool
        assert b.sample_ids_B.dtype == torch.int64
        assert b.num_targets == 2 * SEQ  # no padding in this artifact
        assert (b.tokens_BL[:, -1] == TOK.eos_id).all()
    assert _cat(batches).sample_ids_B.tolist() == list(range(8))
    assert loader.position == 8 and loader.epoch == pytest.approx(0.4)
    assert _cat(loader.next_step()).sample_ids_B.tolist() == list(range(8, 16))
    moved = batches[0].to(torch.device("cpu"))
    _assert_same(moved, batches[0])


def test_rows_match_the_artifact(workdir: Path):
    path = workdir / "data" / "prepared"
    art = open_artifact(path)
    tokens = np.asarray(art.array("tokens")).reshape(-1, art.seq_len)
    mask = np.asarray(art.array("loss_mask")).reshape(-1, art.seq_len)
    loader = StepLoader(art, global_batch_size=8, micro_batch_size=4, shuffle=False)
    batch = _cat(loader.next_step())
    assert batch.tokens_BL.numpy().tolist() == tokens[:8].tolist()
    assert batch.loss_mask_BL.numpy().tolist() == mask[:8].astype(bool).tolist()
    # the last row holds the padding, which is not supervised
    last = loader.read(np.array([art.num_sequences - 1]))
    assert int(last.num_targets) == int(mask[-1].sum()) < art.seq_len


@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_split_the_global_batch(workdir: Path, shuffle: bool):
    art = open_artifact(workdir / "data" / "prepared")
    one = StepLoader(art, global_batch_size=8, micro_batch_size=2, seed=3, shuffle=shuffle)
    ranks = [
        StepLoader(art, global_batch_size=8, micro_batch_size=2, dp_rank=r, dp_size=2, seed=3, shuffle=shuffle)
        for r in range(2)
    ]
    for _ in range(40):  # past the end of the first epoch
        full = _cat(one.next_step())
        parts = [r.next_step() for r in ranks]
        assert [len(p) for p in parts] == [2, 2]
        assert all(b.tokens_BL.shape[0] == 2 for p in parts for b in p)
        _assert_same(_cat(parts[0] + parts[1]), full)
        assert set(_cat(parts[0]).sample_ids_B.tolist()).isdisjoint(_cat(parts[1]).sample_ids_B.tolist())
    assert one.epoch > 1


def test_shuffle_is_a_permutation_per_epoch(indexed: Path):
    loader = _loader(indexed, seed=7)
    rows: list[int] = []
    ids: list[int] = []
    for _ in range(15):  # 120 positions = 6 epochs of 20 rows; steps straddle epoch borders
        batch = _cat(loader.next_step())
        rows += _row_ids(batch)
        ids += batch.sample_ids_B.tolist()
    assert ids == list(range(120))
    epochs = [rows[e * 20 : (e + 1) * 20] for e in range(6)]
    for order in epochs:
        assert sorted(order) == list(range(20))
    assert len({tuple(o) for o in epochs}) == 6  # a new order every epoch
    assert epochs[0] != list(range(20))
    # the same seed gives the same orders, another seed other orders
    again = _loader(indexed, seed=7)
    assert sum((_row_ids(_cat(again.next_step())) for _ in range(5)), []) == rows[:40]
    other = _loader(indexed, seed=8)
    assert sum((_row_ids(_cat(other.next_step())) for _ in range(5)), []) != rows[:40]


def test_no_shuffle_reads_in_order(indexed: Path):
    loader = _loader(indexed, shuffle=False)
    rows = sum((_row_ids(_cat(loader.next_step())) for _ in range(5)), [])
    assert rows == [p % 20 for p in range(40)]


def test_read_is_a_pure_function_of_positions(indexed: Path):
    loader = _loader(indexed, seed=1)
    positions = np.array([39, 0, 21, 20, 5], dtype=np.int64)
    first = loader.read(positions)
    loader.next_step()
    _assert_same(loader.read(positions), first)
    _assert_same(_loader(indexed, seed=1).read(positions), first)
    assert first.sample_ids_B.tolist() == positions.tolist()


@pytest.mark.parametrize("dp_size", [1, 2])
def test_resume_mid_epoch_gives_identical_batches(indexed: Path, dp_size: int):
    def make(rank: int) -> StepLoader:
        return _loader(indexed, seed=5, dp_rank=rank, dp_size=dp_size)

    for rank in range(dp_size):
        a = make(rank)
        a.next_step()  # position 8: the middle of epoch 0
        state = a.state_dict()
        assert state == {"position": 8, "seed": 5, "fingerprint": read_manifest(indexed)["fingerprint"]}
        state = json.loads(json.dumps(state))  # survives serialisation
        expected = [a.next_step() for _ in range(4)]
        b = make(rank)
        b.load_state_dict(state)
        assert b.position == 8
        for want in expected:
            got = b.next_step()
            assert len(got) == len(want)
            for x, y in zip(got, want, strict=True):
                _assert_same(x, y)


def test_resume_restores_the_seed(indexed: Path):
    a = _loader(indexed, seed=11)
    a.next_step()
    state = a.state_dict()
    want = _cat(a.next_step())
    b = _loader(indexed, seed=0)  # a fresh loader built with another seed follows the checkpoint
    b.load_state_dict(state)
    assert b.seed == 11
    _assert_same(_cat(b.next_step()), want)


def test_resume_into_a_used_loader_with_another_seed(indexed: Path):
    a = _loader(indexed, seed=11)
    a.next_step()
    state = a.state_dict()
    want = _cat(a.next_step())
    b = _loader(indexed, seed=0)
    b.next_step()  # caches the epoch-0 permutation of seed 0
    b.load_state_dict(state)
    _assert_same(_cat(b.next_step()), want)


def test_state_from_another_artifact_is_rejected(indexed: Path, tmp_path: Path):
    other = _indexed_artifact(tmp_path / "other", num_rows=24)
    foreign = _loader(other).state_dict()
    loader = _loader(indexed)
    with pytest.raises(CheckpointError, match=r"^data.path: the artifact .* is not the one this checkpoint trained on"):
        loader.load_state_dict(foreign)
    with pytest.raises(CheckpointError):
        loader.load_state_dict({"position": 8, "seed": 0})
    assert loader.position == 0 and loader.seed == 0  # unchanged after a refused state


# --------------------------------------------------------------------------------------------------
# prompt/completion records and document ids


def _write_pairs(path: Path, pairs: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))


@pytest.mark.parametrize("supervision", ["auto", "completion_only", "full"])
def test_prompt_completion_supervision(tmp_path: Path, supervision: str):
    pairs = [("1 + 2 =", " 3"), ("10 + 5 =", " 15"), ("7 + 7 =", " 14")]
    _write_pairs(tmp_path / "data" / "sums.jsonl", pairs)
    src = {"path": "data/sums.jsonl", "format": "prompt_completion", "supervision": supervision}
    spec = _spec(tmp_path, sources=[src], seq_len=16)
    m = prepare(spec, tmp_path)
    tokens = _array(spec.output, "tokens").tolist()
    mask = _array(spec.output, "loss_mask").tolist()
    starts = _array(spec.output, "doc_starts").tolist()
    expected_mask = []
    for (p, c), start in zip(pairs, starts[::2], strict=True):  # 10, 12, 11 tokens: one row each, then padding
        prompt_sup = 1 if supervision == "full" else 0
        n = len(p) + len(c) + 1
        assert tokens[start : start + n] == [*TOK.encode(p + c), TOK.eos_id]
        assert mask[start : start + n] == [prompt_sup] * len(p) + [1] * (len(c) + 1)
        expected_mask += mask[start : start + n]
    assert m["stats"]["supervised_tokens"] == sum(expected_mask)


def test_prompt_completion_missing_field_names_the_option(tmp_path: Path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sums.jsonl").write_text(json.dumps({"prompt": "1 + 1 ="}) + "\n")
    spec = _spec(tmp_path, sources=[{"path": "data/sums.jsonl", "format": "prompt_completion"}])
    with pytest.raises(DataError, match=r"sums.jsonl:1: record has no field 'completion'; set completion_field"):
        prepare(spec, tmp_path)


def test_completion_only_needs_prompt_completion(tmp_path: Path):
    from dllm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"sources\.0: supervision completion_only does not apply to format text"):
        _spec(tmp_path, sources=[{"path": "x.jsonl", "supervision": "completion_only"}])


def test_loader_document_ids_follow_doc_starts(workdir: Path):
    art = open_artifact(workdir / "data" / "prepared")
    loader = StepLoader(art, global_batch_size=8, micro_batch_size=8, shuffle=False, document_ids=True)
    batch = loader.next_step()[0]
    assert batch.doc_ids_BL is not None
    tokens = batch.tokens_BL.reshape(-1).tolist()
    doc = batch.doc_ids_BL.reshape(-1).tolist()
    starts = set(np.asarray(art.array("doc_starts")).tolist())
    for i in range(1, len(doc)):
        # the document index goes up by one exactly where a document starts (just after an EOS)
        assert doc[i] - doc[i - 1] == (1 if i in starts else 0)
        if i in starts:
            assert tokens[i - 1] == TOK.eos_id
    without = StepLoader(art, global_batch_size=8, micro_batch_size=8, shuffle=False).next_step()[0]
    assert without.doc_ids_BL is None
    assert torch.equal(without.tokens_BL, batch.tokens_BL)


def test_pad_to_multiple_pads_each_document_with_supervised_eos(tmp_path: Path):
    pairs = [("1 + 2 =", " 3"), ("10 + 15 =", " 25")]
    _write_pairs(tmp_path / "data" / "sums.jsonl", pairs)
    src = {"path": "data/sums.jsonl", "format": "prompt_completion"}
    spec = _spec(tmp_path, sources=[src], seq_len=32, pad_to_multiple=16)
    prepare(spec, tmp_path)
    tokens = _array(spec.output, "tokens").tolist()
    mask = _array(spec.output, "loss_mask").tolist()
    starts = _array(spec.output, "doc_starts").tolist()
    assert starts == [0, 16]  # both documents padded to 16 tokens
    for start, (p, c) in zip(starts, pairs, strict=True):
        doc, doc_mask = tokens[start : start + 16], mask[start : start + 16]
        n = len(p) + len(c)
        assert doc[:n] == TOK.encode(p + c)
        assert doc[n:] == [TOK.eos_id] * (16 - n)
        assert doc_mask == [0] * len(p) + [1] * (16 - len(p))
