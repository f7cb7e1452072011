"""``python -m mixtral_infer ...``: the same command line as ``mixtral-infer`` and ``main.py``."""

import sys

from mixtral_infer.cli.commands import main

sys.exit(main())
