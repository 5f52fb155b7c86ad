"""Tokenizers: the byte tokenizer and the Hugging Face adapter (local files only, no network)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

from dllm.config.data import TokenizerConfig
from dllm.config.loading import load_config
from dllm.config.prepare import PrepareSpec
from dllm.data.artifact import validate_artifact
from dllm.data.prepare import prepare
from dllm.data.synthetic import demo_corpus
from dllm.errors import ConfigError, DataError
from dllm.tokenization import ByteTokenizer, ChatEncoding, Tokenizer, build_tokenizer
from dllm.tokenization import byte as byte_mod
from tests.helpers import EOS, write_corpus, write_yaml
from tests.helpers import save_bpe as _save_bpe

TEXTS = [
    "",
    "12 + 7 = 19",
    "the cat sees a map by the sea.",
    "héllo wörld ✓ 日本語 🙂",
    "tabs\tand\nnew lines\r\n",
    "\x00 nul and \x7f del",
]


# --------------------------------------------------------------------------------------------------
# ByteTokenizer


def test_byte_round_trip():
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special=False) == text


def test_byte_special_ids():
    tok = ByteTokenizer()
    specials = [tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id]
    assert len(set(specials)) == 4
    assert all(i is not None and 256 <= i < tok.vocab_size for i in specials)
    assert tok.vocab_size == 260
    assert isinstance(tok, Tokenizer)
    assert isinstance(build_tokenizer(TokenizerConfig()), ByteTokenizer)


def test_byte_decode_skips_specials_unless_asked():
    tok = ByteTokenizer()
    ids = [tok.bos_id, *tok.encode("ab"), tok.mask_id, tok.mask_id, *tok.encode("é"), tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "abé"
    assert tok.decode(ids, skip_special=False) == "<|bos|>ab<|mask|><|mask|>é<|eos|><|pad|>"
    assert tok.decode([tok.mask_id] * 3) == ""
    assert tok.decode([999], skip_special=False) == "<|999|>"


def test_byte_decode_accepts_arrays_and_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode(np.array(tok.encode("héllo"), dtype=np.int64)) == "héllo"
    assert tok.decode(np.array([tok.eos_id, 104, 105], dtype=np.uint16), skip_special=False) == "<|eos|>hi"
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated two-byte sequence is replaced, not raised
    assert tok.decode([0xFF, *tok.encode("a")]) == "\ufffda"


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "12 + 7 ="},
    {"role": "assistant", "content": "19"},
    {"role": "user", "content": "and 日本?"},
    {"role": "assistant", "content": "ünïcode ✓"},
]


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """Contiguous spans of ids where the mask is 1."""
    spans: list[list[int]] = []
    prev = 0
    for i, m in zip(ids, mask, strict=True):
        if m and not prev:
            spans.append([])
        if m:
            spans[-1].append(i)
        prev = m
    return spans


def test_chat_template_assistant_mask_covers_content_and_eos():
    tok = ByteTokenizer()
    enc = tok.apply_chat_template(MESSAGES)
    assert isinstance(enc, ChatEncoding)
    assert len(enc.assistant_mask) == len(enc.ids) and set(enc.assistant_mask) <= {0, 1}
    expected_ids: list[int] = []
    expected_mask: list[int] = []
    for msg in MESSAGES:
        header = tok.encode(f"{msg['role'].capitalize()}: ")
        body = tok.encode(msg["content"])
        if msg["role"] == "assistant":
            expected_ids += header + body + [tok.eos_id]
            expected_mask += [0] * len(header) + [1] * (len(body) + 1)
        else:
            expected_ids += header + body + tok.encode("\n")
            expected_mask += [0] * (len(header) + len(body) + 1)
    assert enc.ids == expected_ids
    assert enc.assistant_mask == expected_mask
    spans = _runs(enc.ids, enc.assistant_mask)
    assistants = [m["content"] for m in MESSAGES if m["role"] == "assistant"]
    assert spans == [tok.encode(c) + [tok.eos_id] for c in assistants]
    assert [tok.decode(s) for s in spans] == assistants
    # nothing but assistant turns is supervised: the prompt text has no mask
    unmasked = [i for i, m in zip(enc.ids, enc.assistant_mask, strict=True) if not m]
    assert tok.decode(unmasked) == ("System: Be brief.\nUser: 12 + 7 =\nAssistant: User: and 日本?\nAssistant: ")


def test_chat_template_generation_prompt():
    tok = ByteTokenizer()
    msgs = MESSAGES[:2]
    plain = tok.apply_chat_template(msgs)
    gen = tok.apply_chat_template(msgs, add_generation_prompt=True)
    header = tok.encode("Assistant: ")
    assert gen.ids == plain.ids + header
    assert gen.assistant_mask == plain.assistant_mask + [0] * len(header)
    assert sum(gen.assistant_mask) == 0
    assert tok.decode(gen.ids) == "System: Be brief.\nUser: 12 + 7 =\nAssistant: "


def test_chat_template_rejects_unknown_role():
    with pytest.raises(ValueError, match="unknown chat role 'tool'"):
        ByteTokenizer().apply_chat_template([{"role": "tool", "content": "x"}])


def test_byte_identity_is_stable():
    a, b = ByteTokenizer().identity(), ByteTokenizer().identity()
    assert a == b
    assert json.loads(json.dumps(a)) == a  # it goes into the manifest
    assert a["kind"] == "byte" and a["vocab_size"] == 260
    assert a["special_ids"] == {"pad": 256, "bos": 257, "eos": 258, "mask": 259}
    assert len(a["vocab_hash"]) == 64 and len(a["chat_template_hash"]) == 64


def test_byte_identity_changes_when_relevant(monkeypatch: pytest.MonkeyPatch):
    base = ByteTokenizer().identity()
    moved = ByteTokenizer()
    moved.mask_id, moved.pad_id = moved.pad_id, moved.mask_id
    moved._special = {moved.pad_id: "<|pad|>", 257: "<|bos|>", 258: "<|eos|>", moved.mask_id: "<|mask|>"}
    ident = moved.identity()
    assert ident["special_ids"] != base["special_ids"]
    assert ident["vocab_hash"] != base["vocab_hash"]
    renamed = ByteTokenizer()
    renamed._special = {**renamed._special, renamed.mask_id: "<|MASK|>"}
    assert renamed.identity()["vocab_hash"] != base["vocab_hash"]
    monkeypatch.setitem(byte_mod._ROLE_HEADER, "user", "Human: ")
    changed = ByteTokenizer().identity()
    assert changed["chat_template_hash"] != base["chat_template_hash"]
    assert changed["vocab_hash"] == base["vocab_hash"]


# --------------------------------------------------------------------------------------------------
# HFTokenizer: a byte-level BPE trained here, saved with transformers, loaded from disk only


def _no_network(*args, **kwargs):
    raise AssertionError("a test tried to open a network connection")


def _offline(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(socket.socket, "connect", _no_network)
    mp.setattr(socket.socket, "connect_ex", _no_network)
    mp.setattr(socket, "create_connection", _no_network)
    mp.setattr(socket, "getaddrinfo", _no_network)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        mp.setenv(var, "1")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    _offline(monkeypatch)


CHAT = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# the same template, with the assistant's words marked for `return_assistant_tokens_mask`
CHAT_SPANS = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    with pytest.MonkeyPatch.context() as mp:
        _offline(mp)
        root = tmp_path_factory.mktemp("hf_tok")
        return {
            "plain": _save_bpe(root / "plain"),
            "chat": _save_bpe(root / "chat", chat_template=CHAT),
            "spans": _save_bpe(root / "spans", chat_template=CHAT_SPANS),
            "no_eos": _save_bpe(root / "no_eos", eos=False),
        }


def _hf(path: Path, **kwargs):
    return build_tokenizer(TokenizerConfig(kind="hf", path=path, **kwargs))


def test_hf_adds_a_distinct_mask_token(hf_dirs: dict[str, Path]):
    from dllm.tokenization.hf import HFTokenizer

    saved = json.loads((hf_dirs["plain"] / "tokenizer.json").read_text(encoding="utf-8"))
    base_size = len(saved["model"]["vocab"])
    tok = _hf(hf_dirs["plain"])
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == base_size + 1
    assert tok.mask_id == base_size  # appended after the trained vocabulary
    assert tok.eos_id == saved["model"]["vocab"][EOS]
    assert tok.pad_id == tok.eos_id  # no pad token: EOS pads
    assert tok.bos_id is None
    assert tok.mask_id not in (tok.eos_id, tok.pad_id)
    assert all(0 <= i < tok.vocab_size for i in (tok.mask_id, tok.eos_id, tok.pad_id))
    assert tok.decode([tok.mask_id], skip_special=False) == "<|mask|>"
    # the folder on disk is not modified
    assert json.loads((hf_dirs["plain"] / "tokenizer.json").read_text(encoding="utf-8")) == saved


def test_hf_mask_token_name_is_configurable(hf_dirs: dict[str, Path]):
    tok = _hf(hf_dirs["plain"], mask_token="[MASK]")
    assert tok.decode([tok.mask_id], skip_special=False) == "[MASK]"
    assert tok.encode("[MASK]") == [tok.mask_id]


def test_hf_round_trip(hf_dirs: dict[str, Path]):
    tok = _hf(hf_dirs["plain"])
    for text in [*TEXTS, *demo_corpus(20, seed=5)]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.mask_id not in ids and tok.eos_id not in ids
        assert tok.decode(ids) == text
    # merges learned on the corpus make its sentences shorter than their bytes
    sample = "the teacher follows the long road in the morning."
    assert len(tok.encode(sample)) < len(sample.encode("utf-8"))


def test_hf_decode_skips_specials_unless_asked(hf_dirs: dict[str, Path]):
    tok = _hf(hf_dirs["plain"])
    ids = [tok.mask_id, *tok.encode("12 + 7 = 19"), tok.eos_id]
    assert tok.decode(ids) == "12 + 7 = 19"
    assert tok.decode(ids, skip_special=False) == f"<|mask|>12 + 7 = 19{EOS}"


def test_hf_identity(hf_dirs: dict[str, Path]):
    ident = _hf(hf_dirs["plain"]).identity()
    assert ident == _hf(hf_dirs["plain"]).identity()  # stable across loads
    assert json.loads(json.dumps(ident)) == ident
    byte = ByteTokenizer().identity()
    assert ident["kind"] == "hf" and ident["vocab_hash"] != byte["vocab_hash"]
    assert ident["special_ids"] != byte["special_ids"] and ident["vocab_size"] != byte["vocab_size"]
    # another mask token is another vocabulary; a chat template changes only its own hash
    assert _hf(hf_dirs["plain"], mask_token="[MASK]").identity()["vocab_hash"] != ident["vocab_hash"]
    chat = _hf(hf_dirs["chat"]).identity()
    assert chat["vocab_hash"] == ident["vocab_hash"]
    assert chat["chat_template_hash"] != ident["chat_template_hash"]


def test_hf_chat_template(hf_dirs: dict[str, Path]):
    tok = _hf(hf_dirs["chat"])
    msgs = [{"role": "user", "content": "1 + 2 ="}, {"role": "assistant", "content": "3"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert isinstance(enc, ChatEncoding) and all(isinstance(i, int) for i in enc.ids)
    assert tok.decode(enc.ids) == "user: 1 + 2 =\nassistant: 3\nassistant:"
    with pytest.raises(ConfigError, match="no chat template"):
        _hf(hf_dirs["plain"]).apply_chat_template(msgs)


def test_hf_missing_folder(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"^tokenizer\.path: .*missing"):
        _hf(tmp_path / "missing")


def test_hf_folder_without_tokenizer_files(tmp_path: Path):
    pytest.importorskip("transformers")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^tokenizer\.path: cannot load a tokenizer from"):
        _hf(tmp_path / "empty")


def test_hf_without_eos_is_rejected(hf_dirs: dict[str, Path]):
    with pytest.raises(ConfigError, match=r"^tokenizer\.path: .* has no EOS token"):
        _hf(hf_dirs["no_eos"])


def test_hf_tokenizer_prepares_data(hf_dirs: dict[str, Path], tmp_path: Path):
    """An artifact prepared with the HF tokenizer records its identity and decodes back."""
    write_corpus(tmp_path / "data" / "train.jsonl", num_records=30)
    values = {
        "tokenizer": {"kind": "hf", "path": str(hf_dirs["plain"])},
        "sources": [{"path": "data/train.jsonl"}],
        "output": "out",
        "seq_len": 16,
    }
    spec = load_config(PrepareSpec, write_yaml(tmp_path / "prepare.yaml", values))
    manifest = prepare(spec, tmp_path)
    tok = _hf(hf_dirs["plain"])
    assert manifest["tokenizer"] == tok.identity()
    art = validate_artifact(tmp_path / "out")
    ids = np.asarray(art.array("tokens")).tolist()
    docs = [json.loads(line)["text"] for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    expected = [i for d in docs for i in [*tok.encode(d), tok.eos_id]]
    assert ids[: len(expected)] == expected


TURNS = [
    {"role": "user", "content": "the cat sees"},
    {"role": "assistant", "content": "a red ball"},
    {"role": "user", "content": "and then"},
    {"role": "assistant", "content": "the map"},
]


def test_hf_assistant_spans_come_from_generation_markers(hf_dirs: dict[str, Path]):
    tok = _hf(hf_dirs["spans"])
    enc = tok.apply_chat_template(TURNS)
    assert len(enc.assistant_mask) == len(enc.ids)
    spoken = tok.decode([i for i, m in zip(enc.ids, enc.assistant_mask, strict=True) if m])
    assert spoken.split() == ["a", "red", "ball", "the", "map"]
    assert (
        tok.apply_chat_template(TURNS[:1], add_generation_prompt=True).ids
        == enc.ids[: len(tok.apply_chat_template(TURNS[:1], add_generation_prompt=True).ids)]
    )


def test_hf_template_without_markers_gives_no_spans(hf_dirs: dict[str, Path], tmp_path: Path):
    """assistant_only supervision is refused rather than guessed from the text."""
    tok = _hf(hf_dirs["chat"])
    assert tok.apply_chat_template(TURNS).assistant_mask == []
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": TURNS}) + "\n")
    cfg = {"tokenizer": {"kind": "hf", "path": str(hf_dirs["chat"])}, "sources": [{"path": "chat.jsonl",
           "format": "messages"}], "output": "out", "seq_len": 64}  # fmt: skip
    spec = load_config(PrepareSpec, write_yaml(tmp_path / "prepare.yaml", cfg))
    with pytest.raises(DataError, match=r"chat\.jsonl:1: the tokenizer's chat template marks no assistant spans"):
        prepare(spec, tmp_path)


# -- untrusted text: what UTF-8 cannot encode ---------------------------------------------------------------
UNDECODABLE_TEXTS = {"argv byte": "caf\udcff!", "json escape": "x\ud800y", "valid": "caf\u00e9 \U0001f600"}


@pytest.mark.parametrize("name", list(UNDECODABLE_TEXTS))
def test_valid_text_never_raises_and_keeps_what_is_utf8(name: str):
    from dllm.text import valid_text

    text = valid_text(UNDECODABLE_TEXTS[name])
    assert text.encode("utf-8").decode("utf-8") == text  # always encodes
    expected = {"argv byte": "caf\ufffd!", "json escape": "x\ufffdy"}.get(name, UNDECODABLE_TEXTS[name])
    assert text == expected
    assert valid_text(b"caf\xc3\xa9 \xff") == "caf\u00e9 \ufffd"  # bytes: UTF-8, else U+FFFD
    assert valid_text("caf\udcc3\udca9") == "caf\u00e9"  # surrogateescape'd UTF-8 bytes decode again


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_encode_takes_any_str(kind: str, hf_dirs: dict[str, Path]):
    """Lone surrogates (an argument's undecodable bytes, a JSON escape) encode as U+FFFD, never raise."""
    tok = ByteTokenizer() if kind == "byte" else _hf(hf_dirs["chat"])
    assert tok.encode("a\udcffb") == tok.encode("a\ufffdb") == tok.encode("a\ud800b")
    turn = [{"role": "user", "content": "a\udcffb"}]
    assert tok.apply_chat_template(turn).ids == tok.apply_chat_template([{"role": "user", "content": "a\ufffdb"}]).ids


SANDBOX_ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"


def test_a_chat_template_the_sandbox_refuses_is_one_line(tmp_path: Path):
    """A template reaching for Python internals is stopped by transformers' Jinja sandbox (nothing of it runs):
    a ConfigError naming the file it came from, on use and on the check an import makes."""
    folder = _save_bpe(tmp_path / "evil", chat_template=SANDBOX_ESCAPE)
    tok = _hf(folder)
    source = str(folder / "chat_template.jinja") if (folder / "chat_template.jinja").is_file() else "tokenizer_config"
    with pytest.raises(ConfigError, match="the chat template is refused by the sandbox") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert source in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^x\.gguf: the chat template is refused by the sandbox"):
        tok.check_chat_template("x.gguf")
    _hf(_save_bpe(tmp_path / "strict", chat_template="{{ raise_exception('no') }}")).check_chat_template()  # its own


def test_a_config_field_of_the_wrong_type_is_one_line(hf_dirs: dict[str, Path], tmp_path: Path):
    """transformers checks config.json's field types while it loads a tokenizer (huggingface_hub's strict
    dataclasses): a string where an integer belongs names the file and the field."""
    import shutil

    folder = shutil.copytree(hf_dirs["chat"], tmp_path / "model")
    config = {"model_type": "llama", "hidden_size": "64", "num_attention_heads": 4, "vocab_size": 400}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        _hf(folder)
    line = str(info.value)
    assert line.startswith(f"{folder / 'config.json'}: ") and "hidden_size" in line and "\n" not in line, line
