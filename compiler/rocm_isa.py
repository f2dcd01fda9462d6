"""What a compiled ROCm module runs, read from the AMDGPU assembly IREE dumps (no AMD GPU needed).

``iree-compile ... --iree-hal-dump-executable-files-to=DIR`` (``mxmoe.compile(..., extra_flags=[that flag])``) writes
the linked assembly of every dispatch of a rocm target as ``*.rocmasm``. :func:`kernels` splits it by kernel,
:func:`mix` counts the instruction classes that say whether a dispatch runs on the matrix cores and how it loads,
and :func:`expert_dispatches` picks the grouped matmuls' contractions (IREE names a contraction dispatch
``..._matmul_like_...``; the router's plain ``matmul`` is not one). tests/compiler/test_rocm_target.py and
benchmarks/amd_isa.py use them; docs/amd.md shows their output.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

#: instruction class -> regular expression on one assembly line
CLASSES: dict[str, str] = {
    "mfma": r"\bv_mfma_(?!scale)\w+",
    "mfma_scale": r"\bv_mfma_scale_\w+",
    "vector_fma": r"\bv_(pk_)?fmac?_f32\b",
    "cvt_scale": r"\bv_cvt_scalef32\w*",
    "valu": r"^\s+v_(?!mfma)\w+",
    "load_x4": r"^\s+(global|buffer)_load_dwordx4\b",
    "load_x2": r"^\s+(global|buffer)_load_dwordx2\b",
    "load_dword": r"^\s+(global|buffer)_load_dword\b(?!x)",
    "load_short": r"^\s+(global|buffer)_load_(u|s)short\b",
    "load_byte": r"^\s+(global|buffer)_load_(u|s)byte\b",
    "lds_read": r"^\s+ds_read",
    "lds_write": r"^\s+ds_write",
}


def kernels(dump_dir: str | Path) -> dict[str, list[str]]:
    """Kernel name -> its instruction lines, from every ``*.rocmasm`` file in ``dump_dir``."""
    out: dict[str, list[str]] = {}
    for path in sorted(Path(dump_dir).glob("*.rocmasm")):
        text = path.read_text().splitlines()
        functions = set(re.findall(r"\.type\s+([^,\s]+),@function", "\n".join(text)))
        current = None
        for line in text:
            label = re.match(r"^([A-Za-z_$][\w$.]*):\s*$", line)
            if label and label.group(1) in functions:
                current = label.group(1)
                out[current] = []
            elif current and line.startswith(".Lfunc_end"):
                current = None
            elif current and (re.match(r"^\s+[a-z]", line) or re.match(r"^\.LBB\w+:", line)):
                out[current].append(line)  # instructions, and the labels of its blocks
    return out


def mix(lines: list[str]) -> dict[str, int]:
    """Instruction class counts (:data:`CLASSES`) and the top mnemonics of one kernel."""
    counts = {name: sum(1 for line in lines if re.search(pattern, line)) for name, pattern in CLASSES.items()}
    counts["instructions"] = sum(1 for line in lines if not line.endswith(":"))
    return counts


def mnemonics(lines: list[str], top: int = 8) -> list[tuple[str, int]]:
    return Counter(line.split()[0] for line in lines).most_common(top)


def short_name(kernel: str) -> str:
    """``module_layer$async_dispatch_22_matmul_like_Dx16x5760...`` -> ``d22 matmul_like_Dx16x5760...``."""
    m = re.search(r"dispatch_(\d+)_(.*)", kernel)
    return f"d{m.group(1)} {m.group(2)}" if m else kernel


def expert_dispatches(ks: dict[str, list[str]]) -> dict[str, list[str]]:
    """The contraction dispatches (the grouped matmuls' expert GEMMs): IREE's ``matmul_like`` kernels."""
    return {name: lines for name, lines in ks.items() if "matmul_like" in name}


def _innermost_loop(lines: list[str], label_of, targets_of, matrix) -> tuple[int, int] | None:
    """(first, last) line of the innermost loop holding the most ``matrix`` lines: a loop is a label and the branches
    back to it (back edges that cross each other, as in a rotated loop, make one loop); None when nothing loops."""
    labels, spans = {}, []
    for j, line in enumerate(lines):
        label = label_of(line)
        if label:
            labels[label] = j
        for target in targets_of(line):
            if target in labels:  # a label seen before: a backward branch
                spans.append((labels[target], j))
    regions: list[list[int]] = []
    for start, end in sorted(spans):
        for r in regions:  # crossing (overlapping, neither inside the other): the same loop
            if r[0] < start <= r[1] < end or start < r[0] <= end < r[1]:
                r[0], r[1] = min(r[0], start), max(r[1], end)
                break
        else:
            regions.append([start, end])
    count = lambda r: sum(1 for ln in lines[r[0]:r[1] + 1] if matrix(ln))  # noqa: E731
    holding = [r for r in regions if count(r)]
    inner = [r for r in holding if not any(o is not r and r[0] <= o[0] and o[1] <= r[1] for o in holding)]
    if not inner:
        return None
    start, end = max(inner, key=count)
    return start, end


def main_loop(lines: list[str]) -> list[str]:
    """The instructions of the K loop (assembly lines of one kernel): the innermost loop holding matrix instructions,
    the one with the most of them where several are innermost; [] when nothing loops."""
    def label_of(line):
        m = re.match(r"^(\.LBB\w+):", line.strip())
        return m.group(1) if m else None

    span = _innermost_loop(lines, label_of, lambda ln: [ln.split()[-1]] if "branch" in ln else [],
                           lambda ln: "v_mfma" in ln)
    return [] if span is None else lines[span[0] + 1:span[1] + 1]


def _ir_loop(body: list[str]) -> list[str]:
    """The K loop of one LLVM IR function body (the same rule as :func:`main_loop`, on basic blocks and ``br``)."""
    def label_of(line):
        m = re.match(r"^([\w.$-]+):", line)
        return m.group(1) if m else None

    span = _innermost_loop(body, label_of,
                           lambda ln: re.findall(r"label %([\w.$-]+)", ln) if ln.lstrip().startswith("br ") else [],
                           lambda ln: "@llvm.amdgcn.mfma" in ln)
    return [] if span is None else body[span[0]:span[1] + 1]


def workgroup_tiles(dump_dir: str | Path) -> dict[str, dict[str, list[int]]]:
    """Kernel name -> the lowering config IREE chose for its contraction (``workgroup``, ``reduction``, ...: tile
    sizes per loop of the linalg op, from the dumped ``configured_*.mlir``): which rows and columns one workgroup
    computes and how many K steps (of 32) one loop iteration takes), and ``workgroup_size`` (threads)."""
    out: dict[str, dict[str, list[int]]] = {}
    for path in Path(dump_dir).glob("configured_*.mlir"):
        text = path.read_text()
        fn = re.search(r"func\.func @(\S+?)\(\)", text)
        cfg = re.search(r"lowering_config = #iree_gpu\.lowering_config<\{([^}]*)\}>", text)
        size = re.search(r"workgroup_size = \[([\d, ]+)\]", text)
        if fn and cfg:
            out[fn.group(1)] = {k: [int(v) for v in vals.split(",")]
                                for k, vals in re.findall(r"(\w+) = \[([\d, ]+)\]", cfg.group(1))}
            if size:
                out[fn.group(1)]["workgroup_size"] = [int(v) for v in size.group(1).split(",")]
    return out


#: element type of a dispatch binding -> what it holds in an expert dispatch
_ROLES = {"f4E2M1FN": "weights", "bf16": "activations", "f16": "activations", "f8E4M3FN": "activations",
          "i32": "indices", "i64": "indices"}


def _load_bytes(llvm_type: str) -> int:
    m = re.fullmatch(r"<(\d+) x (\w+)>", llvm_type)
    count, scalar = (int(m.group(1)), m.group(2)) if m else (1, llvm_type)
    bits = {"bfloat": 16, "half": 16, "float": 32, "double": 64}.get(scalar) or int(scalar.lstrip("i"))
    return count * bits // 8


def binding_loads(dump_dir: str | Path, loop: bool = False) -> dict[str, dict[str, Counter]]:
    """Kernel name -> {what a binding holds (weights, scales, activations, activation scales, indices, or two of
    them joined by "+" where one buffer holds both): Counter of load sizes in bytes}, the static global loads of each
    kernel (``loop``: of its K loop only, one iteration) traced to its bindings in the LLVM IR IREE dumps
    (``*.optimized.ll``; kernel argument i is binding i, whose types the dispatch's ``configured_*.mlir`` gives)."""
    dump_dir = Path(dump_dir)
    roles: dict[str, dict[int, str]] = {}
    for path in dump_dir.glob("configured_*.mlir"):
        text = path.read_text()
        for fn in set(re.findall(r"func\.func @(\S+?)\(\)", text)):
            found: dict[int, str] = {}
            for m in re.finditer(r"binding\((\d+)\)[^\n]*?flags\(([^)]*)\)[^\n]*?: memref<([^,>]+)", text):
                index, flags, shape = int(m.group(1)), m.group(2), m.group(3)
                el = shape.rsplit("x", 1)[-1]
                rank = shape.count("x")
                if "ReadOnly" not in flags:
                    role = "output"
                elif el == "f8E8M0FNU":
                    role = "scales" if rank >= 3 else "activation scales"
                else:
                    role = _ROLES.get(el, el)
                if role not in found.get(index, "").split("+"):  # one buffer may hold two results
                    found[index] = f"{found[index]}+{role}" if index in found else role
            roles[fn] = found
    out: dict[str, dict[str, Counter]] = {}
    for path in dump_dir.glob("*.optimized.ll"):
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r'define .*@"?([^"(]+)"?\((.*)\)', lines[i])
            if not m:
                i += 1
                continue
            name, args = m.group(1), re.findall(r"ptr addrspace\(1\)[^,]*?(%\d+)", m.group(2))
            defs, body = {}, []
            i += 1
            while i < len(lines) and not lines[i].startswith("}"):
                d = re.match(r"\s*(%[\w.]+) = (.*)", lines[i])
                if d:
                    defs[d.group(1)] = d.group(2)
                body.append(lines[i])
                i += 1

            def root(v: str, depth: int = 0) -> int | None:
                if v in args:
                    return args.index(v)
                if depth > 40 or v not in defs:
                    return None
                for op in re.findall(r"%[\w.]+", defs[v]):
                    r = root(op, depth + 1)
                    if r is not None:
                        return r
                return None

            counts: dict[str, Counter] = {}
            for ln in (_ir_loop(body) if loop else body):
                lm = re.search(r"= load (<[^>]+>|[a-z0-9]+), ptr addrspace\((?:1|7)\) (%[\w.]+)", ln)
                if lm:
                    arg = root(lm.group(2))
                    role = roles.get(name, {}).get(arg, f"binding {arg}")
                    counts.setdefault(role, Counter())[_load_bytes(lm.group(1))] += 1
            out[name] = counts
    return out
