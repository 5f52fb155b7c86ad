"""Block-aligned query chunks: the one cut of the sequence that both block-sparse paths share.

The blockwise backend (blockwise.py) runs one SDPA call per chunk; its CPU block-diffusion split path
(bd_split.py) scores each chunk's queries against x_0's keys. Both cut the L positions the same way,
so this piece lives below both of them (blockwise.py dispatches to bd_split.py, which must not import
it back).
"""

from __future__ import annotations

Span = tuple[int, int]  # [start, end) along the sequence


def chunk_spans(seq_len: int, block_size: int, num_chunks: int) -> list[Span]:
    """Block-aligned [s, e) splitting L into min(num_chunks, blocks) chunks of (nearly) equal block counts.

    Equal chunks minimise the scored pairs: L*L + 3*sum(Lc^2) for block diffusion, (L*L + sum(Lc^2)) / 2
    for block_causal.
    """
    num_blocks = -(-seq_len // block_size)  # block_causal allows a partial last block
    n = min(num_chunks, num_blocks)
    edges = [min(seq_len, (i * num_blocks // n) * block_size) for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))
