"""Losslessness on the bench's larger pair: the 4 x 256 `ar` target and the 1-layer DFlash drafters
that bench/speculative.py trains (reused from its work folder, trained there when missing), greedy
speculative decoding against the target's own greedy AR decoding with the KV cache, token for token,
over held-out prompts, at batch 1 and batch 8, per block size.

    python bench/speculative_lossless.py [--prompts 200] [--blocks 4 8 12 16]

Prints one JSON line: per block size and batch, the rows compared, the rows equal, the tokens
compared, and `lossless` (every row equal). Correctness, not speed: it needs no quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import speculative as bench  # noqa: E402  (the pair's training lives there)
from dllm.checkpoint.loading import load_drafter_run, load_for_inference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/dllm-bench-speculative"))
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    bench.add_drafter_args(ap)  # the same drafters as bench/speculative.py's (its flags and defaults)
    args = ap.parse_args()
    torch.manual_seed(0)
    work = args.work_dir.absolute()
    work.mkdir(parents=True, exist_ok=True)
    bench.build_data(work)
    arch = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4, "max_seq_len": 512}
    target_run = bench.train(work, "target", {"name": "ar"}, 450, 2e-3, arch)
    loaded = load_for_inference(run=target_run, device=torch.device("cpu"))
    target, tok = loaded.model, loaded.tokenizer
    prompts = bench.prompts_of(tok, args.prompts)
    decoding = bench.causal_sampler(tok, args.new_tokens)
    result: dict[str, Any] = {"bench": "speculative_lossless", "prompts": len(prompts), "target": "ar 4x256",
                              "new_tokens": args.new_tokens, "drafter_data": args.drafter_data,
                              "drafter_steps": args.drafter_steps}  # fmt: skip
    every = True
    for b in args.blocks:
        drafter, _, _ = load_drafter_run(run=bench.train_drafter(work, target_run, b, args), device=torch.device("cpu"))
        drafter.attach(target)
        for batch in (1, 8):
            equal = tokens = 0
            for i in range(0, len(prompts), batch):
                chunk = prompts[i : i + batch]
                ar = bench.decode(target, chunk, decoding)
                spec = bench.decode(target, chunk, decoding, drafter)
                equal += sum(a == s for a, s in zip(ar.sequences, spec.sequences, strict=True))
                tokens += sum(len(a) for a in ar.sequences)
            ok = equal == len(prompts)
            every &= ok
            result[f"b{b}_batch{batch}"] = {"rows_equal": equal, "tokens": tokens, "lossless": ok}
    result["lossless"] = every
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
