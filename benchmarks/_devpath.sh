# Source on a machine without `pip install -e .`: exposes the repo as the `mxmoe` package
# (pyproject's package-dir mapping) through a symlink tree in /tmp/mxmoe_path.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
P=/tmp/mxmoe_path/mxmoe
rm -rf /tmp/mxmoe_path && mkdir -p "$P"
for f in "$ROOT"/mxmoe/*; do ln -s "$f" "$P/$(basename "$f")"; done
for d in core kernels runtime compiler torch_frontend; do ln -s "$ROOT/$d" "$P/$d"; done
export PYTHONPATH=/tmp/mxmoe_path${PYTHONPATH:+:$PYTHONPATH}
