"""The KV cache: the paged pool, its page allocator (reference counted), the request->token table, and the radix
prefix tree. It knows tokens, pages and slots, never requests or their text."""
from .allocator import PageAllocator
from .pool import KVPool
from .req_table import ReqToTokenTable, slots_for
from .window import WindowRule

__all__ = ["KVPool", "PageAllocator", "ReqToTokenTable", "slots_for", "WindowRule"]
