"""``python -m dmuon``: the same command line as the ``dmuon`` console script
(:mod:`dmuon.tools.cli`)."""

from dmuon.tools.cli import main

raise SystemExit(main())
