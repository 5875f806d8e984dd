"""``python -m bench.serving [proxy] ...``: the benchmark, or one of its proxies."""

from bench.serving.main import main

raise SystemExit(main())
