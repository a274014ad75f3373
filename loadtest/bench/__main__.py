"""``python -m tandem.loadtest.bench``: the same command as ``tandem bench``."""

from tandem.loadtest.bench.cli import main

raise SystemExit(main())
