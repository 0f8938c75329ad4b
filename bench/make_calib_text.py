"""Writes ``bench/data/kv_calib_text.txt``: SmolLM2-135M-Instruct's own greedy answers to a few
prompts (CPU, fp32), a text independent of ``kv_quality_text.txt`` for calibrating what a
quantized KV cache may learn from queries (`bench/kv_quality.py --calib-text`).

    PYTHONPATH=. python bench/make_calib_text.py
"""

from __future__ import annotations

from pathlib import Path

from kvplan import LLM, SamplingParams

PROMPTS = (
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper and a storm.",
    "What are the main causes of inflation?",
    "Describe the water cycle for a ten-year-old.",
    "Give three tips for learning a new programming language.",
    "Summarize the history of the printing press.",
    "How do vaccines train the immune system?",
    "Write a letter to a friend about a trip to the mountains.",
)
OUT = Path(__file__).parent / "data" / "kv_calib_text.txt"


def main() -> None:
    llm = LLM(device="cpu")
    outs = llm.generate(list(PROMPTS), SamplingParams(max_tokens=256, temperature=0.0))
    text = "\n\n".join(o.text.strip() for o in outs) + "\n"
    OUT.write_text(text)
    print(f"{OUT}: {len(text)} characters, {sum(len(o.token_ids) for o in outs)} tokens")


if __name__ == "__main__":
    main()
