"""The edit alignment helper: optimal (Levenshtein) and lossless, checked against a plain reference."""

from __future__ import annotations

import random

import torch

from dllm.diffusion.edit_alignment import GAP, PAD, align, num_edits, strip_gaps


def levenshtein(a: list[int], b: list[int]) -> int:
    """Textbook two-row dynamic programme (the independent reference)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def _pad(seqs: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([s + [7] * (width - len(s)) for s in seqs], dtype=torch.long).reshape(len(seqs), width)


def test_alignment_is_optimal_and_lossless_on_500_random_pairs():
    rng = random.Random(0)
    pairs = []
    for _ in range(500):
        vocab = rng.choice([2, 3, 6])  # small vocabularies: many ties and matches
        pairs.append(([rng.randrange(vocab) for _ in range(rng.randrange(0, 13))],
                      [rng.randrange(vocab) for _ in range(rng.randrange(0, 13))]))  # fmt: skip
    for start in range(0, 500, 125):  # batches of 125 rows with per-row lengths
        chunk = pairs[start : start + 125]
        x0, x1 = _pad([a for a, _ in chunk], 12), _pad([b for _, b in chunk], 12)
        len0 = torch.tensor([len(a) for a, _ in chunk])
        len1 = torch.tensor([len(b) for _, b in chunk])
        z0, z1, length = align(x0, len0, x1, len1)
        edits = num_edits(z0, z1)
        for r, (a, b) in enumerate(chunk):
            assert int(edits[r]) == levenshtein(a, b)
            assert strip_gaps(z0[r]).tolist() == a and strip_gaps(z1[r]).tolist() == b
            n = int(length[r])
            assert not ((z0[r, :n] == GAP) & (z1[r, :n] == GAP)).any()  # never a gap on both sides
            assert (z0[r, n:] == PAD).all() and (z1[r, n:] == PAD).all()
            assert max(len(a), len(b)) <= n <= len(a) + len(b)


def test_alignment_is_deterministic_and_independent_of_batch_mates():
    a, b = [1, 2, 3, 2, 1], [2, 3, 1, 1]
    z0, z1, _ = align(torch.tensor([a]), torch.tensor([5]), torch.tensor([b]), torch.tensor([4]))
    other = [[0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 2, 1, 0, 0]]
    zb0, zb1, _ = align(_pad(other, 7), torch.tensor([7, 5]), _pad([[4, 4, 4, 4, 4], b], 5), torch.tensor([5, 4]))
    A = z0.shape[1]
    assert zb0[1, :A].tolist() == z0[0].tolist() and zb1[1, :A].tolist() == z1[0].tolist()
    assert num_edits(z0, z1).item() == levenshtein(a, b) == 2


def test_alignment_of_empty_sequences():
    x = torch.tensor([[5, 6, 7]])
    z0, z1, length = align(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), x, torch.tensor([3]))
    assert z0[0].tolist() == [GAP, GAP, GAP] and z1[0].tolist() == [5, 6, 7] and length.item() == 3
    z0, z1, length = align(x, torch.tensor([0]), x, torch.tensor([0]))
    assert length.item() == 0 and (z0 == PAD).all()
