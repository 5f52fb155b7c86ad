"""Reliability hardening, the fuzz test of `convert` inputs and of the flags of generate, eval, convert and init,
generated from a fixed seed (test_fuzz.py does the same for configs and data files).

Hostile Hugging Face folders: config.json with keys missing, values of the wrong type, out of range, huge,
NaN, odd dtypes or not JSON at all; weights truncated, re-shaped, missing, extra, NaN, integer, or files that
are links to devices, loops or folders. Flags: values of the wrong type, out of range, huge, NaN, empty, and
paths that do not exist, are files where folders are wanted (or the reverse), or cannot be written.

Every case ends the way a user mistake ends: exit code 2, exactly one line on stderr starting
`dllm: error:`, no traceback, the files it was given unchanged (hashed before and after) and nothing
new written. Each mutation is chosen so that the result is certainly invalid. The CLI runs in-process.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dllm.cli.main import main as dllm
from dllm.config.model import ModelConfig
from dllm.models.hf_io import export_hf
from dllm.models.transformer import Transformer
from tests.helpers import write_corpus, write_yaml

SEED = 29
WEIGHTS = "model.safetensors"
MAX_LENGTH = 64

# -- the world every case starts from ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hf/ (a tiny Llama folder), model/ (its `dllm convert`), data/prepared, a prompts file, a sampler file,
    a plain file and an empty folder: every path a flag may name."""
    root = tmp_path_factory.mktemp("fuzz_cli")
    cfg = ModelConfig(family="llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                      vocab_size=272, max_seq_len=MAX_LENGTH)  # fmt: skip
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    export_hf(model.state_dict(), cfg, root / "hf")
    assert dllm(["convert", "--from-hf", str(root / "hf"), "--to", str(root / "model")]) == 0
    write_corpus(root / "data" / "train.jsonl", num_records=20)
    write_yaml(root / "prepare.yaml", {"sources": [{"path": "data/train.jsonl"}], "output": "data/prepared",
                                       "seq_len": 32})  # fmt: skip
    assert dllm(["data", "prepare", "--config", str(root / "prepare.yaml"), "-q"]) == 0
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    write_yaml(root / "sampler.yaml", {"gen_length": 4})
    (root / "afile.txt").write_text("a plain file\n")
    (root / "afolder").mkdir()
    return root


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under root with a digest of its bytes (folders and links marked)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[str(p.relative_to(root))] = "dir"
        else:
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _run(args: list[str], root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The case's command: exit 2, one `dllm: error:` line, nothing under root changed or added."""
    before = _snapshot(root)
    capsys.readouterr()
    code = dllm(args)
    err = capsys.readouterr().err
    after = _snapshot(root)
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}: {err[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("dllm: error: "), err[-2000:]
    assert "Traceback" not in err
    assert after == before, f"changed: {sorted(set(after.items()) ^ set(before.items()))[:5]}"


# -- hostile Hugging Face folders ----------------------------------------------------------------------------------
Mutation = Callable[[Path], None]

REQUIRED_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                 "model_type", "num_key_value_heads"]  # fmt: skip
INT_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
            "num_key_value_heads", "head_dim", "max_position_embeddings"]  # fmt: skip
FLOAT_KEYS = ["rms_norm_eps", "rope_theta"]


def _edit_config(edit: Callable[[dict[str, Any]], Any]) -> Mutation:
    def mutate(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        new = edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg if new is None else new))

    return mutate


def _set_key(key: str, value: Any) -> Mutation:
    def edit(cfg: dict[str, Any]) -> None:
        cfg[key] = value
        if key == "rope_theta":  # rope_parameters carries it too: both say the same
            cfg.setdefault("rope_parameters", {})["rope_theta"] = value

    return _edit_config(edit)


def _write(name: str, data: bytes) -> Mutation:
    return lambda folder: (folder / name).write_bytes(data)


def _edit_weights(edit: Callable[[dict[str, torch.Tensor], random.Random], None], rng: random.Random) -> Mutation:
    seed = rng.randrange(2**31)  # each case draws its own choices, the same ones every run

    def mutate(folder: Path) -> None:
        state = load_file(str(folder / WEIGHTS))
        edit(state, random.Random(seed))
        save_file(state, str(folder / WEIGHTS))

    return mutate


def _pick(state: dict[str, torch.Tensor], rng: random.Random, ndim: int = 0) -> str:
    return rng.choice(sorted(k for k, v in state.items() if v.ndim >= ndim))


def _nan(state: dict[str, torch.Tensor], rng: random.Random) -> None:
    t = state[_pick(state, rng)]
    t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), float("-inf")])


def _reshape(state: dict[str, torch.Tensor], rng: random.Random) -> None:
    key = _pick(state, rng, ndim=2)
    t = state[key]
    state[key] = rng.choice([t.t().contiguous(), torch.cat([t, t[:1]]), t[:, :-1].contiguous(), t.reshape(-1)])


def _drop(state: dict[str, torch.Tensor], rng: random.Random) -> None:
    state.pop(_pick(state, rng))


def _extra(state: dict[str, torch.Tensor], rng: random.Random) -> None:
    state[rng.choice(["model.layers.5.mlp.up_proj.weight", "lm_head.bias", "model.zz.weight"])] = torch.zeros(4)


def _integer(state: dict[str, torch.Tensor], rng: random.Random) -> None:
    key = _pick(state, rng)
    state[key] = state[key].to(rng.choice([torch.int8, torch.int32, torch.int64, torch.bool, torch.uint8]))


def _truncate(rng: random.Random) -> Mutation:
    fraction = rng.random()

    def mutate(folder: Path) -> None:
        data = (folder / WEIGHTS).read_bytes()
        (folder / WEIGHTS).write_bytes(data[: int(len(data) * fraction * 0.99)])

    return mutate


def _header(rng: random.Random) -> Mutation:
    size = rng.choice([2**63 - 1, 2**40, 10, 0])
    junk = rng.choice([b"{}", b"\xff" * 16, b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 99999]}}'])
    return _write(WEIGHTS, size.to_bytes(8, "little") + junk)


def _link(name: str, target: str) -> Mutation:
    def mutate(folder: Path) -> None:
        (folder / name).unlink(missing_ok=True)
        os.symlink(target if target.startswith("/") else folder / target, folder / name)

    return mutate


def _replace_with_folder(name: str) -> Mutation:
    def mutate(folder: Path) -> None:
        (folder / name).unlink()
        (folder / name).mkdir()

    return mutate


def _index(weight_map: Any, keep_weights: bool = False) -> Mutation:
    def mutate(folder: Path) -> None:
        if not keep_weights:
            (folder / WEIGHTS).rename(folder / "model-00001.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return mutate


def _bad_int(rng: random.Random) -> Any:
    return rng.choice(["big", [1], {"a": 1}, True, False, -rng.randint(1, 10**6), 0, 2.5, 2**40, 10**30, float("nan")])


def _bad_float(rng: random.Random) -> Any:
    return rng.choice(["x", [1.0], {"a": 1}, True, -rng.random(), 0.0, float("nan"), float("inf"), float("-inf")])


def _config_mutation(rng: random.Random) -> tuple[str, Mutation]:
    op = rng.choice(["drop", "int", "int", "float", "dtype", "model_type", "heads", "act", "top", "raw", "raw"])
    if op == "drop":
        key = rng.choice(REQUIRED_KEYS)
        return f"drop-{key}", _edit_config(lambda c: c.pop(key))
    if op == "int":
        key = rng.choice(INT_KEYS)
        return f"int-{key}", _set_key(key, _bad_int(rng))
    if op == "float":
        key = rng.choice(FLOAT_KEYS)
        return f"float-{key}", _set_key(key, _bad_float(rng))
    if op == "dtype":
        key = rng.choice(["torch_dtype", "dtype"])
        value = rng.choice(["float128", "int8", "", 5, ["float32"], "bfloat17", "__class__", "Tensor"])
        return f"dtype-{value}", _set_key(key, value)
    if op == "model_type":
        value = rng.choice(["gpt5", "", 7, None, ["llama"]])
        return "model_type", _edit_config(lambda c: c.update(model_type=value, architectures=[str(value)]))
    if op == "heads":
        return "heads", _set_key("num_key_value_heads", rng.choice([3, 5, 64]))
    if op == "act":
        return "act", _set_key("hidden_act", rng.choice(["relu", "", 7, None, "swish2"]))
    if op == "top":
        return "top", _edit_config(lambda c: rng.choice([[c], "text", 5, None, [1, 2]]))
    raw = rng.choice([b"", b"{", b'{"model_type": "llama"', b"\xff\xfe{}", b"[" * 5000 + b"]" * 5000,
                      b'{"vocab_size": ' + b"9" * 5000 + b"}", b"NaN", b"\x00" * 10])  # fmt: skip
    return "raw", _write("config.json", raw)


def _weights_mutation(rng: random.Random) -> tuple[str, Mutation]:
    op = rng.choice(["nan", "nan", "reshape", "reshape", "drop", "extra", "integer", "truncate", "header", "empty"])
    if op == "truncate":
        return op, _truncate(rng)
    if op == "header":
        return op, _header(rng)
    if op == "empty":
        return op, _write(WEIGHTS, b"")
    edit = {"nan": _nan, "reshape": _reshape, "drop": _drop, "extra": _extra, "integer": _integer}[op]
    return op, _edit_weights(edit, rng)


FILE_MUTATIONS: list[tuple[str, Mutation]] = [
    ("weights-to-dev-zero", _link(WEIGHTS, "/dev/zero")),
    ("weights-to-dev-null", _link(WEIGHTS, "/dev/null")),
    ("config-to-dev-urandom", _link("config.json", "/dev/urandom")),
    ("config-dangling", _link("config.json", "/nonexistent/config.json")),
    ("config-loop", _link("config.json", "config.json")),
    ("config-to-folder", _link("config.json", "/tmp")),
    ("weights-folder", _replace_with_folder(WEIGHTS)),
    ("config-folder", _replace_with_folder("config.json")),
    ("no-config", lambda folder: (folder / "config.json").unlink()),
    ("no-weights", lambda folder: (folder / WEIGHTS).unlink()),
    ("index-missing-shard", _index({"a": "model-00002.safetensors"})),
    ("index-escapes", _index({"a": "../hf/model.safetensors"})),
    ("index-absolute", _index({"a": "/etc/passwd"})),
    ("index-not-a-map", _index(["model-00001.safetensors"])),
    ("index-numbers", _index({"a": 5})),
    ("index-to-config", _index({"a": "config.json"})),
    ("index-to-link", lambda folder: (_index({"a": "x.safetensors"})(folder), _link("x.safetensors", "/etc/hostname")(
        folder))),
    ("bin-pickle-junk", lambda folder: ((folder / WEIGHTS).unlink(), (folder / "pytorch_model.bin").write_bytes(
        b"\x80\x04junk"))),
    ("tokenizer-junk", _write("tokenizer.json", b"{not json")),
    ("tokenizer-config-junk", _write("tokenizer_config.json", b"[1, 2")),
]  # fmt: skip


@dataclass(frozen=True)
class FolderCase:
    name: str
    mutate: Mutation


def folder_cases(seed: int = SEED) -> list[FolderCase]:
    rng = random.Random(seed)
    cases = [FolderCase(f"file-{name}", m) for name, m in FILE_MUTATIONS]
    for i in range(55):
        name, m = _config_mutation(rng)
        cases.append(FolderCase(f"config-{i}-{name}", m))
    for i in range(40):
        name, m = _weights_mutation(rng)
        cases.append(FolderCase(f"weights-{i}-{name}", m))
    return cases


FOLDER_CASES = folder_cases()


def test_at_least_100_hostile_folders_from_a_fixed_seed():
    assert len(FOLDER_CASES) >= 100
    assert [c.name for c in folder_cases()] == [c.name for c in FOLDER_CASES]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in FOLDER_CASES])
def test_a_hostile_hf_folder_is_one_line_exit_2(world: Path, case: FolderCase, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]):  # fmt: skip
    src = shutil.copytree(world / "hf", tmp_path / "src")
    case.mutate(src)
    _run(["convert", "--from-hf", str(src), "--to", str(tmp_path / "out")], tmp_path, capsys)


# -- hostile flags ---------------------------------------------------------------------------------------------------
BASES: dict[str, list[str]] = {  # a valid command each; a case replaces or adds one flag
    "generate": ["generate", "--model", "{model}", "-p", "hi", "--gen-length", "4"],
    "likelihood": ["eval", "likelihood", "--model", "{model}", "--data", "{data}", "--limit", "2"],
    "tasks": ["eval", "tasks", "--model", "{model}", "--tasks", "copy", "--limit", "2", "--gen-length", "4"],
    "convert": ["convert", "--from-hf", "{hf}", "--to", "{root}/converted"],
    "init": ["init", "{root}/project", "--num-records", "10"],
}
NOT_INT = ["abc", "", "1.5", "nan", "0x10", "1e3", "--", "١٢"]
MISSING = ["{root}/nowhere", "{root}/nowhere/deeper", "{root}/afile.txt/x"]
UNWRITABLE_FILE = ["/proc/x.jsonl", "/proc/self/none/x.jsonl", "{root}/afolder", "{root}/afile.txt/x.jsonl",
                   "{root}/nowhere/x.jsonl"]  # fmt: skip
FLAGS: dict[str, dict[str, list[str]]] = {  # per command: flag -> values it certainly refuses
    "generate": {
        "--gen-length": [*NOT_INT, "0", "-4", str(10**30), "63"],
        "--block-length": [*NOT_INT, "0", "-1", "3", str(2**63)],
        "--steps": [*NOT_INT, "0", "-2", str(2**63 - 1), str(10**30)],
        "--batch-size": [*NOT_INT, "0", "-1"],
        "--seed": [*NOT_INT, "-1", str(2**63), str(2**64), str(10**30)],
        "--temperature": ["nan", "inf", "-inf", "-1", "abc", ""],
        "--policy": ["", "bogus", "../x", "LOW_CONFIDENCE", "low confidence"],
        "--cache": ["", "bogus", "block", "dual2"],
        "--device": ["", "gpu", "cuda:99", "tpu", "cpu "],
        "--model": ["", *MISSING, "{root}/afile.txt", "{root}/afolder", "{data}", "a@b", "org/name@"],
        "--prompts-file": [*MISSING, "{root}/afolder", "{root}/afile.txt", "{root}/sampler.yaml", "/dev/null"],
        "--sampler-config": [*MISSING, "{root}/afolder", "{root}/prompts.jsonl", "{root}/afile.txt"],
        "--set": ["seed=abc", "nope=1", "gen_length=0", "=", "temperature=.nan", "steps=true", "top_p=2"],
        "--output": UNWRITABLE_FILE,
        "--draft-block-size": ["4", "abc"],
        "--draft": [*MISSING, "{root}/afile.txt", "{root}/afolder"],
        "--run": [*MISSING, "{root}/afolder"],
        "--checkpoint": [*MISSING, "{root}/afolder"],
    },
    "likelihood": {
        "--mc-samples": [*NOT_INT, "0", "-3", str(2**63)],
        "--batch-size": [*NOT_INT, "0", "-1"],
        "--limit": [*NOT_INT, "0", "-1"],
        "--seed": [*NOT_INT, "-1", str(2**64)],
        "--kind": ["", "bogus", "block", "MDLM"],
        "--sampling": ["", "bogus", "Plain"],
        "--device": ["", "gpu", "cuda:99"],
        "--data": ["", *MISSING, "{root}/afolder", "{root}/afile.txt", "{model}"],
        "--model": ["", *MISSING, "{root}/afolder", "{data}"],
    },
    "tasks": {
        "--tasks": ["", ",", "bogus", "{root}/nowhere.jsonl", "{root}/afile.txt", "{root}/afolder", "/dev/null"],
        "--limit": [*NOT_INT, "0", "-1", str(10**30)],
        "--batch-size": [*NOT_INT, "0", "-5"],
        "--seed": [*NOT_INT, "-1", str(2**64)],
        "--gen-length": [*NOT_INT, "0", "-1", "1000"],
        "--policy": ["", "bogus"],
        "--cache": ["", "bogus", "block"],
        "--output": UNWRITABLE_FILE,
        "--sampler-config": [*MISSING, "{root}/afolder"],
        "--set": ["seed=-1", "bogus=1", "steps=0", "gen_length=nan"],
        "--device": ["", "gpu"],
    },
    "convert": {
        "--from-hf": ["", *MISSING, "{root}/afile.txt", "{root}/afolder", "{model}", "{data}", "a@b", "/proc"],
        "--to": ["{root}/afile.txt", "{root}/afile.txt/x", "/proc/x", "/proc/self/none/x", "{root}", "{data}"],
        "--to-hf": ["{root}/afile.txt"],
        "--run": [*MISSING],
        "--model": [*MISSING],
    },
    "init": {
        "--num-records": [*NOT_INT, "0", "-1", str(10**30), str(2**63), "1000001"],
        "DIR": ["{root}/afile.txt", "{root}", "/proc/x", "/proc/self/none/x", "{root}/afile.txt/x"],
    },
}


@dataclass(frozen=True)
class FlagCase:
    name: str
    args: tuple[str, ...]


def _with_flag(base: list[str], flag: str, value: str) -> list[str]:
    """`base` with `flag` set to `value` (replacing its value when present; DIR is init's argument)."""
    if flag == "DIR":
        return [base[0], value, *base[2:]]
    if flag in base:
        i = base.index(flag)
        return [*base[:i], flag, value, *base[i + 2 :]]
    return [*base, flag, value]


def flag_cases(seed: int = SEED) -> list[FlagCase]:
    """Every (command, flag, bad value) once, plus random values of the same kinds, in a seeded order."""
    rng = random.Random(seed)
    cases = []
    for command, flags in FLAGS.items():
        for flag, values in flags.items():
            extra = [f"junk{rng.randrange(10**6)}", str(-rng.randint(1, 10**9))]
            extra += ["9" * rng.randint(20, 4000)] if (command, flag) in _HUGE_REFUSED else []
            for value in [*values, *(v for v in extra if rng.random() < 0.5 and flag in _RANDOM_OK)]:
                cases.append(FlagCase(f"{command}-{flag}={value[:24]}", tuple(_with_flag(BASES[command], flag, value))))
    cases += [  # combinations refused together
        FlagCase("generate-no-source", ("generate", "-p", "hi")),
        FlagCase("generate-two-sources", (*BASES["generate"], "--run", "{root}/afolder")),
        FlagCase("generate-no-prompt", ("generate", "--model", "{model}")),
        FlagCase("generate-draft-block-without-draft", (*BASES["generate"], "--draft-block-size", "4")),
        FlagCase("generate-ar-mdlm-kind", (*BASES["generate"], "--ar", "--model", "{model}", "--set", "seed=-2")),
        FlagCase("tasks-no-tasks", ("eval", "tasks", "--model", "{model}")),
        FlagCase("convert-nothing", ("convert",)),
        FlagCase("convert-both", ("convert", "--from-hf", "{hf}", "--to-hf", "{root}/x")),
        FlagCase("convert-no-to", ("convert", "--from-hf", "{hf}")),
        FlagCase("init-no-dir", ("init",)),
        FlagCase("unknown-option", (*BASES["generate"], "--bogus", "1")),
    ]
    rng.shuffle(cases)
    return cases


_RANDOM_OK = {"--gen-length", "--block-length", "--batch-size", "--limit", "--mc-samples", "--num-records", "--policy",
              "--cache", "--kind", "--device", "--sampling"}  # fmt: skip
_HUGE_REFUSED = {("generate", "--gen-length"), ("generate", "--block-length"), ("likelihood", "--mc-samples"),
                 ("tasks", "--limit"), ("tasks", "--gen-length"), ("init", "--num-records")}  # fmt: skip
FLAG_CASES = flag_cases()


def test_at_least_200_flag_cases_from_a_fixed_seed():
    assert len(FLAG_CASES) >= 200
    assert [c.args for c in flag_cases()] == [c.args for c in FLAG_CASES]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in FLAG_CASES])
def test_a_hostile_flag_is_one_line_exit_2(world: Path, case: FlagCase, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    monkeypatch.chdir(world)
    paths = {"root": str(world), "model": str(world / "model"), "hf": str(world / "hf"),
             "data": str(world / "data" / "prepared")}  # fmt: skip
    _run([a.format(**paths) for a in case.args], world, capsys)
