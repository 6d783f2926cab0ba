"""Nova's functional harness, run by pytest in native-threading mode.

``nova.tests.functional`` applies Nova's concurrency choice when imported, and
must be imported before anything else loads eventlet.  Native threading (Nova
34 supports both) keeps eventlet from monkey-patching the whole pytest
process, which the lab tests share.
"""

import os

os.environ.setdefault("OS_NOVA_DISABLE_EVENTLET_PATCHING", "1")

try:
    import nova.tests.functional  # noqa: F401  (applies the concurrency mode)
except ImportError:  # Nova not installed: the test module skips and says so
    pass
