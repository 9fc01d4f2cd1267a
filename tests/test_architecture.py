"""The house by role: what each room may import, no circles, small modules, a pinned public API.

The import graph is read from the source (every ``import`` and ``from ... import`` statement,
including those inside functions), so a rule holds for code paths a test run never takes; a
second check imports the torch-free rooms in a fresh interpreter and looks at ``sys.modules``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "exporter" / "lossbeat"

# room -> modules (top-level names, or lossbeat rooms) it must never import
FORBIDDEN = {
    "diagnosis": {"torch", "prometheus_client", "lossbeat.measure", "lossbeat.exposition", "lossbeat.monitor"},
    "exposition": {"lossbeat.monitor"},
    "mixin": {"torch", "lossbeat.monitor", "lossbeat.measure"},
    "logs": {"torch", "prometheus_client", "lossbeat.monitor"},
    "measure": {"prometheus_client", "lossbeat.monitor", "lossbeat.exposition", "lossbeat.mixin"},
}
# Size is counted in statements, not lines: a formatter that wraps a long call changes the line
# count but not how much a reader has to hold. Modules over this many statements are split by role,
# except declarative data (the alert definitions, the panels).
MAX_STATEMENTS = 480
DECLARATIVE = {"mixin/alert_rules.py", "mixin/dashboards.py"}
MONITOR_CLASS_MAX_STATEMENTS = 180


def statements(node: ast.AST) -> int:
    """How many statements ``node`` holds, at any depth (docstrings included, blank lines not)."""
    return sum(isinstance(child, ast.stmt) for child in ast.walk(node))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from lossbeat.x import y` may import the submodule y
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges[name] = {t for t in imports_of(path) if t in modules or t.split(".")[0] != "lossbeat"}
    return edges


def _matches(target: str, banned: str) -> bool:
    return target == banned or target.startswith(banned + ".")


def test_every_room_imports_only_what_it_may():
    violations = []
    for module, targets in graph().items():
        parts = module.split(".")
        room = parts[1] if len(parts) > 1 else None
        for target in sorted(targets):
            for banned in FORBIDDEN.get(room, ()):
                if _matches(target, banned):
                    violations.append(f"{module} imports {target} (the {room}/ room may not import {banned})")
    assert violations == []


def test_the_rule_checker_sees_a_violation(tmp_path):
    # the checker itself: a diagnosis module importing torch inside a function is found
    probe = tmp_path / "lossbeat" / "diagnosis" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def f():\n    import torch\n    from ..exposition import metrics\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "lossbeat"
    try:
        assert imports_of(probe) >= {"torch", "lossbeat.exposition", "lossbeat.exposition.metrics"}
    finally:
        PACKAGE = saved


STATE_OWNER = "exposition/state.py"
HISTORY_OWNER = "diagnosis/history.py"
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add", "remove", "discard"}


@dataclass(frozen=True)
class Owner:
    """A class whose fields only its own methods write, and how other modules hold an instance:
    under one of ``held_as`` (a name, or an attribute of anything: ``self.state``, ``monitor._history``),
    or in a parameter annotated with the class."""

    path: str
    cls: str
    held_as: frozenset[str]


STATE = Owner(STATE_OWNER, "MonitorState", frozenset({"state"}))
HISTORY = Owner(HISTORY_OWNER, "History", frozenset({"history", "_history"}))


def state_fields(owner: Owner = STATE) -> set[str]:
    """Every attribute the owner's own methods assign (its fields, public or not)."""
    tree = ast.parse((PACKAGE / owner.path).read_text(encoding="utf-8"))
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner.cls)
    return {
        target.attr
        for node in ast.walk(cls)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for target in ast.walk(target)
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }


def _is_state(node: ast.AST, names: set[str], owner: Owner = STATE) -> bool:
    return (isinstance(node, ast.Name) and node.id in names) or (
        isinstance(node, ast.Attribute) and node.attr in owner.held_as
    )


def state_writes(path: Path, fields: set[str], owner: Owner = STATE) -> list[str]:
    """Where ``path`` writes a field of the owner's class itself: an assignment (augmented, by
    subscript, by ``setattr``) or a mutating call on one. An instance is a name in ``held_as``
    (``state``), ``<anything>.state``, a parameter annotated ``MonitorState``, or a local name
    bound to one of these (``s = self.state``); the same with ``history`` for a History."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where = path.relative_to(PACKAGE) if path.is_relative_to(PACKAGE) else path.name
    found: list[str] = []
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    for scope in scopes:
        names = set(owner.held_as)
        if not isinstance(scope, ast.Module):
            every = [*scope.args.posonlyargs, *scope.args.args, *scope.args.kwonlyargs]
            names.update(
                a.arg
                for a in every
                if a.annotation is not None and re.search(rf"\b{owner.cls}\b", ast.unparse(a.annotation))
            )

        for node in ast.walk(scope):  # aliases first: `s = self.state`, `s, v = self.state, values`
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = (
                        zip(target.elts, node.value.elts)
                        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                        else [(target, node.value)]
                    )
                    names.update(t.id for t, v in pairs if isinstance(t, ast.Name) and _is_state(v, names, owner))
        for node in ast.walk(scope):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = list(node.targets)
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
                    if _is_state(node.args[0], names, owner):
                        found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
                elif (
                    isinstance(func, ast.Attribute)
                    and func.attr in MUTATORS
                    and isinstance(func.value, ast.Attribute)
                    and func.value.attr in fields
                    and _is_state(func.value.value, names, owner)
                ):
                    found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            for target in targets:
                for t in ast.walk(target):
                    while isinstance(t, ast.Subscript):
                        t = t.value
                    if isinstance(t, ast.Attribute) and t.attr in fields and _is_state(t.value, names, owner):
                        found.append(f"{where}:{node.lineno} {ast.unparse(t)}")
    return sorted(set(found))


def test_only_the_state_writes_its_fields():
    """MonitorState's fields change only through its methods: the order a scrape sees them move
    in, and what is swapped whole, is decided in one module. Every other module reads them."""
    fields = state_fields()
    assert {"loss", "steps_total", "halted", "guard_consecutive_skips", "recent"} <= fields
    writes = [w for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / STATE_OWNER for w in state_writes(p, fields)]
    assert writes == [], "write these through a MonitorState method"


def test_only_the_history_writes_its_fields():
    """History's fields (the windows, the layer norms, the loss scale, the router track) change
    only through its methods, wherever the history is held: the monitor's step, the replay of a
    log and the checks all go through the one class that keeps its windows and memory consistent."""
    fields = state_fields(HISTORY)
    assert {"loss", "grad", "layer_norms", "grad_scale", "moe", "grad_level_peak", "memory"} <= fields
    writes = [
        w
        for p in sorted(PACKAGE.rglob("*.py"))
        if p != PACKAGE / HISTORY_OWNER
        for w in state_writes(p, fields, HISTORY)
    ]
    assert writes == [], "write these through a History method"


def test_the_history_writer_check_sees_each_kind_of_write(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def apply(self, monitor, scale):\n"
        "    h = monitor._history\n"
        "    h.grad_scale = scale\n"
        "    self.history.layer_norms = {}\n"
        "    self.history.grad.clear()\n"
        "    history.grad_level_peak += 1.0\n"
        "    self.history.set_grad_scale(scale)\n"  # the owner's method: allowed
        "    print(h.grad_scale, self.history.loss.noise)\n"  # reads: allowed
        "    self.state.loss = scale\n"  # another owner's field: not this check's
        "def judge(past: History | None):\n"
        "    past.moe = None\n"
    )
    found = [w.split(" ", 1)[1] for w in state_writes(probe, state_fields(HISTORY), HISTORY)]
    assert sorted(found) == [
        "h.grad_scale",
        "history.grad_level_peak",
        "past.moe",
        "self.history.grad.clear()",
        "self.history.layer_norms",
    ]


def test_the_state_writer_check_sees_each_kind_of_write(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def apply(self, monitor, record):\n"
        "    s, v = self.state, record\n"
        "    s.loss = v\n"
        "    monitor.state.steps_total += 1\n"
        "    s.event_steps['spike'] = 3\n"
        "    setattr(state, 'halted', True)\n"
        "    self.state.recent.append(v)\n"
        "    self.loss = v\n"  # not a state: allowed
        "    print(s.loss, monitor.state.recent.snapshot())\n"  # reads: allowed
        "    self.state.record_step(step=1)\n"  # the owner's method: allowed
        "def keep(st: MonitorState):\n"
        "    st.layer_first_event_left -= 1\n"
    )
    found = [w.split(" ", 1)[1] for w in state_writes(probe, state_fields())]
    assert sorted(found) == [
        "monitor.state.steps_total",
        "s.event_steps",
        "s.loss",
        "self.state.recent.append(v)",
        "setattr(state, 'halted', True)",
        "st.layer_first_event_left",
    ]


def test_no_import_circles_between_modules():
    edges = {m: {t for t in ts if t.startswith("lossbeat.") and t in graph_modules()} for m, ts in graph().items()}
    # a package's __init__ re-exporting its own modules is not a circle of the design
    for m in edges:
        edges[m] = {t for t in edges[m] if not (m != "lossbeat" and t.startswith(m + "."))}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert cycles == []


def graph_modules() -> set[str]:
    return {module_name(p) for p in PACKAGE.rglob("*.py")}


@pytest.mark.parametrize("room", ["lossbeat.diagnosis", "lossbeat.mixin", "lossbeat.logs", "lossbeat.analyze.replay"])
def test_torch_free_rooms_import_without_torch(room):
    probe = (
        "import importlib, pkgutil, sys\n"
        f"pkg = importlib.import_module({room!r})\n"
        "for info in pkgutil.walk_packages(getattr(pkg, '__path__', []), pkg.__name__ + '.'):\n"
        "    importlib.import_module(info.name)\n"
        "print(sorted(m for m in ('torch', 'prometheus_client') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    allowed = "['prometheus_client']" if room == "lossbeat.mixin" else "[]"
    assert out.strip() in ("[]", allowed), f"{room} pulled in {out.strip()}"


def test_modules_stay_small_and_say_their_role():
    too_long, undocumented = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        count = statements(tree)
        if count > MAX_STATEMENTS and rel not in DECLARATIVE:
            too_long.append(f"{rel}: {count} statements")
        if rel not in ("_version.py",) and not ast.get_docstring(tree):
            undocumented.append(rel)
    assert too_long == []
    assert undocumented == []


def test_the_monitor_class_is_thin():
    path = PACKAGE / "monitor" / "core.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Monitor"]
    assert statements(cls) <= MONITOR_CLASS_MAX_STATEMENTS


def test_public_api_is_pinned():
    import lossbeat

    assert sorted(lossbeat.__all__) == sorted(
        [
            "start_exporter",
            "Monitor",
            "MonitorConfig",
            "NullMonitor",
            "Report",
            "DEFAULT_PORT",
            "load_thresholds",
            "Thresholds",
            "ThresholdsError",
            "TrainingHalted",
        ]
    )
    for name in lossbeat.__all__:
        assert getattr(lossbeat, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        lossbeat.no_such_name  # noqa: B018


# A monitor fed floats never imports torch (lossbeat watch starts seconds sooner); the same monitor
# handles a 0-d tensor once the process has imported torch after building it.
_FLOATS_THEN_TENSORS = """
import json, sys
from lossbeat import NullMonitor, start_exporter
monitor = start_exporter(0, addr="127.0.0.1", linger_seconds=0, log_status_changes=False)
for step in range(30):
    monitor.observe(step, loss=2.0 - step / 100, grad_norm=0.5, learning_rate=1e-3, tokens=512,
                    epoch=step / 30, metrics={"accuracy": 0.5})
monitor.observe(30, loss=None, grad_norm=0.5, learning_rate=1e-3)  # a stage without a loss
monitor.observe_eval(30, 1.5)
monitor.report()
with NullMonitor() as null:
    null.observe(0, loss=1.0)
floats = {"torch": "torch" in sys.modules, "steps": monitor.state.steps_total, "loss": monitor.state.loss,
          "reads": monitor.host_transfers}
import torch
monitor.observe(31, loss=torch.tensor(0.25), grad_norm=torch.tensor(2.0, dtype=torch.bfloat16),
                learning_rate=torch.tensor(1e-3, dtype=torch.float64), losses={"a": torch.tensor([1.0, 3.0])})
monitor.flush()
tensors = {"steps": monitor.state.steps_total, "loss": monitor.state.loss, "grad_norm": monitor.state.grad_norm,
           "reads": monitor.host_transfers, "errors": monitor.state.errors}
monitor.close()
print(json.dumps({"floats": floats, "tensors": tensors}))
"""


@pytest.fixture(scope="module")
def floats_then_tensors() -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, "-c", _FLOATS_THEN_TENSORS], capture_output=True, text=True, check=True, env=env, timeout=300
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_monitor_fed_floats_never_imports_torch(floats_then_tensors):
    floats = floats_then_tensors["floats"]
    assert floats == {"torch": False, "steps": 31, "loss": 1.71, "reads": 0}


def test_a_tensor_after_torch_is_imported_is_read_in_the_one_host_read(floats_then_tensors):
    tensors = floats_then_tensors["tensors"]
    assert tensors["steps"] == 32 and tensors["loss"] == 0.25 and tensors["grad_norm"] == 2.0
    assert tensors["reads"] == 1  # loss, grad norm, LR and the component's mean: one read
    assert tensors["errors"] == {"observe": 0, "gradients": 0, "collect": 0, "diagnose": 0, "input": 1}  # [1, 3]


def documented_modules() -> set[str]:
    """The modules docs/architecture.md's tree of rooms names, as paths relative to the package."""
    text = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    tree = text[text.index("```\nexporter/lossbeat/\n") :]
    tree = tree[: tree.index("\n```", 4)]
    room, named = "", set()
    for line in tree.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        if indent not in (2, 4):  # a description's second line
            continue
        first_column = re.split(r"\s{2,}", line.strip())[0]
        if first_column.endswith("/"):
            room = first_column
            continue
        if indent == 2:
            room = ""
        named.update(room + name for name in re.findall(r"\b\w+\.py\b", first_column))
    return named


def test_every_module_is_named_in_the_architecture_doc():
    modules = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" or path.parent == PACKAGE
    }
    documented = documented_modules()
    assert sorted(modules - documented) == [], "add these to docs/architecture.md's tree of rooms"
    assert sorted(documented - modules) == [], "docs/architecture.md names modules that do not exist"


def test_type_checkers_see_every_public_name_where_it_lives():
    """The lazy names of ``lossbeat/__init__.py`` are imported under TYPE_CHECKING from the module
    they load from, and the package says it is typed (py.typed)."""
    import lossbeat

    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    (guard,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    seen = {alias.name: node.module for node in guard.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert seen == lossbeat._HOME and sorted(seen) == sorted(lossbeat.__all__)
    assert (PACKAGE / "py.typed").is_file()
