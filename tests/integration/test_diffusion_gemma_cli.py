"""`dllm generate`, `chat` and `eval tasks` on DiffusionGemma models without extra flags (the decode
profile picks generation canvas_denoise): a tiny random transformers DiffusionGemmaForBlockDiffusion saved
to a folder, and a diffusiongemma_native_sft run trained here for two steps. DiffusionGemma's fields come
by --set; a flag that has no effect on it is one line, exit 2.

The folder's model writes printable text: the tied embedding rows of every other byte (EOS and the mask
among them) are zero, so their logits are 0, below the best of ~95 random ones, and an output id that is
not printable ASCII is garbage the sampler let through."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from dllm.cli.main import main
from dllm.tokenization import ByteTokenizer

pytest.importorskip("transformers.models.diffusion_gemma")

CANVAS = 8


def save_printable_model(path: Path) -> Path:
    """A tiny random DiffusionGemmaForBlockDiffusion over bytes (canvases of CANVAS) saved to `path`, whose
    proposals are printable ASCII (see above)."""
    from transformers.models.diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from tests.unit.test_diffusion_gemma import TEXT, VISION

    tok = ByteTokenizer()
    text = {**TEXT, "vocab_size": tok.vocab_size, "max_position_embeddings": 128}
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, vision_config=VISION,
                                                                 canvas_length=CANVAS)).eval()  # fmt: skip
    printable = torch.zeros(tok.vocab_size, dtype=torch.bool)
    printable[32:127] = True
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1 and router scales at 1: make every weight matter
            p.add_(torch.randn_like(p) * 0.1)
        for emb in {model.get_input_embeddings().weight, model.get_output_embeddings().weight}:
            emb[~printable] = 0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_printable_model(tmp_path_factory.mktemp("dgemma") / "model")


def _records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def _printable(text: str) -> bool:
    return all(32 <= ord(ch) < 127 for ch in text)


def test_generate_chat_and_eval_on_a_model_folder(folder: Path, capsys, monkeypatch):
    base = ["generate", "--model", str(folder), "-p", "1 + 2 =", "-p", "a longer prompt", "--json"]
    assert main([*base, "--gen-length", "12"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    rows = _records(out)
    assert [len(r["completion"]) for r in rows] == [16, 16]  # 12 tokens rounded up to two canvases of 8
    assert all(_printable(r["completion"]) for r in rows)
    assert all(r["nfe"] == r["steps"] <= 2 * 48 and r["tokens_committed"] == 32 for r in rows)
    assert "canvas_denoise/canvas 8/48 steps a canvas/entropy bound 0.1/cache clean rows" in err
    # DiffusionGemma's fields by --set; seeded: the same text twice, and a greedy proposal differs from a sample
    knobs = ["--set", "denoise_entropy_bound=5", "--set", "denoise_cache=false", "--steps", "8", "--seed", "3"]
    texts = []
    for temperature in ("1", "1", "0"):
        assert main([*base, "--gen-length", "8", *knobs, "--temperature", temperature]) == 0
        out, err = capsys.readouterr()
        texts.append([r["completion"] for r in _records(out)])
        assert "8 steps a canvas/entropy bound 5.0/cache none" in err and all(r["nfe"] <= 8 for r in _records(out))
    assert texts[0] == texts[1] and all(_printable(t) for t in texts[2])
    # chat and eval tasks: the profile decides, no flags
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
    assert main(["chat", "--model", str(folder), "--gen-length", "8", "--live"]) == 0
    err = capsys.readouterr().err
    assert "chatting (canvas_denoise/canvas 8" in err and "[NFE " in err
    assert main(["eval", "tasks", "--model", str(folder), "--tasks", "addition", "--limit", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["examples"] == 3 and summary["policy"] == "canvas_denoise" and summary["cache"] == "clean_rows"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--policy", "threshold"], "sampler.policy: no effect on canvas_denoise"),
        (["--cache", "dual"], "sampler.cache: no effect on canvas_denoise"),
        (["--temperature", "0.7"], "sampler.temperature: 0.7: canvas_denoise proposes"),
        (["--block-length", "4", "--gen-length", "8"], "sampler.block_length: this model decodes canvases of 8"),
        (["--gen-length", "16", "--steps", "3"], "steps 3 must be a multiple of the number of blocks (2)"),
        (["--set", "denoise_t_max=0.1"], "denoise_t_max 0.1 must be above denoise_t_min 0.4"),
        (["--ar"], "is not a causal model"),
    ],
)
def test_bad_flags_are_one_line_exit_2(folder: Path, capsys, flags: list[str], words: str):
    assert main(["generate", "--model", str(folder), "-p", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm: error:") and words in err and err.count("\n") == 1, err


def test_generate_on_a_native_sft_run(tmp_path: Path, capsys):
    """A run trained here (its checkpoint's decode profile: prefix_canvas, blocks of 8) decodes by --run: its
    checkpoints leave out the frozen routers, which loading rebuilds as they started (the rest as trained)."""
    from dllm.config.loading import load_config, validate_config
    from dllm.config.prepare import PrepareSpec
    from dllm.config.spec import RunSpec
    from dllm.data.prepare import prepare
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir
    from tests.helpers import PREPARE, tiny_train_values, write_yaml

    records = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sources = [{"path": "data/sft.jsonl", "format": "prompt_completion"}]
    write_yaml(tmp_path / "prepare.yaml", {**PREPARE, "sources": sources, "layout": "indexed"})
    prepare(load_config(PrepareSpec, tmp_path / "prepare.yaml"), tmp_path)
    model = {"family": "diffusion_gemma", "num_experts": 4, "router_aux_loss_coef": 0.0, "canvas_length": CANVAS,
             "local_window": 8}  # fmt: skip
    values = tiny_train_values(run={"name": "dg", "output_dir": str(tmp_path / "runs")}, model=model,
                               objective={"name": "diffusiongemma_native_sft", "block_size": CANVAS},
                               training={"steps": 2})  # fmt: skip
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path))
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    from dllm.checkpoint.loading import load_for_inference
    from dllm.models.factory import initial_state

    loaded = load_for_inference(run=run_dir)
    start = initial_state(spec.model, None, spec.training.seed)
    for name, value in loaded.model.named_parameters():
        assert torch.equal(value, start[name]) == (".router." in name), name
    args = ["generate", "--run", str(run_dir), "-p", "3+4=", "-p", "12+30=", "--gen-length", "8", "--json"]
    assert main(args) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    rows = _records(out)
    assert len(rows) == 2 and all(1 <= r["nfe"] <= 48 for r in rows) and "canvas_denoise/canvas 8" in err
    assert main(["generate", "--run", str(run_dir), "--ar", "-p", "x"]) == 2  # its canvas decodes, not AR
    err = capsys.readouterr().err
    assert "--ar:" in err and "not a causal model (trained with diffusiongemma_native_sft" in err
    assert err.count("\n") == 1, err


def test_no_likelihood_bound_but_lm_eval_still_generates(folder: Path, capsys):
    """`eval likelihood` refuses a DiffusionGemma model in one line (no masked or block bound applies to its
    uniform canvases); lm-eval's adapter loads it, generates, and refuses only its log-likelihood requests."""
    from lm_eval.api.instance import Instance

    from dllm.errors import ConfigError
    from dllm.evaluation.harness import DllmLM

    code = main(["eval", "likelihood", "--model", str(folder), "--data", str(folder / "no-artifact")])
    err = capsys.readouterr().err
    assert code == 2 and "DiffusionGemma" in err and err.strip().count("\n") == 0, err
    lm = DllmLM(model=str(folder), gen_length=CANVAS)
    (text,) = lm.generate_until([Instance("generate_until", {}, ("Hi", {"until": ["\n"]}), 0)])
    assert _printable(text)
    with pytest.raises(ConfigError, match="evaluate it with tasks"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("Hi", " there"), 0)])
