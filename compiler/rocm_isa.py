"""What a compiled ROCm module runs, read from the AMDGPU assembly IREE dumps (no AMD GPU needed).

``iree-compile ... --iree-hal-dump-executable-files-to=DIR`` (``mxmoe.compile(..., extra_flags=[that flag])``) writes
the linked assembly of every dispatch of a rocm target as ``*.rocmasm``. :func:`kernels` splits it by kernel,
:func:`mix` counts the instruction classes that say whether a dispatch runs on the matrix cores and how it loads,
and :func:`expert_dispatches` picks the grouped matmuls' contractions (IREE names a contraction dispatch
``..._matmul_like_...``; the router's plain ``matmul`` is not one). tests/compiler/test_rocm_target.py and
benchmarks/amd_isa.py use them; docs/amd.md shows their output.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

#: instruction class -> regular expression on one assembly line
CLASSES: dict[str, str] = {
    "mfma": r"\bv_mfma_(?!scale)\w+",
    "mfma_scale": r"\bv_mfma_scale_\w+",
    "vector_fma": r"\bv_(pk_)?fmac?_f32\b",
    "cvt_scale": r"\bv_cvt_scalef32\w*",
    "valu": r"^\s+v_(?!mfma)\w+",
    "load_x4": r"^\s+(global|buffer)_load_dwordx4\b",
    "load_x2": r"^\s+(global|buffer)_load_dwordx2\b",
    "load_dword": r"^\s+(global|buffer)_load_dword\b(?!x)",
    "load_short": r"^\s+(global|buffer)_load_(u|s)short\b",
    "load_byte": r"^\s+(global|buffer)_load_(u|s)byte\b",
    "lds_read": r"^\s+ds_read",
    "lds_write": r"^\s+ds_write",
}


def kernels(dump_dir: str | Path) -> dict[str, list[str]]:
    """Kernel name -> its instruction lines, from every ``*.rocmasm`` file in ``dump_dir``."""
    out: dict[str, list[str]] = {}
    for path in sorted(Path(dump_dir).glob("*.rocmasm")):
        text = path.read_text().splitlines()
        functions = set(re.findall(r"\.type\s+([^,\s]+),@function", "\n".join(text)))
        current = None
        for line in text:
            label = re.match(r"^([A-Za-z_$][\w$.]*):\s*$", line)
            if label and label.group(1) in functions:
                current = label.group(1)
                out[current] = []
            elif current and line.startswith(".Lfunc_end"):
                current = None
            elif current and (re.match(r"^\s+[a-z]", line) or re.match(r"^\.LBB\w+:", line)):
                out[current].append(line)  # instructions, and the labels of its blocks
    return out


def mix(lines: list[str]) -> dict[str, int]:
    """Instruction class counts (:data:`CLASSES`) and the top mnemonics of one kernel."""
    counts = {name: sum(1 for line in lines if re.search(pattern, line)) for name, pattern in CLASSES.items()}
    counts["instructions"] = sum(1 for line in lines if not line.endswith(":"))
    return counts


def mnemonics(lines: list[str], top: int = 8) -> list[tuple[str, int]]:
    return Counter(line.split()[0] for line in lines).most_common(top)


def short_name(kernel: str) -> str:
    """``module_layer$async_dispatch_22_matmul_like_Dx16x5760...`` -> ``d22 matmul_like_Dx16x5760...``."""
    m = re.search(r"dispatch_(\d+)_(.*)", kernel)
    return f"d{m.group(1)} {m.group(2)}" if m else kernel


def expert_dispatches(ks: dict[str, list[str]]) -> dict[str, list[str]]:
    """The contraction dispatches (the grouped matmuls' expert GEMMs): IREE's ``matmul_like`` kernels."""
    return {name: lines for name, lines in ks.items() if "matmul_like" in name}


def main_loop(lines: list[str]) -> list[str]:
    """The instructions of the loop with the most matrix instructions (the K loop), or [] when none loops."""
    blocks: dict[str, list[str]] = {}
    name = None
    for line in lines:
        label = re.match(r"^(\.LBB\w+):", line.strip())
        if label:
            name = label.group(1)
            blocks[name] = []
        elif name:
            blocks[name].append(line)
    looping = {n: b for n, b in blocks.items()
               if any("branch" in ln and re.search(rf"\s{re.escape(n)}$", ln.rstrip()) for ln in b)}
    if not looping:
        return []
    return max(looping.values(), key=lambda b: sum("v_mfma" in ln for ln in b))
