"""Bytes on the wire: ZeroMQ channels, the signed message format, serialization, shared memory.

Knows nothing of actors or message kinds beyond the header fields every message carries.

May import: nothing else of monarch_nb.
"""
