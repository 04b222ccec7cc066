"""The offline byte-level BPE tokenizer trainer: what `sparkspec init` gives a random checkpoint (trained on
standard-library docstrings, no network) and what `sparkspec train tokenizer` trains on its corpus. The
tokenizer carries the DeepSeek-style chat template and special tokens of `sparkspec.tokenizer`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import warnings
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sparkspec.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, Tokenizer

STDLIB_MODULES = (
    "abc argparse ast asyncio base64 bisect calendar codecs collections colorsys configparser contextlib copy csv "
    "dataclasses datetime decimal difflib email enum fnmatch fractions functools getopt gettext glob gzip hashlib "
    "heapq html http.client imaplib inspect io itertools json locale logging lzma math operator optparse pathlib "
    "pickle platform pprint queue random re select shutil signal socket sqlite3 statistics string struct "
    "subprocess tarfile tempfile textwrap threading time timeit tokenize traceback types typing unicodedata "
    "unittest urllib.parse urllib.request uuid warnings weakref zipfile zlib"
).split()


def stdlib_corpus() -> list[str]:
    """Docstrings of Python standard-library modules and their members: ~0.5 MB of English prose and code,
    available on every machine without network. Deterministic for one Python version."""
    seen: dict[str, None] = {}
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # a module missing from a minimal Python build
            continue
        docs = [mod.__doc__]
        with warnings.catch_warnings():  # deprecated aliases (typing.io, ...) warn when touched
            warnings.simplefilter("ignore")
            for _, obj in sorted(vars(mod).items()):
                if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
                    docs.append(obj.__doc__)
        for d in docs:
            if isinstance(d, str) and d.strip():
                seen.setdefault(inspect.cleandoc(d), None)
    return list(seen)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path,
                        special_tokens: list[str] | None = None, chat_template: str = CHAT_TEMPLATE) -> Tokenizer:
    """Train a byte-level BPE tokenizer with exactly `vocab_size` ids and write tokenizer.json +
    tokenizer_config.json (BOS / EOS / PAD and the chat template) into `out_dir`.

    Special tokens take ids 0.. in the order given (default `SPECIAL_TOKENS`: BOS=0, EOS=1, PAD=2, NOISE=3,
    User, Assistant). If the corpus yields fewer merges than needed, `<|reserved_N|>` tokens fill the vocabulary
    so that every id a model of this vocab_size can emit decodes."""
    special_tokens = list(SPECIAL_TOKENS if special_tokens is None else special_tokens)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(special_tokens) + len(alphabet)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size = {vocab_size}: a byte-level BPE tokenizer needs at least {minimum} ids "
                         f"(256 bytes + {len(special_tokens)} special tokens)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special_tokens[0] if len(special_tokens) > 0 else None,
        "eos_token": special_tokens[1] if len(special_tokens) > 1 else None,
        "pad_token": special_tokens[2] if len(special_tokens) > 2 else None,
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return Tokenizer.from_dir(out_dir)
