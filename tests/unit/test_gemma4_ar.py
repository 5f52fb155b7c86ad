"""Causal (AR) decoding of an imported Gemma 4 text model: the diffusion_gemma stack without its canvas block,
which is Gemma4ForCausalLM (tests/unit/test_diffusion_gemma_gemma4.py).

A tiny random transformers Gemma4ForCausalLM (sliding layers of window 4 before a full layer of its own head
width and kv heads, values from keys, logits soft-capped at 30) saved and imported: the causal loop over the
ragged KV cache, fed prompts longer than the window, gives transformers' greedy `generate` token for token
(batch 1, and a ragged batch of 3 that transformers left-pads) with its soft-capped logits, and what our
no-cache reference (`Recompute`) gives; speculative verification and the server's running batch decode as AR
decoding alone. `dllm generate --ar` decodes such a folder and refuses a DiffusionGemma one; `is_causal_model`
decides from the profile and the config.

Shapes: B batch, N new tokens, V vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm.config.model import ModelConfig
from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import Engine, generate
from dllm.inference.scheduler import Limits
from dllm.models.families.base import is_causal_model
from dllm.sampling.canvas import SpecialIds
from tests.unit.test_continuous import _run, _same
from tests.unit.test_diffusion_gemma_gemma4 import V, W, _gemma4, _import
from tests.unit.test_sampling_speculative import ReplayDrafter, full_sequences

pytest.importorskip("transformers.models.gemma4")

MASK = V - 1
SPECIAL = SpecialIds(mask_id=MASK, pad_id=0, eos_id=3, num_tokens=V)
N = 10


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, MASK, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, ours imported from its folder), float32."""
    hf = _gemma4("dense")
    folder = tmp_path_factory.mktemp("gemma4") / "dense"
    hf.save_pretrained(folder)
    return hf, _import(folder)


def _cfg(n: int = N, **kw) -> SamplerConfig:
    return SamplerConfig(generation="causal", gen_length=n, stop_at_eos=False, **kw)


def _theirs(hf, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy continuations of the prompts left-padded in one batch, and its logits [B, N, V]."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    valid = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():  # the causal loop never predicts the mask id: neither may transformers
        out = hf.generate(ids, attention_mask=valid, max_new_tokens=N, do_sample=False, eos_token_id=None,
                          pad_token_id=0, suppress_tokens=[MASK], return_dict_in_generate=True,
                          output_logits=True)  # fmt: skip
    return out.sequences[:, P:].tolist(), torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("lengths", [[9], [9, 6, 13]])
def test_greedy_ar_equals_transformers_and_recompute(pair, lengths):
    hf, ours = pair
    prompts = _prompts(lengths, seed=len(lengths))
    assert min(lengths) > W  # the window cuts every prompt's first keys
    want, want_logits = _theirs(hf, prompts)
    with torch.inference_mode():
        got = generate(ours, prompts, _cfg(), SPECIAL, return_logits=True)
        plain = generate(ours, prompts, _cfg(), SPECIAL, recompute=True, return_logits=True)
    assert plain.sequences == want, (plain.sequences, want)
    assert got.sequences == want
    keep = torch.arange(V) != MASK  # -inf in ours
    diff = float((got.logits_BNV[..., keep] - want_logits[..., keep]).abs().max())
    plain_diff = float((got.logits_BNV[..., keep] - plain.logits_BNV[..., keep]).abs().max())
    print(f"gemma4 AR batch {len(lengths)}: tokens equal; logits max|diff| vs transformers {diff:.1e}, "
          f"vs recompute {plain_diff:.1e}")  # fmt: skip
    assert diff <= 1e-4 and plain_diff <= 1e-4
    bend = float((torch.atanh(want_logits / 30.0) * 30.0 - want_logits).abs().max())
    assert bend > 10 * 1e-4, bend  # logits without the soft-cap would differ by 10x the tolerance


@pytest.fixture(scope="module")
def f64(pair):
    return _import_again(pair[1]).to(torch.float64)


def _import_again(model):
    from dllm.models import Transformer

    copy = Transformer(model.cfg)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def test_speculative_verification_gives_the_ar_tokens(f64):
    """Drafts of 4 that rows accept in different lengths (verification forwards of several queries per row,
    the window applied to each): the AR tokens, with and without the cache."""
    prompts = _prompts([9, 6, 13], seed=7)
    ref = generate(f64, prompts, _cfg(N + 4), SPECIAL)
    drafter = ReplayDrafter(full_sequences(prompts, ref.sequences, 13 + N + 4), 4, error=0.3, seed=0, vocab=V)
    out = generate(f64, prompts, _cfg(), SPECIAL, drafter=drafter)
    assert out.sequences == [s[:N] for s in ref.sequences]
    assert 0 < out.counters.accepted < out.counters.drafted


def test_the_running_batch_decodes_requests_as_alone(f64):
    """Two requests (one of two rows) join the server's running AR batch at different steps: each decodes
    what a `generate` call of it alone decodes."""
    arrivals = [(0, _prompts([9, 5], seed=11), _cfg(12), None), (3, _prompts([11], seed=12), _cfg(8), None)]
    reqs = _run(Engine(f64, SPECIAL, Limits(max_rows=8)), arrivals)
    for req, (_, prompts, cfg, _) in zip(reqs, arrivals, strict=True):
        _same(req, generate(f64, prompts, cfg, SPECIAL))


def test_which_diffusion_gemma_models_decode_causally():
    ids = {"mask_id": 3, "pad_id": 0, "eos_id": 1, "num_tokens": 8, "max_length": 16}
    imported = ModelConfig(family="diffusion_gemma", preset="tiny", canvas_conditioning=False)
    converted = ModelConfig(family="diffusion_gemma", preset="tiny")
    assert converted.canvas_conditioning
    assert is_causal_model(DecodeProfile(**ids), imported)  # a Gemma 4 checkpoint: Gemma4ForCausalLM
    assert not is_causal_model(DecodeProfile(attention="prefix_canvas", block_size=4, **ids), converted)
    native_sft = DecodeProfile(objective="diffusiongemma_native_sft", attention="prefix_canvas", block_size=4, **ids)
    assert not is_causal_model(native_sft, converted)
    assert not is_causal_model(DecodeProfile(objective="mdlm", **ids), imported)  # trained otherwise here


def test_generate_ar_of_a_gemma4_folder(tmp_path: Path, capsys):
    """The recipes' generated Gemma 4 folder (gemma4_text: a sliding layer, then a global one) decodes with
    `dllm generate --ar`; a DiffusionGemma folder or run is refused (tests/integration/test_diffusion_gemma_cli.py)."""
    from dllm.cli.main import main
    from dllm.recipes import write_ar_model

    folder = write_ar_model(tmp_path / "gemma4", family="gemma4")
    args = ["generate", "--model", str(folder), "--ar", "-p", "a prompt longer than its window", "--gen-length",
            "6", "--json"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert json.loads(out)["tokens_committed"] == 6 and "ar (KV cache), 6 forwards for 6 tokens" in err
