"""The layout rules of issue 14, checked on the source: no import cycle among the modules of
ooc/, scheduler/ and vmm/ (imports inside functions and under TYPE_CHECKING count: a cycle a
reader must untangle is one whether or not Python does), no module over 400 lines,
scheduler/ plans without torch, and ``import ooc`` imports no training framework."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ooc", "scheduler", "vmm")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that ``name`` imports, anywhere in its source. A package importing
    its own submodules (its ``__init__`` re-exporting them) is not an edge back."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".") if is_package else name.split(".")[:-1]
            if node.level:
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:   # ``import a.b.c`` as far as it is ours
                t = t.rpartition(".")[0]
            if t and t != name and not (is_package and t.startswith(name + ".")):
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_scheduler_plans_without_torch():
    modules = _modules()
    for name, path in modules.items():
        if not name.startswith("scheduler"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert not any(n == "torch" or n.startswith(("torch.", "ooc")) for n in names), (name, names)


def test_no_module_over_400_lines():
    """Issue 14's rule: a module is split by responsibility before it reaches 400 lines."""
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > 400}
    assert long == {}


def test_importing_ooc_imports_no_framework():
    """transformers, Lightning and peft are imported by ooc/integrations' module of each alone."""
    code = ("import sys, ooc, ooc.integrations, ooc.integrations.held_step; ooc.OutOfCore; "
            "print(sorted(m for m in ('transformers', 'lightning', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


# -- classes: one idea each (issue 39 item 7) --------------------------------------------------
#
# A file limit keeps one idea per file; a class spread over many files (mixins) meets it and
# loses the point. So a class is bounded too: its methods, counted across the project's classes
# it inherits (what a reader must hold to follow a call), and how many of them it inherits.

MAX_METHODS = 30
MAX_PROJECT_BASES = 2

# Classes over the bound today. A class listed here that meets the bound fails the test, so
# the list only shrinks.
EXEMPT = {
    # Outside issue 39's two classes, over the bound on main as well, left for their owners:
    # the fake CUDA driver mirrors the driver API's calls (62 and 60 across its mixins).
    # (vmm.virtual.VirtualAllocator left the list: its three mixins became parts it holds,
    # FreeRanges, IdleHeads and SparseRanges.)
    "ooc.testing.fake_cuda_host.HostBackedFakeDriver",
    "ooc.testing.fake_cuda_copies.FakeCopyDriver",
}


def _classes() -> dict[str, tuple[set[str], list[str]]]:
    """Every class of ooc/, scheduler/ and vmm/: qualified name -> (its own methods, its
    bases that are classes of ours, qualified). A base is resolved through the module's own
    classes and its imports (``from m import C``, ``import m as x`` then ``x.C``)."""
    modules = _modules()
    raw: dict[str, tuple[set[str], list[ast.expr], dict[str, str]]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        names: dict[str, str] = {}   # local name -> qualified name (classes) or module
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                if node.level:
                    base = base[:len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for a in node.names:
                    names[a.asname or a.name] = f"{module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    names[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                names[node.name] = f"{name}.{node.name}"
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                methods = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                raw[f"{name}.{node.name}"] = (methods, node.bases, names)
    out = {}
    for qual, (methods, bases, names) in raw.items():
        ours = []
        for b in bases:
            dotted = ast.unparse(b)
            head, _, rest = dotted.partition(".")
            target = names.get(head, head) + (f".{rest}" if rest else "")
            if target not in raw:   # re-exported by a package: ``from ooc.runtime import X``
                module, _, cls = target.rpartition(".")
                target = next((q for q in raw if q.endswith(f".{cls}") and q.startswith(module)), target)
            if target in raw:
                ours.append(target)
        out[qual] = (methods, ours)
    return out


def _methods_across_bases(classes: dict[str, tuple[set[str], list[str]]], qual: str) -> set[str]:
    methods, bases = classes[qual]
    every = set(methods)
    for b in bases:
        every |= _methods_across_bases(classes, b)
    return every


def _over_bound(classes: dict[str, tuple[set[str], list[str]]]) -> dict[str, str]:
    over = {}
    for qual, (_, bases) in classes.items():
        n = len(_methods_across_bases(classes, qual))
        if n > MAX_METHODS or len(bases) > MAX_PROJECT_BASES:
            over[qual] = f"{n} methods across {len(bases)} project bases {bases}"
    return over


def test_no_class_over_30_methods_or_2_project_bases():
    over = _over_bound(_classes())
    assert set(over) - EXEMPT == set(), {q: over[q] for q in set(over) - EXEMPT}
    assert EXEMPT - set(over) == set(), f"within the bound now, take out of EXEMPT: {EXEMPT - set(over)}"


def test_the_class_bound_counts_inherited_methods_and_bases():
    classes = {
        "m.A": ({f"a{k}" for k in range(20)}, []),
        "m.B": ({f"b{k}" for k in range(11)} | {"a0"}, ["m.A"]),   # 31 across its base
        "m.C": ({"c"}, ["m.A", "m.D", "m.E"]),                      # three project bases
        "m.D": (set(), []), "m.E": (set(), []),
    }
    assert sorted(_over_bound(classes)) == ["m.B", "m.C"]
