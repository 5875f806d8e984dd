"""``python -m pushkv.bench.serving [proxy] ...``: the benchmark, or one of its proxies."""

from pushkv.bench.serving.main import main

raise SystemExit(main())
