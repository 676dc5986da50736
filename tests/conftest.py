"""Shared fixtures: tiny random transformers models (float64, from `minivllm.course.testing`) and the `--impl`
switch for grading."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Two pytest-xdist workers on two cores: one torch thread each. With the default (a thread per core
# in every worker) the workers' OpenMP threads fight over the cores and runs get 10-50x slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from hypothesis import settings  # noqa: E402

from minivllm.course.testing import TINY_SIZES as TINY  # noqa: E402  (kept for older imports)

# Every hypothesis test draws the same examples on every run (derandomize: seeded from the test
# itself) and replays no failure stored by an earlier run (no database): a grade, and the suite,
# do not depend on the luck of a run. Tests that set their own settings keep them on top of this.
settings.register_profile("minivllm", derandomize=True, database=None)
settings.load_profile("minivllm")


def pytest_addoption(parser):
    has_solutions = (Path(__file__).resolve().parent.parent / "solutions").is_dir()  # absent in a student edition
    parser.addoption("--impl", choices=("solutions", "exercises"), default="solutions" if has_solutions else "exercises",
                     help="which implementation the grading tests load: the reference solutions/ "
                          "(the book's own run) or a student's exercises/ (the default where solutions/ is absent)")


@pytest.fixture(scope="session")
def impl_name(request) -> str:
    return request.config.getoption("--impl")


def make_tiny_model(tmp_path_factory, kind: str, tie: bool = False, seed: int = 0, **overrides):
    """Save a tiny random transformers model (`minivllm.course.testing`) in a fresh folder; return (folder, model)."""
    from minivllm.course import testing

    folder = tmp_path_factory.mktemp(f"tiny-{kind}-{'tied' if tie else 'untied'}")
    return folder, testing.make_tiny_model(folder, kind, tie=tie, seed=seed, **overrides)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory, "llama")


@pytest.fixture(scope="session", params=[("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False),
                                         ("qwen3", True)], ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def tiny_model(request, tmp_path_factory):
    kind, tie = request.param
    return make_tiny_model(tmp_path_factory, kind, tie)


@pytest.fixture(scope="session")
def default_model_dir():
    from minivllm.transformers_utils.model_files import resolve_model

    return resolve_model(None)


def pytest_configure(config):
    """In a student edition graded chapter by chapter (`-m ch05_ex1 or ...`): the grader's stand-ins
    replace the regions the edition released in other chapters, for the whole run (`stand_ins.py`)."""
    from stand_ins import released_elsewhere, stand_ins_for

    others = released_elsewhere(Path(__file__).resolve().parent.parent, config.getoption("markexpr", ""))
    if others:
        config._minivllm_stand_ins = stand_ins_for(others)
        config._minivllm_stand_ins.__enter__()


def pytest_unconfigure(config):
    stand_ins = getattr(config, "_minivllm_stand_ins", None)
    if stand_ins is not None:
        stand_ins.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _graders_own_answers_trip(request):
    """A test of exercise X fails if the code under grading calls the grader's stand-in for X (or,
    for some exercises, the chapter's other implementation of it): `stand_ins.tripwires`."""
    from stand_ins import EXERCISE_ID, tripwires

    exercises = sorted({m.name for m in request.node.iter_markers() if EXERCISE_ID.fullmatch(m.name)})
    if not exercises:
        yield
        return
    with tripwires(exercises) as tripped:
        yield
    if tripped:
        pytest.fail(tripped[0], pytrace=False)
