"""``python -m mxmoe.transformers --families [FAMILY ...]``: check transformers' MoE families with mxmoe's experts
implementation and print the table (markdown with ``--markdown``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mxmoe.transformers", description=__doc__)
    p.add_argument("--families", nargs="*", metavar="FAMILY",
                   help="check these model folders of transformers (default: every one with an experts class)")
    p.add_argument("--target", default=None, help="mxmoe target (default: cpu)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown (docs/transformers.md)")
    args = p.parse_args(argv)
    if args.families is None:
        p.print_help()
        return 2
    from mxmoe.transformers.families import check_families, format_table, moe_families

    names = args.families or moe_families()
    unknown = sorted(set(names) - set(moe_families()))
    if unknown:
        print(f"not MoE families of the installed transformers: {', '.join(unknown)}", file=sys.stderr)
        return 2

    def show(r):
        print(f"{r.family:24s} {r.status:12s} {r.seconds:5.1f}s  {r.reason}", file=sys.stderr, flush=True)

    results = check_families(names, target=args.target, progress=show)
    if args.markdown:
        print(format_table(results))
    failed = [r.family for r in results if r.status == "failed"]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
