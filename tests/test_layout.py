"""The code's shape, checked on the source: no import cycle between the package's modules, no module
over MAX_LINES, no ``_private`` name used outside the module that defines it (a test of that module excepted),
bench/ importing only ``bench.*`` and the package, with no ``sys.path`` edits, and the model core reading no
execution state. Checked by running it: ``import qwenvl_vision`` loads the core and none of the periphery.

Imports inside functions count: a lazy import that closes a loop is still a loop between two modules' jobs.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "qwenvl_vision"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(*folders: str) -> dict[str, Path]:
    return {module_name(p): p for folder in folders for p in sorted((REPO / folder).rglob("*.py"))}


def imported(path: Path, name: str, *, local_names: bool = False) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every import in the file, relative ones resolved; with
    local_names, (module, [(name, local name)], line, local name of the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno, alias.asname or alias.name.split(".")[0]) if local_names
                      else (alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if local_names:
                found.append((base, [(a.name, a.asname or a.name) for a in node.names], node.lineno, None))
            else:
                found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


def project_target(module: str, names: list[str], known: dict[str, Path]) -> list[str]:
    """The project modules an import statement reaches: ``from . import video`` reaches qwenvl_vision.inputs.video."""
    submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
    whole = module in known and (not names or len(submodules) < len(names))
    return ([module] if whole else []) + submodules


PACKAGE_MODULES = sources("qwenvl_vision")


def test_no_import_cycle_in_the_package():
    graph = {name: set() for name in PACKAGE_MODULES}
    for name, path in PACKAGE_MODULES.items():
        for module, names, _ in imported(path, name):
            for target in project_target(module, names, PACKAGE_MODULES):
                # A submodule importing its own package's __init__ is a cycle only if __init__ imports it back,
                # which the graph sees; a package importing its submodules is its job.
                if target != name:
                    graph[name].add(target)
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_over_the_line_limit():
    long = {name: n for name, path in PACKAGE_MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def defining_module(module: str, name: str, known: dict[str, Path]) -> str:
    return f"{module}.{name}" if f"{module}.{name}" in known else module


ALL = sources("qwenvl_vision", "bench", "tests")


def allowed_private(user: str, owner: str) -> bool:
    if user == owner or user.startswith(owner + "."):
        return True
    # A test of that module, in the folder that mirrors the module's: tests.inputs.test_video for
    # qwenvl_vision.inputs.video, tests.test_batching for qwenvl_vision.batching, tests.backends.test_cpu_plan for
    # qwenvl_vision.backends.cpu.plan.
    *folders, test = user.split(".")[1:] if user.startswith("tests.") else ("", "")
    tail = owner.split(".")[1:]
    if not test.startswith("test_") or tail[: len(folders)] != folders or len(tail) <= len(folders):
        return False
    return test.removeprefix("test_").startswith("_".join(tail[len(folders):]))


@pytest.mark.parametrize("folder", ["qwenvl_vision", "bench", "tests"])
def test_no_private_name_used_outside_its_module(folder):
    misuses = []
    for name, path in sources(folder).items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> project module it stands for
        for module, names, line, module_alias in imported(path, name, local_names=True):
            if not (module == "qwenvl_vision" or module.startswith(("qwenvl_vision.", "bench", "tests"))):
                continue
            for imported_name, local in names:
                if f"{module}.{imported_name}" in ALL:
                    aliases[local] = f"{module}.{imported_name}"
                elif imported_name.startswith("_") and not imported_name.startswith("__"):
                    owner = defining_module(module, imported_name, ALL)
                    if not allowed_private(name, owner):
                        misuses.append(f"{path.relative_to(REPO)}:{line} imports {module}.{imported_name}")
            if not names and module in ALL:
                # ``import a.b`` binds a (attributes of a reach a.b through the package); ``import a.b as c`` binds
                # c to a.b itself.
                aliases[module_alias] = module if module_alias != module.split(".")[0] else module_alias
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                owner = aliases[node.value.id]
                if not allowed_private(name, owner):
                    misuses.append(f"{path.relative_to(REPO)}:{node.lineno} uses {owner}.{node.attr}")
    assert not misuses, "private names used outside their module:\n" + "\n".join(misuses)


def test_bench_imports_only_bench_and_the_package():
    problems = []
    for name, path in sources("bench").items():
        text = path.read_text()
        if "sys.path" in text:
            problems.append(f"{path.relative_to(REPO)} edits sys.path")
        for module, _, line in imported(path, name):
            top = module.split(".")[0]
            if top == "tests" or (module in {"throughput", "gemm_bound", "profile_tower"}):
                problems.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not problems, "\n".join(problems)


# The tests that run a benchmark's own code on small towers; every other test takes its fixtures from the package
# (qwenvl_vision.testing) or tests/, never from bench/.
BENCHMARK_TESTS = {"tests.bench.test_bench", "tests.bench.test_cuda_check", "tests.teardown.test_teardown"}


def test_only_the_benchmarks_tests_import_bench_and_the_package_imports_neither():
    problems = []
    for name, path in sources("qwenvl_vision", "tests").items():
        for module, _, line in imported(path, name):
            top = module.split(".")[0]
            if top == "bench" and name not in BENCHMARK_TESTS or top == "tests" and name.startswith("qwenvl_vision"):
                problems.append(f"{path.relative_to(REPO)}:{line} imports {module}")
            if module.startswith("qwenvl_vision.testing") and name.startswith("qwenvl_vision") \
                    and not name.startswith("qwenvl_vision.testing"):
                problems.append(f"{path.relative_to(REPO)}:{line} imports {module} (the package's test kit)")
    assert not problems, "\n".join(problems)


def test_nothing_cites_a_file_outside_the_repository():
    cites = [str(p.relative_to(REPO)) for p in [*PACKAGE.rglob("*.py"), *(REPO / "bench").rglob("*.py"),
                                               REPO / "README.md", *(REPO / "docs").glob("*.md")]
             if "REFERENCE.md" in p.read_text()]
    assert not cites, f"cite REFERENCE.md, which is not in the repository: {cites}"


# The model core: the math, which runs the same whatever executes it. The tower picks the execution (once per
# call) and is not in this list; the CPU backend (qwenvl_vision.backends.cpu) reads these modules, never the reverse.
MODEL_CORE = ("qwenvl_vision.model.layers", "qwenvl_vision.model.attention", "qwenvl_vision.model.qwen2_5",
              "qwenvl_vision.model.qwen3")
EXECUTION_STATE = ("ContextVar", "is_compiling", "is_grad_enabled", "is_autocast_enabled", "is_mkldnn",
                   "requires_grad", "is_inference_mode_enabled")


@pytest.mark.parametrize("name", MODEL_CORE)
def test_the_model_core_reads_no_execution_state(name):
    """A module of the model core neither imports the CPU backend nor asks how it is being run (autograd, compile,
    autocast, a packed weight, a context variable): one path per module."""
    path = PACKAGE_MODULES[name]
    reached = [module for module, _, _ in imported(path, name) if module.startswith("qwenvl_vision.backends.cpu")]
    assert not reached, f"{name} imports the CPU backend: {reached}"
    names = {node.attr if isinstance(node, ast.Attribute) else node.id
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Attribute, ast.Name))}
    assert not names & set(EXECUTION_STATE), f"{name} reads {sorted(names & set(EXECUTION_STATE))}"


@pytest.mark.parametrize("name", sorted(n for n in PACKAGE_MODULES if n.startswith("qwenvl_vision.model.")))
def test_the_model_imports_no_backend(name):
    """``model/`` (the math, the tower's skeleton, its cache) runs the same whoever executes it: a backend imports
    the model, never the reverse; the tower asks the backend attached to it for each call's execution."""
    reached = [module for module, _, _ in imported(PACKAGE_MODULES[name], name)
               if module.startswith("qwenvl_vision.backends")]
    assert not reached, f"{name} imports a backend: {reached}"


# What ``import qwenvl_vision`` must not load: the batch job (with Ray), the hand-off, the vLLM cache, Parquet, the
# teardown study, the test kit, and the libraries only they need. A module under one of these names counts too.
PERIPHERY = ("qwenvl_vision.embed", "qwenvl_vision.outputs.handoff", "qwenvl_vision.outputs.vllm_cache",
             "qwenvl_vision.outputs.parquet", "qwenvl_vision.teardown", "qwenvl_vision.testing", "qwenvl_vision.cli",
             "ray", "pyarrow")
CORE = ("qwenvl_vision.loading", "qwenvl_vision.encoder", "qwenvl_vision.options", "qwenvl_vision.batching",
        "qwenvl_vision.results", "qwenvl_vision.model.tower", "qwenvl_vision.checkpoint.weights",
        "qwenvl_vision.checkpoint.hub", "qwenvl_vision.inputs.images", "qwenvl_vision.inputs.video")


def loaded_by(code: str) -> dict:
    """Run `code` in a fresh interpreter (so nothing this test process imported counts) and return what it
    printed as JSON."""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_importing_the_package_loads_the_core_only():
    modules = loaded_by("import json, sys, qwenvl_vision; print(json.dumps(sorted(sys.modules)))")
    periphery = sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in PERIPHERY))
    assert not periphery, f"import qwenvl_vision loads the periphery: {periphery}"
    assert set(CORE) <= set(modules), sorted(set(CORE) - set(modules))


def test_every_exported_name_resolves_and_the_lazy_ones_load_their_module_on_first_use():
    found = loaded_by("""
import json, sys, qwenvl_vision
before = set(sys.modules)
names = {name: getattr(qwenvl_vision, name).__module__ if hasattr(getattr(qwenvl_vision, name), "__module__")
         else None for name in qwenvl_vision.__all__}
print(json.dumps({"all": qwenvl_vision.__all__, "dir": dir(qwenvl_vision), "names": names,
                  "loaded": sorted(set(sys.modules) - before)}))
""")
    assert set(found["all"]) <= set(found["dir"])
    for name in ("read_embeddings", "read_encoded", "read_run"):
        assert found["names"][name] == "qwenvl_vision.embed.reader", name
    for name in ("EncodedItems", "to_transformers", "to_vllm"):
        assert found["names"][name] == "qwenvl_vision.outputs.handoff", name
    assert {"qwenvl_vision.embed.reader", "qwenvl_vision.outputs.handoff"} <= set(found["loaded"])
