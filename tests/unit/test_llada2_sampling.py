"""LLaDA2's samplers as policies of the one canvas loop (`llada2`: LLaDA2.0's threshold commit with a top-k
fallback and per-block steps; `llada2_edit`: LLaDA2.1's, which also rewrites decided tokens of the block
and takes post steps), token for token equal to reference samplers written below from the public sampler
code (dllm/pipelines/llada2/sampler.py and llada21/sampler.py of the reference library: a batch of one,
block-causal forwards over the canvas up to the active block's end, greedy). The references run on the
reference forward of test_llada2 (the public modeling math), ours on the imported native model.

Our canvas pads a row's tail past gen_length, where the public samplers decode masks up to the next block
boundary; so prompts here end on a block boundary (prompt + gen_length a multiple of the block). And the
loop never proposes the mask token (its logit is -inf), where the public samplers may (an edit can then
write a mask back; random weights do that, trained ones all but never): the references here drop it too."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.errors import ConfigError
from dllm.inference.engine import generate
from dllm.sampling.canvas import SpecialIds
from tests.unit.test_llada2 import V, hf_config, load, reference_logits, write_folder

MASK, PAD, EOS = V - 1, V - 2, V - 3
SPECIAL = SpecialIds(mask_id=MASK, pad_id=PAD, eos_id=EOS, num_tokens=V)
BLOCK, GEN = 4, 8
PROMPTS = [[5, 17, 3, 60], [9, 9, 40, 2, 71, 33, 8, 1], [12, 50, 7, 7, 30, 64, 2, 19, 88, 4, 45, 23]]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("llada2") / "hf"
    c = hf_config(num_hidden_layers=2)
    sd = write_folder(folder, c, seed=3)
    return sd, c, load(folder)


def _ref_forward(sd, c):
    def logits(x_T: torch.Tensor) -> torch.Tensor:
        block = torch.arange(x_T.shape[0]) // BLOCK
        return reference_logits(sd, c, x_T[None], block[:, None] >= block[None, :])[0]

    return logits


def _greedy(logits_TV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits_TV = logits_TV.float().index_fill(-1, torch.tensor([MASK]), float("-inf"))  # see the module docstring
    probs = torch.softmax(logits_TV, dim=-1)
    tokens = probs.argmax(-1)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0]


def _transfer(active, probs, tau, k):
    """The public mask transfer: all above tau when at least k are, else the k most confident."""
    conf = torch.where(active, probs, torch.full_like(probs, -float("inf")))
    high = (conf > tau) & active
    if int(high.sum()) >= k:
        return high
    out = torch.zeros_like(active)
    if k > 0 and active.any():
        out[torch.topk(conf, k=min(k, int(active.sum()))).indices] = True
    return out


def reference_llada2(forward, prompt, steps_per_block, tau):
    P = len(prompt)
    num_blocks = -(-(P + GEN) // BLOCK)
    x = torch.full((num_blocks * BLOCK,), MASK)
    x[:P] = torch.tensor(prompt)
    schedule = [BLOCK // steps_per_block + int(i < BLOCK % steps_per_block) for i in range(steps_per_block)]
    for blk in range(P // BLOCK, num_blocks):
        end = (blk + 1) * BLOCK
        for step in range(steps_per_block):
            active = x[end - BLOCK : end] == MASK
            if not active.any():
                break
            tokens, probs = _greedy(forward(x[:end])[-BLOCK:])
            sel = _transfer(active, probs, tau, schedule[step])
            x[end - BLOCK : end][sel] = tokens[sel]
    return x[P : P + GEN].tolist()


def reference_llada21(forward, prompt, tau, edit_tau, max_post_steps, num_to_transfer):
    P = len(prompt)
    num_blocks = -(-(P + GEN) // BLOCK)
    x = torch.full((num_blocks * BLOCK,), MASK)
    x[:P] = torch.tensor(prompt)
    num_edits = 0
    for blk in range(P // BLOCK, num_blocks):
        end = (blk + 1) * BLOCK
        in_prompt = torch.arange(end - BLOCK, end) < P
        post_steps = 0
        while True:
            old = x[end - BLOCK : end].clone()
            active = old == MASK
            if not active.any():
                post_steps += 1
            if post_steps > max_post_steps:
                break
            tokens, probs = _greedy(forward(x[:end])[-BLOCK:])
            sel = _transfer(active, probs, tau, num_to_transfer) if active.any() else torch.zeros_like(active)
            edit = ~active & ~in_prompt & (probs > edit_tau) & (tokens != old)
            num_edits += int(edit.sum())
            x[end - BLOCK : end][sel | edit] = tokens[sel | edit]
            if not active.any() and not edit.any():
                break
    return x[P : P + GEN].tolist(), num_edits


def _ours(model, **fields) -> list[list[int]]:
    cfg = SamplerConfig(gen_length=GEN, block_length=BLOCK, attention="block", shift="off", stop_at_eos=False,
                        **fields)  # fmt: skip
    return generate(model, PROMPTS, cfg, SPECIAL).sequences


@pytest.mark.parametrize("steps_per_block, tau", [(4, 0.9), (2, 0.05), (3, 0.08)])
def test_llada2_policy_equals_the_reference_sampler(weights, steps_per_block: int, tau: float):
    sd, c, model = weights
    forward = _ref_forward(sd, c)
    expected = [reference_llada2(forward, p, steps_per_block, tau) for p in PROMPTS]
    ours = _ours(model, policy="llada2", steps=steps_per_block * GEN // BLOCK, threshold=tau)
    assert ours == expected


@pytest.mark.parametrize("tau, edit_tau, max_post, k", [(0.9, 0.05, 16, 1), (0.06, 0.05, 1, 2), (0.5, 0.9, 0, 1)])
def test_llada2_edit_policy_equals_the_reference_sampler(weights, tau, edit_tau, max_post, k):
    sd, c, model = weights
    forward = _ref_forward(sd, c)
    runs = [reference_llada21(forward, p, tau, edit_tau, max_post, k) for p in PROMPTS]
    if edit_tau < 0.1 and max_post:
        assert sum(n for _, n in runs) > 0, "the case should edit tokens"
    ours = _ours(model, policy="llada2_edit", threshold=tau, edit_threshold=edit_tau, max_post_steps=max_post,
                 min_commit=k)  # fmt: skip
    assert ours == [seq for seq, _ in runs]


@pytest.mark.parametrize(
    "fields, match",
    [(dict(policy="llada2", attention="bidirectional"), "block-causal"),
     (dict(policy="llada2_edit", attention="block", block_length=4, sub_block_length=2), "sub_block_length"),
     (dict(policy="llada2_edit", edit_threshold=0.0), "edit_threshold"),
     (dict(policy="llada2_edit", edit_threshold=1.5), "edit_threshold"),
     (dict(policy="llada2_edit", min_commit=0), "min_commit")],
)  # fmt: skip
def test_bad_settings_are_refused(fields: dict, match: str):
    with pytest.raises(ValidationError, match=match):
        SamplerConfig(gen_length=8, **fields)


def test_a_bidirectional_model_is_refused_one_line():
    profile = DecodeProfile(attention="bidirectional", mask_id=MASK, pad_id=PAD, eos_id=EOS, max_length=64,
                            num_tokens=V)  # fmt: skip
    with pytest.raises(ConfigError, match="policy llada2 decodes whole blocks") as e:
        resolve_sampler(SamplerConfig(gen_length=8, policy="llada2"), profile)
    assert "\n" not in str(e.value)


def test_a_llada2_folder_decodes_in_blocks_of_32_by_default():
    """A folder from elsewhere has no decode profile: LLaDA2's decodes block-causally in the public samplers'
    blocks of 32 (so `dllm generate --model FOLDER --policy llada2` needs no attention settings)."""
    from dllm.checkpoint.loading import derive_profile
    from dllm.config.model import ModelConfig
    from dllm.tokenization.byte import ByteTokenizer

    tok = ByteTokenizer()
    profile = derive_profile(None, ModelConfig(family="llada2_moe", preset="tiny", vocab_size=V), tok)
    assert (profile.attention, profile.block_size) == ("block", 32)
    sampler = resolve_sampler(SamplerConfig(gen_length=64, policy="llada2"), profile)
    assert (sampler.attention, sampler.block_length) == ("block", 32)
    assert (
        derive_profile(None, ModelConfig(family="llada", preset="tiny", vocab_size=V), tok).attention == "bidirectional"
    )


@pytest.mark.parametrize("policy", ["llada2", "llada2_edit"])
def test_the_block_cache_is_exact_for_both_policies(weights, policy: str):
    """Edits stay inside the active block, so the exact block cache (clean previous blocks) still applies."""
    *_, model = weights
    fields = dict(policy=policy, threshold=0.08, edit_threshold=0.05, max_post_steps=4)
    uncached = _ours(model, **fields)
    assert _ours(model, cache="block", **fields) == uncached


@pytest.mark.parametrize("cache", ["none", "block"])
def test_editing_requests_in_a_running_canvas_batch_decode_as_alone(weights, cache: str):
    """Each row's edits and post steps are its own: requests joining a running batch (serving) at different
    steps decode as they do alone, with the loop's counters equal."""
    import copy

    from dllm.inference.engine import Engine, make_loop
    from dllm.inference.scheduler import Limits

    model = copy.deepcopy(weights[2]).double()  # batched and lone forwards then agree to the last bit
    arrivals = [(at, [p], i) for i, (at, p) in enumerate(zip([0, 1, 3], PROMPTS, strict=True))]
    cfgs = [SamplerConfig(gen_length=GEN, block_length=BLOCK, attention="block", shift="off", stop_at_eos=False,
                          policy="llada2_edit", threshold=0.08, edit_threshold=e, max_post_steps=m, cache=cache)
            for e, m in ((0.05, 16), (0.05, 2), (0.5, 1))]  # fmt: skip
    engine = Engine(model, SPECIAL, Limits(max_rows=8))
    reqs: dict[int, object] = {}
    step = 0
    while step == 0 or engine.busy or len(reqs) < len(arrivals):
        for at, prompts, i in arrivals:
            if at == step:
                reqs[i] = engine.add(make_loop(model, prompts, cfgs[i], SPECIAL))
        engine.step()
        step += 1
        assert step < 500
    for _, prompts, i in arrivals:
        got, alone = reqs[i].result, generate(model, prompts, cfgs[i], SPECIAL)  # type: ignore[attr-defined]
        assert got.sequences == alone.sequences
        assert got.counters.as_dict()["steps"] == alone.counters.as_dict()["steps"]
