"""``python -m loadtest.bench``: the same command as ``tandem bench``."""

from loadtest.bench.cli import main

raise SystemExit(main())
