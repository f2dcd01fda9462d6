"""Shared pytest set-up: GPU tests skip on machines without CUDA; the ``rss_bytes``, ``near_tie_tokens`` and
``gpu_module`` fixtures."""

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def rss_bytes():
    """This process's resident set size in bytes (Linux), as a function to call before and after."""
    return _rss_bytes


@pytest.fixture
def near_tie_tokens():
    """``near_tie_tokens(logits [T, E], k)`` -> bool [T]: tokens whose routing may legitimately differ."""
    from mxmoe.torch_frontend.ties import near_tie_tokens as tokens

    return tokens


def _widen_scales(layer, seed: int = 0):
    """Each scale byte of ``layer``'s routed experts lowered by 0-14 (random per group, kept >= 1): rows whose
    groups span up to 15 binades, as the sm_90 w4a8 decode's fold and flush rules see them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("w13_scale", "w2_scale"):
            s = getattr(layer, name)
            s.copy_((s.int() - torch.randint(0, 15, s.shape, generator=g)).clamp(min=1).to(s.dtype))


@pytest.fixture
def widen_scales():
    """``widen_scales(layer)``: spread each weight row's scale bytes over 15 binades, in place."""
    return _widen_scales


@pytest.fixture
def linalg_matvec(monkeypatch):
    """Compile the cpu target without its C microkernel (``MXMOE_CPU_UKERNEL=0``): the pure-linalg matvec
    forms that the microkernel replaces at few tokens stay tested."""
    from mxmoe.kernels.cpu import matvec_object

    monkeypatch.setenv("MXMOE_CPU_UKERNEL", "0")
    matvec_object.cache_clear()
    yield
    matvec_object.cache_clear()


class CliResult:
    """What one run of the installed ``mxmoe`` command did: exit status, stdout, stderr."""

    def __init__(self, proc):
        self.rc, self.out, self.err = proc.returncode, proc.stdout, proc.stderr

    def error(self, *words) -> str:
        """The one ``mxmoe: error: ...`` line, checked: exit status 1, no traceback, every one of ``words`` in it."""
        lines = [ln for ln in self.err.strip().splitlines() if ln.startswith("mxmoe: error:")]
        assert self.rc == 1 and len(lines) == 1 and "Traceback" not in self.err, (self.rc, self.out, self.err)
        for w in words:
            assert w in lines[0], lines[0]
        return lines[0]


@pytest.fixture(scope="session")
def mxmoe_cli():
    """``mxmoe_cli(*argv, cwd=None) -> CliResult``: the installed ``mxmoe`` console script in a subprocess, as users
    run it. In-process calls of ``mxmoe.cli.main`` share the test process's imports (the custom ops already
    registered, torch loaded) and so hide what a fresh process gets wrong; each subprocess pays the import (~0.2 s,
    ~3 s once torch is needed)."""
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("mxmoe")

    def run(*argv, cwd=None, timeout=600) -> CliResult:
        env = {k: v for k, v in os.environ.items() if k != "MXMOE_DEBUG"}
        return CliResult(subprocess.run([str(exe), *map(str, argv)], capture_output=True, text=True, cwd=cwd,
                                        timeout=timeout, env=env))

    return run


@pytest.fixture(scope="session")
def rocm_form_on_cpu():
    """``rocm_form_on_cpu(arch="gfx942", activations="bf16")`` -> a cpu target compiling the linalg of
    ``rocm:{arch}`` (``mxmoe.compiler.targets.rocm_form_on_cpu``)."""
    from mxmoe.compiler.targets import rocm_form_on_cpu as form

    return form


#: where GPU tests find what a machine with the compiler built for them (the GPU machines here have no IREE)
GPU_PLANS_ENV = "MXMOE_GPU_PLANS"


def prebuilt_path(root: str, key: str) -> str:
    """Where ``tests/write_gpu_modules.py`` puts the module a GPU test names ``key``."""
    return os.path.join(root, "prebuilt", f"{key}.mxmoe")


@pytest.fixture(scope="session")
def gpu_module():
    """``gpu_module(key, layer, target, **options)``: ``mxmoe.compile(layer, target=target, **options)``, or, on a
    machine without the compiler, the same module built ahead of time (``tests/write_gpu_modules.py`` writes every
    test's ``GPU_MODULES`` under ``$MXMOE_GPU_PLANS/prebuilt``, without weights) bound to ``layer``'s weights. Skips
    when neither is there."""

    def get(key: str, layer, target: str, **options):
        root = os.environ.get(GPU_PLANS_ENV)
        if root and os.path.exists(prebuilt_path(root, key)):
            from mxmoe.runtime import load

            return load(prebuilt_path(root, key), weights=layer.to_weights())
        pytest.importorskip("iree.compiler", reason=f"no compiler here and no {key} under ${GPU_PLANS_ENV}")
        import mxmoe

        return mxmoe.compile(layer, target=target, **options)

    return get
