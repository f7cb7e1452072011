"""Serving: a continuous-batching engine over the rotating cache's rows, behind an
OpenAI-compatible HTTP server (``python main.py serve``).

``engine`` schedules requests onto cache rows; ``text`` turns tokens into streamed text and
stop strings; ``sizing`` picks the number of rows from a memory budget; ``protocol`` reads
and checks OpenAI request bodies; ``api`` is the HTTP app; ``metrics`` the Prometheus
metrics; ``options`` checks the command's options; ``server`` puts them together and runs
uvicorn. Needs the ``serve`` extra (``pip install -e ".[serve]"``); nothing else in the package
imports this folder.
"""
