"""The house's floors: every import points down (or sideways within a floor), and no module cycle.

Read from the sources with `ast`, so the test sees every import, also those inside functions.
"""

import ast
import functools
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]

# Lowest floor first. A module may import modules of its own floor or of lower floors only.
FLOORS = (
    ("oxygen_jax.axes", "oxygen_jax.nn"),
    ("oxygen_jax.models",),
    ("oxygen_jax.models.pi05",),
    ("oxygen_jax.robots",),
    ("oxygen_jax.ckpts", "oxygen_jax.runtime"),
    ("oxygen_jax.serving",),
    ("oxygen_jax.cli", "oxygen_jax.demo", "oxygen_jax.run", "oxygen_jax.serve", "oxygen_jax"),
    ("training", "training.data", "training.distributed"),  # frames and their sources: no trainer imports
    ("training.flow",),
    ("training.memory", "eval", "eval.bench", "eval.serving", "eval.parity", "eval.refs", "eval.results"),
)


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for top in ("oxygen_jax", "training", "eval"):
        for p in (REPO / top).rglob("*.py"):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


def floor_of(module: str) -> int:
    """The floor of the longest matching prefix (so `models.pi05` sits above `models`)."""
    best, floor = -1, None
    for i, prefixes in enumerate(FLOORS):
        for pre in prefixes:
            if (module == pre or module.startswith(pre + ".")) and len(pre) > best:
                best, floor = len(pre), i
    assert floor is not None, f"module {module} is on no floor: add it to FLOORS"
    return floor


@functools.cache
def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                r = resolve(n)
                if r and r != m:
                    deps.add(r)
        graph[m] = deps
    return graph


def _is_package_face(importer: str, imported: str) -> bool:
    # A package's __init__ re-exporting its own submodules points down by definition.
    return imported.startswith(importer + ".")


def test_every_import_points_to_the_same_or_a_lower_floor():
    graph = import_graph()
    upward = sorted(f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})"
                    for m, deps in graph.items() for d in deps
                    if floor_of(d) > floor_of(m) and not _is_package_face(m, d))
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


def test_the_library_never_imports_training_or_eval():
    graph = import_graph()
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items() if m.split(".")[0] == "oxygen_jax"
                 for d in deps if d.split(".")[0] in ("training", "eval"))
    assert not bad, "\n".join(bad)


# The training loss is decoder maths on the models floor (`LanguageDecoder.suffix_forward`); only the held-out
# evaluation, which runs the serving engine on purpose (greedy answers as served), reaches the runtime.
ENGINE_EVALUATION = ("training.memory.evaluate",)


def test_training_imports_no_runtime_module_except_its_engine_evaluation():
    graph = import_graph()
    gone = [m for m in ENGINE_EVALUATION if m not in graph]
    assert not gone, f"{gone} moved or removed: update ENGINE_EVALUATION"
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items()
                 if m.split(".")[0] == "training" and m not in ENGINE_EVALUATION
                 for d in deps if d == "oxygen_jax.runtime" or d.startswith("oxygen_jax.runtime."))
    assert not bad, "training reaches the runtime floor:\n" + "\n".join(bad)


# A model family lives in these modules (models/ and ckpts/ files of its own); the runtime, the server and the
# commands reach a family only through the interfaces (`models.vla.MultiHead`, `models.decoder`, `ckpts.load`,
# `robots.io.RobotIO`), so a new family is files in models/, ckpts/ and robots/ only.
FAMILY_MODULES = (
    "oxygen_jax.models.pi05", "oxygen_jax.models.qwen35", "oxygen_jax.models.vision", "oxygen_jax.models.heads.adarms",
    "oxygen_jax.models.heads.time_mlp", "oxygen_jax.models.heads.joint", "oxygen_jax.models.heads.cross",
    "oxygen_jax.ckpts.openpi", "oxygen_jax.ckpts.openpi_lora", "oxygen_jax.ckpts.own", "oxygen_jax.ckpts.hf",
    "oxygen_jax.ckpts.qwen35", "oxygen_jax.ckpts.xr0", "oxygen_jax.ckpts.starvla", "oxygen_jax.ckpts.lerobot",
    "oxygen_jax.ckpts.openpi_fast",
)
FAMILY_FREE = ("oxygen_jax.runtime", "oxygen_jax.serving", "oxygen_jax.run", "oxygen_jax.serve",
               "oxygen_jax.command_model")


def test_the_runtime_the_server_and_the_commands_import_no_model_family():
    graph = import_graph()
    inside = lambda m, prefixes: any(m == p or m.startswith(p + ".") for p in prefixes)  # noqa: E731
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items() if inside(m, FAMILY_FREE)
                 for d in deps if inside(d, FAMILY_MODULES))
    assert not bad, "family modules imported above the interfaces:\n" + "\n".join(bad)
    assert inside("oxygen_jax.models.pi05.model", FAMILY_MODULES) and not inside("oxygen_jax.models.vla", FAMILY_MODULES)


# eval/ by concern: the bench and its report, serving studies, parity against fixtures, reference generators
# (run in side venvs with each family's own code: nothing here may import them) and studies kept in their result
# folder (`eval.results.<study>.run`: commands, imported by nothing).
EVAL_DRAWERS = ("eval.bench", "eval.serving", "eval.parity", "eval.refs", "eval.results")


def _test_imports() -> set[str]:
    out = set()
    for p in (REPO / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
    return out


def test_reference_generators_and_result_studies_are_imported_by_nothing_else():
    graph = import_graph()
    edges = [(m, d) for m, deps in graph.items() for d in deps] + [("tests", d) for d in _test_imports()]
    bad = sorted(f"{m} imports {d}" for m, d in edges for drawer in ("eval.refs", "eval.results")
                 if d.startswith(drawer + ".") and not m.startswith(drawer + "."))
    assert not bad, "\n".join(bad)
    assert all(m in graph for m in EVAL_DRAWERS), "an eval drawer moved: update EVAL_DRAWERS"


def test_every_eval_and_training_module_is_imported_or_a_command_the_docs_name():
    graph = import_graph()
    used = {d for deps in graph.values() for d in deps} | _test_imports()
    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    loose = []
    for m, p in _modules().items():
        if m.split(".")[0] not in ("eval", "training") or p.name == "__init__.py" or m in used:
            continue
        command = m.removesuffix(".__main__")
        if f"-m {command}" not in docs and str(p.relative_to(REPO)) not in docs:
            loose.append(m)
    assert not loose, f"modules tied to nothing (neither imported nor a command named in README or docs): {loose}"


def test_no_import_cycle_between_modules():
    graph = import_graph()
    # Strongly connected components (iterative Tarjan); a package face and its own submodules are not a cycle.
    index, low, on, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]; counter[0] += 1; stack.append(v); on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if _is_package_face(node, w) or _is_package_face(w, node) or w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_floor_checker_sees_an_upward_import():
    assert floor_of("oxygen_jax.models.backbone") < floor_of("oxygen_jax.models.pi05.config")
    assert floor_of("oxygen_jax.nn.masks") < floor_of("oxygen_jax.runtime.decode") < floor_of("oxygen_jax.serving.wire")
    assert floor_of("oxygen_jax") > floor_of("oxygen_jax.serving.batcher")
