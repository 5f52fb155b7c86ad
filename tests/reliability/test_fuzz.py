"""Reliability hardening, the fuzz test: malformed train.yaml, prepare.yaml and data files, generated from a fixed seed.

Every case must end the way a user mistake ends: exit code 2, exactly one line on stderr starting
`dllm: error:`, no traceback, and nothing new (or changed) in the project folder. Each mutation is chosen
so that the result is certainly invalid (an unknown key, a value of a type no field accepts, a number
outside its field's range, a required section cut off, bytes that are not UTF-8, ...), so a case that
passes validation is as much a failure as one that crashes. The CLI runs in-process (`dllm.cli.main.main`)
through `dllm config validate` and `dllm data prepare`, which fail before any training.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from dllm.cli.main import main as dllm
from tests.helpers import tiny_train_values, write_corpus

SEED = 23


@dataclass(frozen=True)
class Case:
    """One malformed input: the file to write (relative to the project) and the command to run."""

    name: str
    file: str
    content: bytes
    args: tuple[str, ...]
    extra: dict[str, bytes] = field(default_factory=dict)
    """Other files the case needs (a data file next to its prepare.yaml)."""


def _yaml(data: Any) -> bytes:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).encode("utf-8")


def _set(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A deep copy of `data` with `dotted` set to `value` (missing sections are created)."""
    out = json.loads(json.dumps(data))
    node = out
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {}) if isinstance(node, dict) else node[int(part)]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


# -- value mutations: each yields a value the field certainly refuses ------------------------------------
TRAIN_INTS = [  # fields that take a positive integer
    "training.steps", "training.global_batch_size", "training.micro_batch_size", "data.seq_len",
    "checkpointing.every_steps", "checkpointing.keep_last_n", "logging.every_steps", "topology.nproc_per_node",
    "topology.nnodes", "model.hidden_size", "model.num_layers", "model.num_heads", "model.max_seq_len",
    "model.vocab_size", "objective.block_size",
]  # fmt: skip
TRAIN_FLOATS = ["optimizer.lr", "optimizer.eps", "training.grad_clip", "model.rope_theta", "model.norm_eps",
                "model.init_std"]  # fmt: skip
TRAIN_LITERALS = ["training.device", "training.autocast_dtype", "optimizer.name", "scheduler.name",
                  "checkpointing.resume", "topology.data_parallel", "topology.backend", "model.family", "model.norm",
                  "model.position", "tokenizer.kind", "objective.name", "logging.progress", "model.mlp"]  # fmt: skip
TRAIN_BOOLS = ["data.shuffle", "training.compile", "model.tie_embeddings", "checkpointing.save_final"]
TRAIN_RANGES: dict[str, list[Any]] = {
    "scheduler.min_lr_ratio": [1.5, -0.1], "optimizer.betas": [[1.2, 0.9], [0.9, 1.0], [-1, 0.5], [0.9]],
    "optimizer.weight_decay": [-0.1], "scheduler.warmup_steps": [-1], "topology.dp_size": [3, 0],
    "run.name": ["a b", "../up", ""], "objective.eps": [-1.0, 2.0],
}  # fmt: skip
TRAIN_CROSS: list[dict[str, Any]] = [  # each field valid alone, the combination refused
    {"training.global_batch_size": 7}, {"data.seq_len": 48}, {"model.hidden_size": 63}, {"model.num_kv_heads": 3},
    {"model.max_seq_len": 16}, {"model.vocab_size": 100}, {"tokenizer.kind": "hf"}, {"model.preset": "huge"},
    {"objective.name": "bd3lm", "objective.block_size": 5}, {"model.hidden_size": 2**20},
    {"logging.tensorboard": "sometimes"}, {"tokenizer.path": "data"}, {"data.path": "data/nowhere"},
    {"data.path": "${DATA}/prepared"}, {"run.output_dir": "$HOME/runs"}, {"model.init_from": "data"},
    {"lora.rank": 4, "lora.targets": ["nothing_here"]}, {"model.num_experts": 2, "model.num_experts_per_tok": 4},
]  # fmt: skip

PREPARE_INTS = ["seq_len", "max_length", "pad_to_multiple"]
PREPARE_LITERALS = ["layout", "overflow", "on_bad_record", "tokenizer.kind", "sources.0.kind", "sources.0.format",
                    "sources.0.supervision"]  # fmt: skip
PREPARE_BOOLS = ["append_eos", "add_bos"]
PREPARE_CROSS: list[dict[str, Any]] = [
    {"sources": []}, {"sources": "data/train.jsonl"}, {"sources": ["data/train.jsonl"]},
    {"sources.0.path": "data/nope.jsonl"}, {"sources.0.path": "data/*.none"}, {"sources.0.path": 5},
    {"sources.0.supervision": "completion_only"}, {"tokenizer.kind": "hf"}, {"tokenizer.path": "data"},
    {"layout": "indexed", "overflow": "split"}, {"layout": "indexed", "max_length": 64},
    {"pad_to_multiple": 5, "layout": "indexed"}, {"sources.0.path": "${HOME}/x.jsonl"}, {"output": "$OUT"},
    {"sources.0.format": "messages"}, {"sources.0.format": "tokens"}, {"sources.0.kind": "npy"},
    {"seq_len": 1}, {"sources.0.labels_field": "a", "sources.0.loss_mask_field": "b", "sources.0.format": "tokens"},
    {"sources.0.kind": "parquet"}, {"sources.0.kind": "text", "sources.0.format": "messages"},
]  # fmt: skip


def _bad_value(rng: random.Random, kind: str) -> Any:
    """A value no field of `kind` (int, float, literal, bool) accepts."""
    shapes: list[Callable[[], Any]] = [
        lambda: {"x": [rng.randint(0, 9)]},
        lambda: [rng.random(), "a"],
        lambda: f"junk{rng.randint(0, 999)}",
    ]
    if kind == "int":
        shapes += [lambda: -rng.randint(0, 10**6), lambda: 10 ** rng.choice([19, 25, 300, 5000]), lambda: 2.5]
    if kind == "float":
        shapes += [lambda: -rng.random(), lambda: float("inf"), lambda: float("nan"), lambda: 0.0]
    if kind == "bool":
        shapes = [lambda: f"maybe{rng.randint(0, 9)}", lambda: [True], lambda: {"on": 1}, lambda: 7]
    return rng.choice(shapes)()


def _field_mutations(rng: random.Random, base: dict, fields: dict[str, list[str]], ranges: dict[str, list[Any]],
                     cross: list[dict[str, Any]], n: int) -> list[tuple[str, dict | list | str]]:  # fmt: skip
    """n (name, data) pairs: bad values of typed fields, out-of-range values, unknown keys, sections of the
    wrong type, and valid-alone combinations that must be refused together."""
    out: list[tuple[str, Any]] = []
    sections = [k for k, v in base.items() if isinstance(v, dict)] + [
        f"{k}.0" for k, v in base.items() if isinstance(v, list)
    ]
    sections += ["tokenizer"] if "tokenizer" not in sections else []
    for i in range(n):
        op = rng.choice(["value", "value", "range", "unknown", "section", "cross", "cross", "missing"])
        if op == "value":
            kind = rng.choice(list(fields))
            name = rng.choice(fields[kind])
            out.append((f"{op}-{name}", _set(base, name, _bad_value(rng, kind))))
        elif op == "range":
            name = rng.choice(list(ranges))
            out.append((f"{op}-{name}", _set(base, name, rng.choice(ranges[name]))))
        elif op == "unknown":
            where = rng.choice([*sections, ""])
            key = f"zz_{rng.randint(0, 10**6)}"
            out.append((f"{op}-{where or 'top'}", _set(base, f"{where}.{key}" if where else key, rng.randint(0, 9))))
        elif op == "section":
            where = rng.choice(sections)
            out.append((f"{op}-{where}", _set(base, where, rng.choice([[1, 2], "text", 3, True]))))
        elif op == "missing":
            out.append(("top-level-" + str(i), rng.choice([[base], "just a string", 42, [1, {"a": 2}]])))
        else:
            data = base
            combo = rng.choice(cross)
            for k, v in combo.items():
                data = _set(data, k, v)
            out.append((f"{op}-{'+'.join(combo)}", data))
    return out


# -- text mutations of a whole YAML file ----------------------------------------------------------------
def _alias_bomb(rng: random.Random) -> bytes:
    width, depth = rng.randint(6, 12), rng.randint(7, 10)
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{d}: &l{d} [{', '.join([f'*l{d - 1}'] * width)}]" for d in range(1, depth)]
    return ("\n".join(lines) + "\n").encode()


def _text_mutations(rng: random.Random, text: bytes, required: bytes, n: int) -> list[tuple[str, bytes]]:
    """n (name, bytes) variants of a valid YAML file that certainly do not validate."""
    out: list[tuple[str, bytes]] = []
    cut_before = text.index(required)  # a cut before this key loses a required section
    lines = text.splitlines(keepends=True)
    for _ in range(n):
        op = rng.choice(["truncate", "bad-utf8", "junk", "duplicate", "bomb", "nesting", "nul", "tabs", "flow"])
        if op == "truncate":
            out.append((op, text[: rng.randint(0, cut_before - 1)]))
        elif op == "bad-utf8":
            pos = rng.randint(0, len(text))
            out.append((op, text[:pos] + rng.choice([b"\xff", b"\xc3\x28", b"\xe9", b"\xed\xa0\x80"]) + text[pos:]))
        elif op == "junk":
            out.append((op, bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))) + b"\xff"))
        elif op == "duplicate":
            i = rng.choice([j for j, line in enumerate(lines) if line[:1].isalpha()])
            out.append((op, b"".join(lines) + lines[i] + b"  zz: 1\n"))
        elif op == "bomb":
            out.append((op, text + _alias_bomb(rng)))
        elif op == "nesting":
            d = rng.choice([65, 200, 1000, 20000])
            nested = rng.choice([b"[" * d + b"]" * d, b"{a: " * d + b"1" + b"}" * d])
            out.append((op, text + b"zz_nested: " + nested + b"\n"))
        elif op == "nul":
            pos = rng.randint(0, len(text))
            out.append((op, text[:pos] + b"\x00" + text[pos:]))
        elif op == "tabs":  # YAML forbids tabs in indentation
            i = rng.randint(1, len(lines) - 1)
            out.append((op, b"".join(lines[:i]) + b"\t" + b"".join(lines[i:])))
        else:
            out.append((op, text + rng.choice([b"zz: [1, 2\n", b"zz: {a: 1\n", b'zz: "open\n', b"zz: &\n", b"- x\n"])))
    return out


# -- data-file mutations --------------------------------------------------------------------------------
HUGE_INT = b'{"n": ' + b"9" * 5000 + b"}"
DEEP_JSON = b'{"a": ' + b"[" * 3000 + b"]" * 3000 + b"}"
BOOL_IDS = b'{"input_ids": [true, false, true]}'


def _json_line(rng: random.Random, fmt: str) -> bytes:
    """One JSONL line that no record of `fmt` accepts."""
    common = [b"[1, 2]", b"42", b'"a string"', b"null", b'{"text": "unterminated', b"{}", b"\xff\xfe{}",
              b'{"text": "caf\xe9"}', HUGE_INT, DEEP_JSON,
              bytes(rng.randrange(1, 256) for _ in range(50)) + b"\xff"]  # fmt: skip
    per_format = {
        "text": [b'{"text": 5}', b'{"text": ["a"]}', b'{"text": {"a": 1}}', b'{"text": null}', b'{"txt": "x"}'],
        "prompt_completion": [b'{"prompt": 1, "completion": "x"}', b'{"prompt": "x"}', b'{"completion": "x"}',
                              b'{"prompt": "x", "completion": [1]}', b'{"prompt": [{"role": 1}], "completion": "x"}'],
        "messages": [b'{"messages": "hi"}', b'{"messages": [1, 2]}', b'{"messages": [{"role": "user"}]}',
                     b'{"messages": [{"content": "x"}]}', b'{"messages": [{"role": "user", "content": 5}]}',
                     b'{"messages": {"role": "user"}}'],
        "tokens": [b'{"input_ids": "1 2 3"}', b'{"input_ids": [1, -4]}', b'{"input_ids": [1, 99999]}',
                   b'{"input_ids": [1.5, 2]}', b'{"input_ids": [[1, 2]]}', b'{"input_ids": null}',
                   b'{"input_ids": ["a"]}', b'{"ids": [1]}', BOOL_IDS],
    }  # fmt: skip
    return rng.choice(common + per_format[fmt] * 2)


def _valid_line(fmt: str, i: int) -> bytes:
    record = {
        "text": {"text": f"the cat sees {i} maps"},
        "prompt_completion": {"prompt": f"{i} + 1 =", "completion": f" {i + 1}"},
        "messages": {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "ok"}]},
        "tokens": {"input_ids": [65 + i % 20, 66, 67, 68]},
    }[fmt]
    return json.dumps(record).encode()


def _data_cases(rng: random.Random, n: int) -> list[Case]:
    """Malformed JSONL records of each format, and text files, each behind a valid prepare.yaml."""
    cases = []
    for i in range(n):
        if rng.random() < 0.15:  # a plain text source
            fname = f"data/fuzz{i}.txt"
            content = rng.choice([b"caf\xe9 au lait\n", b"\xff\xfe\x00t\x00", bytes(range(256)), b"ok\n\xc3\x28\n"])
            prep = {"sources": [{"kind": "text", "path": fname}], "output": f"data/out{i}", "seq_len": 16}
            cases.append(Case(f"data-{i}-text", "fuzz_prepare.yaml", _yaml(prep), PREPARE, {fname: content}))
            continue
        fmt = rng.choice(["text", "prompt_completion", "messages", "tokens"])
        lines = [_valid_line(fmt, j) for j in range(rng.randint(3, 12))]
        op = rng.choice(["line", "line", "line", "empty", "blank"])
        if op == "line":
            lines.insert(rng.randint(0, len(lines)), _json_line(rng, fmt))
        elif op == "empty":
            lines = []
        else:
            lines = [b"", b"   ", b"\t"]
        fname = f"data/fuzz{i}.jsonl"
        prep = {"sources": [{"path": fname, "format": fmt}], "output": f"data/out{i}", "seq_len": 16}
        content = b"\n".join(lines) + (b"\n" if lines else b"")
        cases.append(Case(f"data-{i}-{fmt}-{op}", "fuzz_prepare.yaml", _yaml(prep), PREPARE, {fname: content}))
    return cases


# -- the cases ------------------------------------------------------------------------------------------
PREPARE_BASE = {"sources": [{"path": "data/train.jsonl"}], "output": "data/fuzz_out", "seq_len": 32}
VALIDATE = ("config", "validate", "--config", "fuzz_train.yaml")
PREPARE = ("data", "prepare", "--config", "fuzz_prepare.yaml", "-q")
BAD_SETS = [["training.steps"], ["=5"], ["training..steps=1"], ["training.steps.x=1"], ["training.stepz=1"],
            ["training.steps=" + "9" * 5000], ["optimizer.lr=.inf"], ["model=[1]"], ["data.seq_len=0"],
            ["training.steps=&a [*a]"]]  # fmt: skip


def generate_cases(seed: int = SEED) -> list[Case]:
    rng = random.Random(seed)
    train = tiny_train_values()
    train_fields = {"int": TRAIN_INTS, "float": TRAIN_FLOATS, "literal": TRAIN_LITERALS, "bool": TRAIN_BOOLS}
    prep_fields = {"int": PREPARE_INTS, "literal": PREPARE_LITERALS, "bool": PREPARE_BOOLS}
    cases = [
        Case(f"train-{i}-{name}", "fuzz_train.yaml", _yaml(data), VALIDATE)
        for i, (name, data) in enumerate(_field_mutations(rng, train, train_fields, TRAIN_RANGES, TRAIN_CROSS, 80))
    ]
    cases += [
        Case(f"train-text-{i}-{name}", "fuzz_train.yaml", data, VALIDATE)
        for i, (name, data) in enumerate(_text_mutations(rng, _yaml(train), b"training:", 40))
    ]
    cases += [
        Case(f"train-set-{i}", "fuzz_train.yaml", _yaml(train), (*VALIDATE, "--set", s[0]))
        for i, s in enumerate(BAD_SETS)
    ]
    cases += [
        Case(f"prepare-{i}-{name}", "fuzz_prepare.yaml", _yaml(data), PREPARE)
        for i, (name, data) in enumerate(
            _field_mutations(rng, PREPARE_BASE, prep_fields, {"seq_len": [1, 0]}, PREPARE_CROSS, 50)
        )
    ]
    cases += [
        Case(f"prepare-text-{i}-{name}", "fuzz_prepare.yaml", data, PREPARE)
        for i, (name, data) in enumerate(_text_mutations(rng, _yaml(PREPARE_BASE), b"seq_len:", 25))
    ]
    cases += _data_cases(rng, 70)
    return cases  # fmt: skip


CASES = generate_cases()


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a small corpus and its prepared artifact (train configs are checked against it)."""
    root = tmp_path_factory.mktemp("fuzz")
    write_corpus(root / "data" / "train.jsonl", num_records=60)
    (root / "prepare.yaml").write_bytes(_yaml({**PREPARE_BASE, "output": "data/prepared"}))
    assert dllm(["data", "prepare", "--config", str(root / "prepare.yaml"), "-q"]) == 0
    return root


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under root with a digest of its bytes (folders marked), to detect any leftover."""
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def test_at_least_200_cases_from_a_fixed_seed():
    assert len(CASES) >= 200
    assert [c.content for c in generate_cases()] == [c.content for c in CASES]  # deterministic


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_malformed_input_is_one_line_exit_2(project: Path, case: Case, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    monkeypatch.chdir(project)
    monkeypatch.setenv("HOME", str(project))  # `~` and a stray $HOME must not reach the real home
    written = [project / case.file, *(project / name for name in case.extra)]
    (project / case.file).write_bytes(case.content)
    for name, data in case.extra.items():
        (project / name).write_bytes(data)
    before = _snapshot(project)
    try:
        code = dllm(list(case.args))
        err = capsys.readouterr().err
        after = _snapshot(project)
    finally:
        for path in written:
            path.unlink()
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}: {err[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("dllm: error: "), err[-2000:]
    assert "Traceback" not in err
    assert after == before, f"leftovers: {sorted(set(after.items()) ^ set(before.items()))[:5]}"
