"""`python -m tsync_mcore.config --reference | --check` (config/reference.py)."""
from tsync_mcore.config.reference import main

raise SystemExit(main())
