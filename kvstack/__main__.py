"""``python -m kvstack``: the same as the ``kvstack`` command."""

from kvstack.cli import main

raise SystemExit(main())
