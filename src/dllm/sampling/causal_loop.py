"""THE causal loop: speculative decoding, of which AR decoding is the case with a drafter that proposes nothing.

Each round, per row: the drafter proposes b - 1 tokens after the anchor (the last token the target
has not yet run); the target runs [anchor, d_1 .. d_{b-1}] in one forward against its ragged KV cache
(causal.py) and keeps the longest prefix it agrees with, plus one token of its own (at the first
disagreement, or the bonus token after a fully accepted block). Greedy: d_i is kept while it equals
the target's argmax. Temperature > 0: the speculative rejection-sampling rule (Leviathan et al. 2023,
"Fast inference from transformers via speculative decoding", Alg. 1; Chen et al. 2023): keep d_i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from norm(max(p_i - q_i, 0)); so
every output token is distributed exactly as the target's own sampling. Rows keep different numbers
of tokens: the cache's per-row length is set past the kept ones (rejected positions are rolled back).
With `NoDrafter` (b = 1) a round runs the anchor alone and keeps the target's token: AR decoding.

The loop is one request's decoding, advanced one target forward at a time (`decode` is a coroutine): it
yields the `CausalCall` it needs (its rows' tokens of the next target forward) and is sent the logits
(and the captured target features) of those rows. It never runs the target itself: the inference
engine's executor runs one forward for the rows of every causal request running (inference/executor.py),
and keeps their keys in one ragged cache. After each answer the loop says how many of the forward's
tokens each row keeps (`kept_B`): the executor commits them (rejected drafts are rolled back) before
the next forward. The drafter is the request's own (its state, its forward) and runs inside the step.

The prompts run once (prefill), and their last logits give the first token: the target's own choice,
greedy or sampled. It is the first anchor, so the first proposal already reads the features of every
prompt position (the last one included, the most telling about what comes next). DFlash drafters
(Chen et al. 2025) condition on target hidden states: the target's blocks `drafter.target_layer_ids`
are captured during every target forward (models/capture.py) and handed to `drafter.extend` at their
positions. A drafter whose proposals depend on each other (DFlash2's candidate selector) picks its own
drafts from its logits (`SelectingDrafter.select_drafts`); the verification is the same, so decoding stays
lossless.

The canvas of a row is its prompt, then its decided tokens, then masks (a row's position = its canvas
index), so the step callback and the result look like the diffusion loop's.

Shapes: B batch (the request's rows), b block size (anchor + b - 1 drafts), P prompt length, N new tokens,
T canvas, Q query tokens per row, R logit rows, V vocabulary, F captured target features.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from dllm.config.sampler import SamplerConfig
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.causal import right_pad
from dllm.sampling.proposals import draw, token_probs
from dllm.sampling.results import Counters, GenerationResult, StepEvent
from dllm.sampling.speculative import Drafter, NoDrafter, SelectingDrafter, choose


@dataclass(frozen=True)
class CausalCall:
    """A target forward a causal loop needs: Q tokens per row, run at each row's cached length + [0, Q)."""

    tokens_BQ: torch.Tensor
    logit_rows_BR: torch.Tensor | None = None
    """Which of the Q rows need logits (indices into Q); None: all of them."""
    keep_B: torch.Tensor | None = None
    """The tokens each row keeps, when known before the forward (a prefill, an AR round): a hybrid model's
    linear layers then keep their states at once. None: known after verification (`CausalLoop.kept_B`)."""
    layer_ids: tuple[int, ...] = ()
    """The target blocks whose outputs the loop reads (its drafter's), concatenated in this order."""
    prefill: bool = False
    """The request's first forward: its rows start empty (the executor runs it alone, then adds the rows)."""


CausalAnswer = tuple[torch.Tensor, torch.Tensor | None]
"""The logits [B, R, V] of a call's logit rows (float32 at least, the mask id excluded) and the captured
features [B, Q, F] of its `layer_ids` (None without any)."""


class CausalLoop:
    """One causal decoding request: the drafter's state, the canvas, the counters, and the loop (`decode`)."""

    def __init__(
        self, prompts: Sequence[Sequence[int]], cfg: SamplerConfig, special: SpecialIds, device: torch.device, *,
        drafter: Drafter | None = None, generator: torch.Generator | None = None,
        callback: Callable[[StepEvent], None] | None = None, stop: Callable[[list[int]], bool] | None = None,
        return_logits: bool = False,
    ) -> None:  # fmt: skip
        drafter = drafter or NoDrafter()
        self.cfg, self.special, self.drafter, self.generator = cfg, special, drafter, generator
        self.callback, self.stop, self.device = callback, stop, device
        self.tokens_BP, self.len_B = right_pad(prompts, device)
        B, P, N, b = len(prompts), self.tokens_BP.shape[1], cfg.gen_length, drafter.block_size
        self.eos_id = special.eos_id if cfg.stop_at_eos else None
        self.counters = Counters(loop="causal")
        self.capacity = P + N + 2 * b
        """Positions a row may reach: its last round may end b - 1 tokens past its N-th, and an ended row
        still runs a block there."""
        self.state = drafter.start(B, self.capacity)
        self.drafting = b > 1
        self.select = drafter.select_drafts if isinstance(drafter, SelectingDrafter) else None
        arange_T = torch.arange(self.capacity, device=device)
        self.canvas_BT = torch.full((B, self.capacity), special.mask_id, dtype=torch.long, device=device)
        self.canvas_BT[:, :P] = torch.where(arange_T[:P] < self.len_B[:, None], self.tokens_BP, special.mask_id)
        self.length_B = torch.zeros(B, dtype=torch.long, device=device)
        """Tokens of each row the target has run and kept (its cached length)."""
        self.kept_B = self.length_B
        """Tokens each row kept of the last forward answered (the executor commits them)."""
        self.num_B = torch.zeros(B, dtype=torch.long, device=device)  # tokens generated per row
        self.ended_B = torch.zeros(B, dtype=torch.bool, device=device)
        self.live_rows = B  # rows not ended (read on the host once per round)
        self.arange_b, self.arange_N, self.after_b = arange_T[:b], arange_T[:N], arange_T[1 : b + 1]
        self.no_mask = torch.tensor([special.mask_id], device=device)
        self.logits_BTV: torch.Tensor | None = None  # with return_logits: at each token's canvas index
        self.return_logits = return_logits
        self.anchor_B = self.len_B  # each row's anchor, the last token the target has not run (set by prefill)

    @property
    def rows(self) -> int:
        return self.canvas_BT.shape[0]

    def decode(self) -> Generator[CausalCall, CausalAnswer, GenerationResult]:
        """The loop as a coroutine: it yields each target forward it needs and is sent that forward's answer."""
        running = yield from self.prefill()
        while running:
            running = yield from self.round()
        return self.result()

    def keep(self, kept_B: torch.Tensor) -> None:
        """The rows keep `kept_B` tokens of the forward just answered (now cached)."""
        self.kept_B = kept_B
        self.length_B = self.length_B + kept_B

    def prefill(self) -> Generator[CausalCall, CausalAnswer, bool]:
        """Every prompt position's features, and the first token from the last one's logits; whether a row runs on."""
        B, P = self.tokens_BP.shape
        ids = self.drafter.target_layer_ids
        logits_B1V, features = yield CausalCall(self.tokens_BP, (self.len_B - 1)[:, None], self.len_B, ids, True)
        self.keep(self.len_B)
        if self.drafting:
            positions_BP = torch.arange(P, device=self.device).expand(B, P)
            self.drafter.extend(self.state, _features(features, B, P, self.device), positions_BP)
        self.anchor_B = self.choose(logits_B1V[:, 0])
        self.canvas_BT.scatter_(1, self.len_B[:, None], self.anchor_B[:, None])
        ones_B = torch.ones_like(self.len_B)
        self.keep_logits(logits_B1V, self.len_B, ones_B)
        self.num_B = ones_B
        self.ended_B = self.row_ended(self.anchor_B[:, None], ones_B[:, None].bool())
        self.show(self.len_B, ones_B)
        self.live_rows = self.ended_B.tolist().count(False)
        return self.live_rows > 0

    def round(self) -> Generator[CausalCall, CausalAnswer, bool]:
        """Propose, verify, keep: one target forward for every row; whether a row runs on. Ended rows ride
        along (their tokens are neither kept nor shown)."""
        B = self.rows
        anchor_pos_B = self.length_B
        drafts_Bd, q = self.draft(anchor_pos_B)
        block_Bb = torch.cat([self.anchor_B[:, None], drafts_Bd], dim=1) if self.drafting else self.anchor_B[:, None]
        live_B = ~self.ended_B
        # AR keeps the anchor of each live row, known now; a verification's kept tokens are known after it
        call = CausalCall(block_Bb, None, None if self.drafting else live_B.long(), self.drafter.target_layer_ids)
        logits_BbV, features = yield call
        num_accepted_B, next_B = self.verify(drafts_Bd, q, logits_BbV)
        if num_accepted_B is None:  # AR: the round's token is the target's own
            keep_B, new_Bb, kept_Bb = live_B.long(), next_B[:, None], live_B[:, None]
        else:  # the accepted drafts, then the target's own token (the rest is overwritten by masks below)
            keep_B = torch.where(live_B, num_accepted_B + 1, 0)
            new_Bb = torch.cat([drafts_Bd, next_B[:, None]], dim=1).scatter_(
                1, num_accepted_B[:, None], next_B[:, None]
            )
            kept_Bb = self.arange_b < keep_B[:, None]
        new_Bb = torch.where(kept_Bb, new_Bb, self.special.mask_id)
        self.canvas_BT.scatter_(1, anchor_pos_B[:, None] + self.after_b, new_Bb)
        self.keep_logits(logits_BbV, anchor_pos_B + 1, keep_B)
        self.keep(keep_B)  # the anchor and the accepted drafts are now cached; the rest rolls back
        self.num_B = self.num_B + keep_B
        self.anchor_B = next_B  # (an ended row's is never kept)
        self.counters.steps, self.counters.rounds = self.counters.steps + 1, self.counters.rounds + self.live_rows
        self.ended_B = self.ended_B | self.row_ended(new_Bb, kept_Bb)
        self.show(anchor_pos_B + 1, keep_B)
        if not self.drafting:
            self.live_rows = self.ended_B.tolist().count(False)  # the round's host sync
            return self.live_rows > 0
        # the round's host sync: which rows run on, and the most verified positions a row keeps
        host = torch.cat([keep_B, self.ended_B]).tolist()
        self.live_rows = host[B:].count(False)
        if self.live_rows:  # the kept positions' features (a row's past its new length are rewritten next round)
            kept = max(host[:B])
            features_Bk = _features(features, B, self.drafter.block_size, self.device)[:, :kept]
            self.drafter.extend(self.state, features_Bk, anchor_pos_B[:, None] + self.arange_b[:kept])
        return self.live_rows > 0

    def choose(self, logits_BV: torch.Tensor) -> torch.Tensor:
        return choose(self.cfg, logits_BV, self.generator)

    def probs(self, logits_XV: torch.Tensor) -> torch.Tensor:
        return token_probs(logits_XV, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)

    def draft(self, anchor_pos_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafted tokens [B, b-1] and, when sampling, the draft distribution q [B, b-1, V] they came from."""
        if not self.drafting:
            return self.anchor_B.new_zeros(self.anchor_B.shape[0], 0), None
        logits_BdV = self.drafter.propose(self.state, self.anchor_B, anchor_pos_B)
        logits_BdV = logits_BdV.index_fill(-1, self.no_mask, float("-inf"))  # the mask token is never a proposal
        if self.select is not None:
            return self.select(self.state, logits_BdV, self.anchor_B, self.cfg.temperature, self.generator)
        if self.cfg.temperature == 0:
            return logits_BdV.argmax(-1), None
        q = self.probs(logits_BdV)
        return draw(q, self.generator), q

    def verify(
        self, drafts_Bd: torch.Tensor, q: torch.Tensor | None, logits_BbV: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(accepted drafts per row [B], the target's own next token [B]) from the verify logits [B, b, V]:
        row i of the logits is the target's prediction after the anchor and the first i drafts. Nothing
        proposed (AR decoding): (None, the target's own token)."""
        B, d = drafts_Bd.shape
        if d == 0:
            return None, self.choose(logits_BbV[:, 0])
        if q is None:  # greedy: keep drafts while they equal the target's argmax; then the target's argmax
            choice = logits_BbV.argmax(-1)
            num = (drafts_Bd == choice[:, :-1]).long().cumprod(-1).sum(-1)
            return num, choice.gather(1, num[:, None])[:, 0]
        p = self.probs(logits_BbV)  # [B, b, V]
        p_d = p[:, :-1].gather(-1, drafts_Bd[..., None])[..., 0]
        q_d = q.gather(-1, drafts_Bd[..., None])[..., 0]
        u = torch.rand(B, d, generator=self.generator, device=drafts_Bd.device, dtype=p.dtype)
        num = (u * q_d < p_d).long().cumprod(-1).sum(-1)  # accept d_i with probability min(1, p/q)
        p_n = p.gather(1, num[:, None, None].expand(B, 1, p.shape[-1]))[:, 0]
        q_n = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1).gather(1, num[:, None, None].expand(B, 1, q.shape[-1]))
        residual = (p_n - q_n[:, 0]).clamp_min(0)  # after a full block q_n is 0: the bonus token from p
        # p == q on the rejected position cannot reject (probability 0); guard the empty residual anyway
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
        return num, draw(residual, self.generator)

    def row_ended(self, new_BQ: torch.Tensor, kept_BQ: torch.Tensor) -> torch.Tensor:
        """Rows that end with this round's kept tokens (`new_BQ` where `kept_BQ`): an EOS among them, N tokens,
        or (`stop`) a stop string in the decided text."""
        ended_B = self.num_B >= self.cfg.gen_length
        if self.eos_id is not None:
            ended_B |= ((new_BQ == self.eos_id) & kept_BQ).any(-1)
        if self.stop is not None:
            ended_B |= torch.tensor([self.stop(ids) for ids in self.sequences()], device=self.device)
        return ended_B

    def keep_logits(self, logits_BQV: torch.Tensor, start_B: torch.Tensor, keep_B: torch.Tensor) -> None:
        """With return_logits: the logits of the kept tokens at their canvas indices [start, start + keep)
        (the rest go to index 0, a prompt position, never read)."""
        if not self.return_logits:
            return
        if self.logits_BTV is None:
            B, T = self.canvas_BT.shape
            self.logits_BTV = logits_BQV.new_zeros(B, T, logits_BQV.shape[-1])
        arange_Q = self.arange_b[: logits_BQV.shape[1]]
        at_BQ = torch.where(arange_Q < keep_B[:, None], start_B[:, None] + arange_Q, 0)
        self.logits_BTV.scatter_(1, at_BQ[..., None].expand_as(logits_BQV), logits_BQV)

    def show(self, start_B: torch.Tensor, keep_B: torch.Tensor) -> None:
        """The step callback: the canvas and the positions [start, start + keep) decided this round."""
        if self.callback is None:
            return
        arange_T = torch.arange(self.canvas_BT.shape[1], device=self.device)
        committed_BT = (arange_T >= start_B[:, None]) & (arange_T < (start_B + keep_B)[:, None])
        gen_start = self.len_B.tolist()
        self.callback(StepEvent(self.canvas_BT, committed_BT, 0, self.counters.steps, gen_start, self.special.mask_id))

    def sequences(self) -> list[list[int]]:
        """Each row's decided tokens (at most N), cut before its first EOS."""
        N = self.cfg.gen_length
        gen_BN = self.canvas_BT.gather(1, self.len_B[:, None] + self.arange_N)
        rows = [r[:n] for r, n in zip(gen_BN.tolist(), self.num_B.clamp_max(N).tolist(), strict=True)]
        eos = self.eos_id
        return [r[: r.index(eos)] if eos is not None and eos in r else r for r in rows]

    def result(self) -> GenerationResult:
        """Sequences, the canvas [B, P + N] (undecided positions of a row's N hold the EOS, past them padding)."""
        B, P = self.tokens_BP.shape
        N, c = self.cfg.gen_length, self.counters
        sequences = self.sequences()
        # a running row's round keeps its accepted drafts + 1: after the prefill's token, num = rounds + accepted
        c.accepted = int(self.num_B.sum()) - B - c.rounds
        c.drafted = c.rounds * (self.drafter.block_size - 1)
        num = self.num_B.clamp_max(N).tolist()
        c.tokens_committed = sum(min(len(s) + 1, n) for s, n in zip(sequences, num, strict=True))  # EOS included
        arange_L = torch.arange(P + N, device=self.device)
        canvas_BL = self.canvas_BT[:, : P + N]
        gen_BL = (arange_L >= self.len_B[:, None]) & (arange_L < (self.len_B + N)[:, None])
        canvas_BL = torch.where(gen_BL & (canvas_BL == self.special.mask_id), self.special.eos_id, canvas_BL)
        canvas_BL = torch.where(arange_L >= (self.len_B + N)[:, None], self.special.pad_id, canvas_BL)
        logits = None
        if self.logits_BTV is not None:
            at_BN = self.len_B[:, None] + self.arange_N
            logits = self.logits_BTV.gather(1, at_BN[..., None].expand(B, N, self.logits_BTV.shape[-1]))
        return GenerationResult(sequences, canvas_BL, c, self.len_B.tolist(), logits)


def _features(features: torch.Tensor | None, B: int, n: int, device: torch.device) -> torch.Tensor:
    """The captured features [B, n, F]; an empty F for a drafter that reads none."""
    return features if features is not None else torch.zeros(B, n, 0, device=device)
