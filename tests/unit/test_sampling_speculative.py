"""Speculative decoding (the causal loop of sampling/speculative.py) with simple drafters that implement the Drafter
protocol: a second causal model, random proposals, the target's own continuation replayed with
errors, and a linear head over the target features (the feature plumbing).

Lossless: greedy speculative output equals the target's greedy AR output token for token (200 prompts,
batch 1 and batch 8, rows accepting different lengths). Distribution: at temperature 1 the first
generated token matches the target's softmax over 20,000 seeded draws (chi-square), with and without
a drafter. The models are float64 so that a 1-token and a b-token forward agree far below any
argmax gap (in float32 a near-tie could flip between the two summation orders).

Shapes: B batch, b block size, T capacity, N new tokens, V vocabulary, F target features.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.errors import CheckpointError, ConfigError
from dllm.models.capture import capture_layers
from dllm.sampling.proposals import token_probs
from dllm.sampling.speculative import Drafter, FirstProposals, check_drafter, load_drafter
from tests.unit.test_sampling_ar import MASK_ID, V, causal_model, decode, new_tokens, random_prompts

F64 = torch.float64


@pytest.fixture(scope="module")
def target():
    return causal_model(seed=10, dtype=F64)


# --------------------------------------------------------------------------------------------------
# drafters


class ModelDrafter:
    """A second causal model that drafts greedily from the tokens it knows: the prompts (given up front)
    and, from the anchors it is handed, the accepted drafts (its own proposals at positions before the
    new anchor). Ignores the target features."""

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, model, prompts: list[list[int]], block_size: int) -> None:
        self.model, self.prompts, self.block_size = model, prompts, block_size

    def start(self, batch_size: int, max_length: int) -> torch.Tensor:
        seq = torch.zeros(batch_size, max_length + self.block_size, dtype=torch.long)
        for b, p in enumerate(self.prompts):
            seq[b, : len(p)] = torch.tensor(p)
        return seq

    def extend(self, state, features_BNF, positions_BN) -> None:
        assert features_BNF.shape[-1] == 0 and features_BNF.shape[:2] == positions_BN.shape

    def propose(self, state: torch.Tensor, anchor_B, anchor_pos_B) -> torch.Tensor:
        B = anchor_B.shape[0]
        state.scatter_(1, anchor_pos_B[:, None], anchor_B[:, None])
        out = []
        for k in range(self.block_size - 1):
            end = int(anchor_pos_B.max()) + k + 1
            logits = self.model(state[:, :end], torch.arange(end).expand(B, end), AttentionMask("causal")).logits()
            logits_BV = logits[torch.arange(B), anchor_pos_B + k]
            state.scatter_(1, (anchor_pos_B + k + 1)[:, None], logits_BV.argmax(-1)[:, None])
            out.append(logits_BV)
        return torch.stack(out, dim=1)


class RandomDrafter:
    """Seeded random logits (peaked: scale 3), independent of everything."""

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, block_size: int, seed: int = 0) -> None:
        self.block_size, self.gen = block_size, torch.Generator().manual_seed(seed)

    def start(self, batch_size: int, max_length: int) -> None:
        return None

    def extend(self, state, features_BNF, positions_BN) -> None:
        pass

    def propose(self, state, anchor_B, anchor_pos_B) -> torch.Tensor:
        return 3 * torch.randn(anchor_B.shape[0], self.block_size - 1, V, generator=self.gen, dtype=F64)


class ReplayDrafter:
    """Proposes the target's own greedy continuation (computed beforehand, `sequences_BT` = prompt +
    continuation per row at its positions), each token replaced by a random one with probability
    `error`: error 0 is accepted in full, larger errors make rows accept different lengths."""

    target_layer_ids: tuple[int, ...] = ()

    def __init__(
        self, sequences_BT: torch.Tensor, block_size: int, error: float, seed: int = 0, vocab: int = V
    ) -> None:
        self.seq, self.block_size, self.error, self.vocab = sequences_BT, block_size, error, vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.anchor_positions: list[torch.Tensor] = []

    def start(self, batch_size: int, max_length: int) -> None:
        return None

    def extend(self, state, features_BNF, positions_BN) -> None:
        pass

    def propose(self, state, anchor_B, anchor_pos_B) -> torch.Tensor:
        self.anchor_positions.append(anchor_pos_B.clone())
        B, b1 = anchor_B.shape[0], self.block_size - 1
        at = (anchor_pos_B[:, None] + 1 + torch.arange(b1)).clamp_max(self.seq.shape[1] - 1)
        tokens = self.seq.gather(1, at)
        wrong = torch.rand(B, b1, generator=self.gen) < self.error
        tokens = torch.where(wrong, torch.randint(0, MASK_ID, (B, b1), generator=self.gen), tokens)
        return torch.nn.functional.one_hot(tokens, self.vocab).to(F64) * 10


@dataclass
class ProbeState:
    features_BTF: torch.Tensor
    written_BT: torch.Tensor


class FeatureProbeDrafter:
    """Reads target features: keeps every feature written at its position and proposes with a fixed
    random linear head over the features of the position before the anchor (zeros at position 0)."""

    def __init__(self, layer_ids: tuple[int, ...], width: int, block_size: int, seed: int = 0) -> None:
        self.target_layer_ids, self.block_size = layer_ids, block_size
        g = torch.Generator().manual_seed(seed)
        self.head = torch.randn(len(layer_ids) * width, (block_size - 1) * V, generator=g, dtype=F64)

    def start(self, batch_size: int, max_length: int) -> ProbeState:
        F = self.head.shape[0]
        return ProbeState(torch.zeros(batch_size, max_length, F, dtype=F64),
                          torch.zeros(batch_size, max_length, dtype=torch.bool))  # fmt: skip

    def extend(self, state: ProbeState, features_BNF, positions_BN) -> None:
        idx = positions_BN[..., None].expand_as(features_BNF)
        state.features_BTF.scatter_(1, idx, features_BNF)
        state.written_BT.scatter_(1, positions_BN, True)

    def propose(self, state: ProbeState, anchor_B, anchor_pos_B) -> torch.Tensor:
        prev = state.features_BTF[torch.arange(anchor_B.shape[0]), (anchor_pos_B - 1).clamp_min(0)]
        prev = torch.where((anchor_pos_B > 0)[:, None], prev, 0)
        return (prev @ self.head).view(-1, self.block_size - 1, V)


def greedy_reference(target, prompts: list[list[int]], N: int, eos_id: int | None = None):
    return decode(target, prompts, N, eos_id=eos_id)


def full_sequences(prompts: list[list[int]], sequences: list[list[int]], length: int) -> torch.Tensor:
    out = torch.zeros(len(prompts), length, dtype=torch.long)
    for b, (p, s) in enumerate(zip(prompts, sequences, strict=True)):
        out[b, : len(p) + len(s)] = torch.tensor(p + s)
    return out


# --------------------------------------------------------------------------------------------------
# lossless greedy decoding


def test_every_test_drafter_implements_the_protocol(target):
    for d in (ModelDrafter(target, [[1]], 4), RandomDrafter(4), ReplayDrafter(torch.zeros(1, 4).long(), 4, 0.0),
              FeatureProbeDrafter((0,), 64, 4)):  # fmt: skip
        assert isinstance(d, Drafter)


def test_greedy_is_lossless_at_batch_8_with_rows_accepting_different_lengths(target):
    """160 prompts in batches of 8: the replayed continuation with 25% wrong tokens, block 5."""
    N, b = 20, 5
    prompts = random_prompts(160, seed=11)
    totals = {"accepted": 0, "drafted": 0}
    for i in range(0, 160, 8):
        chunk = prompts[i : i + 8]
        ref = greedy_reference(target, chunk, N + b)  # the replay reaches past N in a row's last round
        drafter = ReplayDrafter(full_sequences(chunk, ref.sequences, 9 + N + b), b, error=0.25, seed=i)
        out = decode(target, chunk, N, drafter=drafter)
        assert out.sequences == [s[:N] for s in ref.sequences]
        gains = torch.stack(drafter.anchor_positions).diff(dim=0)
        assert len(set(gains[0].tolist())) > 1 or len(set(gains[1].tolist())) > 1  # rows advance differently
        for k in totals:
            totals[k] += getattr(out.counters, k)
    rate = totals["accepted"] / totals["drafted"]
    assert 0.3 < rate < 0.9, rate


@pytest.mark.parametrize("kind", ["model", "random", "replay"])
def test_greedy_is_lossless_at_batch_1(target, kind):
    """40 prompts one at a time (with the batch-8 test: 200 prompts), each drafter kind, block 4."""
    N, b = 16, 4
    prompts = random_prompts({"model": 14, "random": 13, "replay": 13}[kind], seed=12 + len(kind))
    draft_model = causal_model(seed=3, dtype=F64)
    for p in prompts:
        ref = greedy_reference(target, [p], N + b)
        if kind == "model":
            drafter: Drafter = ModelDrafter(draft_model, [p], b)
        elif kind == "random":
            drafter = RandomDrafter(b, seed=len(p))
        else:
            drafter = ReplayDrafter(full_sequences([p], ref.sequences, 9 + N + b), b, error=0.3)
        out = decode(target, [p], N, drafter=drafter)
        assert out.sequences == [ref.sequences[0][:N]]
        c = out.counters.as_dict()
        assert c["tokens_committed"] == N and c["rounds"] == c["nfe"] - 1  # + the prefill
        assert c["drafted"] == (b - 1) * c["rounds"] and c["tau"] == (c["accepted"] + c["rounds"]) / c["rounds"]


def test_a_shorter_verify_block_checks_the_drafters_first_proposals(target):
    """--draft-block-size below the drafter's: the drafter runs its own block (state sized for it), the target
    verifies its first b - 1 proposals; lossless, and every round drafts b - 1."""
    N, b, trained = 16, 3, 6
    prompts = random_prompts(16, seed=41)
    ref = greedy_reference(target, prompts, N + trained)
    seen: list[int] = []

    class Recording(ReplayDrafter):
        def start(self, batch_size: int, max_length: int) -> None:
            seen.append(max_length)

        def propose(self, state, anchor_B, anchor_pos_B) -> torch.Tensor:
            out = super().propose(state, anchor_B, anchor_pos_B)
            assert out.shape[1] == trained - 1  # its whole block
            return out

    inner = Recording(full_sequences(prompts, ref.sequences, 9 + N + trained), trained, error=0.2)
    drafter = check_drafter(inner, target, block_size=b)
    assert isinstance(drafter, FirstProposals) and drafter.block_size == b and check_drafter(inner, target) is inner
    for i in range(0, 16, 8):
        out = decode(target, prompts[i : i + 8], N, drafter=drafter)
        assert out.sequences == [s[:N] for s in ref.sequences[i : i + 8]]
        c = out.counters.as_dict()
        assert c["drafted"] == (b - 1) * c["rounds"] and 0 < c["accepted"] < c["drafted"]
    # the loop's capacity (longest prompt + N + 2 b) plus the positions the drafter's longer block reaches
    assert seen == [max(len(p) for p in prompts[i : i + 8]) + N + 2 * b + trained - b for i in (0, 8)]
    with pytest.raises(ConfigError, match="use 2 to 6"):
        check_drafter(inner, target, block_size=1)


def test_a_perfect_drafter_is_accepted_in_full_and_eos_ends_rows(target):
    N, b = 16, 4
    prompts = random_prompts(8, seed=13)
    ref = greedy_reference(target, prompts, N + b)
    drafter = ReplayDrafter(full_sequences(prompts, ref.sequences, 9 + N + b), b, error=0.0)
    out = decode(target, prompts, N, drafter=drafter)
    c = out.counters.as_dict()
    assert c["acceptance_rate"] == 1.0 and c["tau"] == b and c["nfe"] == 1 + N // b
    eos = ref.sequences[2][5]
    with_eos = greedy_reference(target, prompts, N, eos_id=eos)
    drafter = ReplayDrafter(full_sequences(prompts, ref.sequences, 9 + N + b), b, error=0.2)
    out = decode(target, prompts, N, drafter=drafter, eos_id=eos)
    assert out.sequences == with_eos.sequences and len(out.sequences[2]) <= 5
    assert out.counters.tokens_committed == with_eos.counters.tokens_committed


def test_ragged_cache_verification_matches_the_no_cache_reference(target):
    """The same rounds, acceptances and tokens when every verify forward recomputes each row in full."""
    prompts = random_prompts(6, seed=14)
    draft_model = causal_model(seed=4, dtype=F64)
    runs = [
        decode(target, prompts, 12, drafter=ModelDrafter(draft_model, prompts, 3), use_cache=use_cache)
        for use_cache in (True, False)
    ]
    assert runs[0].sequences == runs[1].sequences
    cached, plain = (r.counters.as_dict() for r in runs)
    work = ("query_tokens", "cached_tokens")  # what the cache saves: the only counters that differ
    assert {k: v for k, v in cached.items() if k not in work} == {k: v for k, v in plain.items() if k not in work}
    assert plain["cached_tokens"] == 0 < cached["cached_tokens"] and cached["query_tokens"] < plain["query_tokens"]


def test_the_drafter_gets_the_target_features_of_every_kept_position(target):
    """Whenever the drafter proposes, the features it holds before each row's anchor equal a full no-cache
    pass of the target over the final sequence (written by the prefill or by verify rounds, the positions
    of rejected drafts rewritten)."""
    N, b, ids = 12, 4, (0, 1)
    prompts = random_prompts(5, seed=15)
    drafter = FeatureProbeDrafter(ids, 64, b, seed=1)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    propose = drafter.propose

    def probe(state: ProbeState, anchor_B, anchor_pos_B):
        seen.append((state.features_BTF.clone(), state.written_BT.clone(), anchor_pos_B.clone()))
        return propose(state, anchor_B, anchor_pos_B)

    drafter.propose = probe  # type: ignore[method-assign]
    out = decode(target, prompts, N, drafter=drafter)
    assert out.counters.accepted > 0  # the head over real features proposes something the target accepts
    assert len(seen) > 3
    for row, (p, s) in enumerate(zip(prompts, out.sequences, strict=True)):
        seq = torch.tensor([p + s])[:, :-1]  # every position but the last token's was run by the target
        with capture_layers(target, ids) as cap:
            target(seq, torch.arange(seq.shape[1])[None], AttentionMask("causal"))
        for features_BTF, written_BT, anchor_pos_B in seen:
            end = min(int(anchor_pos_B[row]), seq.shape[1])  # the context this proposal read
            torch.testing.assert_close(features_BTF[row, :end], cap.features()[0, :end], atol=1e-10, rtol=0)
            assert bool(written_BT[row, :end].all())


def test_the_capture_hooks_live_for_one_call(target):
    """The target's feature hooks are registered once per call (not per forward) and gone after it."""
    ids = (0, 1)
    drafter = FeatureProbeDrafter(ids, 64, 4, seed=1)
    registered: list[list[int]] = []
    propose = drafter.propose

    def probe(state, anchor_B, anchor_pos_B):
        registered.append([len(layer._forward_hooks) for layer in target.layers])
        return propose(state, anchor_B, anchor_pos_B)

    drafter.propose = probe  # type: ignore[method-assign]
    decode(target, random_prompts(3, seed=2), 8, drafter=drafter)
    expected = [1 if i in ids else 0 for i in range(len(target.layers))]
    assert len(registered) > 1 and all(r == expected for r in registered)
    assert all(not layer._forward_hooks for layer in target.layers)


# --------------------------------------------------------------------------------------------------
# sampling: the generated tokens' distribution is the target's


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit; bins with expected count < 5 merged into one (scipy-free: the chi-square
    survival function is the regularised upper incomplete gamma Q(k/2, x/2))."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)]).double()
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(len(obs) - 1), dtype=F64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


@pytest.mark.parametrize("drafter_kind", ["none", "random", "model"])
def test_generated_tokens_follow_the_target_softmax(target, drafter_kind):
    """20,000 rows of a 1-token prompt in one call, 2 tokens each at temperature 1: the first token (the
    prefill's) matches the target's softmax and the second (drafted and verified by the rejection rule, one
    round per row) matches the target's marginal sum_t p(t) p(. | t) (chi-square, p > 0.01), with and
    without a drafter; the drafter's own distribution q is rejected by the same test (the test has power)."""
    R, b = 20_000, 4
    prompt = [5]
    gen = torch.Generator().manual_seed(17)
    with torch.no_grad():
        logits = target(torch.tensor([prompt]), torch.zeros(1, 1, dtype=torch.long), AttentionMask("causal")).logits()
        logits[..., MASK_ID] = float("-inf")
        p_first = token_probs(logits[0, 0], 1.0, None, None)
        pairs = torch.tensor([[prompt[0], t] for t in range(V)])  # every first token, then its next-token softmax
        second = target(pairs, torch.arange(2).expand(V, 2), AttentionMask("causal")).logits()[:, 1]
        second[..., MASK_ID] = float("-inf")
        p_second = (p_first[:, None] * token_probs(second, 1.0, None, None)).sum(0)
    if drafter_kind == "none":
        out = decode(target, [prompt] * R, 2, temperature=1.0, generator=gen)
    else:
        drafter = RandomDrafter(b, seed=2) if drafter_kind == "random" else ModelDrafter(
            causal_model(seed=5, dtype=F64), [prompt] * R, b)  # fmt: skip
        q_first: list[torch.Tensor] = []
        propose = drafter.propose
        drafter.propose = lambda *a: q_first.append(x := propose(*a)) or x  # type: ignore[method-assign]
        out = decode(target, [prompt] * R, 2, drafter=drafter, temperature=1.0, generator=gen)
        assert out.counters.rounds == R and 0 < out.counters.accepted < out.counters.drafted
        q = torch.softmax(q_first[0][:, 0].masked_fill(torch.arange(V) == MASK_ID, float("-inf")), -1)
        drafted = torch.bincount(torch.multinomial(q, 1, generator=gen)[:, 0], minlength=V)
        assert chi_square_p(drafted, p_second) < 1e-6
    for position, probs in ((0, p_first), (1, p_second)):
        counts = torch.bincount(new_tokens(out, 2)[:, position], minlength=V)
        assert counts[MASK_ID] == 0
        assert chi_square_p(counts, probs) > 0.01, position


# --------------------------------------------------------------------------------------------------
# bad input


def test_bad_drafters_and_folders_are_refused(target, tmp_path):
    with pytest.raises(ConfigError, match="trained with blocks of 4, not 8"):
        check_drafter(RandomDrafter(4), target, block_size=8)
    check_drafter(RandomDrafter(4), target, block_size=4)
    with pytest.raises(ConfigError, match=r"reads target layers \[5\], but the target has 2 layers"):
        check_drafter(FeatureProbeDrafter((1, 5), 64, 4), target)
    with pytest.raises(CheckpointError, match="is not a drafter folder"):
        load_drafter(tmp_path, target)
    prompts = random_prompts(4, seed=19)  # a drafter of block size 1 proposes nothing: AR decoding
    assert (
        decode(target, prompts, 6, drafter=RandomDrafter(1)).sequences == greedy_reference(target, prompts, 6).sequences
    )


def test_sampling_keeps_to_the_targets_top_k_and_stops(target):
    """With top_k the target's distribution is zero outside its k best: a draft there is always rejected
    and the residual never draws it, so every token is in the target's top-k at its position."""
    prompts = random_prompts(16, seed=18)
    out = decode(target, prompts, 10, drafter=RandomDrafter(4, seed=3), temperature=1.0, top_k=3,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    for p, s in zip(prompts, out.sequences, strict=True):
        seq = torch.tensor([p + s])
        with torch.no_grad():
            logits = target(seq, torch.arange(seq.shape[1])[None], AttentionMask("causal")).logits()[0]
        logits[:, MASK_ID] = float("-inf")
        top3 = logits[len(p) - 1 : -1].topk(3, dim=-1).indices
        assert bool((top3 == torch.tensor(s)[:, None]).any(-1).all())
    ref = greedy_reference(target, prompts, 10)
    stopped = decode(target, prompts, 10, drafter=RandomDrafter(4), stop=lambda ids: len(ids) >= 4)
    assert [s[:4] for s in stopped.sequences] == [s[:4] for s in ref.sequences]
    assert all(4 <= len(s) < 4 + 4 for s in stopped.sequences)  # a round adds at most the block size
