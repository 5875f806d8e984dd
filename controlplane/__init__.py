"""pushkv's coordinator: the rendezvous core (plain Python) and its gRPC edge."""

from controlplane import _native

# A fresh mypyc build of the core, if any, goes ahead of the sources (see _native).
NATIVE = _native.activate(__path__)
