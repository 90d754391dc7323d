"""Where the tests find the checkout (ROOT), their worker scripts (WORKERS) and perf/."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "helpers", "workers")
PERF = os.path.join(ROOT, "perf")
