"""What this CPU does fast below FP32: its name and the instruction sets behind INT8 and BF16 (read from
/proc/cpuinfo). The projects' machines differ day to day (AMD EPYC with AVX2 only; AMD EPYC with AVX-512 VNNI and
AVX512_BF16; Intel Xeon with AMX), and so do users' servers: `ctropt optimize` prints this and stores it in the
saved model's metadata (`ctropt.cpu`), so a precision decision says on which CPU it was measured."""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from functools import lru_cache

METADATA_KEY = "ctropt.cpu"


@dataclass(frozen=True)
class CpuInfo:
    name: str
    flags: frozenset

    @property
    def int8(self) -> str | None:
        """The 8-bit dot-product path onnxruntime's INT8 kernels use, or None (then INT8 is emulated, rarely faster)."""
        return next((label for flag, label in (("amx_int8", "AMX-INT8"), ("avx512_vnni", "AVX-512 VNNI"),
                                               ("avx_vnni", "AVX-VNNI")) if flag in self.flags), None)

    @property
    def bf16(self) -> str | None:
        """The BF16 path (OpenVINO's CPU plugin runs BF16 by default where there is one), or None."""
        return next((label for flag, label in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512_BF16"))
                     if flag in self.flags), None)

    @property
    def vectors(self) -> str:
        return "AVX-512" if "avx512f" in self.flags else "AVX2" if "avx2" in self.flags else "baseline"

    def summary(self) -> str:
        return (f"{self.name}: {self.vectors}; INT8 {self.int8 or 'without VNNI/AMX (no fast path)'}; "
                f"BF16 {self.bf16 or 'none'}")


def parse(text: str) -> CpuInfo:
    """A CpuInfo from /proc/cpuinfo's text (its first processor)."""
    name = re.search(r"^(?:model name|Model|Hardware)\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)
    return CpuInfo(name.group(1).strip() if name else (platform.processor() or platform.machine()),
                   frozenset(flags.group(1).split() if flags else ()))


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's CpuInfo (a CPU without /proc/cpuinfo: its architecture's name and no flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse(f.read())
    except OSError:
        return CpuInfo(platform.processor() or platform.machine(), frozenset())


def describe(model) -> None:
    """Name the CPU the model was optimized (and measured) on in its metadata (in place)."""
    kept = [p for p in model.metadata_props if p.key != METADATA_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=METADATA_KEY, value=cpu_info().summary())
