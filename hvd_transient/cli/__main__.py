"""``python -m hvd_transient.cli``: the console script without its wrapper."""
import sys

from hvd_transient.cli import main

sys.exit(main())
