"""A sample class report for instructors: chapter 04 released, three generated submissions graded with
`make grade-class` (`minivllm.course.grade.grade_class`), the scores' CSV written to results/.

    python scripts/sample_class_report.py [--out results/class_report_ch04.csv]

The submissions, each a copy of the student edition (`scripts/release.py ch04`):
* `full`: the book's answers in the chapter (its graded regions as the book has them) and the extend
  exercise's worked answer (`solutions/ch04_scheduler.py`);
* `partial`: the book's answers, except that the scheduler's decode preempts the oldest running
  sequence instead of the newest (ch04_ex3 loses the parts that check it), and the extend exercise
  left as handed out;
* `empty`: the edition as handed out (every stub in place).
"""
from __future__ import annotations

import argparse
import csv
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from release import release  # noqa: E402

from minivllm.course.grade import grade_class  # noqa: E402

CHAPTER, EXTEND = "notebooks/04_scheduler.ipynb", "exercises/ch04_scheduler.py"
WRONG_DECODE = ("self.preempt(self.running.pop())", "self.preempt(self.running.popleft())")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "class_report_ch04.csv"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        edition, subs = Path(tmp) / "edition", Path(tmp) / "submissions"
        release(["ch04"], edition)
        for name in ("full", "partial", "empty"):
            shutil.copytree(edition, subs / name, ignore=shutil.ignore_patterns(".git"))
        shutil.copyfile(ROOT / CHAPTER, subs / "full" / CHAPTER)
        shutil.copyfile(ROOT / "solutions" / Path(EXTEND).name, subs / "full" / EXTEND)
        book = (ROOT / CHAPTER).read_text()
        assert book.count(WRONG_DECODE[0]) == 1, "the book's decode changed: update WRONG_DECODE"
        (subs / "partial" / CHAPTER).write_text(book.replace(*WRONG_DECODE))
        t0 = time.perf_counter()
        rows = grade_class(subs, args.out, tests_from=edition, verbose=True)
        print(f"graded {len(rows)} submissions in {time.perf_counter() - t0:.0f} s into {args.out}")
    with open(args.out, newline="") as f:
        print("".join(f"{row}\n" for row in csv.reader(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
