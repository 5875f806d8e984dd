"""``python -m bench.hooks``: the hooks benchmark."""

from bench.hooks.main import main

raise SystemExit(main())
