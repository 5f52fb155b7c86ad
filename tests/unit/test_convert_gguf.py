"""`dllm convert --from-gguf` on small GGUF files written here with gguf's own writer: a random
transformers llama stored as llama.cpp stores it (q and k rows permuted, a Q8_0 embedding, a byte-level
BPE vocabulary and a chat template) imports with transformers' logits; the output folder is staged and
renamed (an error leaves nothing behind, --overwrite replaces); bad input is one line and exit code 2.
The real SmolLM2 file is tests/integration/test_real_model.py."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.cli.main import main

gguf = pytest.importorskip("gguf", reason="GGUF import needs gguf: pip install 'dllm[real]'")
transformers = pytest.importorskip("transformers")

V, E, LAYERS, HEADS, KV_HEADS = 300, 64, 2, 4, 2
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"  # fmt: skip


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (`LlamaModel.permute`) does to q and k rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """The 256 byte symbols, a few merges, then the control tokens; padded to V with unused tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n"]
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<|end|>", "<|user|>", "<|assistant|>", "<|endoftext|>"]
    tokens = specials + symbols + merged
    tokens += [f"<unused{i}>" for i in range(V - len(tokens))]
    num_plain = len(symbols) + len(merged)
    types = [3] * len(specials) + [1] * num_plain + [5] * (V - len(specials) - num_plain)  # control, normal, unused
    return tokens, merges, types


def hf_llama(tie: bool = False):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=E, intermediate_size=96, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms are ones at init: make every weight matter
    return model


def write_gguf(
    path: Path, model=None, *, arch: str = "llama", tokenizer: bool = True, template: str = TEMPLATE
) -> Path:
    """A llama-architecture GGUF of `model` (a transformers llama) as llama.cpp writes one."""
    model = model if model is not None else hf_llama()
    c = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny test llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    if tokenizer:
        tokens, merges, types = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(3)
        w.add_eos_token_id(0)
        w.add_chat_template(template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for key, t in model.state_dict().items():
        if c.tie_word_embeddings and key == "lm_head.weight":
            continue
        base, _, suffix = key.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        data = t.float().numpy()
        if name.endswith("attn_q.weight"):
            data = llama_cpp_permute(data, c.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            data = llama_cpp_permute(data, c.num_key_value_heads)
        if name == "token_embd.weight":  # one quantized tensor: dequantized by gguf on import
            w.add_tensor(name, gguf.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("tie", [False, True])
def test_import_matches_transformers_loading_the_same_file(tmp_path: Path, capsys, tie: bool):
    """Our import of a GGUF and transformers' (AutoModelForCausalLM with gguf_file=) give the same logits, and
    both equal the model the file was written from (up to Q8_0 rounding of the embedding)."""
    from dllm.checkpoint.loading import load_for_inference

    hf = hf_llama(tie)
    src = write_gguf(tmp_path / "m.gguf", hf)
    code, _, err = run(["convert", "--from-gguf", str(src), "--to", str(tmp_path / "out")], capsys)
    assert code == 0, err
    ours = load_for_inference(model_dir=tmp_path / "out")
    assert ours.model_cfg.tie_embeddings == tie and ours.model_cfg.num_layers == LAYERS
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf").eval()
    x = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours.model(x, torch.arange(12).expand(2, 12), AttentionMask("causal")).logits()[..., :V]
        torch.testing.assert_close(logits, theirs(x).logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(logits, hf(x).logits, atol=0.05, rtol=0)  # the embedding went through Q8_0


def test_the_folder_has_the_tokenizer_and_chat_template_and_decodes(tiny_gguf: Path, tmp_path: Path, capsys,
                                                                     monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    out = tmp_path / "out"
    code, _, err = run(["convert", "--from-gguf", str(tiny_gguf), "--to", str(out)], capsys)
    assert code == 0, err
    assert "weights dequantized" not in err  # a job shorter than the display's 5 s between lines prints none
    from dllm.training import progress

    bar = progress.CountBar
    every = lambda label, total, enabled=True, every_s=0.0: bar(label, total, enabled)  # noqa: E731
    monkeypatch.setattr(progress, "CountBar", every)  # a line per tensor
    code, _, err = run(["convert", "--from-gguf", str(tiny_gguf), "--to", str(tmp_path / "lines")], capsys)
    counts = [line.split()[0].split("/") for line in err.splitlines() if "weights dequantized" in line]
    done = [int(d) for d, _ in counts]  # parameters, tensor by tensor, up to the model's
    assert code == 0 and len(counts) > 1 and done == sorted(done) and counts[-1][0] == counts[-1][1], err
    code, _, err = run(["convert", "--from-gguf", str(tiny_gguf), "--to", str(tmp_path / "q"), "-q"], capsys)
    assert code == 0 and "weights dequantized" not in err, err
    names = {p.name for p in out.iterdir()}
    assert {"model.yaml", "model.safetensors", "tokenizer.json", "decode_profile.json"} <= names
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    ours = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in ("the cat in the hat", "a thin tether"):
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "user", "content": "the heat"}]
    text = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>the heat<|end|><|assistant|>"
    assert ours.eos_token == "<|end|>" and ours.mask_token is not None  # the added mask token
    code, stdout, err = run(["generate", "--model", str(out), "--ar", "--chat", "-p", "the", "--gen-length", "5",
                             "--json"], capsys)  # fmt: skip
    assert code == 0, err
    assert json.loads(stdout)["nfe"] >= 1 and "ar (KV cache)" in err
    assert json.loads((out / "decode_profile.json").read_text())["eos_id"] == 0


def test_overwrite_replaces_and_a_failure_leaves_nothing(tiny_gguf: Path, tmp_path: Path, capsys):
    """As every convert output: a user's folder is never written into, an earlier output of convert is
    replaced only with --overwrite."""
    user = tmp_path / "mine"
    user.mkdir()
    (user / "stale.txt").write_text("old")
    for extra in ([], ["--overwrite"]):
        code, _, err = run(["convert", "--from-gguf", str(tiny_gguf), "--to", str(user), *extra], capsys)
        assert code == 2 and "is not an output of dllm convert" in err and (user / "stale.txt").exists()
    out = tmp_path / "out"
    assert run(["convert", "--from-gguf", str(tiny_gguf), "--to", str(out)], capsys)[0] == 0
    code, _, err = run(["convert", "--from-gguf", str(tiny_gguf), "--to", str(out)], capsys)
    assert code == 2 and "--overwrite" in err
    code, _, err = run(["convert", "--from-gguf", str(tiny_gguf), "--to", str(out), "--overwrite"], capsys)
    assert code == 0, err
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]  # no staging or old folder left
    # a file whose tokenizer cannot be read fails after the weights, inside the staging folder
    bad = write_gguf(tmp_path / "notok.gguf", tokenizer=False)
    code, _, err = run(["convert", "--from-gguf", str(bad), "--to", str(tmp_path / "new")], capsys)
    assert code == 2 and err.startswith("dllm: error: --from-gguf:") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notok.gguf", "out"]


def _unsupported(path: Path) -> Path:
    w = gguf.GGUFWriter(path, "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_unsupported, "holds a mamba model; supported GGUF architectures: llama"),
        (lambda p: p.write_text("just some text, not a model\n") and p, "is not a GGUF file"),
        ("truncate", "is a truncated or damaged GGUF file"),
        (lambda p: p.parent, "is not a file; give a .gguf model file"),
    ],
)
def test_bad_input_is_one_line_exit_2(tiny_gguf: Path, tmp_path: Path, capsys, make, message: str):
    if make == "truncate":
        src = tmp_path / "cut.gguf"
        src.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size * 2 // 3])
    else:
        src = make(tmp_path / "in.gguf")
    code, out, err = run(["convert", "--from-gguf", str(src), "--to", str(tmp_path / "out")], capsys)
    assert code == 2 and err.startswith("dllm: error: ") and err.count("\n") == 1, err
    assert message in err and out == "" and not (tmp_path / "out").exists()


def test_without_gguf_the_line_says_what_to_install(tiny_gguf: Path, tmp_path: Path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_gguf(name, *args, **kwargs):
        if name == "gguf" or name.startswith("gguf."):
            raise ImportError("No module named 'gguf'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    code, _, err = run(["convert", "--from-gguf", str(tiny_gguf), "--to", str(tmp_path / "out")], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "needs the gguf package: pip install 'dllm[real]' (or: pip install gguf)" in err


def test_a_chat_template_the_sandbox_refuses_is_refused_at_import(tmp_path: Path, capsys):
    """A template reaching for Python internals (stopped by transformers' Jinja sandbox, nothing of it runs) is
    refused when the file is imported, naming the file, not at the model's first chat; nothing is written."""
    src = write_gguf(tmp_path / "evil.gguf", template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    code, out, err = run(["convert", "--from-gguf", str(src), "--to", str(tmp_path / "out")], capsys)
    assert code == 2 and err.count("\n") == 1 and out == "", err
    assert f"--from-gguf: {src} (tokenizer.chat_template): the chat template is refused by the sandbox" in err
    assert [p.name for p in tmp_path.iterdir()] == ["evil.gguf"]


def test_flags_that_do_not_go_with_from_gguf(tiny_gguf: Path, tmp_path: Path, capsys):
    code, _, err = run(["convert", "--from-gguf", str(tiny_gguf)], capsys)
    assert code == 2 and "--from-gguf needs --to OUT" in err
    code, _, err = run(["convert", "--from-gguf", str(tiny_gguf), "--to", str(tmp_path / "o"), "--to-hf", "x"], capsys)
    assert code == 2 and "drop --to-hf" in err


# -- the fuzz of GGUF headers ---------------------------------------------------------------------------------------
# Every count, length and type a header holds, set to what no file can hold: huge lengths and counts (2**64 - 1 is
# -1 read as unsigned), value and tensor types GGUF does not define, model sizes of the wrong type or beyond
# reason, special token ids past the vocabulary. gguf's reader trusted them: a block count of 10**9 built a model of
# that many blocks, and a count past the end of the file could loop for ever.
HUGE = [2**64 - 1, 2**40]
MODEL_COUNTS = ["llama.context_length", "llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.dimension_count",
                "llama.vocab_size"]  # fmt: skip
UINT32, FLOAT32, UNDEFINED_TYPE = 4, 6, 13


def header_mutations(path: Path) -> dict[str, tuple[int, int, int]]:
    """case name -> (byte offset, size, new value) for the tiny GGUF at `path`, located with gguf's reader."""
    reader = gguf.GGUFReader(path)
    cases = {f"{name} {v}": (at, 8, v) for name, at in (("tensor count", 8), ("metadata count", 16)) for v in HUGE}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        type_at = field.offset + 8 + len(key.encode())
        cases[f"{key}: key length"] = (field.offset, 8, HUGE[0])
        cases[f"{key}: undefined type"] = (type_at, 4, UNDEFINED_TYPE)
        kind = field.types[0]
        if kind in (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING):
            length_at = type_at + 4 + (4 if kind == gguf.GGUFValueType.ARRAY else 0)
            cases.update({f"{key}: length {v}": (length_at, 8, v) for v in HUGE})
        if key in MODEL_COUNTS:
            cases.update({f"{key} = {v}": (type_at + 4, 4, v) for v in (0, 10**9, 2**32 - 1)})
            cases[f"{key}: float32"] = (type_at, 4, FLOAT32)
        if key.endswith("_token_id"):  # one past the vocabulary: transformers indexed its tokens with it
            cases.update({f"{key} = {v}": (type_at + 4, 4, v) for v in (V, 2**32 - 1)})
    for tensor in (reader.tensors[0], reader.tensors[-1]):
        at, n = tensor.field.offset, len(tensor.shape)
        dims_at = at + 8 + len(tensor.name.encode()) + 4
        cases[f"tensor {tensor.name}: name length"] = (at, 8, HUGE[0])
        cases.update({f"tensor {tensor.name}: {v} dimensions": (dims_at - 4, 4, v) for v in (0, 5, 2**32 - 1)})
        cases[f"tensor {tensor.name}: dimension 2**40"] = (dims_at, 8, 2**40)
        cases[f"tensor {tensor.name}: type 1000"] = (dims_at + 8 * n, 4, 1000)
        cases[f"tensor {tensor.name}: offset 2**40"] = (dims_at + 8 * n + 4, 8, 2**40)
    return cases


@pytest.fixture(scope="module")
def mutations(tiny_gguf: Path) -> dict[str, tuple[int, int, int]]:
    return header_mutations(tiny_gguf)


@pytest.mark.timeout(300)
def test_every_count_of_a_gguf_header_beyond_the_file_is_one_line(tiny_gguf: Path, mutations, tmp_path: Path, capsys):
    """Each mutation ends as exit code 2, one line, in seconds, with nothing written next to the file."""
    import time

    assert len(mutations) > 100
    pristine = tiny_gguf.read_bytes()
    src, out = tmp_path / "m.gguf", tmp_path / "out"
    for name, (at, size, value) in mutations.items():
        data = bytearray(pristine)
        data[at : at + size] = value.to_bytes(size, "little")
        src.write_bytes(bytes(data))
        t0 = time.perf_counter()
        code, stdout, err = run(["convert", "--from-gguf", str(src), "--to", str(out)], capsys)
        assert time.perf_counter() - t0 < 20, name
        assert code == 2 and err.startswith("dllm: error: ") and err.count("\n") == 1, (name, err[-3000:])
        assert stdout == "" and "Traceback" not in err and [p.name for p in tmp_path.iterdir()] == ["m.gguf"], name
