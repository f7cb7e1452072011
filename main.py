"""The command line (fire), from a source tree: ``python main.py COMMAND``.

    python main.py demo [MODEL_PATH] [--prompt TEXT]...    complete prompts in one batch
    python main.py interactive [MODEL_PATH] [--instruct]   a prompt loop that streams each answer
    python main.py convert SRC DST [--to mistral|hf]       a model folder in the other layout
    python main.py models                                  the shipped models, by name

``python main.py --help`` (or ``COMMAND --help``) says more; the commands live in
``mixtral_infer/cli/commands.py``.
"""

import sys

from mixtral_infer.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
