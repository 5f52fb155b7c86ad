"""The causal target of the causal loop (speculative.py): a ragged KV cache (rows at different lengths)
and the two ways to run the target over it.

A causal target (a run trained with objective `ar`, or an imported llama/qwen2/qwen3/gpt2 or Gemma 4 folder)
runs its prompts once (prefill), then each round a few new tokens per row against the cache: one for
AR decoding, the anchor and the drafts for speculative decoding, where rows keep different numbers of
them.

The cache is ragged: row b holds its tokens at buffer index = position, [0, length_B[b]); a forward of
Q tokens writes them (scatter) at length_B[b] + [0, Q) and its queries attend causally to every index
up to their own (the AttentionMask's per-row query offsets). Whatever a row's buffer holds past its
length (padding of a shorter prompt, drafts the target rejected) lies after every query of that row,
so it is never read, and the next forward overwrites it: rolling back a rejection is setting the length.
Sliding-window layers (Gemma 4's local ones) read the same buffers: the window counts back from each query's
buffer index, its position, so the keys past the window stay cached and are masked, never dropped.

A hybrid model's linear-attention layers (qwen3_5) keep no keys: each layer keeps one state per row
(convolution window and recurrent matrix, `RaggedLayerKV.recurrent`, models/linear_state.py), the state
after the row's kept tokens. A state cannot be rolled back by setting a length, so `commit` tells the
layers how many tokens each row keeps: a forward that knows it already (`keep_B`: a prefill of right-padded
prompts, an AR round where ended rows keep none) keeps the states after them at once; a verification
forward keeps its start states and the rule's per-token inputs, and `commit` re-runs the rule alone over
the accepted prefix (linear_state.py says why that is the cheaper exact way).

`Recompute` is the plain reference with the same interface: every forward runs each row's whole
sequence again, no cache (tests and bench/ar_decoding.py compare the two).

Shapes: B batch, K key/value heads, T cache capacity, D head width, Q query tokens per row, P prompt
length, V vocabulary, F captured target features.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from dllm.attention.masks import AttentionMask
from dllm.models.capture import CapturedLayers, capture_layers
from dllm.models.linear_state import RowStates
from dllm.sampling.results import Counters

# ---------------------------------------------------------------------------------------------------
# the ragged cache and the two ways to run the target


@dataclass
class RaggedLayerKV:
    """One layer's key/value buffers [B, K, T, D] (allocated on the first write)."""

    owner: RaggedKVCache
    """The cache holding this layer, as a weak proxy: no reference cycle, so a dropped cache is freed at once."""
    k_BKTD: torch.Tensor | None = None
    v_BKTD: torch.Tensor | None = None
    bases: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per buffer name, the memory its rows are the first rows of (kept when rows leave a running batch,
    reused when rows join it again)."""
    recurrent: RowStates = field(init=False)
    """A linear-attention layer's per-row states instead of keys and values (models/linear_state.py)."""

    def __post_init__(self) -> None:
        self.recurrent = RowStates(self.owner)

    def allocate(self, name: str, like: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
        """A zeroed buffer [rows, K, capacity, D] of `like`'s kind, as the buffer `name` and its base."""
        _, K, _, D = like.shape
        buf = like.new_zeros(rows, K, capacity, D)
        setattr(self, name, buf)
        self.bases[name] = buf
        return buf

    def update(self, k_BKQD: torch.Tensor, v_BKQD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys/values at each row's `owner.write_BQ`; return the buffers [0, key_end)."""
        c = self.owner
        B, K, Q, D = k_BKQD.shape
        if self.k_BKTD is None or self.v_BKTD is None:
            self.allocate("k_BKTD", k_BKQD, B, c.capacity)
            self.allocate("v_BKTD", v_BKQD, B, c.capacity)
        if c.write_start is not None:  # every row at the same length: one slice (a copy, no index tensor)
            self.k_BKTD[:, :, c.write_start : c.write_start + Q] = k_BKQD
            self.v_BKTD[:, :, c.write_start : c.write_start + Q] = v_BKQD
        else:
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
    write_start: int | None = None
    """Where the next forward writes when every row has the same length (None: rows differ, write_BQ says)."""
    keep_B: torch.Tensor | None = None
    """The tokens each row keeps of the next forward when known before it (a prefill, an AR round): linear
    layers then keep their states after them at once (None: at `commit`, after speculative verification)."""
    windowed: bool = False
    """The model has sliding-window layers (Gemma 4): their window is counted from each query's own index, so
    every forward's mask places its queries (no mask-free step)."""
    layers: dict[int, RaggedLayerKV] = field(default_factory=dict)

    def layer(self, i: int) -> RaggedLayerKV:
        if i not in self.layers:
            self.layers[i] = RaggedLayerKV(weakref.proxy(self))
        return self.layers[i]

    def _buffers(self) -> Iterator[tuple[RaggedLayerKV, str, torch.Tensor]]:
        """Every allocated key and value buffer: (its layer, its attribute name, the buffer)."""
        for layer in self.layers.values():
            for name in ("k_BKTD", "v_BKTD"):
                buf = getattr(layer, name)
                if buf is not None:
                    yield layer, name, buf

    def rebuild(self, rows: Sequence[int], capacity: int) -> None:
        """Buffers of rows `rows` of these (in that order; -1: a new, empty row) and `capacity` positions:
        rows join and leave a running batch between forwards (inference/causal_rows.py). Rows that join
        after the kept ones, at the same capacity, take the next rows of the buffers' memory when it has
        them (no copy: a server's buffers reach their working size and stay there); otherwise one copy
        into new memory of at least half as many rows more."""
        new_rows = list(rows).count(-1)
        n, kept_rows = len(rows), len(rows) - new_rows
        in_place = capacity == self.capacity and list(rows) == [*range(kept_rows), *([-1] * new_rows)]
        index = torch.tensor(rows, dtype=torch.long, device=self.length_B.device)
        kept = index >= 0
        for layer in self.layers.values():
            layer.recurrent.rebuild(rows)
        for layer, name, old in list(self._buffers()):
            base = layer.bases.get(name, old)
            if in_place and base.shape[0] >= n:
                buf = base[:n]
                buf[kept_rows:].zero_()
                setattr(layer, name, buf)
                continue
            grown = base.shape[0] if n <= base.shape[0] else max(n, base.shape[0] + base.shape[0] // 2)
            keep = min(old.shape[2], capacity)
            new = layer.allocate(name, old, grown, capacity)
            new[:n][kept, :, :keep] = old[index[kept], :, :keep]
            setattr(layer, name, new[:n])
        self.capacity = capacity

    def move(self, src: Sequence[int], dst: Sequence[int], num_rows: int) -> None:
        """Copy buffer rows `src` to rows `dst`, then keep the first `num_rows` rows (a view: the memory
        stays, to be reused when rows join again)."""
        s = torch.tensor(src, dtype=torch.long, device=self.length_B.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.length_B.device)
        for layer in self.layers.values():
            layer.recurrent.move(src, dst, num_rows)
        for layer, name, buf in list(self._buffers()):
            if len(src):
                buf[d] = buf[s]
            setattr(layer, name, buf[:num_rows])

    def put(self, rows: Sequence[int], other: RaggedKVCache, length: int, num_rows: int) -> None:
        """Copy positions [0, length) of every row of `other` (a prefill's cache) into rows `rows` of these
        buffers (allocated with `num_rows` rows on the first copy)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.length_B.device)
        for i, src in other.layers.items():
            dst = self.layer(i)
            dst.recurrent.put(index, src.recurrent, num_rows)
            for name in ("k_BKTD", "v_BKTD"):
                values = getattr(src, name)
                if values is None:
                    continue
                if getattr(dst, name) is None:
                    dst.allocate(name, values, num_rows, self.capacity)
                getattr(dst, name)[index, :, :length] = values[:, :, :length]

    def commit(self, n_B: torch.Tensor) -> None:
        """The linear layers keep the first n_B tokens per row of the last forward (their K/V rows need nothing:
        the lengths say what is kept)."""
        for layer in self.layers.values():
            layer.recurrent.commit(n_B)

    def at(self, num_queries: int) -> tuple[torch.Tensor, AttentionMask]:
        """Place the next forward of Q tokens per row after each row's cached tokens: their positions
        [B, Q] (= buffer indices) and the causal mask with per-row query offsets."""
        arange_Q = torch.arange(num_queries, device=self.length_B.device)
        self.write_BQ = self.length_B[:, None] + arange_Q
        shortest, longest = torch.stack(torch.aminmax(self.length_B)).tolist()  # the one host sync
        self.key_end = longest + num_queries
        self.write_start = longest if shortest == longest else None
        if self.key_end > self.capacity:
            raise ValueError(f"ragged cache: {self.key_end} positions do not fit its capacity {self.capacity}")
        if longest == 0:  # every row empty (a prefill): plain causal, SDPA's is_causal kernel
            return self.write_BQ, AttentionMask("causal")
        if num_queries == 1 and shortest == longest and not self.windowed:  # each query sees every key: no mask
            return self.write_BQ, AttentionMask("bidirectional")
        return self.write_BQ, AttentionMask("causal", query_offset_B=self.length_B.clone())


class Target:
    """A causal model run over ragged rows: `forward(tokens_BQ)` runs Q tokens per row at positions
    length_B + [0, Q) and returns their logits [B, Q, V] (and the captured features [B, Q, F] of
    `layer_ids`, None without any); `length_B += n_B` (`commit`) keeps tokens, anything past is dropped.
    The default runs against the ragged KV cache; `Recompute` is the no-cache reference."""

    def __init__(self, model: nn.Module, batch: int, capacity: int, counters: Counters,
                 layer_ids: Sequence[int] = (), mask_id: int | None = None) -> None:  # fmt: skip
        self.model, self.layer_ids, self.mask_id = model, tuple(layer_ids), mask_id
        self.device = next(model.parameters()).device
        self.exclude = None if mask_id is None else torch.tensor([mask_id], device=self.device)
        self.length_B = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.capacity, self.counters = capacity, counters
        self.cache = RaggedKVCache(capacity, self.length_B, windowed=has_sliding_window(model))
        self._captured: CapturedLayers | None = None  # open while `capturing()` is

    @contextmanager
    def capturing(self) -> Iterator[Target]:
        """Keep the hooks that capture `layer_ids` registered over many forwards (a decoding call) rather
        than registering and removing them in every forward (none without `layer_ids`: AR decoding)."""
        if not self.layer_ids:
            yield self
            return
        with capture_layers(self.model, self.layer_ids) as captured:
            self._captured = captured
            try:
                yield self
            finally:
                self._captured = None

    def forward(
        self, tokens_BQ: torch.Tensor, logit_rows_BR: torch.Tensor | None = None, keep_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, R, V] at query rows `logit_rows_BR` (indices into Q; None: all Q; a bool [B, Q] mask: the
        logits [M, V] of its M true rows, row-major) and features [B, Q, F].
        `keep_B`: what the next `commit` keeps, when known now (linear layers then keep their states at once)."""
        self.cache.length_B, self.cache.keep_B = self.length_B, keep_B
        positions_BQ, mask = self.cache.at(tokens_BQ.shape[1])
        self.counters.cached_tokens += tokens_BQ.shape[0] * (self.cache.key_end - tokens_BQ.shape[1])
        return self._run(tokens_BQ, positions_BQ, mask, self.cache, None, logit_rows_BR)

    def commit(self, n_B: torch.Tensor) -> None:
        """Keep n_B more tokens per row (those the last forward ran first); the rest is rolled back."""
        self.cache.commit(n_B)
        self.length_B = self.length_B + n_B

    def _run(self, tokens_BL, positions_BL, mask, cache, rows_BQ, logit_rows_BR):
        """The one model call: features at rows `rows_BQ` of its output (None: all rows) and logits at
        `logit_rows_BR` of those (None: all), the mask token excluded."""
        if self._captured is None and self.layer_ids:  # a forward outside `capturing()`: hooks for it alone
            with self.capturing():
                return self._run(tokens_BL, positions_BL, mask, cache, rows_BQ, logit_rows_BR)
        self.counters.nfe += 1
        self.counters.query_tokens += tokens_BL.numel()
        out = self.model(tokens_BL, positions_BL, mask, cache=cache)
        features = self._captured.features() if self._captured is not None and self.layer_ids else None
        hidden = out.hidden_BLE if rows_BQ is None else _rows(out.hidden_BLE, rows_BQ)
        if features is not None and rows_BQ is not None:
            features = _rows(features, rows_BQ)
        if logit_rows_BR is not None and logit_rows_BR.dtype == torch.bool:  # rows of a running batch's requests
            hidden = hidden[logit_rows_BR]
        elif logit_rows_BR is not None:  # the head only where logits are read (a prefill needs one row)
            hidden = _rows(hidden, logit_rows_BR)
        # the mask token is never a prediction (the objectives exclude it from the softmax too)
        return out.token_logits(hidden, self.exclude), features


class Recompute(Target):
    """The plain reference: every forward runs each row's whole sequence [0, length + Q) again, no cache."""

    def __init__(self, model: nn.Module, batch: int, capacity: int, counters: Counters,
                 layer_ids: Sequence[int] = (), mask_id: int | None = None) -> None:  # fmt: skip
        super().__init__(model, batch, capacity, counters, layer_ids, mask_id)
        self.tokens_BT = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)

    def forward(
        self, tokens_BQ: torch.Tensor, logit_rows_BR: torch.Tensor | None = None, keep_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, Q = tokens_BQ.shape
        write_BQ = self.length_B[:, None] + torch.arange(Q, device=self.device)
        self.tokens_BT.scatter_(1, write_BQ, tokens_BQ)
        end = int(write_BQ.max()) + 1
        positions = torch.arange(end, device=self.device).expand(B, end)
        return self._run(self.tokens_BT[:, :end], positions, AttentionMask("causal"), None, write_BQ, logit_rows_BR)


def keeps_recurrent_state(model: nn.Module) -> bool:
    """A model with linear-attention layers (qwen3_5): a recurrent state per layer, which a canvas decodes only
    with block attention, and which the running canvas batch does not keep (the causal loop and the running
    AR batch keep them per row: `RaggedLayerKV.recurrent`)."""
    return bool(getattr(getattr(model, "cfg", None), "has_linear_layers", False))


def has_sliding_window(model: nn.Module) -> bool:
    """A model with sliding-window layers (Gemma 4's local layers)."""
    return bool(getattr(getattr(model, "cfg", None), "has_local_layers", False))


def _rows(x_BLE: torch.Tensor, rows_BQ: torch.Tensor) -> torch.Tensor:
    return x_BLE.gather(1, rows_BQ[..., None].expand(-1, -1, x_BLE.shape[-1]))


def right_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as [B, P] rows starting at position 0 (padded with 0 after their end) and their lengths."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("every prompt needs at least one token (the first prediction reads its last state)")
    P = max(len(p) for p in prompts)
    tokens = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], dtype=torch.long, device=device)
    return tokens, torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)


# ---------------------------------------------------------------------------------------------------
# scoring: the log-probability of every token of a sequence under a causal model


@dataclass
class TokenScores:
    """A sequence's tokens scored by a causal model: per position i, log p(token_i | tokens_<i) (None at
    position 0, which nothing predicts) and the `top` most likely ids there with theirs (empty at 0)."""

    logprobs: list[float | None]
    top: list[list[tuple[int, float]]]


def score_tokens(model: nn.Module, rows: Sequence[Sequence[int]], top: int = 0, mask_id: int | None = None,
                 max_rows_per_forward: int = 4) -> list[TokenScores]:  # fmt: skip
    """Every token of each row scored in one causal forward (teacher forcing): the model's own log-softmax
    in float32 over its raw logits (no temperature, top-k or top-p), the mask token excluded as in
    decoding. Rows of a forward are right-padded; padding comes after every real token, so a causal
    forward never reads it."""
    device = next(model.parameters()).device
    exclude = None if mask_id is None else torch.tensor([mask_id], device=device)
    scores: list[TokenScores] = []
    with torch.inference_mode():
        for i in range(0, len(rows), max_rows_per_forward):
            chunk = rows[i : i + max_rows_per_forward]
            tokens_BL, len_B = right_pad(chunk, device)
            B, L = tokens_BL.shape
            out = model(tokens_BL, torch.arange(L, device=device).expand(B, L), AttentionMask("causal"))
            logits_BLV = out.token_logits(out.hidden_BLE[:, :-1], exclude)
            logp_BLV = logits_BLV.log_softmax(-1)
            chosen_BL = logp_BLV.gather(-1, tokens_BL[:, 1:, None])[..., 0]
            if top:
                top_lp, top_id = logp_BLV.topk(min(top, logp_BLV.shape[-1]), dim=-1)
            for b, n in enumerate(len_B.tolist()):
                logprobs: list[float | None] = [None, *chosen_BL[b, : n - 1].tolist()]
                tops: list[list[tuple[int, float]]] = [[]]
                if top:
                    ids, lps = top_id[b, : n - 1].tolist(), top_lp[b, : n - 1].tolist()
                    tops += [list(zip(i_, l_, strict=True)) for i_, l_ in zip(ids, lps, strict=True)]
                else:
                    tops += [[] for _ in range(n - 1)]
                scores.append(TokenScores(logprobs, tops))
    return scores
