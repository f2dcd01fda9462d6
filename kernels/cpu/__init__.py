"""Hand-written CPU microkernels that the cpu lowering links into IREE dispatches.

The cpu target's grouped matvec (few tokens per expert) is compute bound on the MXFP4 decode; IREE's
codegen reaches a table lookup only as an AVX2 gather. ``mxfp4_matvec.c`` does the decode with
``vpshufb`` and the products with ``vpmaddwd`` (docs/cpu.md, "Microkernel"). At compile time it is built
with the machine's C compiler into an ELF object that ``iree-compile`` links into the module (IREE's
``hal.executable.objects``), so the compiled artifact carries it and the deploy machine needs no compiler.

:func:`matvec_object` returns the object, or says why there is none (no C compiler, a host without
AVX2/FMA/F16C, ``MXMOE_CPU_UKERNEL=0``): the lowering then uses its pure-linalg matvec.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mxmoe.core.host import cache_root, has_cpu_features

SOURCE = Path(__file__).with_name("mxfp4_matvec.c")
#: the C entry point (see the source for its arguments)
MATVEC_SYMBOL = "mxmoe_mxfp4_grouped_matvec"
#: the C entry point that quantizes its activation rows
QUANTIZE_SYMBOL = "mxmoe_mxfp4_quantize_rows"
#: CPU features the object is built for; the cpu target compiles for the host, so the host must have them
REQUIRED_FEATURES = ("avx2", "fma", "f16c")
#: freestanding, position independent, nothing from libc: what IREE's embedded ELF linking requires
CFLAGS = ("-O3", "-std=c11", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-ffreestanding", "-fno-builtin",
          "-fno-stack-protector", "-fno-plt", "-fno-asynchronous-unwind-tables", "-fvisibility=hidden")
ENV_SWITCH = "MXMOE_CPU_UKERNEL"


@dataclass(frozen=True)
class Ukernel:
    """The built object (``path``), or None and the ``reason`` there is none."""

    path: str | None
    reason: str = ""


def _compiler() -> str | None:
    for cand in (os.environ.get("MXMOE_CC"), os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _cache_dir() -> Path:
    root = cache_root()
    if root is None:  # caching switched off: a folder for this process
        return Path(tempfile.mkdtemp(prefix="mxmoe-ukernel-"))
    return root / "ukernels"


@functools.cache
def matvec_object() -> Ukernel:
    """The microkernel object for this host, built once and cached by source, compiler and flags."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "off", "false", "no"):
        return Ukernel(None, f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}")
    if platform.machine() not in ("x86_64", "AMD64"):
        return Ukernel(None, f"the microkernel is x86-64 only (this host is {platform.machine()})")
    missing = [f for f in REQUIRED_FEATURES if not has_cpu_features(f)]
    if missing:
        return Ukernel(None, f"the host CPU lacks {', '.join(missing)}")
    cc = _compiler()
    if cc is None:
        return Ukernel(None, "no C compiler found (set MXMOE_CC or CC, or install cc/gcc/clang)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return Ukernel(None, f"C compiler {cc} does not run ({e})")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, *CFLAGS]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"mxfp4_matvec-{key}.o"
    if out.is_file():
        return Ukernel(str(out))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".o", dir=out.parent)
        os.close(fd)
        proc = subprocess.run([cc, *CFLAGS, "-c", str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            os.unlink(tmp)
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
            return Ukernel(None, f"{cc} failed on {SOURCE.name}: {first}")
        os.replace(tmp, out)  # atomic: a concurrent compile sees a whole object or none
    except (OSError, subprocess.SubprocessError) as e:
        return Ukernel(None, f"building {SOURCE.name} failed ({e})")
    return Ukernel(str(out))
