"""The import graph of the library (STYLE.md §1, §11): no cycles, no private names across modules.

Read with ``ast`` (nothing is imported), so imports under ``TYPE_CHECKING`` and inside
functions count too: a cycle hidden there is still a cycle in the design.
"""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

_PACKAGES = ("hf_pipeline", "dist")

#: Known exceptions, each to be removed by its owner (issue 9).
_PRIVATE_ALLOWED: set[tuple[str, str, str]] = set()


def _modules() -> dict[str, tuple[ast.Module, bool]]:
    """Dotted module name -> (parsed source, is a package ``__init__``)."""
    out = {}
    for package in _PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            out[name] = (ast.parse(path.read_text(encoding="utf-8")), is_package)
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(module -> modules it imports, [(importer, module, private name)])."""
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    private = []
    for name, (tree, is_package) in modules.items():
        aliases = {}  # local name -> a project module bound to it
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        edges[name].add(alias.name)
                        aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(name, is_package, node)
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:
                        edges[name].add(submodule)
                        aliases[alias.asname or alias.name] = submodule
                    elif source in modules and source != name:
                        edges[name].add(source)
                        if alias.name.startswith("_"):
                            private.append((name, source, alias.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                attr = node.attr
                if target not in (None, name) and attr.startswith("_") and attr[:2] != "__":
                    private.append((name, target, attr))
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges[node]:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_modules_and_their_imports():
    edges, _ = _graph()
    assert "hf_pipeline.stores.hub" in edges and "dist.atomic" in edges
    assert "hf_pipeline.stores.staging" in edges["hf_pipeline.stores.base"]
    assert "hf_pipeline.stores.base" in edges["hf_pipeline.stores"]


def test_no_import_cycles():
    assert _cycles(_graph()[0]) == []


def test_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]


def test_no_module_uses_another_modules_private_names():
    _, private = _graph()
    assert sorted(set(private) - _PRIVATE_ALLOWED) == []


def _doc_code_imports() -> list[tuple[str, str, str]]:
    """(page, module, name) of every ``from hf_pipeline... import name`` in README's and
    the docs' Python blocks (what users copy)."""
    import re

    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = []
    for page in pages:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            for node in ast.walk(ast.parse(block)):
                if (
                    isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[0] in _PACKAGES
                ):
                    found += [(page.name, node.module, a.name) for a in node.names]
                elif isinstance(node, ast.Import):
                    found += [
                        (page.name, a.name, "")
                        for a in node.names
                        if a.name.split(".")[0] in _PACKAGES and a.name != "hf_pipeline"
                    ]
    return found


def test_docs_import_only_the_public_api():
    """README and docs import from ``hf_pipeline`` itself, and only names in its
    ``__all__``: the modules behind it may move."""
    import hf_pipeline

    found = _doc_code_imports()
    assert found, "no imports found in README/docs: the scan is broken"
    bad = [f for f in found if f[1] != "hf_pipeline" or f[2] not in hf_pipeline.__all__]
    assert not bad, bad


def test_public_api_names_resolve():
    import hf_pipeline

    assert hf_pipeline.__all__ == sorted(hf_pipeline.__all__)
    eager = {"Config", "load_config"} | {n for n in hf_pipeline.__all__ if n.endswith("Error")}
    assert set(hf_pipeline.__all__) == eager | set(hf_pipeline._LAZY)
    for name in hf_pipeline.__all__:
        assert getattr(hf_pipeline, name) is not None, name


#: Pages for contributors, which name modules on purpose: the code's map
#: (architecture.md) and the history of changes (changelog.md, which names what was
#: changed where). Every other page, and README, is for users.
_CONTRIBUTOR_PAGES = {"architecture.md", "changelog.md"}


_DOTTED = re.compile(r"\bhf_pipeline(?:\.[A-Za-z_]\w*){2,}")


def _doc_dotted_references() -> list[tuple[str, str]]:
    """(page, reference) of every ``hf_pipeline.<a>.<b>...`` in the users' pages, prose
    and code alike (``hf_pipeline.cache.layout.open_dataset``, ``hf_pipeline.Loader.from_config``)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = []
    for page in pages:
        if page.name in _CONTRIBUTOR_PAGES:
            continue
        for ref in _DOTTED.findall(page.read_text()):
            found.append((str(page.relative_to(REPO)), ref))
    return found


def test_docs_dotted_references_name_the_public_api():
    """A dotted ``hf_pipeline.<module>.<name>`` in a user's page sends users to a module
    path that may move: the first part after ``hf_pipeline.`` must be a public name
    (``hf_pipeline.Loader.from_config``), never a module (``hf_pipeline.read.loader``)."""
    import hf_pipeline

    # The scan sees references in prose and code, and only dotted ones.
    sample = "`hf_pipeline.read.loader.loader_options`, hf_pipeline.Loader.from_config(x), hf_pipeline.Loader"
    assert _DOTTED.findall(sample) == [
        "hf_pipeline.read.loader.loader_options",
        "hf_pipeline.Loader.from_config",
    ]
    bad = [
        (page, ref)
        for page, ref in _doc_dotted_references()
        if ref.split(".")[1] not in hf_pipeline.__all__
    ]
    assert not bad, bad


def test_every_module_logger_is_named_after_its_module():
    """One rule (docs/operations.md): ``logging.getLogger(__name__)``, so that
    ``logging.getLogger("hf_pipeline")`` and ``("dist")`` configure whole subtrees and a
    record names the module it came from. dist used "dist" for all, hf_pipeline mixed
    "hf_pipeline" and ``__name__``."""
    bad = []
    for path in sorted([*(REPO / "hf_pipeline").rglob("*.py"), *(REPO / "dist").rglob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "getLogger"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).split(".")[0] in ("hf_pipeline", "dist")
            ):
                bad.append(f"{rel}:{node.lineno}: getLogger({node.args[0].value!r})")
    assert not bad, bad
    import dist.coordinator
    import hf_pipeline.publish.pull

    assert dist.coordinator.logger.name == "dist.coordinator"
    assert hf_pipeline.publish.pull.logger.name == "hf_pipeline.publish.pull"
