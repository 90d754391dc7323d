"""Where the tests find the checkout (ROOT) and their helper scripts (WORKERS)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
