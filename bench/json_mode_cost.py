"""JSON mode's host cost per tokenizer: building the vocabulary trie (once per engine) and the
per-step masks while a guide follows one JSON document token by token (each mask must allow
the document's next token; first visits of a state walk the trie, later ones hit the memo);
then the same under a JSON schema of that document (`kvplan.engine.json_schema`: a view of
the same trie with its own memo).

    PYTHONPATH=. python bench/json_mode_cost.py [--models SmolLM2-135M-Instruct,gemma-3-270m]

Tokenizers from ``~/.cache/kvplan/<name>`` (written by ``kvplan generate`` / the tests)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from transformers import AutoTokenizer

from kvplan.engine.json_mode import JsonGuide, TokenTrie, token_bytes
from kvplan.engine.json_schema import JsonSchema

DOC = {"name": "Paris", "country": "France", "population": 2102650,
       "areas": [1.5, "x\u00e9"], "capital": True}  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "country": {"enum": ["France", "Norway"]},
        "population": {"type": "integer"}, "capital": {"type": "boolean"},
        "areas": {"type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "string"}]},
                  "maxItems": 4},
    },
    "required": ["name", "population"],
}  # fmt: skip


def _follow(guide, ids: list[int], vocab: int) -> list[float]:
    """Seconds of each step's mask while ``guide`` follows ``ids`` (each must be allowed)."""
    times = []
    for i, tid in enumerate(ids):
        t = time.perf_counter()
        mask = guide.mask(vocab)
        times.append(time.perf_counter() - t)
        if not mask[tid]:
            raise AssertionError(f"step {i}: token {tid} of the document not allowed")
        guide.feed(ids[: i + 1])
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="SmolLM2-135M-Instruct,gemma-3-270m")
    args = ap.parse_args()
    for name in args.models.split(","):
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(f"~/.cache/kvplan/{name}"))
        t0 = time.perf_counter()
        pieces = token_bytes(tok)
        t1 = time.perf_counter()
        trie = TokenTrie(pieces)
        t2 = time.perf_counter()
        ids = tok.encode(json.dumps(DOC, indent=2), add_special_tokens=False)
        times = _follow(JsonGuide(trie, pieces, [tok.eos_token_id]), ids, len(pieces))
        print(f"{name}: vocab {len(pieces)}, token bytes {t1 - t0:.2f} s, trie {t2 - t1:.2f} s; "
              f"mask per step median {statistics.median(times) * 1e3:.2f} ms, worst "
              f"{max(times) * 1e3:.1f} ms over {len(times)} steps")  # fmt: skip
        schema = JsonSchema(SCHEMA)
        view = trie.view(schema)
        times = _follow(JsonGuide(view, pieces, [tok.eos_token_id]), ids, len(pieces))
        print(f"{name} with a schema: mask per step median {statistics.median(times) * 1e3:.2f} "
              f"ms, worst {max(times) * 1e3:.1f} ms, all {sum(times) * 1e3:.0f} ms over "
              f"{len(times)} steps")  # fmt: skip


if __name__ == "__main__":
    main()
