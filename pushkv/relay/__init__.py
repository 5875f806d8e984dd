"""The node relay (`pushkv relay`): a node's agent streams on one NodeStream."""
