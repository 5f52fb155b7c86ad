"""Exact log-likelihoods of a causal model for requests that share contexts, each context computed once.

lm-eval's multiple-choice requests repeat one context per choice (4 for ARC and MMLU, 2 for BoolQ). Here
the requests are grouped by context; a forward runs each group's context followed by one of its
continuations (the first request's), with a KV cache of it; every other continuation of the group then
runs against the cached context keys (its own tokens written after the cache's context rows, the padding
between them masked out), and one-token continuations need no second forward at all: the context's last
state predicts every choice's token. Each row's scores are those of one causal forward over [context ;
continuation] (tests/unit/test_shared_context.py checks them against likelihood.nelbo_samples' AR path).

Per request: (sum of log p(continuation token | everything before it), whether every continuation token
is the argmax of its place, the mask token excluded from that argmax as in decoding).

Shapes: G contexts (groups), R requests, L length, T cache length, E width, N scored positions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from dllm.attention.masks import AttentionMask
from dllm.sampling.cache import KVCache

LOGIT_ROWS = 512
"""Scored positions per head matmul ([rows, vocabulary] logits at a time)."""


def score_shared_contexts(
    model: torch.nn.Module, rows: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int,
    mask_id: int | None = None,
) -> list[tuple[float, bool]]:  # fmt: skip
    """(log-likelihood, is_greedy) of each (context ids, continuation ids) row, in the given order; contexts
    must be non-empty and continuations non-empty. `batch_size` contexts per forward."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, cont) in enumerate(rows):
        assert len(ctx) > 0 and len(cont) > 0, "a request needs a context and a continuation"
        groups.setdefault(tuple(ctx), []).append(i)
    for members in groups.values():  # the longest continuation rides along with its context's forward
        members.sort(key=lambda i: -len(rows[i][1]))
    out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
    contexts = sorted(groups, key=lambda c: -(len(c) + len(rows[groups[c][0]][1])))
    with torch.no_grad():
        for chunk in _chunks(contexts, batch_size):
            _score_groups(model, chunk, [groups[c] for c in chunk], rows, batch_size, mask_id, out)
    return out


def _chunks(items: Sequence, size: int) -> Iterator[list]:
    for lo in range(0, len(items), size):
        yield list(items[lo : lo + size])


def _score_groups(model, contexts, members, rows, batch_size: int, mask_id, out) -> None:
    """One forward of G contexts (each with its first continuation), then the other continuations."""
    device = next(model.parameters()).device
    firsts = [rows[m[0]][1] for m in members]
    first_rows = [list(c) + list(f[:-1]) for c, f in zip(contexts, firsts, strict=True)]
    tokens_GL, _ = _right_pad(first_rows, device)
    L = tokens_GL.shape[1]
    rest = [(g, i) for g, m in enumerate(members) for i in m[1:] if len(rows[i][1]) > 1]
    M = max((len(rows[i][1]) - 1 for _, i in rest), default=0)
    cache = KVCache(L + M).at(0, L) if M else None
    G = len(contexts)
    hidden = model(tokens_GL, torch.arange(L, device=device).expand(G, L), AttentionMask("causal"), cache).hidden_BLE
    states, targets, owner = [], [], []
    for g, m in enumerate(members):
        n = len(contexts[g])
        states.append(hidden[g, n - 1 : n - 1 + len(firsts[g])])  # the first continuation, teacher-forced
        targets.append(firsts[g])
        owner += [m[0]] * len(firsts[g])
        for i in m[1:]:  # every other continuation's first token, from the context's last state
            states.append(hidden[g, n - 1 : n])
            targets.append(rows[i][1][:1])
            owner.append(i)
    if M:
        for part in _chunks(rest, batch_size):
            _continue(model, cache, contexts, part, rows, L, M, states, targets, owner)
    _accumulate(model, torch.cat(states), [t for ts in targets for t in ts], owner, mask_id, out)


def _continue(model, cache: KVCache, contexts, part, rows, L: int, M: int, states, targets, owner) -> None:
    """The continuations of `part` [(group, request)] after their first token, against the cached contexts:
    cache rows [0, n) hold the context (the rest of the first forward's row is masked out), rows L.. these."""
    device = cache.layers[0].k_BKTD.device  # type: ignore[union-attr]
    conts = [list(rows[i][1][:-1]) for _, i in part]
    idx = torch.tensor([g for g, _ in part], device=device)
    sub = KVCache(L + M).at(L, L + M)
    for j, layer in cache.layers.items():
        assert layer.k_BKTD is not None and layer.v_BKTD is not None and layer.recurrent is None
        kv = sub.layer(j)
        kv.k_BKTD, kv.v_BKTD = layer.k_BKTD[idx], layer.v_BKTD[idx]
    tokens_RM, _ = _right_pad(conts, device, M)
    n_R = torch.tensor([len(contexts[g]) for g, _ in part], device=device)
    positions = n_R[:, None] + torch.arange(M, device=device)  # continuing each context's own positions
    keys = torch.arange(L + M, device=device)
    valid_RT = (keys[None, :] < n_R[:, None]) | (keys[None, :] >= L)
    mask = AttentionMask("causal", key_valid_BL=valid_RT, query_offset=L)
    hidden = model(tokens_RM, positions, mask, sub).hidden_BLE
    for r, (_, i) in enumerate(part):
        cont = rows[i][1]
        states.append(hidden[r, : len(cont) - 1])  # token k of the continuation predicts token k + 1
        targets.append(cont[1:])
        owner += [i] * (len(cont) - 1)


def _accumulate(model, states_NE: torch.Tensor, targets: list[int], owner: list[int], mask_id, out) -> None:
    """Sum each request's log-probabilities (float32 log-softmax, as decoding's logits) and check its argmax."""
    target_N = torch.tensor(targets, device=states_NE.device)
    logp, greedy = [], []
    exclude = None if mask_id is None else torch.tensor([mask_id], device=states_NE.device)
    for lo in range(0, len(targets), LOGIT_ROWS):
        logits = model.logits(states_NE[lo : lo + LOGIT_ROWS])
        t = target_N[lo : lo + LOGIT_ROWS]
        logp.append(logits.log_softmax(-1).gather(-1, t[:, None])[:, 0].double())
        if exclude is not None:
            logits = logits.index_fill(-1, exclude, float("-inf"))
        greedy.append(logits.argmax(-1) == t)
    logp_N, greedy_N = torch.cat(logp).cpu(), torch.cat(greedy).cpu()
    sums: dict[int, float] = {}
    right: dict[int, bool] = {}
    for k, i in enumerate(owner):
        sums[i] = sums.get(i, 0.0) + float(logp_N[k])
        right[i] = right.get(i, True) and bool(greedy_N[k])
    for i in sums:
        out[i] = (sums[i], right[i])


def _right_pad(seqs: Sequence[Sequence[int]], device, length: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """[len(seqs), length or the longest] token ids, 0 after each row (a causal row never reads its padding)."""
    L = max(length or 0, max(len(s) for s in seqs))
    out = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        out[b, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return out.to(device), [len(s) for s in seqs]
