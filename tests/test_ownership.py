"""Each object owns its state: outside the runtime (``kvmemory/runtime``, which holds the Session and the Engine)
and the cache (``kvmemory/cache``), no module sets an attribute of a session, its cache or an engine. They ask
through methods (the memory returns the room a cache may reserve; the engine keeps its own identity), and a
session's changes go through ``Session.edit()``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
OWNERS = ("kvmemory/runtime", "kvmemory/cache")
OWNED = {"session", "engine", "cache"}


def owned_root(node: ast.expr) -> str | None:
    """The owned name an attribute chain starts from (``self.session.cache.x`` -> "session"), if any."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    chain = list(reversed(names))[:-1]  # the attribute set is the last name; what it is set on comes before
    return next((name for name in chain if name in OWNED), None)


def writes_to_owned_state(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and owned_root(target):
                found.append(f"{where}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_no_module_outside_the_runtime_sets_state_of_a_session_its_cache_or_an_engine():
    files = [p for top in ("kvmemory", "integrations", "agents") for p in (ROOT / top).rglob("*.py")]
    outside = [p for p in files if not p.relative_to(ROOT).as_posix().startswith(OWNERS)]
    assert len(outside) > 20
    writes = [w for path in outside for w in writes_to_owned_state(path.read_text(), str(path.relative_to(ROOT)))]
    assert writes == []


def test_the_check_finds_such_writes():
    source = "def f(self, engine):\n    self.session.cache.growth_room = 3\n    engine._identity = {}\n    self.x = 1\n"
    assert writes_to_owned_state(source, "probe") == [
        "probe:2: self.session.cache.growth_room",
        "probe:3: engine._identity",
    ]
