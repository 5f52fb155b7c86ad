"""What this CPU offers bfloat16 arithmetic, from the feature flags Linux lists in /proc/cpuinfo: native bf16
matmuls (x86 AVX512-BF16 or AMX tiles; Arm's BF16 extension) or none (bf16 converted to float32 around every
op, usually slower than float32 itself). `dllm doctor` prints it; decoding with `--dtype bfloat16` warns on a
CPU without it. Elsewhere than Linux the flags are not read: unknown."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
X86_BF16 = ("avx512_bf16", "amx_bf16", "amx_tile")
"""x86 flags of native bf16: AVX512-BF16 (dot products and conversions), AMX (bf16 tile matmuls)."""
ARM_BF16 = ("bf16",)
"""Arm's BF16 extension (the `Features` line of an aarch64 /proc/cpuinfo)."""


@dataclass(frozen=True)
class Bf16Support:
    """Whether the CPU computes bf16 natively (None: unknown) and the flags that say so."""

    native: bool | None
    flags: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line: native (the flags), none, or unknown."""
        if self.native is None:
            return "unknown (CPU flags are read from /proc/cpuinfo on Linux only)"
        return f"native ({', '.join(self.flags)})" if self.native else "none (no avx512_bf16, amx_bf16 or bf16 flag)"

    def meaning(self) -> str:
        """What it means for training (training.autocast_dtype) and decoding (--dtype)."""
        if self.native is None:
            return ("float32 is the safe default; measure bfloat16 with bench/bf16.py before choosing "
                    "training.autocast_dtype: bfloat16 or --dtype bfloat16")  # fmt: skip
        if not self.native:
            return ("bf16 is emulated here (converted to float32 around each op), usually slower than float32: keep "
                    "training.autocast_dtype float32 and decoding --dtype float32")  # fmt: skip
        amx = " (AMX tiles: several times float32's matmul rate)" if "amx_bf16" in self.flags else ""
        return (
            f"bf16 matmuls run in hardware{amx}: --dtype bfloat16 decodes from half the weight bytes and "
            "training.autocast_dtype: bfloat16 computes the forward in bf16; bench/bf16.py measures both"
        )


def bf16_support(cpuinfo_text: str | None) -> Bf16Support:
    """Native bf16 from the text of /proc/cpuinfo (None: not read, unknown). Every processor's `flags` (x86)
    or `Features` (Arm) line must hold a flag: a machine whose cores differ is as good as its weakest."""
    if cpuinfo_text is None:
        return Bf16Support(None)
    lines = [line.partition(":") for line in cpuinfo_text.splitlines()]
    per_cpu = [set(value.split()) for key, sep, value in lines if sep and key.strip() in ("flags", "Features")]
    if not per_cpu:
        return Bf16Support(None)
    common = set.intersection(*per_cpu)
    found = tuple(f for f in (*X86_BF16, *ARM_BF16) if f in common)
    return Bf16Support(bool(found), found)


def read_cpuinfo(path: Path = CPUINFO) -> str | None:
    """The text of /proc/cpuinfo, or None where there is none (not Linux) or it cannot be read."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
