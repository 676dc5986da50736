"""A Python file loaded as a fresh module, for the tests: `scripts/` is not a package, and the graded
chapters' files are chosen at run time (`adapters.load`)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_file(path: Path, module_name: str) -> ModuleType:
    """Execute the file at `path` as a new module named `module_name` (not put in `sys.modules`)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_script(name: str, module_name: str | None = None) -> ModuleType:
    """`scripts/NAME.py` as a new module, named `module_name` (default NAME)."""
    return load_file(SCRIPTS / f"{name}.py", module_name or name)
