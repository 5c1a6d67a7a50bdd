#!/usr/bin/env python3
"""Import-circle scan of src/: see main()'s docstring. Run by ci/test.sh."""
import os, re, sys
from collections import defaultdict

def strip(src):
    """Source with comments and string/char literal contents blanked (braces inside them would mislead)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith('//', i):
            j = src.find('\n', i); j = n if j < 0 else j
            out.append(' ' * (j - i)); i = j
        elif src.startswith('/*', i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith('/*', j): depth += 1; j += 2
                elif src.startswith('*/', j): depth -= 1; j += 2
                else: j += 1
            out.append(re.sub(r'[^\n]', ' ', src[i:j])); i = j
        else:
            m = re.compile(r'b?r(#*)"').match(src, i)
            if m and (i == 0 or not (src[i-1].isalnum() or src[i-1] == '_')):
                end = '"' + m.group(1)
                j = src.find(end, m.end()); j = n if j < 0 else j + len(end)
                out.append('""' + re.sub(r'[^\n]', ' ', src[i:j])[2:]); i = j
            elif c == '"':
                j = i + 1
                while j < n and src[j] != '"':
                    j += 2 if src[j] == '\\' else 1
                out.append('"' + re.sub(r'[^\n]', ' ', src[i+1:j]) + '"'); i = j + 1
            elif c == "'":
                m = re.compile(r"'(\\.[^']*|[^\\'])'").match(src, i)
                if m:
                    out.append("' '" + ' ' * (m.end() - i - 3)); i = m.end()
                else:
                    out.append(c); i += 1
            else:
                out.append(c); i += 1
    return ''.join(out)

def blank_test_blocks(code):
    """Blanks inline `#[cfg(test)] mod name { ... }` blocks (test code may reach anywhere)."""
    out = code
    for m in re.finditer(r'#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{', code):
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {'{': 1, '}': -1}.get(code[j], 0); j += 1
        out = out[:m.start()] + re.sub(r'[^\n]', ' ', out[m.start():j]) + out[j:]
    return out

def test_only_children(code):
    return set(re.findall(r'#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;', code))

def expand_use(tree):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (whitespace removed)."""
    tree = re.sub(r'\s+', '', tree)
    def split_top(s):
        parts, depth, cur = [], 0, ''
        for ch in s:
            if ch == ',' and depth == 0:
                parts.append(cur); cur = ''
                continue
            depth += {'{': 1, '}': -1}.get(ch, 0); cur += ch
        if cur: parts.append(cur)
        return parts
    def go(prefix, s):
        i = s.find('{')
        if i < 0:
            s = re.sub(r'\bas\w+$', '', s.split('as')[0] if False else s)
            return [prefix + s]
        head, inner = s[:i], s[i+1:s.rfind('}')]
        res = []
        for p in split_top(inner):
            res += go(prefix + head, p)
        return res
    return [re.sub(r'(::)?(self|\*)$', '', p) for p in go('', tree)]

def main():
    """Every reference from one module to another inside src/ (a `use` or an
    inline `crate::`/`super::` path), resolved to the deepest module it names,
    becomes an edge between the two sibling modules under their nearest common
    parent: `engine::cpu::forward -> crate::plan` is `engine -> plan` among the
    crate root's children; `engine::cpu -> engine::cuda` is `cpu -> cuda` among
    engine's. A parent using its children, or a child using its parent's own
    items, is how Rust modules are built and is not an edge. A circle is a
    strongly connected set of two or more siblings. Test code (`#[cfg(test)]`
    modules) may reach anywhere and is left out. Exit 1 when any circle exists."""
    root = sys.argv[1] if len(sys.argv) > 1 else 'src'
    files = {}
    for d, _, names in os.walk(root):
        for f in names:
            if not f.endswith('.rs'): continue
            p = os.path.join(d, f)
            rel = os.path.relpath(p, root)[:-3].split(os.sep)
            if rel in (['lib'],): mod = ()
            elif rel == ['main']: continue
            elif rel[-1] == 'mod': mod = tuple(rel[:-1])
            else: mod = tuple(rel)
            files[mod] = p
    codes, skip = {}, set()
    for mod, p in files.items():
        raw = open(p, encoding='utf-8').read()
        code = strip(raw)
        for child in test_only_children(code):
            skip.add(mod + (child,))
        codes[mod] = blank_test_blocks(code)
    mods = set(files)
    # A skipped test module's own children are test-only too.
    live = {m for m in mods if not any(m[:len(s)] == s for s in skip)}

    def resolve(mod, path):
        parts = path.split('::')
        if parts[0] == 'crate': base, rest = (), parts[1:]
        elif parts[0] in ('super', 'self'):
            base = mod
            while parts and parts[0] in ('super', 'self'):
                if parts[0] == 'super':
                    if not base: return None
                    base = base[:-1]
                parts = parts[1:]
            rest = parts
        else: return None
        best = base
        for k in range(1, len(rest) + 1):
            if base + tuple(rest[:k]) in mods: best = base + tuple(rest[:k])
            else: break
        return best

    edges = defaultdict(lambda: defaultdict(list))   # parent -> (a, b) -> [where]
    for mod in sorted(live):
        code = codes[mod]
        refs = []
        for m in re.finditer(r'\buse\s+((?:crate|super|self)\b[^;]*);', code):
            line = code.count('\n', 0, m.start()) + 1
            refs += [(line, p) for p in expand_use(m.group(1))]
        uses = ''.join(c if c == '\n' else ' ' for c in code)
        for m in re.finditer(r'(?<![\w:])((?:crate|super|self)(?:::\w+)+)', re.sub(r'\buse\s+[^;]*;', lambda u: re.sub(r'[^\n]', ' ', u.group(0)), code)):
            refs.append((code.count('\n', 0, m.start()) + 1, m.group(1)))
        for line, path in refs:
            t = resolve(mod, path)
            if t is None or t == mod: continue
            k = 0
            while k < min(len(mod), len(t)) and mod[k] == t[k]: k += 1
            if k == len(mod) or k == len(t): continue   # ancestor or descendant
            parent = mod[:k]
            edges[parent][(mod[k], t[k])].append(f'{files[mod]}:{line} {path}')

    circles = []
    for parent, es in edges.items():
        graph = defaultdict(set)
        for a, b in es: graph[a].add(b)
        # Tarjan's strongly connected components.
        index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]
        def visit(v):
            index[v] = low[v] = counter[0]; counter[0] += 1; stack.append(v); on.add(v)
            for w in graph[v]:
                if w not in index: visit(w); low[v] = min(low[v], low[w])
                elif w in on: low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v: break
                if len(comp) > 1: comps.append(sorted(comp))
        sys.setrecursionlimit(10000)
        for v in list(graph):
            if v not in index: visit(v)
        for comp in comps:
            circles.append((parent, comp, {e: w for e, w in es.items() if e[0] in comp and e[1] in comp}))
    if not circles:
        print(f'import_cycles: no import circle in {root}/ ({len(live)} modules)')
        return 0
    for parent, comp, es in circles:
        where = '::'.join(('crate',) + parent)
        print(f'import circle under {where}: ' + ' <-> '.join(comp))
        for (a, b), ws in sorted(es.items()):
            print(f'  {a} -> {b}: {len(ws)} reference(s), e.g. {ws[0]}')
    return 1

if __name__ == '__main__':
    sys.exit(main())
