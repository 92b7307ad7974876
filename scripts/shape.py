"""The largest classes, functions and modules of the package: lines and branch points.

A branch point is an ``if``, loop, ``try``/``except``, ``with``, conditional expression,
boolean operator, comprehension clause or ``match`` case. For comparing the shape of the code
before and after a change: ``python scripts/shape.py [package_dir] [--top N]``.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

BRANCHES = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.Try,
    ast.ExceptHandler,
    ast.With,
    ast.IfExp,
    ast.BoolOp,
    ast.comprehension,
    ast.match_case,
)
Row = tuple[int, int, int, str]  # lines, branches, methods, where


def measure(root: Path) -> tuple[list[Row], list[Row], list[tuple[int, str]]]:
    classes: list[Row] = []
    functions: list[Row] = []
    modules: list[tuple[int, str]] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        modules.append((len(text.splitlines()), str(path)))
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            branches = sum(isinstance(n, BRANCHES) for n in ast.walk(node))
            where = f"{path}:{node.lineno} {node.name}"
            if isinstance(node, ast.ClassDef):
                methods = sum(
                    isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body
                )
                classes.append((lines, branches, methods, where))
            else:
                functions.append((lines, branches, 0, where))
    return classes, functions, modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="celery_dlock", type=Path)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    classes, functions, modules = measure(args.root)
    print("largest classes (lines, branches, methods):")
    for lines, branches, methods, where in sorted(classes, reverse=True)[: args.top]:
        print(f"  {lines:5d} lines {branches:4d} branches {methods:3d} methods  {where}")
    print("largest functions (lines, branches):")
    for lines, branches, _, where in sorted(functions, reverse=True)[: args.top]:
        print(f"  {lines:5d} lines {branches:4d} branches  {where}")
    print("largest modules (lines):")
    for lines, where in sorted(modules, reverse=True)[: args.top]:
        print(f"  {lines:5d}  {where}")


if __name__ == "__main__":
    main()
