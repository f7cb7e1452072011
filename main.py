"""The command line (fire), from a source tree: ``python main.py COMMAND``.

    python main.py demo [MODEL_PATH] [--prompt TEXT]...    complete prompts in one batch
    python main.py interactive [MODEL_PATH] [--instruct]   a prompt loop that streams each answer
    python main.py convert SRC DST [--to mistral|hf]       a model folder in the other layout
    python main.py models                                  the shipped models, by name

``python main.py --help`` (or ``COMMAND --help``) says more; the commands live in
``mixtral_infer/cli/commands.py``.
"""

import sys

try:
    from mixtral_infer.cli import main
except KeyboardInterrupt:  # Ctrl-C before the command line has even been imported
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())
