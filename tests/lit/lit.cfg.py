# lit configuration for mxmoe's pass tests: each .mlir file holds input IR, RUN lines and CHECK lines.
import os
import sys

import lit.formats

config.name = "mxmoe"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir"]
config.test_source_root = os.path.dirname(__file__)
bindir = os.path.dirname(sys.executable)
config.environment["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
config.substitutions.append(("mxmoe-opt", f"{sys.executable} -m mxmoe.compiler.opt"))
config.substitutions.append(("FileCheck", os.path.join(bindir, "filecheck")))
