"""Module import cycles in a crate (CI fails on any), re-exports resolved: edges from each
module file to the modules its paths name (crate::/super::/self::),
where a name re-exported by a parent (`pub use child::Name` or
`pub(crate) use child::{A, B}`) resolves to the child that defines it.
Prints every strongly connected component of more than one module."""
import os, re, sys
root = sys.argv[1]
mods = {}
for dp, _, fs in os.walk(root):
    for f in fs:
        if not f.endswith('.rs'): continue
        p = os.path.join(dp, f)
        rel = os.path.relpath(p, root)[:-3]
        parts = rel.split('/')
        if parts[-1] in ('mod', 'lib'): parts = parts[:-1]
        mods['::'.join(parts)] = p
def strip_tests(src):
    i = src.find('#[cfg(test)]\nmod tests')
    src = src[:i] if i >= 0 else src
    # Comments (doc links are not imports) and string literals.
    src = re.sub(r'//[^\n]*', '', src)
    src = re.sub(r'"(?:[^"\\]|\\.)*"', '""', src)
    return src
# re-exports: (module, Name) -> child module
reexp = {}
for m, p in mods.items():
    src = strip_tests(open(p).read())
    for g in re.finditer(r'pub(?:\([a-z]+\))?\s+use\s+(?:self::)?([a-z_][a-z0-9_]*)((?:::[A-Za-z_][A-Za-z0-9_]*)*)(?:::\{([^}]*)\})?\s*;', src):
        child = (m + '::' if m else '') + g.group(1)
        if child not in mods: continue
        tail = g.group(2)
        if g.group(3):
            names = [x.strip().split(' as ')[-1].strip() for x in g.group(3).split(',')]
        else:
            names = [tail.split('::')[-1]] if tail else []
        for n in names:
            if n and n != 'self':
                reexp[(m, n)] = child
def resolve(cur, path):
    segs = path.split('::')
    if segs[0] == 'crate': base = []; segs = segs[1:]
    elif segs[0] == 'super':
        base = cur[:-1]; segs = segs[1:]
        while segs and segs[0] == 'super': base = base[:-1]; segs = segs[1:]
    elif segs[0] == 'self': base = cur; segs = segs[1:]
    else: return None
    for i in range(len(segs), -1, -1):
        cand = '::'.join(base + segs[:i])
        if cand in mods:
            # a name re-exported by that module: the child defining it
            if i < len(segs):
                t = reexp.get((cand, segs[i]))
                while t is not None:
                    cand = t
                    t = reexp.get((cand, segs[i]))
            return cand
    return None
edges = {m: set() for m in mods}
for m, p in mods.items():
    src = strip_tests(open(p).read())
    cur = m.split('::') if m else []
    found = []
    for mm in re.finditer(r'\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)', src):
        found.append(mm.group(1))
    for g in re.finditer(r'\b(crate|super(?:::super)*|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^}]*)\}', src):
        for item in g.group(3).split(','):
            item = item.strip().split(' as ')[0].strip()
            if not item or item == 'self': continue
            found.append(g.group(1) + g.group(2) + '::' + item.split('::{')[0])
    for f in found:
        t = resolve(cur, f)
        if t is None or t == m: continue
        if t.startswith(m + '::') and m: continue      # own children
        if m.startswith(t + '::') or t == '': continue  # own ancestors (their items)
        edges[m].add(t)
# Tarjan SCC
idx = {}; low = {}; st = []; on = set(); out = []; c = [0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in edges[v]:
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: out.append(sorted(comp))
for v in edges:
    if v not in idx: sc(v)
for comp in out:
    print(' / '.join(comp))
    for a in comp:
        print('    ', a, '->', sorted(e for e in edges[a] if e in comp))
print(root + ':', len(out), 'import cycles (components of more than one module)')
sys.exit(1 if out else 0)
