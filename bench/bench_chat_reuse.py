"""A chat served from its row: the next turn, the same request sent again ("regenerate") and an edited
last message, against an equally long conversation read fresh, on the shipped tiny-mixtral (window 32).

The serving engine in process, as the server runs it: each turn's messages go through the chat
template (``protocol.chat_prompt``), each answer is cut by ``--answer-tokens`` (max_tokens) and sent
back as its text, so the template encodes it again (issue 72, item 6: those ids differ from the
generated ones). Per turn, time to first token of:

- **next**: the turn on the engine that served the conversation so far (prefix reuse, ``--slack``);
- **regenerate**: the same request again, right after;
- **edit**: the same request with the last word of its message changed, right after;
- **fresh**: the same prompt (as the engine read it) on an engine that holds nothing of it.

``--repeat`` conversations (default 3), medians per turn. User messages are ``--user-words`` words
(default 40) drawn from the model's corpus' vocabulary. One torch thread is steadier on a shared
machine (two threads on two busy cores took seconds a turn now and then).

    python bench/bench_chat_reuse.py --threads 1 --repeat 5 --out bench/results_chat_reuse.json

On a 2-core AMD EPYC, float32, eager steps, slack 48, the last (8th) turn, 702 tokens: fresh 49.5 ms,
next 10.6 (4.7x sooner), regenerate 4.4 (11x), edit 7.5 (6.6x). Before (48eb4bf, no slack): next 10.2
in the median but 51 ms in 2 of 5 conversations (an answer encoded again missed its row), regenerate
and edit 50 and 48 ms (the whole conversation read again).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_vs_transformers import machine_info  # noqa: E402

from mixtral_infer import Tokenizer, load_model  # noqa: E402
from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent  # noqa: E402
from mixtral_infer.serve.protocol import chat_prompt  # noqa: E402

WORDS = ("and the LORD said unto Moses behold I will send thee into the land of Egypt that thou mayest bring forth "
         "my people out of the house of bondage for they have cried unto me and I have heard them wherefore "
         "go thou and speak unto Pharaoh king of Egypt saying let my people go that they may serve me in the "
         "wilderness and the children of Israel journeyed from Rameses to Succoth about six hundred thousand "
         "on foot that were men beside children").split()  # fmt: skip


def message(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "?"


def ask(engine: Engine, prompt: List[int], max_tokens: int) -> Dict:
    """One request, run to its end: time to first token, its text as the server streams a chat's,
    the prompt as the engine read it and the tokens it found in a row."""
    events: List = []
    first: List[float] = []

    def sink(event):
        if isinstance(event, TokenEvent) and not first:
            first.append(time.perf_counter())
        events.append(event)

    started = time.perf_counter()
    request = engine.submit(prompt, RequestSettings(max_tokens=max_tokens, leading_space=False), sink)
    while engine.step():
        pass
    text = "".join(e.text for e in events if isinstance(e, TokenEvent)) + events[-1].text
    return {"ttft": first[0] - started, "text": text, "read_as": request.prompt, "reused": request.reused}


def conversation(model, tokenizer, options, seed: int) -> Dict[str, List]:
    rng = random.Random(seed)
    slack = {"slack": options.slack} if options.slack else {}  # (an engine before slack takes none)
    chat = Engine(model, tokenizer, rows=2, decode=options.decode, **slack)
    fresh = Engine(model, tokenizer, rows=1, decode=options.decode, prefix_reuse=False)
    ask(fresh, chat_prompt(tokenizer, [{"role": "user", "content": "Warm up."}]), 2)  # the allocator, the first step
    out: Dict[str, List] = {key: [] for key in ("next", "regenerate", "edit", "fresh", "prompt_tokens",
                                                "reused_next", "reused_regenerate", "reused_edit")}  # fmt: skip
    messages: List[Dict[str, str]] = []
    for _ in range(options.turns):
        question = message(rng, options.user_words)
        messages.append({"role": "user", "content": question})
        prompt = chat_prompt(tokenizer, messages)
        turn = ask(chat, prompt, options.answer_tokens)
        again = ask(chat, prompt, options.answer_tokens)
        edited = question.rsplit(" ", 1)[0] + " " + rng.choice(WORDS) + "?"
        edit = ask(chat, chat_prompt(tokenizer, messages[:-1] + [{"role": "user", "content": edited}]), options.answer_tokens)
        # the conversation goes on from its regenerated answer (the same text: greedy)
        alone = ask(fresh, turn["read_as"], options.answer_tokens)
        for key, result in (("next", turn), ("regenerate", again), ("edit", edit), ("fresh", alone)):
            out[key].append(result["ttft"])
        out["prompt_tokens"].append(len(turn["read_as"]))
        out["reused_next"].append(turn["reused"])
        out["reused_regenerate"].append(again["reused"])
        out["reused_edit"].append(edit["reused"])
        messages.append({"role": "assistant", "content": again["text"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--slack", type=int, default=48, help="Engine's slack (0: none): more than an answer and the end of a message")
    ap.add_argument("--decode", default="eager")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None)
    options = ap.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    runs = []
    with torch.inference_mode():
        for seed in range(options.repeat):
            runs.append(conversation(model, tokenizer, options, seed))
            last = runs[-1]
            print(f"round {seed + 1}: last turn ({last['prompt_tokens'][-1]} tokens) fresh {last['fresh'][-1] * 1e3:.1f} ms, "
                  f"next {last['next'][-1] * 1e3:.1f}, regenerate {last['regenerate'][-1] * 1e3:.1f}, "
                  f"edit {last['edit'][-1] * 1e3:.1f}", file=sys.stderr, flush=True)  # fmt: skip
    result: Dict = {"machine": machine_info(), "threads": torch.get_num_threads(), "model": "tiny-mixtral",
                    "window": model.args.sliding_window, "settings": vars(options) | {"out": None}}  # fmt: skip
    for key in ("next", "regenerate", "edit", "fresh"):
        result[f"ttft_ms_{key}"] = [round(statistics.median(t) * 1e3, 2) for t in zip(*[r[key] for r in runs])]
    for key in ("prompt_tokens", "reused_next", "reused_regenerate", "reused_edit"):
        result[key] = runs[0][key]  # the conversation of the first round
    for key in ("next", "regenerate", "edit"):  # from the second turn on: the row has wrapped
        ratios = [f / t for f, t in zip(result["ttft_ms_fresh"][1:], result[f"ttft_ms_{key}"][1:])]
        result[f"fresh_over_{key}"] = {"min": round(min(ratios), 2), "median": round(statistics.median(ratios), 2)}
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1), flush=True)
    if options.out:
        Path(options.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("MIXTRAL_INFER_MEASURE", "0")  # the same choices in every run: Tuning()'s defaults
    main()
