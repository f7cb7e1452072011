"""``python -m mixtral_infer ...``: the same command line as ``mixtral-infer`` and ``main.py``."""

import sys

from mixtral_infer.cli import main

sys.exit(main())
