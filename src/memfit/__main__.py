"""`python -m memfit`: the memfit command line."""

from memfit.cli import main

raise SystemExit(main())
