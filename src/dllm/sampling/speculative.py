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

The prompts run once (prefill), and their last logits give the first token: the target's own choice,
greedy or sampled. It is the first anchor, so the first proposal already reads the features of every
prompt position (the last one included, the most telling about what comes next). DFlash drafters
(Chen et al. 2025) condition on target hidden states: the target's blocks `drafter.target_layer_ids`
are captured during every target forward (models/capture.py) and handed to `drafter.extend` at their
positions. A drafter whose proposals depend on each other (DFlash2's candidate selector: a chain through each
position's top candidates) picks its own drafts from its logits (`SelectingDrafter.select_drafts`: tokens,
and when sampling the distributions q they were drawn from), as the public DFlash2 generation loop does; the
verification is the same, so decoding stays lossless.

The canvas of a row is its prompt, then its decided tokens, then masks (a row's position = its canvas
index), so the step callback and the result look like the diffusion loop's.

Shapes: B batch, b block size (anchor + b - 1 drafts), P prompt length, N new tokens, T canvas,
V vocabulary, F captured target features.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import ValidationError
from torch import nn

from dllm.config.drafter import DrafterKind
from dllm.config.registries import DRAFTER_ARCHITECTURES, DRAFTERS
from dllm.config.sampler import SamplerConfig
from dllm.errors import CheckpointError, ConfigError
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.causal import Recompute, Target, right_pad
from dllm.sampling.proposals import draw, token_probs
from dllm.sampling.results import Counters, GenerationResult, StepEvent


@runtime_checkable
class Drafter(Protocol):
    """What speculative decoding needs from a drafter (a DFlash model, or any proposer)."""

    block_size: int
    """b: one round proposes b - 1 tokens after the anchor."""
    target_layer_ids: tuple[int, ...]
    """Target blocks whose outputs it reads (0-based into target.layers); may be ()."""

    def start(self, batch_size: int, max_length: int) -> Any:
        """Fresh per-call state (e.g. the drafter's own K/V buffers over projected target features)."""
        ...

    def extend(self, state: Any, features_BNF: torch.Tensor, positions_BN: torch.Tensor) -> None:
        """Target features (the captured blocks' outputs concatenated in target_layer_ids order, F = len(ids)
        * E) of N positions per row, written at those positions; a later write to a position overwrites an
        earlier one (rejected positions get rewritten)."""
        ...

    def propose(self, state: Any, anchor_B: torch.Tensor, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        """Logits [B, b-1, V] for positions anchor_pos+1 .. anchor_pos+b-1, attending to the context features
        of positions [0, anchor_pos_B) of each row plus its own block. It may overwrite what `extend` wrote
        at positions >= anchor_pos_B (the loop extends every verified position before it is read)."""
        ...


@runtime_checkable
class SelectingDrafter(Drafter, Protocol):
    """A drafter that picks its drafts itself rather than per position from its logits (DFlash2)."""

    def select_drafts(
        self, state: Any, logits_BdV: torch.Tensor, anchor_B: torch.Tensor, temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """(drafts [B, d] for the first d positions of the last `propose`'s logits, and at temperature > 0 the
        distributions q [B, d, V] each was drawn from, given the drafts before it)."""
        ...


class NoDrafter:
    """The drafter of AR decoding: proposes nothing (b = 1), reads no target features."""

    block_size = 1
    target_layer_ids: tuple[int, ...] = ()

    def start(self, batch_size: int, max_length: int) -> None:
        return None

    def extend(self, state: Any, features_BNF: torch.Tensor, positions_BN: torch.Tensor) -> None:
        return None

    def propose(self, state: Any, anchor_B: torch.Tensor, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        return torch.empty(anchor_B.shape[0], 0, 0, device=anchor_B.device)


def causal_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    cfg: SamplerConfig,
    special: SpecialIds,
    *,
    drafter: Drafter | None = None,
    generator: torch.Generator | None = None,
    callback: Callable[[StepEvent], None] | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    use_cache: bool = True,
    return_logits: bool = False,
) -> GenerationResult:
    """Decode up to `cfg.gen_length` tokens per prompt with the target `model` (greedy or sampled at
    `cfg.temperature`, `top_k`, `top_p`), one token per round, or more with a drafter's proposals: the
    output is the target's own (greedy: token for token; sampled: in distribution). A row ends at its
    first EOS (`cfg.stop_at_eos`) or once `stop(row_ids)` holds; ended rows ride along without advancing.
    `use_cache=False` runs each row's whole sequence every round (the reference of the ragged cache);
    `return_logits` keeps the logits each token was chosen from. `sampling.generate` calls this for
    `cfg.generation == "causal"` (under inference mode)."""
    loop = CausalLoop(model, prompts, cfg, special, drafter or NoDrafter(), generator, callback, stop, use_cache,
                      return_logits)  # fmt: skip
    with loop.target.capturing():  # the feature hooks stay registered for the call
        running = loop.prefill()
        while running:
            running = loop.round()
    return loop.result()


class CausalLoop:
    """One causal decoding call: the target over its ragged cache, the drafter's state, the canvas, the counters."""

    def __init__(
        self, model: nn.Module, prompts: Sequence[Sequence[int]], cfg: SamplerConfig, special: SpecialIds,
        drafter: Drafter, generator, callback, stop, use_cache: bool, return_logits: bool,
    ) -> None:  # fmt: skip
        self.cfg, self.special, self.drafter, self.generator = cfg, special, drafter, generator
        self.callback, self.stop = callback, stop
        self.device = device = next(model.parameters()).device
        self.tokens_BP, self.len_B = right_pad(prompts, device)
        B, P, N, b = len(prompts), self.tokens_BP.shape[1], cfg.gen_length, drafter.block_size
        self.eos_id = special.eos_id if cfg.stop_at_eos else None
        self.counters = Counters(loop="causal")
        # a row's last round may end b - 1 tokens past its N-th, and an ended row still runs a block there
        capacity = P + N + 2 * b
        kind = Target if use_cache else Recompute
        self.target = kind(model, B, capacity, self.counters, drafter.target_layer_ids, special.mask_id)
        self.state = drafter.start(B, capacity)
        self.drafting = b > 1
        self.select = drafter.select_drafts if isinstance(drafter, SelectingDrafter) else None
        arange_T = torch.arange(capacity, device=device)
        prompt_BT = arange_T < self.len_B[:, None]
        self.canvas_BT = torch.full((B, capacity), special.mask_id, dtype=torch.long, device=device)
        self.canvas_BT[:, :P] = torch.where(prompt_BT[:, :P], self.tokens_BP, special.mask_id)
        self.num_B = torch.zeros(B, dtype=torch.long, device=device)  # tokens generated per row
        self.ended_B = torch.zeros(B, dtype=torch.bool, device=device)
        self.live_rows = B  # rows not ended (read on the host once per round)
        self.arange_b, self.arange_N, self.after_b = arange_T[:b], arange_T[:N], arange_T[1 : b + 1]
        self.no_mask = torch.tensor([special.mask_id], device=device)
        self.logits_BTV: torch.Tensor | None = None  # with return_logits: at each token's canvas index
        self.return_logits = return_logits
        self.anchor_B = self.len_B  # each row's anchor, the last token the target has not run (set by prefill)

    def prefill(self) -> bool:
        """Every prompt position's features, and the first token from the last one's logits; whether a row runs on."""
        B, P = self.tokens_BP.shape
        logits_B1V, features = self.target.forward(self.tokens_BP, (self.len_B - 1)[:, None], keep_B=self.len_B)
        self.target.commit(self.len_B)
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

    def round(self) -> bool:
        """Propose, verify, keep: one target forward for every row; whether a row runs on. Ended rows ride
        along (their tokens are neither kept nor shown)."""
        B = self.num_B.shape[0]
        anchor_pos_B = self.target.length_B  # commit replaces the tensor: this one stays the round's
        drafts_Bd, q = self.draft(anchor_pos_B)
        block_Bb = torch.cat([self.anchor_B[:, None], drafts_Bd], dim=1) if self.drafting else self.anchor_B[:, None]
        live_B = ~self.ended_B
        # AR keeps the anchor of each live row, known now; a verification's kept tokens are known after it
        logits_BbV, features = self.target.forward(block_Bb, keep_B=None if self.drafting else live_B.long())
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
        self.target.commit(keep_B)  # the anchor and the accepted drafts are now cached; the rest rolls back
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


def choose(cfg: SamplerConfig, logits_BV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The target's own token: the argmax when greedy, else a draw from its sampling distribution."""
    if cfg.temperature == 0:
        return logits_BV.argmax(-1)
    return draw(token_probs(logits_BV, cfg.temperature, cfg.top_k, cfg.top_p), generator)


def _features(features: torch.Tensor | None, B: int, n: int, device: torch.device) -> torch.Tensor:
    """The captured features [B, n, F]; an empty F for a drafter that reads none."""
    return features if features is not None else torch.zeros(B, n, 0, device=device)


# ---------------------------------------------------------------------------------------------------
# loading a drafter folder: the seam a drafter family fills


def load_drafter(path: Path, target: nn.Module) -> Drafter:
    """The drafter saved in folder `path` for `target`. A drafter family (DFlash) fills this seam: its
    entry in config/registries.py, chosen by the folder's config.json (`model_type`, or a public layout's
    `architectures`), loads the weights and refuses a drafter trained for, or not fitting, another target."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"--draft: {path} is not a drafter folder (no config.json)")
    try:
        header = json.loads((path / "config.json").read_text(encoding="utf-8"))
        archs = header.get("architectures")
        public = [DRAFTER_ARCHITECTURES[a] for a in archs or [] if a in DRAFTER_ARCHITECTURES]
        kind = DrafterKind.model_validate({"model_type": public[0] if public else header.get("model_type")})
    except (ValueError, AttributeError, TypeError, ValidationError):
        raise CheckpointError(
            f"--draft: {path}/config.json names no drafter family (model_type one of {', '.join(DRAFTERS.names())}, "
            f"or architectures one of {', '.join(DRAFTER_ARCHITECTURES)}); export a drafter run with "
            "dllm convert --to-hf"
        ) from None
    return DRAFTERS.resolve(kind.model_type)(path, target)


def check_drafter(drafter: Drafter, target: nn.Module, block_size: int | None = None) -> Drafter:
    """The drafter that serves `target` with blocks of `block_size` (None: the drafter's own): the drafter
    itself, or for a shorter block `FirstProposals` of it. Refused: a longer block than it was trained for,
    or target layers the target does not have."""
    if block_size is not None and not 2 <= block_size <= drafter.block_size:
        raise ConfigError(
            f"--draft-block-size: the drafter was trained with blocks of {drafter.block_size}, not {block_size}; "
            f"use 2 to {drafter.block_size} (the target then verifies the drafter's first proposals) or a drafter "
            "trained for that block size"
        )
    num_layers = len(target.layers)  # type: ignore[arg-type]
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"--draft: the drafter reads target layers {bad}, but the target has {num_layers} layers; "
                          "it was trained for another target")  # fmt: skip
    if block_size is None or block_size == drafter.block_size:
        return drafter
    return FirstProposals(drafter, block_size)


class FirstProposals:
    """A drafter's first `block_size - 1` proposals: the target verifies blocks shorter than the drafter was
    trained with (a cheaper verification where one costs more per token, e.g. a large batch). The drafter
    still runs its whole block, the input it was trained on; its later proposals are dropped."""

    def __init__(self, drafter: Drafter, block_size: int) -> None:
        assert 2 <= block_size <= drafter.block_size
        self.drafter, self.block_size = drafter, block_size
        self.target_layer_ids = drafter.target_layer_ids
        if isinstance(drafter, SelectingDrafter):  # the first proposals of its chain (given its first logits)
            self.select_drafts = drafter.select_drafts

    def start(self, batch_size: int, max_length: int) -> Any:
        # the drafter's own block reaches block_size - self.block_size positions past the loop's
        return self.drafter.start(batch_size, max_length + self.drafter.block_size - self.block_size)

    def extend(self, state: Any, features_BNF: torch.Tensor, positions_BN: torch.Tensor) -> None:
        self.drafter.extend(state, features_BNF, positions_BN)

    def propose(self, state: Any, anchor_B: torch.Tensor, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        return self.drafter.propose(state, anchor_B, anchor_pos_B)[:, : self.block_size - 1]
