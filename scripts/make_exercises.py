"""Generate exercises/ from solutions/ (nbgrader's convention).

    python scripts/make_exercises.py          # write exercises/
    python scripts/make_exercises.py --check  # exit 1 if exercises/ is stale or leaks a solution

Every region between a `### BEGIN SOLUTION` line and a `### END SOLUTION` line is replaced by
`raise NotImplementedError("<file>.<function>: <the TODO line above it>")` at the same indentation
(so that a grader's report names what is left to do); in a Triton kernel (a `@triton.jit` function,
whose compiler refuses `raise`) by `tl.static_assert(False, "<file>.<function>: ...")`, which stops
the compilation and the interpreter with the same words (`minivllm.course.grade.kernel_stub`).
Everything else (docstrings, the TODO line above each region) is kept. exercises/ is generated:
edit solutions/ only.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's minivllm.course.grade, whatever is installed

from minivllm.course.grade import in_triton_kernel, kernel_stub  # noqa: E402

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
HEADER = "# GENERATED from solutions/{name} by scripts/make_exercises.py: your work goes here.\n"


def strip_solutions(text: str, name: str) -> str:
    """Return `text` with each solution region replaced by a `raise NotImplementedError(...)` naming it.

    Raises:
        ValueError: unbalanced or nested markers.
    """
    out, inside, where, todo = [HEADER.format(name=name)], False, Path(name).stem, ""
    lines = text.splitlines()
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        stripped = line.strip()
        if m := re.match(r"(?:async\s+)?def\s+(\w+)", stripped):
            where, todo = f"{Path(name).stem}.{m[1]}", ""
        elif stripped.startswith("# TODO:"):
            todo = stripped[len("# TODO:"):].strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"{name}:{lineno}: nested {BEGIN}")
            inside = True
            indent = re.match(r"\s*", line).group(0)
            task = where + (": " + todo if todo else "")
            stub = kernel_stub(task) if in_triton_kernel(lines, lineno - 1) else f"raise NotImplementedError({task!r})"
            out.append(f"{indent}{stub}\n")
        elif stripped == END:
            if not inside:
                raise ValueError(f"{name}:{lineno}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{name}: {BEGIN} never closed")
    return "".join(out)


def expected() -> dict[str, str]:
    return {p.name: strip_solutions(p.read_text(), p.name) for p in sorted((ROOT / "solutions").glob("ch*.py"))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    want = expected()
    if args.check:
        have = {p.name: p.read_text() for p in (ROOT / "exercises").glob("ch*.py")}
        bad = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
        for n in bad:
            print(f"exercises/{n} differs from the stubs generated from solutions/{n}: authors run "
                  "`make exercises` (it resets exercises/ to fresh stubs; students: grade with "
                  "`pytest -m chNN_exK --impl=exercises` instead)")
        return 1 if bad else 0
    for name, text in want.items():
        (ROOT / "exercises" / name).write_text(text)
        print("wrote exercises/" + name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
