"""`Request.token_view`: the prompt + outputs without a copy, equal to ``all_token_ids``."""

import numpy as np
import pytest

from kvplan.engine.request import Request
from kvplan.engine.sampling import SamplingParams


def test_token_view_equals_all_token_ids():
    req = Request(0, [5, 6, 7], SamplingParams())
    req.output_token_ids += [8, 9]
    view, ref = req.token_view, req.all_token_ids
    assert len(view) == len(ref) and list(view) == ref
    assert [view[i] for i in range(-5, 5)] == [ref[i] for i in range(-5, 5)]
    for sl in (slice(0, 4), slice(1, 4), slice(2, None), slice(0, 9), slice(None, None, 2)):
        assert list(view[sl]) == ref[sl]
    assert np.asarray(view[:4]).tolist() == ref[:4]
    prefix = view[:4]
    req.output_token_ids.append(10)  # a prefix view keeps its length; the full view grows
    assert len(prefix) == 4 and len(req.token_view) == 6
    with pytest.raises(IndexError):
        view[5]


def test_slices_iteration_and_arrays_match_the_list_everywhere():
    """Every slice (across the prompt / output boundary, empty, reversed, stepped), iteration
    and ``np.asarray`` of views of every length equal the plain list's."""
    req = Request(0, list(range(100, 107)), SamplingParams())
    req.output_token_ids += list(range(200, 205))
    full = req.all_token_ids
    for end in range(len(full) + 1):
        view, ref = req.token_view[:end], full[:end]
        assert list(view) == ref and list(iter(view)) == ref
        arr = np.asarray(view)
        assert arr.dtype == np.int64 and arr.tolist() == ref
        assert np.asarray(view, dtype=np.int32).dtype == np.int32
        for start in range(-3, end + 2):
            for stop in range(-3, end + 2):
                for step in (None, 1, 2, -1):
                    sl = slice(start, stop, step)
                    assert list(view[sl]) == ref[sl], (end, sl)
    # np.concatenate of chunk views (the prompt planner's gather)
    parts = [req.token_view[2:9], req.token_view[:3]]
    assert np.concatenate(parts).tolist() == full[2:9] + full[:3]
