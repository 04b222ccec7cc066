"""Where the repository's own files are: the shipped demo checkpoint and the eval prompt sets (and how an eval
set reads: `read_turns`).

Everything is located relative to this package (an editable install or a clone), never outside the repository.
Command-line tools import their defaults from here rather than from `sparkspec.cli`, so that lower layers
(benchmarks, server) do not depend on the command line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "checkpoints" / "demo"
EVAL_DATA_DIR = REPO_ROOT / "data" / "eval"  # DeepSpec gsm8k / humaneval / mt-bench prompts (`turns` per line)


def eval_data_dirs() -> list[Path]:
    """Where `<name>.jsonl` eval sets are looked for, first hit wins: $SPARKSPEC_EVAL_DIR, then `data/eval`."""
    env = os.environ.get("SPARKSPEC_EVAL_DIR")
    return ([Path(env)] if env else []) + [EVAL_DATA_DIR]


def find_eval_file(name: str, data_dir: Path | None = None) -> Path:
    """Path of eval set `name`; `data_dir` (a `--data-dir` flag) replaces the search."""
    dirs = [Path(data_dir)] if data_dir is not None else eval_data_dirs()
    for d in dirs:
        if (d / f"{name}.jsonl").is_file():
            return d / f"{name}.jsonl"
    raise FileNotFoundError(f"eval dataset '{name}': no {name}.jsonl in {', '.join(str(d) for d in dirs)}")


def read_turns(path: Path) -> list[list[str]]:
    """A DeepSpec eval file: one {"turns": [str, ...]} per line."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            obj = json.loads(line)
            if not isinstance(obj.get("turns"), list) or not obj["turns"]:
                raise ValueError(f"{path}:{n}: expected a non-empty 'turns' list")
            out.append(obj["turns"])
    return out


def eval_files() -> list[Path]:
    """Every `*.jsonl` of the first eval directory that has any (the default benchmark prompts)."""
    for d in eval_data_dirs():
        files = sorted(d.glob("*.jsonl"))
        if files:
            return files
    return []
