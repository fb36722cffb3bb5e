"""Who runs next. `Scheduler` (scheduler.py) keeps the queues and picks each step; the prefill admission rule is
`PrefillAdder` (prefill.py), the decode set and retraction's victim are in decode.py, and a request's pages, table
row and share of the prefix tree are `CacheManager`'s (cache.py)."""
from .batch import ScheduledBatch
from .prefill import INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO
from .scheduler import Scheduler

__all__ = ["INIT_NEW_TOKEN_RATIO", "MIN_NEW_TOKEN_RATIO", "ScheduledBatch", "Scheduler"]
