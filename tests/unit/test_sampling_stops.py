"""Stop strings (`dllm.sampling.stops`), shared by the CLI and the lm-evaluation-harness adapter."""

from __future__ import annotations

from dllm.sampling.stops import cut_at_stop, stop_function
from dllm.tokenization import ByteTokenizer


def test_cut_at_stop_cuts_before_the_earliest_stop_string():
    assert cut_at_stop("a+b=3\nQ: next", ["Q:", "\n"]) == "a+b=3"
    assert cut_at_stop("no stop here", ["###"]) == "no stop here"
    assert cut_at_stop("anything", []) == "anything"


def test_stop_function_is_none_without_stop_strings_and_checks_decoded_text():
    tok = ByteTokenizer()
    assert stop_function(tok, []) is None
    stop = stop_function(tok, ["\n\n"])
    assert stop is not None
    assert not stop(tok.encode("one line\n"))
    assert stop(tok.encode("one line\n\nmore"))
