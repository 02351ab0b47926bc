"""pytest plugin for the device runs: a per-test time limit without pytest-timeout.

``python -m pytest -p pytest_alarm ...`` (with this folder on ``sys.path``). Each test gets
``KVPOOL_TEST_LIMIT`` seconds (default 120): faulthandler dumps every thread's stack a few
seconds before the limit (so a test stuck inside a C call still shows where), then SIGALRM
raises in the test, which fails it and lets the next one run. A failure's report is printed
as soon as the test ends (a run cut by an outer time limit still shows why tests failed).
"""

import faulthandler
import os
import signal
import sys

import pytest

LIMIT = int(os.environ.get("KVPOOL_TEST_LIMIT", "120"))


class TestTimeLimit(Exception):
    pass


def _raise(signum, frame):
    raise TestTimeLimit(f"test ran past {LIMIT} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    old = signal.signal(signal.SIGALRM, _raise)
    faulthandler.dump_traceback_later(max(1, LIMIT - 5), file=sys.stderr)
    signal.alarm(LIMIT)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


def pytest_runtest_logreport(report):
    if report.failed:
        sys.stderr.write(f"\n==== {report.nodeid} ({report.when}) failed:\n")
        sys.stderr.write(report.longreprtext[-6000:] + "\n")
        sys.stderr.flush()
