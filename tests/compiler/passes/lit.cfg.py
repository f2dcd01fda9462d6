# lit configuration for mxmoe's pass tests: each .mlir file holds input IR, RUN lines and CHECK lines.
#
# RUN lines name the tools bare (`mxmoe-opt`, `filecheck`/`FileCheck`, `not`); they are substituted with
# absolute paths found in, in order: $MXMOE_BIN_DIR, the bin folder of the Python running lit, the repo's
# .venv/bin. So the tests run the repo's tools even when PATH lacks the virtual environment.
import os
import shutil
import tempfile
import sys

import lit.formats

config.name = "mxmoe"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir"]
config.excludes = ["Inputs"]
config.test_source_root = os.path.dirname(__file__)
# Scratch files (%t) go outside the source tree: $MXMOE_LIT_OUT (tests/test_lit.py sets a fresh one) or /tmp.
config.test_exec_root = os.environ.get("MXMOE_LIT_OUT") or os.path.join(
    tempfile.gettempdir(), f"mxmoe-lit-{os.getuid() if hasattr(os, 'getuid') else 0}")

_repo = os.path.dirname(os.path.dirname(os.path.dirname(config.test_source_root)))
_candidates = [os.environ.get("MXMOE_BIN_DIR"), os.path.dirname(sys.executable), os.path.join(_repo, ".venv", "bin")]


def _tool(name):
    for d in filter(None, _candidates):
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return found
    lit_config.fatal(f"cannot find '{name}' in {[d for d in _candidates if d]} or on PATH; "
                     "install the package with its test extra (pip install -e .[test])")


_bin = os.path.dirname(_tool("mxmoe-opt"))
config.environment["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")
for var in ("PYTHONPATH", "HOME", "TMPDIR"):
    if var in os.environ:
        config.environment[var] = os.environ[var]

# Match a tool name only where a command starts, not inside a path or a longer word.
_word = r"(?<![\w/.%-]){}(?![\w.-])"
config.substitutions.append((_word.format("mxmoe-opt"), _tool("mxmoe-opt")))
config.substitutions.append((_word.format("FileCheck"), _tool("filecheck")))
config.substitutions.append((_word.format("filecheck"), _tool("filecheck")))
