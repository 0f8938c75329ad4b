"""`kvplan._checks.check_tensor`: each rule passes what it should and names the argument and
the offending value when it fails (the fast comparisons of the passing case included)."""

from __future__ import annotations

import pytest
import torch

from kvplan._checks import check_tensor


def test_passing_cases_return_the_tensor():
    x = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    for kw in (
        dict(dtype=torch.bfloat16),
        dict(dtype=(torch.float32, torch.bfloat16)),
        dict(dtype=[torch.bfloat16]),
        dict(ndim=3),
        dict(shape=(2, 3, 4)),
        dict(shape=[2, None, 4]),
        dict(shape=torch.Size([2, 3, 4])),
        dict(device="cpu"),
        dict(device=torch.device("cpu")),
        dict(contiguous=True),
    ):
        assert check_tensor("x", x, **kw) is x


@pytest.mark.parametrize(
    "kw, err, text",
    [
        (
            dict(dtype=torch.float32),
            TypeError,
            "x must have dtype torch.float32, got torch.bfloat16",
        ),
        (dict(dtype=(torch.float32, torch.float16)), TypeError, "torch.float32 or torch.float16"),
        (dict(ndim=2), ValueError, "x must be 2-D, got shape (2, 3, 4)"),
        (dict(shape=(2, 3)), ValueError, "must have shape (2, 3), got (2, 3, 4)"),
        (dict(shape=[2, None, 5]), ValueError, "must have shape (2, '*', 5)"),
        (dict(device="meta"), ValueError, "x must be on meta, got cpu"),
    ],
)
def test_failures_name_the_argument_and_value(kw, err, text):
    x = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(err) as info:
        check_tensor("x", x, **kw)
    assert text in str(info.value)


def test_type_and_contiguity():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        check_tensor("x", [1, 2])
    t = torch.zeros(4, 6)[:, ::2]
    with pytest.raises(ValueError, match="x must be contiguous"):
        check_tensor("x", t, contiguous=True)
