"""Where minisrv keeps what it caches on disk between processes (a GGUF model's parameters, config and tokenizer;
which tokenizer class a folder needs): one folder, chosen by --cache-dir, else $MINISRV_CACHE_DIR, else
$XDG_CACHE_HOME/minisrv; "off" turns the caches off."""
from __future__ import annotations

import os
from typing import Optional

from minisrv import env

OFF = "off"


def cache_root(setting: Optional[str]) -> Optional[str]:
    """The cache's folder, or None when the cache is off. `setting`: the --cache-dir value (None: not given)."""
    where = setting if setting is not None else env.CACHE_DIR.get()
    if where is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(xdg, "minisrv")
    if where.strip().lower() in (OFF, ""):
        return None
    return os.path.abspath(os.path.expanduser(where))
