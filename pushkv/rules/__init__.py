"""The pure rules every side shares: which engines pair, which rank writes
which heads and layers, which prompt blocks go where, and the transfer states
as the contract numbers them. No I/O here."""
