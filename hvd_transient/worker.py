"""``python -m hvd_transient.worker``: the path users' startup scripts and job commands name.

The worker lives in :mod:`hvd_transient.join.worker`; this module keeps the documented path.
"""
from __future__ import annotations

from hvd_transient.join.worker import main

if __name__ == "__main__":
    main()
