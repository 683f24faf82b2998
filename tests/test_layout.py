"""The package's layers import downwards only: no import cycle, function-local imports counted."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import plasticity_callbacks

PACKAGE = Path(plasticity_callbacks.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """Every package module ``path`` imports, at any depth (a function-local import is an import too)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("plasticity_callbacks"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("plasticity_callbacks"):
                target = node.module
            else:
                continue
            subs = [f"{target}.{a.name}" for a in node.names if is_module(f"{target}.{a.name}")]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(target)
    found.discard(here)
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py") if p.name != "__main__.py"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The package's import graph, parsed once for the tests that read it (every module's source: 0.5 CPU-s)."""
    return import_graph()


def test_no_import_cycle_in_the_package(graph):
    assert "plasticity_callbacks.app.runs.checkpoints" in graph  # the walk reached the nested layers
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("layer", ["functional", "model_map", "ops"])
def test_lower_layers_do_not_import_higher_ones(layer, graph):
    higher = ("plasticity_callbacks.callbacks", "plasticity_callbacks.app", "plasticity_callbacks.integrations")
    for module, targets in graph.items():
        if module.startswith(f"plasticity_callbacks.{layer}"):
            assert not [t for t in targets if t.startswith(higher)], module


def external_imports(path: Path) -> set[str]:
    """The top-level names of the packages outside this one that ``path`` imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_checkpoints_and_the_hf_adapter_need_no_app_extra(graph):
    """The Hugging Face adapter reads and writes its state through app.runs: neither may need Hydra."""
    needed = {"hydra", "omegaconf", "matplotlib"}
    reached, todo = set(), ["plasticity_callbacks.integrations.hf"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph.get(module, ()))
    assert "plasticity_callbacks.app.runs.checkpoints" in reached
    for module in reached:
        path = PACKAGE.parent / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        assert not external_imports(path) & needed, module


@pytest.mark.cli
def test_the_hf_adapter_imports_without_the_app_extra_and_the_app_names_it():
    """In a child interpreter where Hydra and OmegaConf cannot be imported."""
    code = ("import sys\n"
            "for name in ('hydra', 'omegaconf'): sys.modules[name] = None\n"
            "import plasticity_callbacks.integrations.hf\n"
            "try:\n"
            "    import plasticity_callbacks.app.train\n"
            "except ImportError as error:\n"
            "    print(type(error).__name__, error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("MissingExtraError") and "[app]" in result.stdout, result.stdout


def test_no_constructor_takes_more_than_ten_arguments():
    """A long constructor is a sign that several concerns share one object: options travel whole as one
    dataclass (OptimizerSettings, LMDesign, the monitor's Curvature), checked once in __post_init__."""
    import importlib
    import inspect
    import pkgutil

    import plasticity_callbacks

    long = []
    for info in pkgutil.walk_packages(plasticity_callbacks.__path__, "plasticity_callbacks."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra
            continue
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or "__dataclass_fields__" in vars(cls):
                continue
            try:
                signature = inspect.signature(cls)
            except ValueError:  # a builtin's (an exception's) constructor
                continue
            parameters = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if len(parameters) > 10:
                long.append(f"{info.name}.{name} ({len(parameters)})")
    assert not long, long
