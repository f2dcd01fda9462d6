"""mxmoe-opt: run mxmoe (and upstream) passes on textual MLIR and print the result.

    mxmoe-opt FILE.mlir --passes=mxmoe-verify,mxmoe-fuse,canonicalize
    mxmoe-opt --list-passes

A pass that rejects its input prints ``FILE:LINE:COL: error: ...`` on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import sys

from mxmoe.compiler.context import new_context
from mxmoe.compiler.dialect import VerifyError
from mxmoe.compiler.passes import DESCRIPTIONS, run_passes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mxmoe-opt", description="Run mxmoe passes on textual MLIR.")
    p.add_argument("file", nargs="?", help="input .mlir file ('-' for stdin)")
    p.add_argument("--passes", default="", help="comma-separated pass names; NAME{option} passes an option")
    p.add_argument("--list-passes", action="store_true", help="list mxmoe passes and exit")
    args = p.parse_args(argv)
    if args.list_passes:
        for name, desc in DESCRIPTIONS.items():
            print(f"{name}: {desc.split(':', 1)[-1].strip()}")
        return 0
    if not args.file:
        p.error("an input file is required")
    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file).read()
    except OSError as e:
        print(f"mxmoe-opt: error: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 1
    ctx = new_context()
    from iree.compiler import ir

    with ctx, ir.Location.unknown():
        try:
            module = ir.Module.parse(text, )
        except Exception as e:  # MLIR's parse diagnostics
            print(f"mxmoe-opt: error: {args.file} does not parse: {e}", file=sys.stderr)
            return 1
        try:
            run_passes(module, args.passes)
        except VerifyError as e:
            print(f"{_locate(str(e), args.file)}", file=sys.stderr)
            return 1
        print(module)
    return 0


def _locate(msg: str, file: str) -> str:
    """'loc("f":3:5): ...' -> 'f:3:5: error: ...' (the form lit/FileCheck tests match)."""
    if msg.startswith("loc("):
        loc, _, rest = msg.partition("): ")
        loc = loc[4:].replace('"', "")
        return f"{loc}: error: {rest}"
    return f"{file}: error: {msg}"


if __name__ == "__main__":
    sys.exit(main())
