"""Nova's functional harness, run by pytest in native-threading mode.

``nova.tests.functional`` applies Nova's concurrency choice when imported, and
must be imported before anything else loads eventlet.  Native threading (Nova
34 supports both) keeps eventlet from monkey-patching the whole pytest
process, which the lab tests share.
"""

import os

import pytest

os.environ.setdefault("OS_NOVA_DISABLE_EVENTLET_PATCHING", "1")

try:
    import nova.tests.functional  # noqa: F401  (applies the concurrency mode)
except ImportError:  # Nova not installed: the test module skips and says so
    pass


@pytest.fixture(scope="class")
def nova_lab(request):
    """A fresh two-host lab for a Nova end-to-end class (its ``lab`` attribute)."""
    from flexmig_lab.lab import Lab
    from tests.functional.conftest import keep_logs, lab_missing_reason

    reason = lab_missing_reason()
    if reason:
        pytest.skip(reason)
    lab = Lab()
    lab.down()
    lab.up(2)
    request.cls.lab = lab
    yield lab
    keep_logs(lab)
    lab.down()
