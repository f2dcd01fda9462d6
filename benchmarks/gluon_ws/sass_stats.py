import re, sys, collections
def loops(path):
    lines = [l for l in open(path) if re.search(r'/\*[0-9a-f]{4,}\*/', l)]
    ins = []
    for l in lines:
        m = re.search(r'/\*([0-9a-f]+)\*/\s+(.*?);', l)
        if m: ins.append((int(m.group(1), 16), m.group(2).strip()))
    labels = {}
    src = open(path).read()
    # find backward branches: BRA `(.L_x_N) where label address < branch address
    lab_addr = {}
    for m in re.finditer(r'\.(L_x_\d+):\s*\n(?:.*\n)*?\s*/\*([0-9a-f]+)\*/', src):
        lab_addr[m.group(1)] = int(m.group(2), 16)
    out = []
    for a, t in ins:
        m = re.search(r'BRA\s+`?\(\.(L_x_\d+)\)', t)
        if m and m.group(1) in lab_addr and lab_addr[m.group(1)] < a:
            out.append((lab_addr[m.group(1)], a))
    return ins, out
ins, lps = loops(sys.argv[1])
for lo, hi in lps:
    body = [t for a, t in ins if lo <= a <= hi]
    c = collections.Counter(re.sub(r'^@!?U?P\w+\s+', '', t).split()[0] for t in body)
    print(f"loop {lo:#x}-{hi:#x}: {len(body)} instrs; top:", dict(c.most_common(14)))
