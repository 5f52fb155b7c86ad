"""Lossless speculative decoding: a drafter proposes a block, the causal target verifies it in one forward.

Each round, per row: the drafter proposes b - 1 tokens after the anchor (the last token the target
has not yet run); the target runs [anchor, d_1 .. d_{b-1}] in one forward against its ragged KV cache
(sampling/ar.py) and keeps the longest prefix it agrees with, plus one token of its own (at the first
disagreement, or the bonus token after a fully accepted block). Greedy: d_i is kept while it equals
the target's argmax. Temperature > 0: the speculative rejection-sampling rule (Leviathan et al. 2023,
"Fast inference from transformers via speculative decoding", Alg. 1; Chen et al. 2023): keep d_i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from norm(max(p_i - q_i, 0)); so
every output token is distributed exactly as the target's own sampling. Rows keep different numbers
of tokens: the cache's per-row length is set past the kept ones (rejected positions are rolled back).

The prompts run once (prefill), and their last logits give the first token, as in AR decoding: the
target's own choice, greedy or sampled. It is the first anchor, so the first proposal already reads
the features of every prompt position (the last one included, the most telling about what comes
next). DFlash drafters (Chen et al. 2025) condition on target hidden states: the target's blocks
`drafter.target_layer_ids` are captured during every target forward (models/capture.py) and handed to
`drafter.extend` at their positions.

Shapes: B batch, b block size (anchor + b - 1 drafts), P prompt length, N new tokens, V vocabulary,
F captured target features.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dllm.sampling.ar import (
    DecodeCounters,
    DecodeResult,
    Decoding,
    Recompute,
    Target,
    finish,
    right_pad,
    row_ended,
    sample,
)


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


def speculative_generate(
    target: nn.Module,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    decoding: Decoding,
    *,
    mask_id: int | None = None,
    generator: torch.Generator | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    use_cache: bool = True,
) -> DecodeResult:
    """Decode up to `max_new_tokens` per prompt with the drafter's proposals, verified by the target:
    the output is the target's own (greedy: token for token; sampled: in distribution).

    Rows that have ended keep riding along in the batch without advancing. `use_cache=False` verifies
    by recomputing each row's whole sequence (the reference of the ragged cache)."""
    b = drafter.block_size
    if b < 2:
        raise ValueError(f"a drafter proposes block_size - 1 >= 1 tokens per round; block_size is {b}")
    with torch.inference_mode():
        device = next(target.parameters()).device
        tokens_BP, lengths_B = right_pad(prompts, device)
        B, P, N = len(prompts), tokens_BP.shape[1], decoding.max_new_tokens
        # a row's last round may end b - 1 tokens past its N-th, and an ended row still runs a block there
        capacity = P + N + 2 * b
        runner = (Target if use_cache else Recompute)(target, B, capacity, drafter.target_layer_ids, mask_id)
        state = drafter.start(B, capacity)
        # a round writes b tokens after a row's num_B (those past its keep_B are rewritten by the next round),
        # an ended row's up to N + b - 1 + b
        out_BN = torch.zeros(B, N + 2 * b, dtype=torch.long, device=device)
        num_B = torch.zeros(B, dtype=torch.long, device=device)  # tokens generated per row
        ended_B = torch.zeros(B, dtype=torch.bool, device=device)
        rounds_B = torch.zeros_like(num_B)  # verify rounds per row while it runs
        arange_b = torch.arange(b, device=device)
        no_mask = torch.tensor([mask_id if mask_id is not None else 0], device=device)
        with runner.capturing():  # the feature hooks stay registered for the call
            # the prefill: every prompt position's features, and the first token from the last one's logits
            logits_B1V, features = runner.forward(tokens_BP, (lengths_B - 1)[:, None])
            runner.commit(lengths_B)
            drafter.extend(state, _features(features, B, P, device), torch.arange(P, device=device).expand(B, P))
            anchor_B = decoding.choose(logits_B1V[:, 0], generator)
            out_BN[:, 0] = anchor_B
            num_B = num_B + 1
            ended_B = row_ended(out_BN[:, :1], num_B, decoding.eos_id, stop) | (num_B >= N)
            running = not bool(ended_B.all())
            while running:
                anchor_pos_B = runner.length_B  # commit replaces the tensor: this one stays the round's
                draft_logits = drafter.propose(state, anchor_B, anchor_pos_B)
                if mask_id is not None:
                    draft_logits = draft_logits.index_fill(-1, no_mask, float("-inf"))
                drafts, q = _draft(draft_logits, decoding, generator)
                logits, features = runner.forward(torch.cat([anchor_B[:, None], drafts], dim=1))
                num_accepted_B, next_B = _verify(drafts, q, logits, decoding, generator)
                live_B = ~ended_B
                keep_B = torch.where(live_B, num_accepted_B + 1, 0)
                new_Bb = _append(out_BN, num_B, drafts, num_accepted_B, next_B)
                num_B = num_B + keep_B
                runner.commit(keep_B)  # the anchor and the accepted drafts are now cached; the rest rolls back
                anchor_B = torch.where(live_B, next_B, anchor_B)
                rounds_B += live_B
                ended_B = ended_B | (num_B >= N)
                if decoding.eos_id is not None:  # an EOS among the kept new tokens
                    ended_B |= ((new_Bb == decoding.eos_id) & (arange_b < keep_B[:, None])).any(-1)
                if stop is not None:
                    ended_B = ended_B | row_ended(out_BN[:, :N], num_B.clamp_max(N), decoding.eos_id, stop)
                # the round's host sync: whether a row runs on, and the most verified positions a row keeps
                host = torch.cat([keep_B, ended_B]).tolist()
                kept, running = max(host[:B]), not all(host[B:])
                if running:  # the kept positions' features (a row's past its new length are rewritten next round)
                    features_Bk = _features(features, B, b, device)[:, :kept]
                    drafter.extend(state, features_Bk, anchor_pos_B[:, None] + arange_b[:kept])
        # a running row's round keeps its accepted drafts + 1: after the prefill's token, num = rounds + accepted
        rounds, generated = torch.stack([rounds_B.sum(), num_B.sum()]).tolist()
        counters = DecodeCounters(rounds=rounds, accepted=generated - B - rounds)
        counters.drafted = counters.rounds * (b - 1)
        counters.target_forwards = runner.forwards
        result = finish(out_BN[:, :N], num_B, decoding.eos_id, counters)
    return result


def _append(out_BN, num_B, drafts, num_accepted_B, next_B) -> torch.Tensor:
    """Write each row's round [its accepted drafts, then the target's token, then the rejected drafts] into
    `out_BN` after its num_B generated tokens, and return it [B, b]: a row keeps the first keep_B of them
    (0 for an ended row, which writes past its end), the rest the next round overwrites."""
    new_Bb = torch.cat([drafts, drafts[:, :1]], dim=1).scatter_(1, num_accepted_B[:, None], next_B[:, None])
    out_BN.scatter_(1, num_B[:, None] + torch.arange(new_Bb.shape[1], device=drafts.device), new_Bb)
    return new_Bb


def _draft(draft_logits: torch.Tensor, decoding: Decoding, generator: torch.Generator | None):
    """The drafted tokens [B, b-1] and, when sampling, the draft distribution q [B, b-1, V] they came from."""
    if decoding.temperature == 0:
        return draft_logits.argmax(-1), None
    q = decoding.probs(draft_logits)
    return sample(q, generator), q


def _verify(
    drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, decoding: Decoding, generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts per row [B], the target's own next token [B]) from the verify logits [B, b, V]:
    row i of the logits is the target's prediction after the anchor and the first i drafts."""
    B, b1 = drafts.shape
    if q is None:  # greedy: keep drafts while they equal the target's argmax; then the target's argmax
        choice = logits.argmax(-1)
        num = (drafts == choice[:, :-1]).long().cumprod(-1).sum(-1)
        return num, choice.gather(1, num[:, None])[:, 0]
    p = decoding.probs(logits)  # [B, b, V]
    p_d = p[:, :-1].gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(B, b1, generator=generator, device=drafts.device, dtype=p.dtype)
    num = (u * q_d < p_d).long().cumprod(-1).sum(-1)  # accept d_i with probability min(1, p/q)
    p_n = p.gather(1, num[:, None, None].expand(B, 1, p.shape[-1]))[:, 0]
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1).gather(1, num[:, None, None].expand(B, 1, q.shape[-1]))
    residual = (p_n - q_n[:, 0]).clamp_min(0)  # after a full block q_n is 0: the bonus token from p
    # p == q on the rejected position cannot reject (probability 0); guard the empty residual anyway
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    return num, sample(residual, generator)


def _features(features: torch.Tensor | None, B: int, n: int, device: torch.device) -> torch.Tensor:
    """The captured features [B, n, F]; an empty F for a drafter that reads none."""
    return features if features is not None else torch.zeros(B, n, 0, device=device)


# ---------------------------------------------------------------------------------------------------
# loading a drafter folder: the seam a drafter family fills


def load_drafter(path: Path, target: nn.Module, loaded: Any = None) -> Drafter:
    """The drafter saved in folder `path` for `target` (`loaded`: the target's checkpoint.inference
    LoadedModel, for its identity). A drafter family (issue 18 part B: DFlash) fills this seam: its
    entry in config/registries.py, chosen by the folder's config.json, loads the weights and refuses a
    drafter trained for another target."""
    import json

    from pydantic import ValidationError

    from dllm.config.model import DrafterKind
    from dllm.config.registries import DRAFTERS
    from dllm.errors import CheckpointError

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"--draft: {path} is not a drafter folder (no config.json)")
    try:
        header = json.loads((path / "config.json").read_text(encoding="utf-8"))
        kind = DrafterKind.model_validate({"model_type": header.get("model_type")})
    except (ValueError, AttributeError, ValidationError):
        raise CheckpointError(
            f"--draft: {path}/config.json names no drafter family (model_type one of {', '.join(DRAFTERS.names())}); "
            "export a drafter run with dllm convert --to-hf"
        ) from None
    return DRAFTERS.resolve(kind.model_type)(path, target)


def check_drafter(drafter: Drafter, target: nn.Module, block_size: int | None = None) -> None:
    """Refuse a drafter that cannot serve `target`: a block size it was not trained for (`block_size`, the
    one asked for), or target layers the target does not have."""
    from dllm.errors import ConfigError

    if block_size is not None and block_size != drafter.block_size:
        raise ConfigError(
            f"--draft-block-size: the drafter was trained with blocks of {drafter.block_size}, not {block_size}; "
            "drop the flag or use a drafter trained for that block size"
        )
    num_layers = len(target.layers)  # type: ignore[arg-type]
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"--draft: the drafter reads target layers {bad}, but the target has {num_layers} layers; "
                          "it was trained for another target")  # fmt: skip
