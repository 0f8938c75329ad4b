"""`tools/compile_sm90.py`'s check for 64-bit integer divisions (CI's ``--no-int64-div``)."""

from tools.compile_sm90 import int64_divisions

PTX = """
    div.s64     %rd7, %rd5, %rd6;
    rem.u64     %rd9, %rd7, %rd8;
    div.rn.f32  %f3, %f1, %f2;
    div.s32     %r4, %r2, %r3;
    rem.s32     %r5, %r2, %r3;
    mul.lo.s64  %rd10, %rd9, %rd9;
"""


def test_int64_divisions_counts_64_bit_div_and_rem_only():
    assert int64_divisions(PTX) == 2
    assert int64_divisions("div.full.f32 %f1, %f2, %f3;\nrem.u32 %r1, %r2, %r3;") == 0
