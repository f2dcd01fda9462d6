"""mxmoe-opt: run mxmoe (and upstream) passes on textual MLIR and print the result.

    mxmoe-opt FILE.mlir --passes=mxmoe-verify,mxmoe-fuse,canonicalize
    mxmoe-opt FILE.mlir --split-input-file --passes=mxmoe-verify
    mxmoe-opt --list-passes

Diagnostics (a parse error, or a pass that rejects its input) go to stderr as
``FILE:LINE:COL: error: ...`` and the exit status is 1. With ``--split-input-file`` the input is cut at
lines ``// -----`` into chunks that are parsed and run one by one (line numbers stay those of FILE); the
printed modules are separated by ``// -----`` and the exit status is 1 if any chunk failed.
"""

from __future__ import annotations

import argparse
import re
import sys

from mxmoe.compiler.context import new_context
from mxmoe.compiler.dialect import VerifyError
from mxmoe.compiler.passes import DESCRIPTIONS, check_pipeline, run_passes

SPLIT_MARKER = "// -----"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mxmoe-opt", description="Run mxmoe passes on textual MLIR.")
    p.add_argument("file", nargs="?", help="input .mlir file ('-' for stdin)")
    p.add_argument("--passes", default="", help="comma-separated pass names; NAME{option} passes an option")
    p.add_argument("--split-input-file", action="store_true",
                   help=f"run each chunk between '{SPLIT_MARKER}' lines on its own")
    p.add_argument("--list-passes", action="store_true", help="list mxmoe passes and exit")
    args = p.parse_args(argv)
    if args.list_passes:
        for name, desc in DESCRIPTIONS.items():
            print(f"{name}: {desc.split(':', 1)[-1].strip()}")
        return 0
    if not args.file:
        p.error("an input file is required")
    try:
        check_pipeline(args.passes)
    except VerifyError as e:
        print(f"mxmoe-opt: error: {e}", file=sys.stderr)
        return 1
    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file).read()
    except OSError as e:
        print(f"mxmoe-opt: error: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 1
    chunks = _split(text) if args.split_input_file else [text]
    failed = False
    outputs = []
    for chunk in chunks:
        out = _run_one(chunk, args.file, args.passes)
        if out is None:
            failed = True
        else:
            outputs.append(out)
    try:
        if outputs:
            print(f"\n{SPLIT_MARKER}\n".join(outputs))
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `mxmoe-opt ... | head`
        pass
    return 1 if failed else 0


def _split(text: str) -> list[str]:
    """Cut at ``// -----`` lines; each chunk is padded with blank lines so its line numbers stay the file's."""
    chunks, current, start = [], [], 0
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == SPLIT_MARKER:
            chunks.append("\n" * start + "\n".join(current))
            current, start = [], i + 1
        else:
            current.append(line)
    chunks.append("\n" * start + "\n".join(current))
    return chunks


def _run_one(text: str, file: str, passes: str) -> str | None:
    """Parse ``text`` and run ``passes``; the printed module, or None after printing the diagnostics."""
    from iree.compiler import ir

    ctx = new_context()
    with ctx, ir.Location.unknown():
        try:
            module = ir.Module.parse(text)
        except ir.MLIRError as e:
            for d in e.error_diagnostics:
                _print_diagnostic(d, file)
            if not e.error_diagnostics:
                print(f"{file}: error: does not parse: {e.message}", file=sys.stderr)
            return None
        try:
            run_passes(module, passes)
        except VerifyError as e:
            print(_locate(str(e), file), file=sys.stderr)
            return None
        return str(module)


_LOC = re.compile(r'^loc\("(?P<file>[^"]*)":(?P<line>\d+):(?P<col>\d+)\)')


def _file_loc(loc: str, file: str) -> str | None:
    """``loc("-":3:5)`` -> ``FILE:3:5`` (input parsed from a string is named "-"); None if not a file location."""
    m = _LOC.match(loc)
    if not m:
        return None
    name = file if m["file"] in ("-", "") else m["file"]
    return f"{name}:{m['line']}:{m['col']}"


def _print_diagnostic(d, file: str) -> None:
    where = _file_loc(str(d.location), file) or file
    print(f"{where}: error: {d.message}", file=sys.stderr)
    for n in d.notes:
        print(f"{_file_loc(str(n.location), file) or file}: note: {n.message}", file=sys.stderr)


def _locate(msg: str, file: str) -> str:
    """'loc("-":3:5): ...' -> 'FILE:3:5: error: ...' (the form lit/FileCheck tests match)."""
    m = _LOC.match(msg)
    if m:
        rest = msg[m.end():].removeprefix(":").strip()
        return f"{_file_loc(m.group(0), file)}: error: {rest}"
    if msg.startswith("loc("):  # a location that is not file:line:col (unknown, fused, name)
        loc, _, rest = msg.partition("): ")
        return f"{file}: error: {rest} ({loc})" if rest else f"{file}: error: {msg}"
    return f"{file}: error: {msg}"


if __name__ == "__main__":
    sys.exit(main())
