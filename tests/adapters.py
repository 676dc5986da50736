"""The one place that chooses whose code the grading tests run (CS336's adapter pattern).

Tests never import solutions/ or exercises/ directly; they call `load(chapter_file, impl)`, where
`impl` comes from `pytest --impl=solutions|exercises`. A fresh stub imports cleanly and fails its
tests with NotImplementedError, never with an ImportError.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from script_loader import load_file

ROOT = Path(__file__).resolve().parent.parent


def load(chapter_file: str, impl: str) -> ModuleType:
    """Import `<impl>/<chapter_file>.py` (e.g. `load("ch02_model", "exercises")`) as a fresh module."""
    return load_file(ROOT / impl / f"{chapter_file}.py", f"_graded_{impl}_{chapter_file}")


def raises_value_error(call, what: str) -> None:
    """A grader's check that `call()` raises ValueError, `what` naming the call in the failure. A stub's
    NotImplementedError passes through (so a stub fails with its task); anything else raised, or a
    return, fails the check with what happened instead."""
    try:
        got = call()
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - the message names what was raised instead
        raise AssertionError(f"{what} must raise ValueError, raised {type(e).__name__}: {e}") from e
    raise AssertionError(f"{what} must raise ValueError, returned {got!r}")


def failed_checks(checks, *args) -> list[str]:
    """The messages of the `checks` that fail when called with `args` (a check fails by raising
    AssertionError; anything else propagates). A wrong-answer test asserts this list is not empty."""
    failures = []
    for check in checks:
        try:
            check(*args)
        except AssertionError as e:
            failures.append(str(e))
    return failures
