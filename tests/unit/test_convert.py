"""`dllm convert`, `model.init_from` and `dllm generate --model` with a Hugging Face checkpoint and
tokenizer built here (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.cli.main import main as dllm
from dllm.errors import ConfigError
from dllm.training.build import build_trainer
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir
from tests.helpers import load_spec, save_bpe, tiny_train_values, write_yaml

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a BPE tokenizer that has EOS but no mask token."""
    folder = save_bpe(tmp_path_factory.mktemp("hf") / "llama")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = dllm(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_convert_generate_and_export(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    conv = tmp_path / "conv"
    code, _, err = _run(["convert", "--from-hf", str(hf_dir), "--to", str(conv)], capsys)
    assert code == 0, err
    assert "weights read" not in err  # a job shorter than the display's 5 s between lines prints none
    assert (conv / "model.yaml").is_file() and (conv / "model.safetensors").is_file()
    assert (conv / "tokenizer.json").is_file()
    for source in (conv, hf_dir):  # a converted folder and the original both sample
        code, out, err = _run(["generate", "--model", str(source), "-p", "the cat", "--gen-length", "8",
                               "--block-length", "8", "--steps", "4", "--json"], capsys)  # fmt: skip
        assert code == 0, err
        assert json.loads(out)["prompt"] == "the cat"
    code, _, err = _run(["convert", "--to-hf", str(tmp_path / "back"), "--model", str(conv)], capsys)
    assert code == 0, err
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    orig = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    x = torch.randint(0, orig.config.vocab_size, (1, 10))
    with torch.no_grad():
        # the exported vocabulary grew by the added mask token; the original rows are unchanged
        torch.testing.assert_close(back(x).logits[..., : orig.config.vocab_size], orig(x).logits, atol=1e-5, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert tok.mask_token_id == orig.config.vocab_size == back.config.vocab_size - 1


def test_init_from_trains_and_exports(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.jsonl").write_text("".join(json.dumps({"text": f"the cat sees {i} maps"}) + "\n"
                                                      for i in range(200)))  # fmt: skip
    tok = {"kind": "hf", "path": str(hf_dir)}
    write_yaml(tmp_path / "prepare.yaml", {"tokenizer": tok, "sources": [{"path": "data/t.jsonl"}],
                                           "output": "data/prepared", "seq_len": 32})  # fmt: skip
    code, _, err = _run(["data", "prepare", "--config", str(tmp_path / "prepare.yaml"), "-q"], capsys)
    assert code == 0, err
    values = tiny_train_values(model={"init_from": str(hf_dir)}, tokenizer=tok, training={"steps": 2})
    values["model"].pop("preset")
    train_yaml = write_yaml(tmp_path / "train.yaml", values)
    spec, warnings = resolve_run_spec(load_spec(train_yaml))
    assert spec.model.family == "llama" and spec.model.hidden_size == 32 and spec.model.num_layers == 2
    assert any("embeddings grow" in w for w in warnings)
    trainer = build_trainer(spec, prepare_run_dir(spec))
    orig = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    x = torch.randint(0, orig.config.vocab_size, (1, 10))
    with torch.no_grad():  # the trainer starts from the checkpoint's weights
        ours = trainer.model(x, torch.arange(10)[None], AttentionMask("causal")).logits()
        torch.testing.assert_close(ours[..., : orig.config.vocab_size], orig(x).logits, atol=1e-5, rtol=0)
    losses = trainer.fit()
    trainer.metrics.close()
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    run_dir = tmp_path / "runs" / "t"
    code, _, err = _run(["convert", "--to-hf", str(tmp_path / "exported"), "--run", str(run_dir)], capsys)
    assert code == 0, err
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).config.num_hidden_layers == 2


def test_init_from_rejects_a_conflicting_architecture(hf_dir: Path, tmp_path: Path):
    values = tiny_train_values(model={"init_from": str(hf_dir), "hidden_size": 64})
    values["model"].pop("preset")
    train_yaml = write_yaml(tmp_path / "train.yaml", values)
    with pytest.raises(ConfigError, match=r"model\.hidden_size: 64 but the checkpoint .* has 32"):
        resolve_run_spec(load_spec(train_yaml), check_data=False)


def test_convert_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    src = tmp_path / "src"
    src.mkdir()
    code, _, err = _run(["convert", "--from-hf", str(src)], capsys)
    assert code == 2 and "--to OUT" in err
    code, _, err = _run(["convert", "--from-hf", str(src), "--to", str(tmp_path / "o")], capsys)
    assert code == 2 and "no config.json" in err
    (src / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    code, _, err = _run(["convert", "--from-hf", str(src), "--to", str(tmp_path / "o")], capsys)
    assert code == 2 and "model_type 'mamba' is not supported" in err


def test_lora_on_a_pretrained_model_exports_a_peft_adapter(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    peft = pytest.importorskip("peft")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.jsonl").write_text("".join(json.dumps({"text": f"a dog finds {i} apples"}) + "\n"
                                                      for i in range(200)))  # fmt: skip
    tok = {"kind": "hf", "path": str(hf_dir)}
    write_yaml(tmp_path / "prepare.yaml", {"tokenizer": tok, "sources": [{"path": "data/t.jsonl"}],
                                           "output": "data/prepared", "seq_len": 32})  # fmt: skip
    assert dllm(["data", "prepare", "--config", str(tmp_path / "prepare.yaml"), "-q"]) == 0
    values = tiny_train_values(model={"init_from": str(hf_dir)}, tokenizer=tok, training={"steps": 3},
                               optimizer={"lr": 0.05})  # fmt: skip
    values["model"].pop("preset")
    values["lora"] = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    write_yaml(tmp_path / "train.yaml", values)
    assert dllm(["launch", "--config", str(tmp_path / "train.yaml")]) == 0
    run_dir = tmp_path / "runs" / "t"
    code, _, err = _run(["convert", "--to-hf", str(tmp_path / "adapter"), "--run", str(run_dir), "--adapter-only"],
                        capsys)  # fmt: skip
    assert code == 0, err
    code, _, err = _run(["convert", "--to-hf", str(tmp_path / "merged"), "--run", str(run_dir)], capsys)
    assert code == 0, err
    # the merged export equals base + adapter as PEFT computes it (on the grown vocabulary)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    base.resize_token_embeddings(merged.config.vocab_size)
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            base.get_parameter(name).copy_(merged.get_parameter(name))
    x = torch.randint(0, merged.config.vocab_size, (1, 10))
    with torch.no_grad():
        before = base(x).logits
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(x).logits, merged(x).logits, atol=1e-5, rtol=0)
        assert not torch.allclose(adapted(x).logits, before, atol=1e-4)  # the adapter trained


def test_lora_targets_must_match(tmp_path: Path):
    values = tiny_train_values()
    values["lora"] = {"targets": ["attn.qkv"]}
    with pytest.raises(ConfigError, match=r"lora\.targets: .*match no nn\.Linear module"):
        resolve_run_spec(load_spec(write_yaml(tmp_path / "train.yaml", values)), check_data=False)
