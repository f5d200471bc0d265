"""The Python package as a stack (docs/design.md "Layers", item 4): the contract, checked on the source.

Each module of python/tide_jax has a level in `LAYERS` (bottom first). A module imports only modules
of its own level or below (at the top of the file or inside a function alike), and reads no other
module's `_private` attribute (nor imports one by name): what a higher module needs from a lower one
is that module's public API, documented in its header. Tests may still reach into private names.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "tide_jax"

# Bottom to top. Modules of one level may import each other (the package and its tools: `__init__`
# imports `_info` lazily, `_info` reads the package's `__version__`).
LAYERS = [
    ["_compat"],       # JAX version differences
    ["_dispatch"],     # the dispatch lock
    ["_lib"],          # loading the native library, its build and runtime reports, its settings check
    ["_settings"],     # every Python-side TIDE_* setting (the twin of src/config.rs)
    ["_distributed"],  # multi-process jobs: job ids, hosts, topology, the rail, NCCL ids
    ["_layout"],       # Layout: pytrees onto dim-0 shards
    ["_twins"],        # the pure-JAX twins of the collectives ("jax" backend, test oracle)
    ["_inflight"],     # in-flight lanes of hand-written starts
    ["_linear"],       # the linear primitive: autodiff and vmap of the collectives
    ["_native"],       # the native calls: Handle, start/done/into/cast, attributes, mesh guard, sites
    ["_dropin"],       # the drop-in's primitive (tide_jax.lax)
    ["_ops"],          # the public collectives: validation, backends, autodiff
    ["reference"],     # the "jax" backend's public ops
    ["lax"],           # the drop-in for jax.lax.all_gather / psum_scatter
    ["_loop"],         # scan_layers
    ["_models"],       # what the front doors share
    ["nnx", "equinox"],  # the front doors
    ["__init__", "_info", "info", "launch"],  # the package and its tools
]
LEVEL = {m: i for i, group in enumerate(LAYERS) for m in group}
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def _imports(tree: ast.AST, here: str):
    """(line, module imported, names imported from it) for each tide_jax module this file imports;
    `from . import x` where x is no module names the package (`__init__`)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("tide_jax"):
                continue
            if node.level > 1:
                raise AssertionError(f"{here}.py:{node.lineno}: imports from above the package")
            mod = node.module or ""
            mod = mod[len("tide_jax"):].lstrip(".") if node.level == 0 else mod
            if mod:
                out.append((node.lineno, mod.split(".")[0], [a.name for a in node.names]))
            else:
                for a in node.names:
                    out.append((node.lineno, a.name if a.name in MODULES else "__init__", []))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "tide_jax":
                    out.append((node.lineno, "__init__", []))
                elif a.name.startswith("tide_jax."):
                    out.append((node.lineno, a.name.split(".")[1], []))
    return out


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """Names bound to tide_jax modules: `from . import _ops`, `from . import _linear as _lin`,
    `import tide_jax._ops as _ops`."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and not node.module:
            for a in node.names:
                if a.name in MODULES:
                    out[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "tide_jax":
            for a in node.names:
                if a.name in MODULES:
                    out[a.asname or a.name] = a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tide_jax.") and a.asname:
                    out[a.asname] = a.name.split(".")[1]
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _tree(module: str) -> ast.AST:
    path = PACKAGE / f"{module}.py"
    return ast.parse(path.read_text(), filename=str(path))


def test_every_module_has_a_level():
    missing = [m for m in MODULES if m not in LEVEL]
    assert not missing, f"place these modules of python/tide_jax in LAYERS (and docs/design.md): {missing}"
    gone = [m for m in LEVEL if m not in MODULES]
    assert not gone, f"LAYERS names modules that no longer exist: {gone}"


@pytest.mark.parametrize("module", MODULES)
def test_no_module_imports_one_above_it(module):
    above = [f"{module}.py:{line}: imports {mod} (level {LEVEL[mod]}: {LAYERS[LEVEL[mod]]}), above "
             f"{module} (level {LEVEL[module]})"
             for line, mod, _ in _imports(_tree(module), module) if mod in LEVEL and LEVEL[mod] > LEVEL[module]]
    assert not above, "\n".join(above)


@pytest.mark.parametrize("module", MODULES)
def test_no_module_reads_another_modules_private_names(module):
    tree = _tree(module)
    aliases = _module_aliases(tree)
    bad = [f"{module}.py:{line}: imports {name} from {mod}"
           for line, mod, names in _imports(tree, module) if mod != module
           for name in names if _private(name) and name not in MODULES]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and aliases[node.value.id] != module and _private(node.attr)):
            bad.append(f"{module}.py:{node.lineno}: reads {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)
