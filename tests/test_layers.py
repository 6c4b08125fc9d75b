"""The package imports one way: core <- kernels <- ops <- models <- training <- entry points.

Every import statement of the project counts, also those inside functions (a lazy import is
still a dependency). Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` too, so the
package roots must import nothing of the project at module level (``coat_jax/__init__.py``
loads its public names on first use)."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest
from child_env import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]

LAYERS = (  # (path prefix relative to the repository, layer), most specific first
    ("coat_jax/core/", 0),
    ("pallas_kernels/", 1),
    ("coat_jax/ops/", 2),
    ("coat_jax/models/", 3),
    ("coat_jax/training/", 4),
    ("coat_jax/tools/", 5),
    ("coat_jax/generate.py", 5),  # ``python -m coat_jax.generate``: coat_jax.tools.generate
    ("coat_jax/__init__.py", 0),  # imports nothing; its public names load on first use
    ("train.py", 5),
    ("bench/", 5),
    ("examples/", 5),
    ("configs/", 5),
)
NAMES = ("core", "kernels", "ops", "models", "training", "entry points")


def layer_of(path: str) -> int:
    for prefix, layer in LAYERS:
        if path == prefix or path.startswith(prefix):
            return layer
    raise AssertionError(f"{path}: in no layer; add it to LAYERS")


def project_files() -> list[str]:
    files = []
    for pattern in ("coat_jax/**/*.py", "pallas_kernels/*.py", "bench/*.py", "examples/*.py",
                    "configs/*.py", "train.py"):  # fmt: skip
        files += [str(p.relative_to(ROOT)) for p in ROOT.glob(pattern)]
    return sorted(files)


def module_files() -> dict[str, str]:
    """Importable module name -> file, for the two packages (train.py as ``train``)."""
    out = {"train": "train.py"}
    for path in project_files():
        if path.startswith(("coat_jax/", "pallas_kernels/")):
            name = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            out[name] = path
    return out


def imported_modules(source: str, modules: dict[str, str]) -> set[str]:
    """Project modules that ``source`` imports anywhere, with the packages whose
    ``__init__`` each import runs."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # the package __init__s on the way, and the module
                if ".".join(parts[:i]) in modules:
                    found.add(".".join(parts[:i]))
    return found


def public_name_uses(source: str, modules: dict[str, str]) -> list[str]:
    """Names taken from the package root's lazy public API (``import coat_jax`` or ``from
    coat_jax import fp8_adamw``): they load layer 2, so only entry points may use them."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            uses += [a.name for a in node.names if a.name == "coat_jax"]
        elif isinstance(node, ast.ImportFrom) and node.module == "coat_jax":
            names = [f"coat_jax.{a.name}" for a in node.names]
            uses += [name for name in names if name not in modules]
    return uses


def violations(files: dict[str, str], modules: dict[str, str]) -> list[str]:
    """``importer -> imported`` lines where a lower layer imports a higher one (or anything
    imports the train.py script); ``files``: path -> source."""
    bad = []
    for path, source in files.items():
        if layer_of(path) < 5:
            bad += [f"{path} ({NAMES[layer_of(path)]}) imports the public API: {name}"
                    for name in public_name_uses(source, modules)]  # fmt: skip
        for name in sorted(imported_modules(source, modules)):
            target = modules[name]
            if target == "train.py" or layer_of(target) > layer_of(path):
                bad.append(f"{path} ({NAMES[layer_of(path)]}) imports {name} "
                           f"({NAMES[layer_of(target)]})")  # fmt: skip
    return bad


def cycles(files: dict[str, str], modules: dict[str, str]) -> list[list[str]]:
    """Module import cycles (each as a list of module names)."""
    by_path = {v: k for k, v in modules.items()}
    graph = {by_path[p]: imported_modules(s, modules) - {by_path[p]}
             for p, s in files.items() if p in by_path}  # fmt: skip
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def sources() -> dict[str, str]:
    return {path: (ROOT / path).read_text() for path in project_files()}


def test_no_lower_layer_imports_a_higher_one():
    assert violations(sources(), module_files()) == []


def test_no_module_import_cycle():
    assert cycles(sources(), module_files()) == []


def test_package_inits_import_nothing_of_the_project():
    modules = module_files()
    for path in modules.values():
        if path.endswith("__init__.py"):
            tree = ast.parse((ROOT / path).read_text())
            top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            ours = imported_modules(ast.unparse(ast.Module(top, [])), modules) if top else set()
            assert ours == set(), f"{path} imports {ours} at module level"


@pytest.mark.parametrize(
    "path, source, expected",
    [
        ("pallas_kernels/k.py", "def f():\n    from coat_jax.ops import optim\n", "imports"),
        ("coat_jax/core/q.py", "import coat_jax.training.run\n", "imports"),
        ("bench/b.py", "import train\n", "imports train"),
        ("coat_jax/ops/o.py", "from coat_jax.core import quant\n", None),
        ("coat_jax/models/m.py", "from coat_jax import fp8_adamw\n", "public API"),
        ("coat_jax/training/t.py", "import coat_jax\n", "public API"),
        ("bench/b.py", "import coat_jax\n", None),
    ],
)
def test_the_checker_catches_upward_and_script_imports(path, source, expected):
    found = violations({path: source}, module_files())
    assert (expected in found[0]) if expected else found == []


def test_the_checker_finds_a_cycle():
    modules = {"a.x": "coat_jax/ops/x.py", "a.y": "coat_jax/ops/y.py", "a": "coat_jax/ops/i.py"}
    files = {"coat_jax/ops/x.py": "from a import y\n", "coat_jax/ops/y.py": "import a.x\n"}
    assert cycles(files, modules) == [["a.x", "a.y", "a.x"]]


def test_importing_a_layer_loads_no_higher_layer():
    """At run time: after importing every module of layers 0..L, no module of a higher layer
    is loaded (package roots, lazy names and import side effects included)."""
    by_layer = {}
    for name, path in module_files().items():
        if path != "train.py" and layer_of(path) < 5:
            by_layer.setdefault(layer_of(path), []).append(name)
    code = textwrap.dedent(f"""
        import importlib, sys
        by_layer = {by_layer!r}
        prefixes = {{1: ("pallas_kernels",), 2: ("coat_jax.ops",), 3: ("coat_jax.models",),
                     4: ("coat_jax.training",), 5: ("coat_jax.tools",)}}
        for layer in sorted(by_layer):
            for name in by_layer[layer]:
                importlib.import_module(name)
            higher = [m for m in sys.modules for l, ps in prefixes.items() if l > layer
                      for p in ps if m == p or m.startswith(p + ".")]
            assert not higher, (layer, higher)
            print("layer", layer, "ok")
    """)
    env = child_env(JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == len(by_layer)
