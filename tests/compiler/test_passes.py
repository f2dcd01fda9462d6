"""Run the lit/FileCheck pass tests (tests/compiler/passes/*.mlir) as part of pytest.

Every .mlir file under tests/compiler/passes (one or more per pass, named after it) must be discovered by lit and pass. The tools (`mxmoe-opt`, `filecheck`) are
found next to this Python (tests/compiler/passes/lit.cfg.py looks in $MXMOE_BIN_DIR, this interpreter's bin folder and the
repo's .venv/bin), so the suite works whether or not the virtual environment is on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

LIT_DIR = Path(__file__).parent / "passes"
_RESULT = re.compile(r"^(PASS|FAIL|XFAIL|XPASS|UNSUPPORTED|UNRESOLVED|TIMEOUT|SKIPPED|EXCLUDED): mxmoe :: (\S+)", re.M)


def _run_lit(paths: list[Path], tmp_path: Path, env_path: str | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ)
    env["MXMOE_BIN_DIR"] = os.path.dirname(sys.executable)
    env["MXMOE_LIT_OUT"] = str(tmp_path / "lit-out")
    if env_path is not None:
        env["PATH"] = env_path
    jobs = str(min(2, os.cpu_count() or 1))
    # lit has no __main__ module; call the entry point its console script calls.
    proc = subprocess.run([sys.executable, "-c", "import lit.main; lit.main.main()", "-v", "-j", jobs, *map(str, paths)],
                          capture_output=True, text=True, env=env, timeout=600)
    return proc, {name: status for status, name in _RESULT.findall(proc.stdout)}


def _lit_files() -> list[str]:
    return sorted(p.name for p in LIT_DIR.glob("*.mlir"))


def test_lit_suite(tmp_path):
    pytest.importorskip("lit", reason="lit is a test dependency: pip install -e .[test]")
    files = _lit_files()
    assert files, f"no lit tests found in {LIT_DIR}"
    proc, results = _run_lit([LIT_DIR], tmp_path)
    report = proc.stdout[-20000:] + proc.stderr[-5000:]
    not_run = [f for f in files if f not in results]
    failed = {f: s for f, s in results.items() if s != "PASS"}
    assert not not_run, f"lit did not run {not_run}:\n{report}"
    assert not failed, f"lit tests did not pass: {failed}\n{report}"
    assert proc.returncode == 0, report


def test_lit_finds_tools_without_venv_on_path(tmp_path):
    """lit.cfg.py must substitute absolute tool paths: run one test with a PATH that lacks the venv."""
    pytest.importorskip("lit", reason="lit is a test dependency: pip install -e .[test]")
    venv_bin = os.path.dirname(sys.executable)
    bare = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and os.path.abspath(p) != os.path.abspath(venv_bin)
                           and not os.path.exists(os.path.join(p, "mxmoe-opt")))
    proc, results = _run_lit([LIT_DIR / "opt-parse-error.mlir"], tmp_path, env_path=bare or os.defpath)
    assert results == {"opt-parse-error.mlir": "PASS"}, proc.stdout[-10000:] + proc.stderr[-5000:]
