"""``python -m tpkit``: the command line (``tpkit.views.cli``)."""

from .views.cli import main

raise SystemExit(main())
