"""Reliability hardening, convert: `dllm convert --from-hf` with a config.json or weights that do not belong together.

Every case ends in one line `dllm: error: ...`, exit code 2, and no output folder; before the checks they
gave tracebacks, tried to allocate terabytes, or wrote a broken model folder.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dllm.cli.main import main as dllm
from dllm.config.model import ModelConfig
from dllm.models.hf_io import export_hf
from dllm.models.transformer import Transformer

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder as transformers writes it (config.json + model.safetensors); byte tokenizer."""
    cfg = ModelConfig(family="llama", preset="tiny", vocab_size=320)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return export_hf(model.state_dict(), cfg, tmp_path_factory.mktemp("hf") / "llama")


def _config(edit: Callable[[dict], object], replace: bool = False) -> Callable[[Path], None]:
    """Edit config.json in place (or, with replace, write what `edit` returns instead)."""

    def mutate(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        new = edit(cfg)
        (folder / "config.json").write_text(json.dumps(new if replace else cfg))

    return mutate


def _weights(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        state = load_file(str(folder / WEIGHTS))
        edit(state)
        save_file(state, str(folder / WEIGHTS))

    return mutate


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(data)


def _truncate(folder: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def _drop_down_proj(state: dict) -> None:
    state.pop("model.layers.1.mlp.down_proj.weight")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(64 * 192)  # as many values, ignored


def _index(shard: str) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        (folder / WEIGHTS).rename(folder / "model-00001.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))

    return mutate


def _write_nan(key: str) -> Callable[[Path], None]:
    """config.json with NaN (Python's json writes and reads it) as rope_theta, at the top or in rope_parameters."""

    def mutate(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        (cfg[key] if key == "rope_parameters" else cfg)["rope_theta"] = float("nan")
        (folder / "config.json").write_text(json.dumps(cfg))

    return mutate


class _Payload:
    """A pickle whose loading would create a file (it must never run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle(folder: Path) -> None:
    (folder / WEIGHTS).unlink()
    torch.save({"w": _Payload(folder / "PWNED")}, folder / "pytorch_model.bin")


def _raw_pickle(folder: Path) -> None:
    """A plain pickle (protocol 4, not torch's 2): torch's unpickler warned about it before refusing it."""
    (folder / WEIGHTS).unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _Payload(folder / "PWNED")}, protocol=4))


HOSTILE = [
    ("list", _config(lambda c: [c], replace=True), "config.json: expected a JSON object of model settings, not a list"),
    ("missing key", _config(lambda c: c.pop("hidden_size")), "config.json: missing key 'hidden_size'"),
    ("negative", _config(lambda c: c.update(num_hidden_layers=-2)), "config.json: num_layers: Input should be greater"),
    ("string size", _config(lambda c: c.update(hidden_size="big")), "config.json: hidden_size: Input should be"),
    ("activation", _config(lambda c: c.update(hidden_act="relu")), "config.json: unsupported value 'relu'"),
    ("rope list", _config(lambda c: c.update(rope_parameters=[1])), "config.json: a value of the wrong type"),
    ("not utf-8", _write("config.json", b'{"model_type": "llama\xe9"}'), "config.json: unreadable"),
    ("huge int", _write("config.json", b'{"vocab_size": ' + b"9" * 5000 + b"}"), "config.json: unreadable"),
    ("absurd vocab", _config(lambda c: c.update(vocab_size=2**36)), "describes 4,398,046,"),
    ("absurd layers", _config(lambda c: c.update(num_hidden_layers=10**9)), "the config and the weights do not"),
    ("wider mlp", _config(lambda c: c.update(intermediate_size=256)), "the config and the weights do not"),
    ("transposed", _weights(lambda s: s.update({"model.layers.1.mlp.up_proj.weight": s[
        "model.layers.1.mlp.up_proj.weight"].t().contiguous()})),
     "model.layers.1.mlp.up_proj.weight has shape [64, 192] but config.json implies [192, 64]"),
    ("missing tensor", _weights(_drop_down_proj), "no weight model.layers.1.mlp.down_proj.weight"),
    ("bad header", _write(WEIGHTS, b"\xff" * 8 + b"{}"), "model.safetensors: not a valid safetensors file"),
    ("truncated", _truncate, "model.safetensors: not a valid safetensors file"),
    ("index escapes", _index("../../etc/passwd"), "shard '../../etc/passwd' is not a file in"),
    ("index junk", _write("model.safetensors.index.json", b"[1]"), None),
    ("pickle", _pickle, "pytorch_model.bin: refused: not a plain tensor file (Trying to load unsupported GLOBAL"),
    ("rope nan", _write_nan("rope_theta"), "config.json: rope_theta: nan is not a finite number"),
    ("rope params nan", _write_nan("rope_parameters"), "config.json: rope_parameters.rope_theta: nan is not a finite"),
    ("float128", _config(lambda c: c.update(torch_dtype="float128")),
     "config.json: torch_dtype: 'float128' is not a floating-point dtype of torch"),
    ("int dtype", _config(lambda c: c.update(dtype="int64")), "config.json: dtype: 'int64' is not a floating-point"),
    ("dtype list", _config(lambda c: c.update(torch_dtype=["float32"])), "config.json: torch_dtype: ['float32']"),
    ("all nan", _weights(lambda s: s.update({k: torch.full_like(v, float("nan")) for k, v in s.items()})),
     "weight model.embed_tokens.weight holds 20,480 NaN or infinite value(s) of 20,480"),
    ("one inf", _weights(lambda s: s["model.layers.1.mlp.up_proj.weight"].view(-1)[7:8].fill_(float("inf"))),
     "weight model.layers.1.mlp.up_proj.weight holds 1 NaN or infinite value(s) of 12,288; the checkpoint is corrupt"),
    ("rope bool", _config(lambda c: c.update(rope_theta=True, rope_parameters={"rope_theta": True})),
     "config.json: rope_theta: true/false is not a number"),
    ("bin junk", lambda f: ((f / WEIGHTS).unlink(), (f / "pytorch_model.bin").write_bytes(b"\x80\x04junk")),
     "pytorch_model.bin: refused: not a plain tensor file"),
    ("int weights", _weights(lambda s: s.update({"model.norm.weight": s["model.norm.weight"].to(torch.int32)})),
     "weight model.norm.weight is int32, not floating point (a quantized checkpoint?)"),
    ("raw pickle", _raw_pickle, "pytorch_model.bin: refused: not a plain tensor file"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "expected"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_folder_is_one_line_and_writes_nothing(good: Path, tmp_path: Path, mutate, expected: str | None,
                                                       capsys: pytest.CaptureFixture[str]):  # fmt: skip
    src = shutil.copytree(good, tmp_path / "src")
    if expected is None:  # an index next to no model.safetensors
        (src / WEIGHTS).unlink()
        expected = "model.safetensors.index.json: expected a JSON object with a weight_map"
    mutate(src)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as printed:
        warnings.simplefilter("always")
        code = dllm(["convert", "--from-hf", str(src), "--to", str(tmp_path / "out")])
    assert not printed, [str(w.message) for w in printed]  # nothing but the one line: no warning before it
    lines = capsys.readouterr().err.strip().splitlines()
    assert time.perf_counter() - t0 < 10
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("dllm: error: ") and expected in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    assert not (src / "PWNED").exists()


def test_a_model_beyond_memory_is_refused_before_loading(good: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    monkeypatch.setattr("dllm.models.sizing.host_memory_bytes", lambda: 100_000)
    assert dllm(["convert", "--from-hf", str(good), "--to", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("legacy", [False, True])
def test_good_folders_still_convert(good: Path, tmp_path: Path, legacy: bool):
    assert dllm(["convert", "--from-hf", str(good), "--to", str(tmp_path / "out")]) == 0
    src = shutil.copytree(good, tmp_path / "bin")  # a plain pytorch_model.bin (zip or legacy format) loads
    torch.save(load_file(str(src / WEIGHTS)), src / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    (src / WEIGHTS).unlink()
    assert dllm(["convert", "--from-hf", str(src), "--to", str(tmp_path / "out2")]) == 0
    a, b = load_file(str(tmp_path / "out" / WEIGHTS)), load_file(str(tmp_path / "out2" / WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


MODEL_YAML_EDITS = [
    ("negative", lambda t: t.replace("hidden_size: 64", "hidden_size: -1"), "model.yaml: model: hidden_size:"),
    ("list", lambda t: "model: [1]\n", "model.yaml: model must be a mapping"),
    ("tokenizer list", lambda t: t + "tokenizer: [1]\n", "duplicate key 'tokenizer'"),
    ("bigger", lambda t: t.replace("hidden_size: 64", "hidden_size: 256"), "describes 476,416 parameters"),
    ("fewer layers", lambda t: t.replace("num_layers: 2", "num_layers: 1"), "input_layernorm.weight has no place"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "expected"), [e[1:] for e in MODEL_YAML_EDITS], ids=[e[0] for e in MODEL_YAML_EDITS])
def test_a_model_folder_whose_model_yaml_lies_is_one_line(good: Path, tmp_path: Path, edit, expected: str,
                                                           capsys: pytest.CaptureFixture[str]):  # fmt: skip
    """A `dllm convert` folder (model.yaml + native safetensors) edited by hand, then sampled from."""
    assert dllm(["convert", "--from-hf", str(good), "--to", str(tmp_path / "m")]) == 0
    yaml_file = tmp_path / "m" / "model.yaml"
    yaml_file.write_text(edit(yaml_file.read_text()))
    capsys.readouterr()
    code = dllm(["generate", "--model", str(tmp_path / "m"), "-p", "x", "--gen-length", "4"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("dllm: error: ") and expected in lines[0], lines[0]


def test_a_model_folder_with_nan_weights_is_one_line(good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A `dllm convert` folder whose weights were damaged afterwards (sampled directly, or used as init_from)."""
    assert dllm(["convert", "--from-hf", str(good), "--to", str(tmp_path / "m")]) == 0
    _weights(lambda s: s["norm.weight"].fill_(float("nan")))(tmp_path / "m")
    capsys.readouterr()
    assert dllm(["generate", "--model", str(tmp_path / "m"), "-p", "x", "--gen-length", "4"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors: weight norm.weight holds 64 NaN" in lines[0], lines


@pytest.mark.parametrize(("target", "expected"), [("afile", "--to: {t} is a file; give a folder"),
                                                  ("afile/sub", "--to: {root}/afile is a file, not a folder"),
                                                  ("/proc/x", "--to: /proc/x is in /proc")])  # fmt: skip
def test_an_import_target_that_cannot_be_written_is_refused_before_loading(
    good: Path, tmp_path: Path, target: str, expected: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
):  # fmt: skip
    (tmp_path / "afile").write_text("mine")
    monkeypatch.setattr("dllm.models.hf_io.load_hf_state_dict", lambda folder: pytest.fail("weights were loaded"))
    out = target if target.startswith("/") else str(tmp_path / target)
    capsys.readouterr()
    assert dllm(["convert", "--from-hf", str(good), "--to", out]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected.format(t=out, root=tmp_path) in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "mine"


def test_a_full_disk_while_importing_is_one_line_and_leaves_no_folder(good: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    import errno

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("dllm.config.profile.write_profile", full)  # the last file: the weights are written by then
    capsys.readouterr()
    assert dllm(["convert", "--from-hf", str(good), "--to", str(tmp_path / "out")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dllm: error:")]
    assert len(lines) == 1 and f"{tmp_path / 'out'}: no space left on the disk" in lines[0], lines
    assert not (tmp_path / "out").exists()


# -- folders with a tokenizer: what transformers checks as it loads it ----------------------------------------------
SANDBOX_ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"


@pytest.fixture(scope="module")
def with_tokenizer(good: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama folder with a byte-level BPE tokenizer and a plain chat template."""
    from tests.helpers import save_bpe

    folder = shutil.copytree(good, tmp_path_factory.mktemp("hf_tok") / "llama")
    return save_bpe(folder, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


TOKENIZER_CASES = [
    ("string number", _config(lambda c: c.update(hidden_size="64")),
     "config.json: Field 'hidden_size' expected int, got str (value: '64')"),
    ("sandbox escape", _write("chat_template.jinja", SANDBOX_ESCAPE.encode()),
     "chat_template.jinja: the chat template is refused by the sandbox (access to attribute '__class__'"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "expected"), [c[1:] for c in TOKENIZER_CASES], ids=[c[0] for c in TOKENIZER_CASES])
def test_a_tokenizer_transformers_refuses_is_one_line(with_tokenizer: Path, tmp_path: Path, mutate, expected: str,
                                                      capsys: pytest.CaptureFixture[str]):  # fmt: skip
    src = shutil.copytree(with_tokenizer, tmp_path / "src")
    mutate(src)
    capsys.readouterr()
    assert dllm(["convert", "--from-hf", str(src), "--to", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllm: error: ") and expected in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert dllm(["generate", "--model", str(src), "--chat", "-p", "x", "--gen-length", "4"]) == 2  # sampled as it is
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines


def test_a_model_folder_whose_template_the_sandbox_refuses_is_one_line(
    with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):  # fmt: skip
    """A `dllm convert` folder whose chat template was replaced after the import, then chatted with."""
    assert dllm(["convert", "--from-hf", str(with_tokenizer), "--to", str(tmp_path / "m")]) == 0
    (tmp_path / "m" / "chat_template.jinja").write_text(SANDBOX_ESCAPE)
    capsys.readouterr()
    assert dllm(["generate", "--model", str(tmp_path / "m"), "--chat", "-p", "x", "--gen-length", "4"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{tmp_path / 'm' / 'chat_template.jinja'}: the chat template is refused" in lines[0]
