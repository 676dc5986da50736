"""minivllm.utils.checks: the one place for "an int but not a bool" and similar argument checks."""
import numpy as np
import pytest

from minivllm.utils.checks import is_int, require_bool, require_int, require_number


@pytest.mark.parametrize("value, expected", [
    (0, True), (-3, True), (2**70, True), (np.int64(5), True), (np.uint8(7), True),
    (True, False), (False, False), (np.bool_(True), False), (1.0, False), (np.float32(2), False),
    ("1", False), (None, False),
])
def test_is_int(value, expected):
    assert is_int(value) is expected


def test_require_int_returns_a_python_int():
    got = require_int("n", np.int32(4), minimum=1)
    assert got == 4 and type(got) is int


@pytest.mark.parametrize("kwargs, message", [
    (dict(value=True), r"n must be an int, got True"),
    (dict(value=2.5), r"n must be an int, got 2.5"),
    (dict(value=0, minimum=1), r"n must be >= 1, got 0"),
    (dict(value=9, maximum=8), r"n must be <= 8, got 9"),
    (dict(value=9, minimum=0, maximum=8), r"n must be in \[0, 8\], got 9"),
])
def test_require_int_names_the_value_and_the_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        require_int("n", **kwargs)


@pytest.mark.parametrize("value", [True, "0.5", float("nan"), float("inf"), None])
def test_require_number_rejects(value):
    with pytest.raises(ValueError, match="t must be"):
        require_number("t", value)


def test_require_number_limits_and_types():
    assert require_number("t", 1) == 1.0 and type(require_number("t", np.float32(0.5))) is float
    with pytest.raises(ValueError, match=r"t must be >= 0.0, got -0.1"):
        require_number("t", -0.1, minimum=0.0)


@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_require_bool_rejects_non_bools(value):
    with pytest.raises(ValueError, match="flag must be a bool"):
        require_bool("flag", value)
    assert require_bool("flag", True) is True
