"""Who runs next. `Scheduler` (scheduler.py) keeps the queues, picks each step (the decode set and retraction's
victim included) and hands it over as a `ScheduledBatch`; the prefill admission rule is `PrefillAdder`
(prefill.py), and a request's pages, table row and share of the prefix tree are `CacheManager`'s (cache.py)."""
from .prefill import INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO
from .scheduler import ScheduledBatch, Scheduler

__all__ = ["INIT_NEW_TOKEN_RATIO", "MIN_NEW_TOKEN_RATIO", "ScheduledBatch", "Scheduler"]
