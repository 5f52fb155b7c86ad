"""Untrusted text made valid: the one decoding of what a user types, pipes or passes as an argument.

Python hands the CLI text that UTF-8 cannot encode: an argument or a C-locale stdin with bytes that are
not UTF-8 arrives with them as lone surrogates (PEP 383's surrogateescape, U+DC80..U+DCFF), and a JSON
escape such as "\\udcff" decodes to one. Writing, tokenizing or printing such a str raises
UnicodeEncodeError. `valid_text` turns it (or raw bytes) into text that always encodes: what was UTF-8
stays as it was, every invalid byte or lone surrogate becomes U+FFFD, the replacement character.
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
_OTHER_SURROGATES = re.compile("[\ud800-\udc7f\udd00-\udfff]")
"""Lone surrogates that are not surrogateescape's stand-ins for the bytes 0x80..0xFF."""


def valid_text(value: str | bytes | bytearray) -> str:
    """`value` as text that encodes to UTF-8; never raises. Bytes are decoded as UTF-8; the bytes a
    surrogateescape'd str stands for are decoded again; whatever is not UTF-8 becomes U+FFFD."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    raw = _OTHER_SURROGATES.sub(REPLACEMENT, value).encode("utf-8", errors="surrogateescape")
    return raw.decode("utf-8", errors="replace")
