"""Adapter for a Hugging Face tokenizer folder on local disk (a hub id is resolved to one by dllm.hub).

Needs the `hf` extra (transformers). A tokenizer without a mask token gets one added, so that
masked diffusion works with any causal LM tokenizer.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dllm.errors import ConfigError
from dllm.hub import local_folder
from dllm.text import valid_text
from dllm.tokenization.base import ChatEncoding, sha256_json

if TYPE_CHECKING:
    from dllm.config.data import TokenizerConfig

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class HFTokenizer:
    """Wraps `transformers.AutoTokenizer` loaded from a local folder (never downloads by itself)."""

    kind = "hf"

    @classmethod
    def from_config(cls, cfg: TokenizerConfig) -> HFTokenizer:
        """The registered constructor of kind `hf`: the folder `tokenizer.path`."""
        assert cfg.path is not None  # guaranteed by TokenizerConfig validation
        return cls(local_folder(cfg.path, "tokenizer.path"), mask_token=cfg.mask_token)

    def __init__(self, path: Path, mask_token: str = "<|mask|>") -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("tokenizer.kind 'hf' needs transformers: pip install 'dllm[hf]'") from None
        if not Path(path).is_dir():
            raise ConfigError(f"tokenizer.path: {path} is not a folder with tokenizer files")
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except _config_errors() as e:  # transformers checks config.json's field types as it loads the tokenizer
            reason = " ".join(str(e.__cause__ or e).split())[:300]
            raise ConfigError(f"{Path(path) / 'config.json'}: {reason}; write the field as that type") from None
        except (OSError, ValueError) as e:
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            raise ConfigError(f"tokenizer.path: cannot load a tokenizer from {path}: {reason}") from None
        if tok.mask_token_id is None:
            tok.add_special_tokens({"mask_token": mask_token})
        if tok.eos_token_id is None:
            raise ConfigError(f"tokenizer.path: the tokenizer in {path} has no EOS token; set eos_token in it")
        self._tok = tok
        self.path = Path(path)
        self.mask_id = int(tok.mask_token_id)
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.bos_id = int(tok.bos_token_id) if tok.bos_token_id is not None else None
        self.vocab_size = len(tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(valid_text(text), add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> ChatEncoding:
        if not getattr(self._tok, "chat_template", None):
            raise ConfigError(f"tokenizer.path: the tokenizer in {self.path} has no chat template")
        # assistant spans only from a template that marks them with {% generation %} (never guessed)
        spans = bool(_GENERATION_TAG.search(self._tok.chat_template))
        messages = [{k: valid_text(v) if isinstance(v, str) else v for k, v in m.items()} for m in messages]
        out = self._sandboxed(
            messages,
            None,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=True,
            return_assistant_tokens_mask=spans,
        )
        ids = list(out["input_ids"])
        mask = [int(m) for m in out["assistant_masks"]] if spans else []
        return ChatEncoding(ids=ids, assistant_mask=mask)

    def template_source(self) -> str:
        """Where the chat template was read from, for messages: the file of the folder that holds it."""
        for name in ("chat_template.jinja", "chat_template.json"):
            if (self.path / name).is_file():
                return str(self.path / name)
        return f"{self.path / 'tokenizer_config.json'} (chat_template)"

    def check_chat_template(self, source: str | None = None) -> None:
        """Render a one-turn conversation, so that a template the sandbox refuses is refused when a model is
        imported, not at its first chat; `source` names the template (default: `template_source`). A template
        that refuses this conversation for its own reasons (raise_exception) may still suit real ones."""
        from jinja2.exceptions import TemplateError

        if not getattr(self._tok, "chat_template", None):
            return
        with contextlib.suppress(TemplateError):  # the template's own refusal; the sandbox's is a ConfigError
            self._sandboxed([{"role": "user", "content": "hi"}], source, tokenize=False, add_generation_prompt=True)

    def _sandboxed(self, messages: list[dict[str, Any]], source: str | None, **kwargs: Any) -> Any:
        """transformers' apply_chat_template (a Jinja sandbox); a template it stops (one reaching for Python
        internals) is one line naming `source` (default: `template_source`)."""
        from jinja2.exceptions import SecurityError

        try:
            return self._tok.apply_chat_template(messages, **kwargs)
        except SecurityError as e:
            reason = " ".join(str(e).split())[:200]
            raise ConfigError(f"{source or self.template_source()}: the chat template is refused by the sandbox "
                              f"({reason}); use a template that only formats the messages") from None  # fmt: skip

    def save(self, folder: Path) -> None:
        """Write the tokenizer files, the added mask token included."""
        self._tok.save_pretrained(str(folder))

    def identity(self) -> dict[str, Any]:
        vocab = sorted(self._tok.get_vocab().items())
        specials = {"pad": self.pad_id, "bos": self.bos_id, "eos": self.eos_id, "mask": self.mask_id}
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "vocab_hash": sha256_json(vocab),
            "chat_template_hash": sha256_json(getattr(self._tok, "chat_template", None)),
            "special_ids": specials,
        }


def _config_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's error for a config field of the wrong type (none before its strict dataclasses)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)
