"""Autoregressive decoding of causal models with a ragged KV cache (rows at different lengths).

A causal target (a run trained with objective `ar`, or an imported llama/qwen2/qwen3/gpt2 folder)
decodes one token per forward: the prompts run once (prefill), then each step runs one new token per
row against the cache. The same pieces serve speculative decoding (sampling/speculative.py), where a
forward verifies several tokens per row and rows keep different numbers of them.

The cache is ragged: row b holds its tokens at buffer index = position, [0, length_B[b]); a forward of
Q tokens writes them (scatter) at length_B[b] + [0, Q) and its queries attend causally to every index
up to their own (the AttentionMask's per-row query offsets). Whatever a row's buffer holds past its
length (padding of a shorter prompt, drafts the target rejected) lies after every query of that row,
so it is never read, and the next forward overwrites it: rolling back a rejection is setting the length.

`Recompute` is the plain reference with the same interface: every forward runs each row's whole
sequence again, no cache (tests and bench/ar_decoding.py compare the two).

Shapes: B batch, K key/value heads, T cache capacity, D head width, Q query tokens per row, P prompt
length, N new tokens, V vocabulary, F captured target features.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dllm.attention.masks import AttentionMask
from dllm.config.profile import DecodeProfile
from dllm.config.registries import FAMILIES
from dllm.models.capture import CapturedLayers, capture_layers
from dllm.sampling.proposals import filter_logits

# ---------------------------------------------------------------------------------------------------
# the ragged cache and the two ways to run the target


@dataclass
class RaggedLayerKV:
    """One layer's key/value buffers [B, K, T, D] (allocated on the first write)."""

    owner: RaggedKVCache
    k_BKTD: torch.Tensor | None = None
    v_BKTD: torch.Tensor | None = None

    def update(self, k_BKQD: torch.Tensor, v_BKQD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys/values at each row's `owner.write_BQ`; return the buffers [0, key_end)."""
        c = self.owner
        B, K, Q, D = k_BKQD.shape
        if self.k_BKTD is None or self.v_BKTD is None:
            self.k_BKTD = k_BKQD.new_zeros(B, K, c.capacity, D)
            self.v_BKTD = v_BKQD.new_zeros(B, K, c.capacity, D)
        index = c.write_BQ[:, None, :, None].expand(B, K, Q, D)
        self.k_BKTD.scatter_(2, index, k_BKQD)
        self.v_BKTD.scatter_(2, index, v_BKQD)
        return self.k_BKTD[:, :, : c.key_end], self.v_BKTD[:, :, : c.key_end]


@dataclass
class RaggedKVCache:
    """Per-layer buffers of `capacity` positions; row b's cached tokens are [0, length_B[b])."""

    capacity: int
    length_B: torch.Tensor
    write_BQ: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))
    """Where the next forward writes: length_B[:, None] + [0, Q) (set by `at`)."""
    key_end: int = 0
    """The next forward attends to buffer indices [0, key_end) (each row's causal mask cuts its own)."""
    layers: dict[int, RaggedLayerKV] = field(default_factory=dict)

    def layer(self, i: int) -> RaggedLayerKV:
        if i not in self.layers:
            self.layers[i] = RaggedLayerKV(self)
        return self.layers[i]

    def at(self, num_queries: int) -> tuple[torch.Tensor, AttentionMask]:
        """Place the next forward of Q tokens per row after each row's cached tokens: their positions
        [B, Q] (= buffer indices) and the causal mask with per-row query offsets."""
        arange_Q = torch.arange(num_queries, device=self.length_B.device)
        self.write_BQ = self.length_B[:, None] + arange_Q
        self.key_end = int(self.length_B.max()) + num_queries
        if self.key_end > self.capacity:
            raise ValueError(f"ragged cache: {self.key_end} positions do not fit its capacity {self.capacity}")
        if self.key_end == num_queries:  # every row empty (a prefill): plain causal, SDPA's is_causal kernel
            return self.write_BQ, AttentionMask("causal")
        return self.write_BQ, AttentionMask("causal", query_offset_B=self.length_B.clone())


class Target:
    """A causal model run over ragged rows: `forward(tokens_BQ)` runs Q tokens per row at positions
    length_B + [0, Q) and returns their logits [B, Q, V] (and the captured features [B, Q, F] of
    `layer_ids`, None without any); `length_B += n_B` (`commit`) keeps tokens, anything past is dropped.
    The default runs against the ragged KV cache; `Recompute` is the no-cache reference."""

    def __init__(self, model: nn.Module, batch: int, capacity: int, layer_ids: Sequence[int] = (),
                 mask_id: int | None = None) -> None:  # fmt: skip
        self.model, self.layer_ids, self.mask_id = model, tuple(layer_ids), mask_id
        self.device = next(model.parameters()).device
        self.length_B = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.capacity = capacity
        self.forwards = 0
        self.cache = RaggedKVCache(capacity, self.length_B)
        self._captured: CapturedLayers | None = None  # open while `capturing()` is

    @contextmanager
    def capturing(self) -> Iterator[Target]:
        """Keep the hooks that capture `layer_ids` registered over many forwards (a decoding call) rather
        than registering and removing them in every forward."""
        with capture_layers(self.model, self.layer_ids) as captured:
            self._captured = captured
            try:
                yield self
            finally:
                self._captured = None

    def forward(
        self, tokens_BQ: torch.Tensor, logit_rows_BR: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, R, V] at query rows `logit_rows_BR` (indices into Q; None: all Q) and features [B, Q, F]."""
        self.cache.length_B = self.length_B
        positions_BQ, mask = self.cache.at(tokens_BQ.shape[1])
        return self._run(tokens_BQ, positions_BQ, mask, self.cache, None, logit_rows_BR)

    def commit(self, n_B: torch.Tensor) -> None:
        """Keep n_B more tokens per row (those the last forward ran first); the rest is rolled back."""
        self.length_B = self.length_B + n_B

    def _run(self, tokens_BL, positions_BL, mask, cache, rows_BQ, logit_rows_BR):
        """The one model call: features at rows `rows_BQ` of its output (None: all rows) and logits at
        `logit_rows_BR` of those (None: all), the mask token excluded."""
        if self.layer_ids and self._captured is None:  # a forward outside `capturing()`: hooks for it alone
            with self.capturing():
                return self._run(tokens_BL, positions_BL, mask, cache, rows_BQ, logit_rows_BR)
        self.forwards += 1
        out = self.model(tokens_BL, positions_BL, mask, cache=cache)
        features = self._captured.features() if self._captured is not None and self.layer_ids else None
        hidden = out.hidden_BLE if rows_BQ is None else _rows(out.hidden_BLE, rows_BQ)
        if features is not None and rows_BQ is not None:
            features = _rows(features, rows_BQ)
        if logit_rows_BR is not None:  # the head only where logits are read (a prefill needs one row)
            hidden = _rows(hidden, logit_rows_BR)
        head, weight, bias = out.head(hidden)
        logits = F.linear(head, weight, bias)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if self.mask_id is not None:  # never a prediction (the objectives exclude it from the softmax too)
            logits[..., self.mask_id] = float("-inf")
        return logits, features


class Recompute(Target):
    """The plain reference: every forward runs each row's whole sequence [0, length + Q) again, no cache."""

    def __init__(self, model: nn.Module, batch: int, capacity: int, layer_ids: Sequence[int] = (),
                 mask_id: int | None = None) -> None:  # fmt: skip
        super().__init__(model, batch, capacity, layer_ids, mask_id)
        self.tokens_BT = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)

    def forward(
        self, tokens_BQ: torch.Tensor, logit_rows_BR: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, Q = tokens_BQ.shape
        write_BQ = self.length_B[:, None] + torch.arange(Q, device=self.device)
        self.tokens_BT.scatter_(1, write_BQ, tokens_BQ)
        end = int(write_BQ.max()) + 1
        positions = torch.arange(end, device=self.device).expand(B, end)
        return self._run(self.tokens_BT[:, :end], positions, AttentionMask("causal"), None, write_BQ, logit_rows_BR)


def _rows(x_BLE: torch.Tensor, rows_BQ: torch.Tensor) -> torch.Tensor:
    return x_BLE.gather(1, rows_BQ[..., None].expand(-1, -1, x_BLE.shape[-1]))


# ---------------------------------------------------------------------------------------------------
# choosing tokens: greedy, or sampling from the temperature / top-k / top-p distribution


@dataclass(frozen=True)
class Decoding:
    """How tokens are chosen and when rows end (shared by AR and speculative decoding)."""

    max_new_tokens: int = 32
    """Tokens to generate per row (fewer when the row ends at an EOS or a stop)."""
    temperature: float = 0.0
    """0: greedy (argmax); above 0: sample from softmax(filtered logits / temperature)."""
    top_k: int | None = None
    """Sample only among the k most probable tokens; None keeps all."""
    top_p: float | None = None
    """Nucleus sampling: the smallest set of tokens with this total probability; None keeps all."""
    eos_id: int | None = None
    """A row ends after its first EOS (cut from the output); None: every row runs max_new_tokens."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0:
            raise ValueError(f"max_new_tokens must be >= 1 and temperature >= 0, got {self}")

    def probs(self, logits_XV: torch.Tensor) -> torch.Tensor:
        """The sampling distribution (float64): top-k / top-p on the logits, then the temperature, as
        the diffusion sampler's proposals do (sampling/proposals.py)."""
        return torch.softmax(filter_logits(logits_XV.double(), self.top_k, self.top_p) / self.temperature, dim=-1)

    def choose(self, logits_XV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """One token per row of logits: the argmax when greedy, else a draw from `probs`."""
        if self.temperature == 0:
            return logits_XV.argmax(-1)
        return sample(self.probs(logits_XV), generator)


def sample(probs_XV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of a (not necessarily normalised) distribution, by inverting its CDF with one
    seeded uniform per row; a zero-probability token is never drawn."""
    cdf_XV = probs_XV.cumsum(-1)
    u_X1 = torch.rand(cdf_XV.shape[:-1], generator=generator, device=cdf_XV.device, dtype=cdf_XV.dtype)[..., None]
    return torch.searchsorted(cdf_XV, u_X1 * cdf_XV[..., -1:], right=True).squeeze(-1).clamp_max(cdf_XV.shape[-1] - 1)


# ---------------------------------------------------------------------------------------------------
# results


@dataclass
class DecodeCounters:
    """What a call cost. Tokens count each row's output up to its end (EOS included)."""

    target_forwards: int = 0
    """Forward calls of the target model (the prefill included)."""
    tokens: int = 0
    """Tokens generated over all rows."""
    rounds: int = 0
    """Decoding rounds summed over the rows still running: AR steps, or speculative verify forwards per row."""
    drafted: int = 0
    """Draft tokens proposed to the rows still running (speculative decoding)."""
    accepted: int = 0
    """Draft tokens the target accepted."""

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(self.__dict__)
        d["tokens_per_forward"] = self.tokens / max(self.target_forwards, 1)
        d["forwards_per_token"] = self.target_forwards / max(self.tokens, 1)
        # tau: tokens a row gains per round (accepted drafts + the target's own token; 1 for AR decoding)
        d["tau"] = (self.accepted + self.rounds) / max(self.rounds, 1)
        d["acceptance_rate"] = self.accepted / max(self.drafted, 1)
        return d


@dataclass
class DecodeResult:
    sequences: list[list[int]]
    """Generated ids per prompt, cut before the first EOS (when `eos_id` is set)."""
    tokens_BN: torch.Tensor
    """The generated ids [B, max_new_tokens] (after a row's end: EOS, or whatever the last round wrote)."""
    counters: DecodeCounters
    logits_BNV: torch.Tensor | None = None
    """The logits each token was chosen from (`ar_generate(..., return_logits=True)`)."""


# ---------------------------------------------------------------------------------------------------
# the AR loop


def right_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as [B, P] rows starting at position 0 (padded with 0 after their end) and their lengths."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("every prompt needs at least one token (the first prediction reads its last state)")
    P = max(len(p) for p in prompts)
    tokens = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], dtype=torch.long, device=device)
    return tokens, torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)


def ar_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    decoding: Decoding,
    *,
    mask_id: int | None = None,
    generator: torch.Generator | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    use_cache: bool = True,
    return_logits: bool = False,
) -> DecodeResult:
    """Decode up to `max_new_tokens` after each prompt, one token per forward (greedy or sampled).

    The prompts run once, then each step runs one token per row against the ragged KV cache
    (`use_cache=False`: the whole sequence again, the reference). `stop(row_ids)` ends a row early
    (stop strings); `mask_id` is never generated."""
    with torch.inference_mode():
        device = next(model.parameters()).device
        tokens_BP, lengths_B = right_pad(prompts, device)
        B, N = len(prompts), decoding.max_new_tokens
        target = (Target if use_cache else Recompute)(model, B, tokens_BP.shape[1] + N, mask_id=mask_id)
        logits_B1V, _ = target.forward(tokens_BP, (lengths_B - 1)[:, None])
        target.commit(lengths_B)
        logits_BV = logits_B1V[:, 0]
        out_BN = torch.zeros(B, N, dtype=torch.long, device=device)
        num_B = torch.zeros(B, dtype=torch.long, device=device)  # tokens generated per row until its end
        ended_B = torch.zeros(B, dtype=torch.bool, device=device)
        counters, kept = DecodeCounters(), []
        for n in range(N):
            out_BN[:, n] = decoding.choose(logits_BV, generator)
            kept.append(logits_BV.clone() if return_logits else None)
            counters.rounds += int((~ended_B).sum())
            num_B = num_B + (~ended_B).long()
            ended_B = ended_B | row_ended(out_BN, num_B, decoding.eos_id, stop)
            if n == N - 1 or bool(ended_B.all()):
                break
            logits_B1V, _ = target.forward(out_BN[:, n : n + 1])
            target.commit(torch.ones_like(lengths_B))
            logits_BV = logits_B1V[:, 0]
        counters.target_forwards = target.forwards
        result = finish(out_BN, num_B, decoding.eos_id, counters)
        if return_logits:
            result.logits_BNV = torch.stack(kept, dim=1)
    return result


def row_ended(
    out_BN: torch.Tensor, num_B: torch.Tensor, eos_id: int | None, stop: Callable[[list[int]], bool] | None
) -> torch.Tensor:
    """Rows whose first num_B tokens hold an EOS or, cut before it, make `stop` true."""
    decided_BN = torch.arange(out_BN.shape[1], device=out_BN.device) < num_B[:, None]
    ended_B = ((out_BN == eos_id) & decided_BN).any(-1) if eos_id is not None else torch.zeros_like(num_B).bool()
    if stop is not None:
        ended_B = ended_B | torch.tensor([stop(ids) for ids in cut(out_BN, num_B, eos_id)], device=out_BN.device)
    return ended_B


def cut(out_BN: torch.Tensor, num_B: torch.Tensor, eos_id: int | None) -> list[list[int]]:
    """Each row's first num_B tokens, cut before its first EOS."""
    rows = [r[:n] for r, n in zip(out_BN.tolist(), num_B.tolist(), strict=True)]
    return [r[: r.index(eos_id)] if eos_id is not None and eos_id in r else r for r in rows]


def finish(out_BN: torch.Tensor, num_B: torch.Tensor, eos_id: int | None, counters: DecodeCounters) -> DecodeResult:
    """The result of a loop that generated num_B tokens per row (at most N = out_BN's width); undecided
    positions of `tokens_BN` hold the EOS (or 0). `counters.tokens` counts each row's EOS too."""
    N = out_BN.shape[1]
    num_B = num_B.clamp_max(N)
    decided_BN = torch.arange(N, device=out_BN.device) < num_B[:, None]
    tokens_BN = torch.where(decided_BN, out_BN, eos_id if eos_id is not None else 0)
    sequences = cut(tokens_BN, num_B, eos_id)
    counters.tokens = sum(min(len(s) + 1, n) for s, n in zip(sequences, num_B.tolist(), strict=True))
    return DecodeResult(sequences, tokens_BN, counters)


# ---------------------------------------------------------------------------------------------------
# which models decode causally


def is_causal_model(profile: DecodeProfile, family: str) -> bool:
    """Whether a loaded model decodes autoregressively: its profile says attention causal (a run trained
    with objective ar, or exported from one), or it is a folder never trained here (no objective in its
    profile) of an autoregressive family (llama, qwen2, qwen3, qwen3_moe, gpt2 are causal LMs; llada,
    dream and bert are not). A diffusion run converted from an AR model is not: it was trained otherwise."""
    if profile.attention == "causal":
        return True
    return profile.objective is None and FAMILIES.resolve(family).causal_lm


__all__ = [
    "DecodeCounters", "DecodeResult", "Decoding", "RaggedKVCache", "Recompute", "Target", "ar_generate",
    "is_causal_model", "sample",
]  # fmt: skip
