"""Benchmark prompts: the eval JSONL files when they are around (`turns` / `prompt` / `text` per line), else a
small built-in mix of math, code and chat prompts (so benchmarks and tests run on a clean clone)."""

from __future__ import annotations

import json
from pathlib import Path

BUILTIN_PROMPTS = [
    ("A train leaves at 3 pm travelling 60 km/h. A second train leaves the same station at 4 pm at 90 km/h. "
     "When does the second train catch up? Explain step by step."),
    "What is the sum of the first 50 odd numbers? Show your reasoning.",
    "A shop sells pencils at 3 for 1 dollar. How many dollars do 27 pencils cost?",
    "Solve for x: 3x + 7 = 2x - 5. Check the answer.",
    "If a rectangle has a perimeter of 40 cm and one side is 12 cm, what is its area?",
    "Tom has twice as many apples as Ana. Together they have 36. How many does each have?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function `is_palindrome(s)` that ignores case and punctuation, with two tests.",
    "Implement binary search over a sorted list in Python and explain its complexity.",
    "Write a SQL query that returns the three customers with the highest total order value.",
    "Explain what a Python generator is and give a short example that reads a file lazily.",
    "Write a shell one-liner that counts the lines of every .py file below the current directory.",
    "Describe the water cycle to a ten-year-old in a short paragraph.",
    "Give three tips for writing clear technical documentation.",
    "Summarise the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "What are the trade-offs between trains and planes for a 600 km trip?",
    "Write a short poem about autumn leaves and the first frost.",
    "Explain the difference between weather and climate in two sentences.",
    "Draft a polite email asking a colleague to review a pull request by Friday.",
    "List five healthy breakfast ideas that take under ten minutes.",
    "Why is the sky blue? Answer briefly and precisely.",
    "Compare arrays and linked lists: when would you pick each?",
    "Translate into French: 'The library opens at nine and closes at six.'",
    "Write a haiku about a quiet harbour at dawn.",
]


def default_prompt_files() -> list[str]:
    """The eval sets shipped in the repository (`data/eval/*.jsonl`, or $SPARKSPEC_EVAL_DIR's)."""
    from sparkspec.paths import eval_files

    return [str(f) for f in eval_files()]


def read_prompt_file(path: str | Path) -> list[str]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if isinstance(obj, dict):
            if isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
                out.append(obj["turns"][0])
            elif isinstance(obj.get("prompt"), str):
                out.append(obj["prompt"])
            elif isinstance(obj.get("text"), str):
                out.append(obj["text"])
    return out


def load_prompts(files: list[str] | None = None, num: int | None = None, use_default_files: bool = True
                 ) -> list[str]:
    """Prompts interleaved across files (so a short sweep still mixes domains); built-ins as the fallback."""
    files = list(files or (default_prompt_files() if use_default_files else []))
    per_file = [read_prompt_file(f) for f in files]
    for f in files:
        if not Path(f).is_file():
            raise ValueError(f"prompt file not found: {f}")
    prompts = []
    for i in range(max((len(p) for p in per_file), default=0)):
        prompts += [p[i] for p in per_file if i < len(p)]
    if not prompts:
        prompts = list(BUILTIN_PROMPTS)
    if num is not None:
        prompts = (prompts * (num // len(prompts) + 1))[:num]
    return prompts
