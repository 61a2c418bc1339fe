"""``python -m dmuon``: the same command line as the ``dmuon`` console script."""

from dmuon.cli import main

raise SystemExit(main())
