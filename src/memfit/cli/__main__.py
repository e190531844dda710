"""`python -m memfit.cli`: the memfit command line."""

from memfit.cli import main

raise SystemExit(main())
