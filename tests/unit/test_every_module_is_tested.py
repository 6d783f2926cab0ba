"""No production module is left out of the tests.

A module counts as tested when a test imports it (directly, or as a name
imported from its package), runs it (``python -m`` it, by name in a test), or
holds doctests (the test command collects them: ``--doctest-modules``).  A new
module that none of these reach fails here, naming it.
"""

from __future__ import annotations

import ast
import doctest
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRODUCT = ("flexmig", "agents", "nova_driver", "ovs_ext")


def module_names() -> dict[str, pathlib.Path]:
    names = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                continue  # packages: their modules are what is tested
            names[".".join(parts)] = path
    return names


def referenced_by_tests() -> set[str]:
    """Module names the tests import, or name in text (``-m x.y``, subprocess args)."""
    found: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        if path == pathlib.Path(__file__).resolve():
            continue  # its own names would count
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def reexported(module: str, referenced: set[str]) -> bool:
    """A test imports a name its package re-exports from this module."""
    package, _, _ = module.rpartition(".")
    init = ROOT / package.replace(".", "/") / "__init__.py"
    if not init.exists():
        return False
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == module:
            if any(f"{package}.{alias.name}" in referenced for alias in node.names):
                return True
    return False


def has_doctests(path: pathlib.Path) -> bool:
    return ">>> " in path.read_text() and bool(
        doctest.DocTestParser().get_examples(path.read_text())
    )


def test_every_production_module_is_reached_by_a_test() -> None:
    referenced = referenced_by_tests()
    untested = [
        name
        for name, path in module_names().items()
        if name not in referenced and not reexported(name, referenced) and not has_doctests(path)
    ]
    assert untested == [], f"production modules no test reaches: {untested}"


def test_the_check_sees_a_module_no_test_reaches() -> None:
    # The check itself could pass vacuously; it must tell a tested module from
    # an untested one.
    referenced = referenced_by_tests()
    assert "flexmig.migration.planner" in referenced
    assert "flexmig.no_such_module" not in referenced
    assert importlib.util.find_spec("flexmig.migration.planner") is not None
