"""Cutting named functions, classes, assignments and class members out of a wheel's source file."""

from __future__ import annotations
import __future__

import ast
import contextlib
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from . import UsageError

# decorators a cut-out method keeps: they change how it is called, and they are builtins
# (the others, typing's @overload or a registry's, would need their module)
_KEPT_DECORATORS = {"staticmethod", "classmethod", "property"}


def _member_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _kept(node: ast.stmt) -> ast.stmt:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        node.decorator_list = [d for d in node.decorator_list if isinstance(d, ast.Name) and d.id in _KEPT_DECORATORS]
    return node


def cut(source: str, filename: str, names: Iterable[str], namespace: dict[str, Any]) -> None:
    """Compile the top-level functions, classes and assignments and the class members
    `names` ("f", "X", "Class", "Class.method", "Class.attribute") of `source` into
    `namespace`, keeping the file's line numbers.

    A class named whole is taken as written (its bases and decorators must be in
    `namespace`). A class named by members is rebuilt with only those members (methods
    keep only their staticmethod/classmethod/property decorators; of overloads, the last
    definition wins, as at run time), and of its bases only those already in `namespace` or cut out before it;
    its other collaborators come from the stand-in it is mixed with, so nothing else of
    the file runs.
    """
    tree = ast.parse(source, filename)
    wanted = list(names)
    by_class: dict[str, list[str]] = {}
    top: list[str] = []
    for name in wanted:
        owner, _, member = name.partition(".")
        (by_class.setdefault(owner, []).append(member) if member else top.append(name))
    body: list[ast.stmt] = []
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in top:
            body.append(node)
            found.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name in by_class:
            members = [_kept(m) for m in node.body if set(_member_names(m)) & set(by_class[node.name])]
            found.update(f"{node.name}.{n}" for m in members for n in _member_names(m))
            bases = [b for b in node.bases if isinstance(b, ast.Name) and (b.id in namespace or b.id in found)]
            cls = ast.ClassDef(
                name=node.name,
                bases=bases,
                keywords=[],
                body=members or [ast.Pass()],
                decorator_list=[],
                type_params=[],
            )
            ast.copy_location(cls, node)
            body.append(cls)
            found.add(node.name)
        else:
            hit = [n for n in _member_names(node) if n in top]
            if hit:
                body.append(node)
                found.update(hit)
    missing = [n for n in wanted if n not in found]
    if missing:
        raise UsageError(f"{filename}: not found in the wheel: {', '.join(missing)}")
    module = ast.Module(body=body, type_ignores=[])
    ast.fix_missing_locations(module)
    # the wheels' files use `from __future__ import annotations`: their annotations stay text
    code = compile(module, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)  # noqa: S102 - the pinned wheel's own code


@contextlib.contextmanager
def modules_in_place(modules: Mapping[str, types.ModuleType]) -> Iterator[None]:
    """`modules` in sys.modules while the cut-out code runs (it imports them inside its
    functions), whatever held those names before put back afterwards."""
    saved = {k: sys.modules.get(k) for k in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
