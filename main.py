"""python main.py demo [MODEL_PATH] | python main.py interactive [MODEL_PATH] [--instruct]"""

import sys

from mixtral_infer.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
