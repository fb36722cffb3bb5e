#!/usr/bin/env python
"""Offline generation: `python scripts/generate.py "Hello" --max-tokens 32` (see --help)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minisrv.generate_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
