"""Wire-protocol version shared by coordinator and agents.

Bump PROTOCOL_VERSION when a change breaks the other side: renumbered or
retyped proto fields, a new meaning of an order or notice, or a changed NIXL
notification format (agent/notif.py).
"""

PROTOCOL_VERSION = 1
