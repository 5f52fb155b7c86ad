"""The tokenizer of a GGUF file as Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json,
chat_template.jinja): transformers rebuilds it from the file's `tokenizer.ggml.*` metadata (its GGUF
tokenizer converters) and saves it, so `HFTokenizer` reads it like any other tokenizer folder.
"""

from __future__ import annotations

from pathlib import Path

from dllm.errors import ConfigError


def save_gguf_tokenizer(gguf_file: Path, folder: Path) -> None:
    """Write the tokenizer (and chat template) of `gguf_file` into `folder`."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("--from-gguf: the tokenizer needs transformers: pip install 'dllm[hf]'") from None
    gguf_file = Path(gguf_file)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # IndexError: a token id past its vocabulary
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ConfigError(f"--from-gguf: {gguf_file}: cannot read its tokenizer ({reason})") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"--from-gguf: {gguf_file}: its tokenizer has no EOS token (tokenizer.ggml.eos_token_id)")
    tok.save_pretrained(str(folder))
