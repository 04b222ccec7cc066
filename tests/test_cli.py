"""CLI user errors: one line on stderr naming what is wrong, exit code 2, no traceback."""

import json
import sys

import pytest

from sparkspec.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--model", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["init", "--preset", "nope", "--out", "/tmp/sparkspec-never"], "nope"),
])
def test_missing_things_are_named(capsys, argv, needle):
    code, err = run(capsys, *argv)
    assert code == 2 and len(err) == 1 and needle in err[0]


def test_bad_generate_inputs(capsys, tmp_path, tiny_checkpoint):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json}\n')
    code, err = run(capsys, "generate", "--model", str(tiny_checkpoint), "--prompts-file", str(bad))
    assert code == 2 and err == [err[-1]] and f"{bad}:2" in err[0]
    code, err = run(capsys, "generate", "--model", str(tiny_checkpoint), "--temperature", "-1")
    assert code == 2 and "temperature" in err[-1]
    long_ids = tmp_path / "long.jsonl"
    long_ids.write_text(json.dumps({"prompt_token_ids": [5] * 5000}) + "\n")
    code, err = run(capsys, "generate", "--model", str(tiny_checkpoint), "--prompts-file", str(long_ids))
    assert code == 2 and "max_position_embeddings" in err[-1]


def test_missing_optional_package_names_the_extra(capsys, monkeypatch, tiny_checkpoint):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` now fails like an absent package
    code, err = run(capsys, "serve", "--model", str(tiny_checkpoint))
    assert code == 2 and "sparkspec[serve]" in err[-1]
