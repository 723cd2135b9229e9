"""Cutting named functions, assignments and methods out of a wheel's source file."""

from __future__ import annotations
import __future__

import ast
from collections.abc import Iterable
from typing import Any

from . import UsageError


def cut(source: str, filename: str, names: Iterable[str], namespace: dict[str, Any]) -> None:
    """Compile the top-level functions, assignments and class methods `names` ("f", "X",
    "Class.method") of `source` into `namespace`, keeping the file's line numbers.

    A class is rebuilt with only the methods named, and of its bases only those already in
    `namespace` (cut out before it); its other collaborators come from the stand-in it is
    mixed with, so nothing else of the file runs.
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
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in top:
            body.append(node)
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            hit = [t.id for t in targets if isinstance(t, ast.Name) and t.id in top]
            if hit:
                body.append(node)
                found.update(hit)
        elif isinstance(node, ast.ClassDef) and node.name in by_class:
            methods = [
                m
                for m in node.body
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name in by_class[node.name]
            ]
            found.update(f"{node.name}.{m.name}" for m in methods)
            bases = [b for b in node.bases if isinstance(b, ast.Name) and b.id in namespace]
            cls = ast.ClassDef(
                name=node.name,
                bases=bases,
                keywords=[],
                body=methods or [ast.Pass()],
                decorator_list=[],
                type_params=[],
            )
            ast.copy_location(cls, node)
            body.append(cls)
    missing = [n for n in wanted if n not in found]
    if missing:
        raise UsageError(f"{filename}: not found in the wheel: {', '.join(missing)}")
    module = ast.Module(body=body, type_ignores=[])
    ast.fix_missing_locations(module)
    # the wheels' files use `from __future__ import annotations`: their annotations stay text
    code = compile(module, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)  # noqa: S102 - the pinned wheel's own code
