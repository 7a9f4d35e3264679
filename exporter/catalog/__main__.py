"""``python -m phasewatch.catalog``: write docs/metrics-reference.md (``--check``: fail
when it is stale)."""

import sys

from phasewatch.catalog.reference_page import main

sys.exit(main())
