"""pushkv's coordinator: the rendezvous core (plain Python) and its gRPC edge.

Importing this package runs no code beyond this docstring: agents and vLLM
workers never import it, and the core builds (pure Python, or compiled by
mypyc at install time: see core_build.py) are chosen by how it was installed.
"""
