"""Hand-written CPU microkernels that the cpu lowering links into IREE dispatches.

The cpu target's grouped MXFP4 matmul is bound by the decode (few tokens per expert) or the dot products
(many); IREE's codegen reaches a table lookup only as a gather. ``mxfp4_matvec.c`` groups the rows by
expert, decodes with table lookups and multiplies with the host's dot-product instructions (docs/cpu.md,
"Microkernel"). At compile time it is built with the machine's C compiler into an ELF object that
``iree-compile`` links into the module (IREE's ``hal.executable.objects``), so the compiled artifact carries
it and the deploy machine needs no compiler.

Flavors (:data:`FLAVORS`), the best the host runs picked at compile time: ``avx512amx`` (``avx512bf16`` with
AMX tiles, ``tdpbf16ps``: bf16 layers then keep their weights in the ``cpu-mxfp4-rows16`` layout and every expert
matmul runs on the tiles, ``bf16_rows16.c``; :func:`bf16_layout`), ``avx512bf16`` (AVX-512 with
AVX512-BF16 and AVX512-VNNI: exact bf16 dot products, ``vdpbf16ps``; the int8 form's ``vpdpbusd``) and ``avx2``
(AVX2/FMA/F16C: int16 activations, ``vpmaddwd``). ``MXMOE_CPU_UKERNEL=avx2`` forces the AVX2 one (the tests use it to keep it tested on an
AVX-512 host). Both also hold the int8 form of the cpu target's ``activations="mxint8"`` (``mxint8_rows16.c``,
included by ``mxfp4_matvec.c``: MXINT8 activations against weights in the ``cpu-mxfp4-rows16`` layout;
``vpdpbusd`` in the AVX-512 flavor, ``vpmaddubsw`` in the AVX2 one).

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
#: every file the object is built from (SOURCE includes the others): the cache key hashes them all
SOURCES = (SOURCE, Path(__file__).with_name("mxint8_rows16.c"), Path(__file__).with_name("bf16_rows16.c"),
           Path(__file__).with_name("glu_epilogue.c"))
#: the C entry point (see the source for its arguments)
MATVEC_SYMBOL = "mxmoe_mxfp4_grouped_matvec"
#: the C entry point that quantizes its activation rows
QUANTIZE_SYMBOL = "mxmoe_mxfp4_quantize_rows"
#: the C entry point that groups the slots by expert
GROUP_SYMBOL = "mxmoe_group_slots"
#: the int8-activation form's entry points (activations="mxint8"): the MXINT8 quantizer and the matmul of
#: weights in the cpu-mxfp4-rows16 layout (``mxint8_rows16.c``)
MXINT8_QUANTIZE_SYMBOL = "mxmoe_mxint8_quantize_rows"
ROWS16_SYMBOL = "mxmoe_rows16_grouped_matvec"
#: the two-plane form's (activations="mxint16"): each activation row as two int8 planes, the same rows16 matmul
MXINT16_QUANTIZE_SYMBOL = "mxmoe_mxint16_quantize_rows"
ROWS16X2_SYMBOL = "mxmoe_rows16x2_grouped_matvec"
#: the bf16 form on rows16 weights (``bf16_rows16.c``: AMX tiles, or vdpbf16ps where the kernel refuses them): its
#: activation packer and its matmul; built in the BF16 flavors only
BF16_ROWS16_PACK_SYMBOL = "mxmoe_bf16_rows16_pack_rows"
BF16_ROWS16_SYMBOL = "mxmoe_bf16_rows16_grouped_matmul"
#: the symbols whose presence in a module's MLIR says the C microkernel is linked into it
MATMUL_SYMBOLS = (MATVEC_SYMBOL, ROWS16_SYMBOL, ROWS16X2_SYMBOL, BF16_ROWS16_SYMBOL)
#: freestanding, position independent, nothing from libc: what IREE's embedded ELF linking requires. Functions on
#: 64-byte lines: without it, where the passes land moved the 2-row passes of unchanged code by 15-20% between
#: builds (single-thread harness, 2026-11-28: bf16 / int8 2 rows 10.3-11.1 / 26.5-28.9 GB/s against 13.0 / 33.6)
BASE_CFLAGS = ("-O3", "-std=c11", "-fPIC", "-ffreestanding", "-fno-builtin", "-fno-stack-protector", "-fno-plt",
               "-fno-asynchronous-unwind-tables", "-fvisibility=hidden", "-fno-tree-loop-distribute-patterns",
               "-falign-functions=64")
#: flavor -> (the CPU features it needs, its -m flags), best first. The cpu target compiles for the host, so
#: the host must have the features of the flavor it links.
_AVX512BF16 = (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
               ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                "-mavx512vnni"))
FLAVORS = {
    "avx512amx": (_AVX512BF16[0] + ("amx_tile", "amx_bf16"), _AVX512BF16[1] + ("-mamx-tile", "-mamx-bf16")),
    "avx512bf16": _AVX512BF16,
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
}
#: the flavors whose bf16 activations take the exact bf16 path (vdpbf16ps, and AMX tiles in avx512amx)
BF16_FLAVORS = ("avx512amx", "avx512bf16")
#: CPU features any flavor needs
REQUIRED_FEATURES = FLAVORS["avx2"][0]
#: the flags of the AVX2 flavor (the one every x86-64 host with the microkernel can run)
CFLAGS = BASE_CFLAGS + FLAVORS["avx2"][1]
ENV_SWITCH = "MXMOE_CPU_UKERNEL"
#: the weight layout of bf16 layers (activations="bf16"): "rows16" (the AMX form, bf16_rows16.c) or "blocksplit"
BF16_LAYOUT_SWITCH = "MXMOE_CPU_BF16_LAYOUT"
#: flavor -> its default layout for bf16 layers: rows16 where the AMX form runs (gpt-oss-20b, 2 threads: 1.13 /
#: 1.26 / 1.98 / 1.65x the blocksplit form at 4 / 8 / 64 / 512 tokens, 0.86-1.01x at 1; docs/cpu.md), blocksplit elsewhere
#: (on vdpbf16ps alone the rows16 form measured 2.1x slower than the blocksplit matvec at 1 row, further behind with more)
BF16_LAYOUTS = {"avx512amx": "rows16", "avx512bf16": "blocksplit", "avx2": "blocksplit"}


@dataclass(frozen=True)
class Ukernel:
    """The built object (``path``) and its ``flavor``, or None and the ``reason`` there is none."""

    path: str | None
    reason: str = ""
    flavor: str = ""


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


def host_flavors() -> list[str]:
    """The flavors this host runs, best first."""
    return [name for name, (features, _) in FLAVORS.items() if has_cpu_features(*features)]


@functools.cache
def matvec_object() -> Ukernel:
    """The microkernel object for this host, built once and cached by source, compiler and flags: the best
    flavor the host runs and the compiler builds (``MXMOE_CPU_UKERNEL=<flavor>`` asks for one)."""
    switch = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if switch in ("0", "off", "false", "no"):
        return Ukernel(None, f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}")
    if platform.machine() not in ("x86_64", "AMD64"):
        return Ukernel(None, f"the microkernel is x86-64 only (this host is {platform.machine()})")
    missing = [f for f in REQUIRED_FEATURES if not has_cpu_features(f)]
    if missing:
        return Ukernel(None, f"the host CPU lacks {', '.join(missing)}")
    if switch in FLAVORS:  # a forced flavor, if the host runs it
        lacks = [f for f in FLAVORS[switch][0] if not has_cpu_features(f)]
        if lacks:
            return Ukernel(None, f"{ENV_SWITCH}={switch}: the host CPU lacks {', '.join(lacks)}")
        candidates = [switch]
    else:
        candidates = host_flavors()
    cc = _compiler()
    if cc is None:
        return Ukernel(None, "no C compiler found (set MXMOE_CC or CC, or install cc/gcc/clang)")
    try:
        version = _compiler_version(cc)
    except (OSError, subprocess.SubprocessError) as e:
        return Ukernel(None, f"C compiler {cc} does not run ({e})")
    failure = None
    for flavor in candidates:  # a compiler too old for a flavor's flags falls back to the next one
        built = _build(cc, version, flavor)
        if built.path:
            return built
        failure = failure or built
    return failure


def bf16_layout(flavor: str) -> str:
    """The weight layout the cpu target gives bf16 layers with the microkernel of ``flavor``: "rows16" or
    "blocksplit" (:data:`BF16_LAYOUTS`; ``MXMOE_CPU_BF16_LAYOUT`` asks for one, rows16 on a BF16 flavor only)."""
    asked = os.environ.get(BF16_LAYOUT_SWITCH, "").strip().lower()
    if not asked:
        return BF16_LAYOUTS.get(flavor, "blocksplit")
    if asked not in ("rows16", "blocksplit"):
        raise ValueError(f"{BF16_LAYOUT_SWITCH}={os.environ[BF16_LAYOUT_SWITCH]!r}: expected rows16 or blocksplit")
    if asked == "rows16" and flavor not in BF16_FLAVORS:
        raise ValueError(f"{BF16_LAYOUT_SWITCH}=rows16 needs an AVX512-BF16 microkernel flavor "
                         f"({', '.join(BF16_FLAVORS)}), this one is {flavor or 'not built'}")
    return asked


def shared_library(flavor: str, defines: tuple[str, ...] = ()):
    """The microkernels of ``flavor`` (with extra ``-D`` ``defines``) built as a shared library and loaded
    (``ctypes.CDLL``), to call the entry points from Python (the tests, benchmarks): each memref argument as
    :func:`memref_args`, then the sizes. Cached as the module objects are (:func:`_compile_cached`: each build takes
    seconds, and several test files load the same flavors)."""
    import ctypes

    cc = _compiler()
    flags = [f for f in BASE_CFLAGS + FLAVORS[flavor][1] if f != "-fvisibility=hidden"] + list(defines)
    return ctypes.CDLL(str(_compile_cached(cc, _compiler_version(cc), flavor, flags, "-shared", ".so")))


def memref_args(a) -> list:
    """A contiguous numpy array as the five arguments of an MLIR ``memref<?xT>`` (the entry points' convention)."""
    import ctypes

    p = ctypes.c_void_p(a.ctypes.data)
    return [p, p, ctypes.c_size_t(0), ctypes.c_size_t(a.size), ctypes.c_size_t(1)]


def group_slots(fn, ids, num_experts: int, chunk: int = 64):
    """The C grouping (``fn``: a loaded library's GROUP_SYMBOL) of the slots' expert ids: (order [S] i32, info
    [2 (E + S / chunk)] i64, counts [work items, valid slots] i32), the buffers a matmul's work items read."""
    import ctypes

    import numpy as np

    S = len(ids)
    ids = np.ascontiguousarray(ids, np.int32)
    order = np.full(max(S, 1), -7, np.int32)  # poison: every entry must be written
    info = np.full(2 * (num_experts + S // chunk), -7, np.int64)
    counts = np.full(2, -7, np.int32)
    fn(*memref_args(ids), *memref_args(order), *memref_args(info), *memref_args(counts), ctypes.c_size_t(S),
       ctypes.c_size_t(num_experts), ctypes.c_size_t(chunk))
    return order[:S], info, counts


@functools.cache
def _compiler_version(cc: str) -> str:
    """``cc --version`` (part of the build cache's key)."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout


def _compile_cached(cc: str, version: str, flavor: str, flags: list[str], mode: str, suffix: str) -> Path:
    """SOURCE compiled with ``flags`` and ``mode`` ("-c": an object, "-shared": a library) into the cache, under a
    name keyed by the sources, the compiler and the flags; the file's path. Raises OSError or
    subprocess.SubprocessError (CalledProcessError with the compiler's stderr) when the build fails."""
    key = hashlib.sha256("\0".join([*(f.read_text() for f in SOURCES), version, *flags]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"mxfp4_matvec-{flavor}-{key}{suffix}"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, mode, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300,
                       check=True)
        os.replace(tmp, out)  # atomic: a concurrent build sees a whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _build(cc: str, version: str, flavor: str) -> Ukernel:
    try:
        out = _compile_cached(cc, version, flavor, list(BASE_CFLAGS + FLAVORS[flavor][1]), "-c", ".o")
    except subprocess.CalledProcessError as e:
        first = next((ln for ln in e.stderr.splitlines() if "error" in ln), e.stderr.strip()[:200])
        return Ukernel(None, f"{cc} failed on {SOURCE.name}: {first}", flavor)
    except (OSError, subprocess.SubprocessError) as e:
        return Ukernel(None, f"building {SOURCE.name} failed ({e})", flavor)
    return Ukernel(str(out), flavor=flavor)
