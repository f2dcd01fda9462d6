"""What this machine is, as the layers that build or check host code need to know it.

* :func:`cpu_features`: the ISA flags of this CPU that host-compiled code may use. The cpu target compiles for
  the host, an artifact records them, and loading it elsewhere refuses a CPU that lacks one.
* :func:`cache_root`: where mxmoe keeps what it can rebuild (compiled modules, built microkernels):
  ``$MXMOE_CACHE_DIR`` if set (``off`` disables caching), else ``$XDG_CACHE_HOME/mxmoe``, else ``~/.cache/mxmoe``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

#: CPU features that decide whether host-compiled code runs on another machine.
ISA_FLAGS = ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "avx512f", "avx512bw", "avx512cd",
             "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512vbmi", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")

ENV_CACHE_DIR = "MXMOE_CACHE_DIR"


@functools.cache
def _cpuinfo_flags() -> frozenset[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_features() -> list[str] | None:
    """The :data:`ISA_FLAGS` this CPU has, in that order (None where /proc/cpuinfo is missing)."""
    have = _cpuinfo_flags()
    return None if have is None else [x for x in ISA_FLAGS if x in have]


def has_cpu_features(*names: str) -> bool:
    """Whether this CPU has every feature in ``names`` (False where that cannot be read)."""
    have = _cpuinfo_flags()
    return have is not None and all(n in have for n in names)


def cache_root() -> Path | None:
    """The cache folder from the environment, or None when ``MXMOE_CACHE_DIR`` switches caching off."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env is not None:
        if env.strip().lower() in ("off", "0", "none", "false", ""):
            return None
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mxmoe"
