"""Write a student edition: the book without the answers to the chosen exercises.

    python scripts/release.py ch05 --out ../ch05-student          # all of chapter 05's exercises
    python scripts/release.py ch05_ex1 ch05_ex3 --out DIR          # some exercises
    make release ASSIGNMENT=ch05 OUT=DIR

What it does:
1. copies the tracked tree (`git ls-files`, as it is on disk) to DIR, without `solutions/` (and
   without `.git`, which is not tracked);
2. in the chapters that hold the chosen exercises' graded regions (`# EXERCISE chNN_exK (N points):
   task` over `### BEGIN SOLUTION` / `### END SOLUTION`, see `minivllm.course.grade`), replaces each chosen
   region by `raise NotImplementedError("chNN_exK: task")` with nbgrader's `ClearSolutions`
   preprocessor (inside a `@triton.jit` kernel, whose compiler refuses `raise`, by
   `tl.static_assert(False, "chNN_exK: task")`), and clears those chapters' outputs (nbgrader's
   `ClearOutput`); regions of other exercises keep their code, without the markers;
3. re-exports the package in DIR from the stubbed chapters (DIR's `scripts/export.py`), so that
   DIR/minivllm/ holds the stubs too, and checks that no line of a chosen region's answer is anywhere
   in DIR (`check_edition`: trivial lines, lines the book has outside every region, and the graders
   in tests/ aside);
4. writes DIR/EDITION.json (the exercises, their points, the commit it came from, hashes that let
   `python -m minivllm.course.grade` see whether the student changed the chapters).

Earlier chapters keep their code, so the engine runs around the student's part; `exercises/` (the
extend exercises' stubs) and the graders in `tests/` are copied as they are.
"""
from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's minivllm.course.grade, whatever is installed

from minivllm.course.grade import (EDITION_FILE, EXERCISES, REGION_MARKER, STUB, Region,  # noqa: E402
                                   edition_hashes, find_regions, in_triton_kernel, resolve, stub_line)

LEFT_OUT = ("solutions/",)  # the worked answers stay with the instructor
PLACEHOLDER = "raise NotImplementedError()  # minivllm-release-stub"


def tracked_files(root: Path) -> list[str]:
    """The paths git tracks in `root` (relative, as `git ls-files` lists them)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def notebook_regions(root: Path) -> dict[str, list[str]]:
    """exercise id -> the chapters (paths relative to `root`) that hold a graded region of it."""
    import nbformat

    where: dict[str, list[str]] = {}
    for nb_path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                for r in find_regions(cell.source, f"{nb_path.name} cell {cell.get('id')}"):
                    where.setdefault(r.id, [])
                    if str(nb_path.relative_to(root)) not in where[r.id]:
                        where[r.id].append(str(nb_path.relative_to(root)))
    return where


def stub_notebook(src: Path, dst: Path, chosen: set[str]) -> list[tuple[str, str]]:
    """Write `src` to `dst` with the regions of `chosen` stubbed and every output cleared.

    Returns (exercise id, the region's answer text) for each stubbed region.
    """
    import nbformat
    from nbgrader.preprocessors import ClearOutput, ClearSolutions

    nb = nbformat.read(src, as_version=4)
    answers = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        regions = find_regions(cell.source, f"{src.name} cell {cell.get('id')}")
        lines = cell.source.split("\n")
        for r in reversed(regions):
            if r.id in chosen:
                answers.append((r.id, "\n".join(lines[r.begin + 1:r.end])))
            else:  # not part of this assignment: the code stays, the delimiters go
                del lines[r.end]
                del lines[r.begin]
        cell.source = "\n".join(lines)
    # nbgrader's own preprocessor replaces what is left between the delimiters ...
    nb, _ = ClearSolutions(code_stub={"python": PLACEHOLDER}, enforce_metadata=False).preprocess(nb, {})
    for cell in nb.cells:  # ... and each stub then names its exercise and task (the marker line above it)
        if cell.cell_type == "code" and PLACEHOLDER in cell.source:
            lines = cell.source.split("\n")
            for i, line in enumerate(lines):
                if line.strip() == PLACEHOLDER:
                    m = REGION_MARKER.match(lines[i - 1]) if i else None
                    assert m is not None, f"{src.name}: a stub without its `# EXERCISE` line above"
                    lines[i] = stub_line(Region(m["id"], int(m["points"]), m["task"].strip(), m["indent"], i - 1, i, i),
                                         kernel=in_triton_kernel(lines, i))
            cell.source = "\n".join(lines)
    nb, _ = ClearOutput().preprocess(nb, {})
    nbformat.write(nb, dst)
    return answers


# lines too common to give an answer away: nothing but brackets and punctuation, or only such words
TRIVIAL = re.compile(r"^[\W_]*(?:(?:return|pass|break|continue|else|try|finally|None|True|False)\b[\W_]*)*$")
TEXT_SUFFIXES = (".py", ".ipynb", ".md", ".txt", ".cpp", ".toml", ".cfg", ".yml", ".yaml", ".json")
# Not searched for answers: the graders, whose stand-ins for other exercises' regions are working code by
# design (tests/stand_ins.py; README's course section says an answer pasted from them passes).
NOT_SEARCHED = ("tests/",)


def normalized(line: str) -> str:
    """A line as the leak check compares lines: stripped, without a trailing `# comment`."""
    line = line.strip()
    if "#" in line:
        try:
            for tok in tokenize.generate_tokens(io.StringIO(line).readline):
                if tok.type == tokenize.COMMENT:
                    return line[:tok.start[1]].rstrip()
        except (tokenize.TokenError, SyntaxError):  # a piece of a longer statement or string
            pass
    return line


def _outside_regions(text: str, where: str) -> list[str]:
    """The lines of `text` (a cell's or a module's source) outside its graded regions."""
    lines, out, start = text.split("\n"), [], 0
    for r in find_regions(text, where):
        out += lines[start:r.marker]
        start = r.end + 1
    return out + lines[start:]


def book_lines(root: Path) -> set[str]:
    """Every line (normalized) the book has outside its graded regions: its chapters (code and prose)
    and the package exported from them. An answer's line found there gives nothing away."""
    import nbformat

    found: set[str] = set()
    for nb_path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(nb_path, as_version=4).cells:
            found.update(map(normalized, _outside_regions(cell.source, nb_path.name)))
    for f in sorted((root / "minivllm").rglob("*.py")):
        found.update(map(normalized, _outside_regions(f.read_text(), str(f.relative_to(root)))))
    return found


def kept_answer_lines(root: Path, stubbed: set[str]) -> set[str]:
    """Every line (normalized) of the answers of the regions NOT in `stubbed` (exercise ids), in the
    chapters at `root`: the edition shows them (e.g. chapter 04's admission loop beside chapter 11's
    stubbed scheduler), so an answer's line that is also one of theirs gives nothing away."""
    import nbformat

    found: set[str] = set()
    for nb_path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(nb_path, as_version=4).cells:
            lines = cell.source.split("\n")
            for r in find_regions(cell.source, nb_path.name):
                if r.id not in stubbed:
                    found.update(map(normalized, lines[r.begin + 1:r.end]))
    return found


def answer_lines(answers: list[tuple[str, str]], root: Path = ROOT) -> dict[str, set[str]]:
    """exercise id -> the lines that would give its answer away: the lines of the stubbed regions'
    answers (`answers`: exercise id, answer text) less the trivial ones, those the book at `root`
    has outside every region (`book_lines`) and those of the answers the edition keeps
    (`kept_answer_lines`). (The extend exercises' answers in solutions/ are kept out of exercises/
    by scripts/make_exercises.py and tests/test_pipeline.py.)"""
    book = book_lines(root) | kept_answer_lines(root, {ex for ex, _ in answers})
    out: dict[str, set[str]] = {}
    for ex, answer in answers:
        out.setdefault(ex, set()).update(n for n in map(normalized, answer.split("\n"))
                                         if not TRIVIAL.match(n) and n not in book)
    return out


def _edition_texts(out: Path):
    """(path relative to `out`, its lines) for every text file of the edition (a notebook: its cells'
    sources and text outputs)."""
    for f in sorted(out.rglob("*")):
        if not f.is_file() or f.suffix not in TEXT_SUFFIXES or "__pycache__" in f.parts or ".git" in f.parts:
            continue
        rel = str(f.relative_to(out))
        if rel.startswith(NOT_SEARCHED):
            continue
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        if f.suffix == ".ipynb":
            cells = json.loads(text).get("cells", [])
            parts = ["".join(c.get("source", "")) for c in cells]
            parts += ["".join(o.get("text", "")) for c in cells for o in c.get("outputs", [])]
            text = "\n".join(parts)
        yield rel, text.split("\n")


def find_leaks(out: Path, leaking: dict[str, set[str]]) -> list[str]:
    """`path:line: exercise: text` for each line of the edition at `out` (but `NOT_SEARCHED`) that is
    a line of an answer (`answer_lines`)."""
    owner: dict[str, list[str]] = {}
    for ex, lines in leaking.items():
        for line in lines:
            owner.setdefault(line, []).append(ex)
    found = []
    for rel, lines in _edition_texts(out):
        for i, line in enumerate(lines, 1):
            if (n := normalized(line)) in owner:
                found.append(f"{rel}:{i}: {', '.join(owner[n])}: {n}")
    return found


def check_edition(out: Path, answers: list[tuple[str, str]], root: Path = ROOT) -> None:
    """Raise RuntimeError if a line of a stubbed region's answer is anywhere in the edition at `out`
    (`find_leaks`; lines the book has outside every region and trivial ones aside, `answer_lines`), or
    a stub is missing from its package."""
    package = "\n".join(p.read_text() for p in sorted((out / "minivllm").rglob("*.py")))
    leaks = find_leaks(out, answer_lines(answers, root))
    if leaks:
        raise RuntimeError(f"{len(leaks)} line(s) of answers are in the edition at {out}:\n" + "\n".join(leaks[:40]))
    for ex, _ in answers:
        if not any(m["id"] == ex for m in STUB.finditer(package)):
            raise RuntimeError(f"{ex}'s stub is not in the edition's package")


def release(assignment: list[str], out: Path, root: Path = ROOT) -> dict:
    """Write the student edition of `assignment` (exercise or chapter ids) into `out`; return its
    EDITION.json record.

    Raises:
        ValueError: an unknown exercise or chapter, `out` not empty (or inside the book), or a
            rebuild exercise with no graded region in any chapter.
        RuntimeError: an answer survived in the edition, or the export failed.
    """
    chosen = resolve(assignment)
    out = out.resolve()
    if out == root or root in out.parents and not out.is_relative_to(root / "build"):
        raise ValueError(f"{out} is inside the book; write the edition elsewhere (or under build/)")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    regions = notebook_regions(root)
    missing = [e for e in chosen if EXERCISES[e].kind == "rebuild" and e not in regions]
    if missing:
        raise ValueError(f"rebuild exercises {missing} have no graded region in any chapter")
    for rel in tracked_files(root):
        if rel.startswith(LEFT_OUT) or not (root / rel).is_file():
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, out / rel)
    answers: list[tuple[str, str]] = []
    for nb_rel in sorted({nb for e in chosen for nb in regions.get(e, [])}):
        answers += stub_notebook(root / nb_rel, out / nb_rel, set(chosen))
    r = subprocess.run([sys.executable, "scripts/export.py"], cwd=out, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"exporting the student edition failed:\n{r.stdout}{r.stderr}")
    check_edition(out, answers, root)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    record = {"assignment": assignment, "exercises": chosen,
              "points": {e: EXERCISES[e].points for e in chosen},
              "max_total": sum(EXERCISES[e].points for e in chosen),
              "stubbed_regions": sorted({e for e, _ in answers}), "released_from": commit, **edition_hashes(out)}
    (out / EDITION_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a student edition of the book without the chosen answers.")
    ap.add_argument("assignment", nargs="+", help="exercise ids (ch05_ex1) or chapters (ch05)")
    ap.add_argument("--out", required=True, type=Path, help="an empty or new folder outside the book")
    args = ap.parse_args(argv)
    try:
        rec = release(args.assignment, args.out)
    except (ValueError, RuntimeError) as e:
        print(f"release: {e}", file=sys.stderr)
        return 2
    print(f"wrote the student edition of {', '.join(rec['exercises'])} ({rec['max_total']} points) to {args.out}; "
          f"regions stubbed in the chapters and the package: {', '.join(rec['stubbed_regions']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
