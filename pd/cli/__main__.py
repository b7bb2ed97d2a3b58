"""``python -m pd.cli``: the same as the ``pd`` command."""

from pd.cli import main

raise SystemExit(main())
