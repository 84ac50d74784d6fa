"""`hf_structkv.validation`: the shared integer- and flag-argument checks."""

import numpy as np
import pytest

from hf_structkv.validation import check_bool, check_int, is_int


@pytest.mark.parametrize("value", [0, 7, -3, np.int64(5), np.int32(0)])
def test_is_int_accepts_integers(value):
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, np.float32(1.0)])
def test_is_int_rejects_bools_floats_and_strings(value):
    assert not is_int(value)


def test_check_int_returns_a_python_int_in_range():
    assert check_int("n", 3, 1) == 3
    value = check_int("n", np.int64(4), 0, 4)
    assert value == 4 and type(value) is int
    assert check_int("n", None, 1, none_ok=True) is None


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        (0, {"minimum": 1}, ValueError, r"^n must be an integer >= 1, got 0$"),
        (5, {"minimum": 0, "maximum": 4}, ValueError, r"^n must be an integer in \[0, 4\], got 5$"),
        (-1, {"minimum": 0, "maximum": 4}, ValueError, r"^n must be an integer in \[0, 4\], got -1$"),
        (True, {"minimum": 0}, TypeError, r"^n must be an integer >= 0, got True$"),
        (2.0, {"minimum": 0}, TypeError, r"got 2\.0$"),
        (None, {"minimum": 0}, TypeError, r"^n must be an integer >= 0, got None$"),
        (
            0,
            {"minimum": 1, "counts": "tokens per chunk", "none_ok": True},
            ValueError,
            r"^n must be an integer >= 1 \(tokens per chunk\) or None, got 0$",
        ),
        ("4", {"minimum": 1, "none_ok": True}, TypeError, r"^n must be an integer >= 1 or None, got '4'$"),
    ],
)
def test_check_int_names_the_argument_the_range_and_the_value(value, kwargs, error, message):
    with pytest.raises(error, match=message):
        check_int("n", value, **kwargs)


@pytest.mark.parametrize("value", [True, False])
def test_check_bool_returns_the_flag(value):
    assert check_bool("flag", value) is value


@pytest.mark.parametrize("value", [0, 1, None, "yes", np.bool_(True)])
def test_check_bool_names_the_argument_and_the_bad_value(value):
    with pytest.raises(TypeError, match=rf"^flag must be True or False, got {value!r}$"):
        check_bool("flag", value)
