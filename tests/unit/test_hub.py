"""Hugging Face hub ids (`org/name[@revision]`) for `dllm convert --from-hf`, `model.init_from` and
`tokenizer.path`, resolved by huggingface_hub's own snapshot_download against a hub cache built here in
its on-disk layout (models--org--name/{refs/main, snapshots/<sha>/...}) with HF_HUB_OFFLINE=1: the real
library code path, no network."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dllm.cli.main import main as dllm
from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.training.preflight import resolve_run_spec
from tests.helpers import load_spec, save_bpe, tiny_train_values, write_yaml

transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache folder, the model folder it holds): a tiny Llama and its BPE tokenizer as the hub caches them."""
    folder = save_bpe(tmp_path_factory.mktemp("src") / "model")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder))
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return cache, folder


@pytest.fixture
def offline(hub_cache: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at the cache built here, for this process (huggingface_hub
    reads its environment once, at import: its constants are set too) and for child processes."""
    cache, _ = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_convert_from_a_pinned_hub_id_in_a_fresh_offline_process(offline: Path, hub_cache, tmp_path: Path):
    """A child process with only the environment variables: huggingface_hub reads them itself."""
    _, folder = hub_cache
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(offline)}
    code = "import sys; from dllm.cli.main import main; sys.exit(main(sys.argv[1:]))"
    out = tmp_path / "from_hub"
    res = subprocess.run([sys.executable, "-c", code, "convert", "--from-hf", f"{REPO}@{SHA}", "--to", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert dllm(["convert", "--from-hf", str(folder), "--to", str(tmp_path / "from_folder")]) == 0
    want, got = _weights(tmp_path / "from_folder"), _weights(out)
    assert want.keys() == got.keys() and all(torch.equal(v, got[k]) for k, v in want.items())
    assert (out / "tokenizer.json").is_file()


def test_init_from_and_tokenizer_take_hub_ids(offline: Path, hub_cache, tmp_path: Path):
    from dllm.models.factory import initial_state
    from dllm.tokenization import build_tokenizer

    _, folder = hub_cache
    assert ModelConfig(init_from=REPO).init_from == REPO  # kept as an id, resolved when used
    values = tiny_train_values(model={"init_from": REPO}, tokenizer={"kind": "hf", "path": f"{REPO}@{SHA}"})
    values["model"].pop("preset")
    spec, _ = resolve_run_spec(load_spec(write_yaml(tmp_path / "train.yaml", values)), check_data=False)
    assert spec.model.init_from == REPO and spec.tokenizer.path == f"{REPO}@{SHA}"
    assert (spec.model.family, spec.model.hidden_size, spec.model.num_layers) == ("llama", 32, 2)
    tok = build_tokenizer(spec.tokenizer)
    assert tok.path == offline / f"models--{REPO.replace('/', '--')}" / "snapshots" / SHA
    assert tok.vocab_size == len(transformers.AutoTokenizer.from_pretrained(str(folder))) + 1  # + the mask token
    state = initial_state(spec.model, None, seed=0)
    orig = _weights(folder)
    rows = orig["model.embed_tokens.weight"].shape[0]
    torch.testing.assert_close(state["embed_tokens.weight"][:rows], orig["model.embed_tokens.weight"])
    torch.testing.assert_close(state["layers.1.mlp.down_proj.weight"], orig["model.layers.1.mlp.down_proj.weight"])


def test_a_local_folder_wins_over_a_hub_id(offline: Path, hub_cache, tmp_path: Path):
    _, folder = hub_cache
    shutil.copytree(folder, tmp_path / REPO)
    values = tiny_train_values(model={"init_from": REPO})
    values["model"].pop("preset")
    spec = load_spec(write_yaml(tmp_path / "train.yaml", values))
    assert spec.model.init_from == tmp_path / REPO


def test_hub_errors_are_one_line(offline: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code = dllm(["convert", "--from-hf", "tiny-org/not-cached", "--to", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--from-hf: tiny-org/not-cached is no local folder" in err and "HF_HUB_OFFLINE is set" in err
    code = dllm(["convert", "--from-hf", f"{REPO}@{'f' * 40}", "--to", str(tmp_path / "o")])  # uncached revision
    assert code == 2 and "not (completely) in the Hugging Face cache" in capsys.readouterr().err
    code = dllm(["convert", "--from-hf", "tiny-org/tiny llama@main", "--to", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "neither a local folder nor a hub id org/name[@revision]" in err
    values = tiny_train_values(model={"init_from": "tiny-org/x@"})
    with pytest.raises(ConfigError, match=r"model\.init_from: 'tiny-org/x@' is neither a local folder nor a hub id"):
        load_spec(write_yaml(tmp_path / "bad.yaml", values))
    values = tiny_train_values(model={"init_from": "tiny-org/not-cached"})
    values["model"].pop("preset")
    with pytest.raises(ConfigError, match=r"model\.init_from: tiny-org/not-cached is no local folder"):
        resolve_run_spec(load_spec(write_yaml(tmp_path / "train.yaml", values)), check_data=False)


def test_snapshots_never_fetch_pickles_or_code():
    """The allow-list is applied by huggingface_hub's own filter (what snapshot_download downloads)."""
    from huggingface_hub.utils import filter_repo_objects

    from dllm.hub import ALLOW_PATTERNS

    files = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "model.yaml",
             "pytorch_model.bin", "training_args.bin", "model.pt", "modeling_llada.py", "optimizer.pkl"]  # fmt: skip
    kept = set(filter_repo_objects(files, allow_patterns=list(ALLOW_PATTERNS)))
    assert kept == set(files[:9])


# ---- --model (and --draft) of the sampling commands ------------------------------------------------


def _generate_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict]:
    import json

    common = ["generate", "-p", "Hello", "-p", "a b", "--gen-length", "8", "--steps", "8", "--json"]
    assert dllm(common + args) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]  # wall times differ


def test_generate_takes_a_pinned_hub_id(offline: Path, hub_cache, capsys: pytest.CaptureFixture[str]):
    """Offline: the id resolves to the cached snapshot and decodes exactly as the same folder given by path
    (masked diffusion, and --ar decoding with the KV cache)."""
    _, folder = hub_cache
    for extra in ([], ["--ar"]):
        from_folder = _generate_json(["--model", str(folder), *extra], capsys)
        assert len(from_folder) == 2 and all(r["completion"] for r in from_folder)
        assert _generate_json(["--model", f"{REPO}@{SHA}", *extra], capsys) == from_folder
        assert _generate_json(["--model", REPO, *extra], capsys) == from_folder  # refs/main -> the same snapshot


def test_model_hub_id_errors_are_one_line(offline: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A missing id (offline), an uncached revision and a malformed id: one line, exit 2, for every command
    that takes --model (and --draft), before any model is loaded."""
    cases = [
        (["generate", "-p", "x", "--model", "tiny-org/not-cached"], "--model: tiny-org/not-cached is no local folder"),
        (["chat", "--model", f"{REPO}@{'f' * 40}"], f"--model: {REPO}@{'f' * 40} is no local folder"),
        (["eval", "tasks", "--tasks", "addition", "--model", "tiny-org/x@"], "--model: 'tiny-org/x@' is neither"),
        (["eval", "likelihood", "--data", str(tmp_path), "--model", "tiny-org/gone"], "--model: tiny-org/gone is no"),
        (["serve", "--model", "tiny-org/gone", "--port", str(_free_port())], "--model: tiny-org/gone is no local"),
        (["generate", "-p", "x", "--model", REPO, "--draft", "tiny-org/drafter"], "--draft: tiny-org/drafter is no"),
    ]
    for args, message in cases:
        code = dllm(args)
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"dllm: error: {message}") and err.count("\n") == 1, (args, err)
        if "not-cached" in message or "gone" in message:
            assert "HF_HUB_OFFLINE is set" in err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_model_arguments_resolve_ids_and_folders(offline: Path, hub_cache):
    """A folder is itself; an id is its cached snapshot, and it is what `dllm serve` names the model by
    default (not the snapshot's commit folder)."""
    from dllm.cli.common import hub_id, model_folder

    _, folder = hub_cache
    assert hub_id(f"{REPO}@{SHA}") == f"{REPO}@{SHA}" and hub_id(str(folder)) is None and hub_id(None) is None
    assert model_folder(f"{REPO}@{SHA}") == offline / f"models--{REPO.replace('/', '--')}" / "snapshots" / SHA
    assert model_folder(str(folder)) == folder
