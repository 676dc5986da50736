"""Count the engine's core in lines of code: no blank lines, no comment-only lines, no docstrings.

    python scripts/count_core_lines.py            # the core folders of this checkout, per file and in all
    python scripts/count_core_lines.py --json     # the same as JSON
    python scripts/count_core_lines.py FILE ...   # any files (e.g. an older checkout's flat modules)

The core is what serves a request: the engine, scheduling and KV-cache management (prefix caching
included), the model runner, the model, the attention backends' Python and the sampler — the parts
nano-vllm's ~1,200 lines hold. Not counted: the data and API modules, the baselines, benchmarks,
entry points, course tooling, and kernels' non-Python sources. nbdev's generated lines (`# %%` cell
markers, `__all__`) are not code a reader wrote and are left out too.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE_FOLDERS = ("engine", "core", "worker", "model_executor", "attention", "sample")


def docstring_lines(source: str) -> set[int]:
    """Line numbers (1-based) taken by module, class and function docstrings."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring, not `__all__`."""
    skip = docstring_lines(source)
    for node in ast.parse(source).body:  # nbdev's generated `__all__ = [...]`
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            skip.update(range(node.lineno, node.end_lineno + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - skip)


def core_files(root: Path = ROOT) -> list[Path]:
    """The core's Python files in `root`'s package (sorted)."""
    return sorted(f for folder in CORE_FOLDERS for f in (root / "minivllm" / folder).rglob("*.py")
                  if "__pycache__" not in f.parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="files to count (default: the core folders)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    files = args.files or core_files()
    counts = {str(f.resolve().relative_to(ROOT) if f.resolve().is_relative_to(ROOT) else f): code_lines(f.read_text())
              for f in files}
    if args.json:
        print(json.dumps({"files": counts, "total": sum(counts.values())}, indent=1))
    else:
        for name, n in counts.items():
            print(f"{n:6d}  {name}")
        print(f"{sum(counts.values()):6d}  in all ({len(counts)} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
