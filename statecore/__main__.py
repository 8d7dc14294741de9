"""``python -m statecore`` runs the ``statecore`` command."""

from statecore.cli import main

raise SystemExit(main())
