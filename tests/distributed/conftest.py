"""A hard per-test time limit for the multi-process tests (pytest-timeout is not a
dependency): a test that runs past it dumps every thread's stack and ends its process, so a
hang shows up as a failure instead of a stuck CI job."""

import faulthandler

import pytest

TEST_LIMIT_S = 120


@pytest.fixture(autouse=True)
def _hard_time_limit():
    faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
