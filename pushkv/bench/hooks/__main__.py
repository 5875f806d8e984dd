"""``python -m pushkv.bench.hooks``: the hooks benchmark."""

from pushkv.bench.hooks.main import main

raise SystemExit(main())
