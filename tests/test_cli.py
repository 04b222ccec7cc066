"""CLI user errors: one line on stderr naming what is wrong, exit code 2, no traceback."""

import json
import sys

import pytest
import torch

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
    for name in ("sparkspec.serve.connections", "sparkspec.serve.api"):  # imported (with uvicorn) by other tests
        monkeypatch.delitem(sys.modules, name, raising=False)
    code, err = run(capsys, "serve", "--model", str(tiny_checkpoint))
    assert code == 2 and "sparkspec[serve]" in err[-1]


def test_a_missing_prompts_file_is_reported_before_the_model_loads(capsys, monkeypatch, tiny_checkpoint, tmp_path):
    import sparkspec.loading.checkpoint

    monkeypatch.setattr(sparkspec.loading.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("model loaded"))
    code, err = run(capsys, "generate", "--model", str(tiny_checkpoint), "--prompts-file", str(tmp_path / "no.jsonl"))
    assert code == 2 and err == [f"error: prompts file not found: {tmp_path / 'no.jsonl'}"]


@pytest.mark.parametrize("argv", [
    ["eval", "--datasets", "gsm8k", "--num-prompts", "1"],
    ["bench", "offline", "--model", "MODEL"],
])
def test_plot_without_matplotlib_fails_before_running(capsys, monkeypatch, tiny_checkpoint, tmp_path, argv):
    import sparkspec.loading.checkpoint

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(sparkspec.loading.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("model loaded"))
    argv = [str(tiny_checkpoint) if a == "MODEL" else a for a in argv]
    code, err = run(capsys, *argv, "--plot", str(tmp_path / "p.png"))
    assert code == 2 and len(err) == 1 and "sparkspec[bench]" in err[0]


def test_generate_separates_prompts_and_reports_spec_metrics(capsys, tiny_checkpoint_with_drafters):
    ck = str(tiny_checkpoint_with_drafters)
    code = main(["generate", "--model", ck, "--prompt", "Hi", "--prompt", "Bye", "--max-tokens", "5",
                 "--ignore-eos", "--spec", "none"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("--- prompt 0 ---\n") and "\n\n--- prompt 1 ---\n" in out
    code = main(["generate", "--model", ck, "--prompt", "Hi", "--max-tokens", "9", "--ignore-eos", "--spec", "mtp",
                 "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert code == 0 and len(rec["token_ids"]) == 9 and rec["elapsed_s"] > 0 and rec["ttft_s"] is not None
    spec = rec["spec"]
    assert spec["method"] == "mtp" and spec["num_steps"] > 0
    assert spec["acceptance_length"] == pytest.approx((spec["num_accepted_tokens"] + spec["num_steps"])
                                                      / spec["num_steps"], abs=1e-4)
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert {"acceptance_rate", "num_draft_tokens", "text"} <= set(spec) | set(rec)


def test_bench_offline_writes_json_only_where_asked(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["bench", "offline", "--model", str(tiny_checkpoint), "--settings", "none", "--concurrency", "2",
            "--output-len", "3", "--num-prompts", "2", "--min-requests", "2", "--device", "cpu"]
    assert main(args) == 0
    assert list(tmp_path.iterdir()) == []
    assert main(args + ["--json", "out/b.json"]) == 0
    row = json.loads((tmp_path / "out" / "b.json").read_text())["results"][0]
    assert row["setting"] == "none"
    assert row["kv_blocks"] > 0 and row["preemptions"] == 0  # two short requests fit: nothing was preempted
    assert "tok/s" in capsys.readouterr().out


def test_bench_offline_process_per_setting(tiny_checkpoint, tmp_path):
    """--process-per-setting: every setting's rows come from a fresh process of its own, none from this one."""
    import os

    args = ["bench", "offline", "--model", str(tiny_checkpoint), "--settings", "none,ngram", "--concurrency", "2",
            "--output-len", "3", "--num-prompts", "2", "--min-requests", "2", "--device", "cpu",
            "--process-per-setting", "--json", str(tmp_path / "b.json")]
    assert main(args) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    rows = data["results"]
    assert [r["setting"] for r in rows] == ["none", "ngram fixed"] and data["meta"]["process_per_setting"]
    assert len({r["pid"] for r in rows}) == 2 and os.getpid() not in {r["pid"] for r in rows}


def test_bench_offline_interleave(tiny_checkpoint, tmp_path, monkeypatch):
    """--interleave: one process, each setting's engine built once, every level of every setting back to back per
    concurrency, the order rotated per round; the table keeps each setting's best round."""
    import os

    import sparkspec.bench.offline as offline

    built, build = [], offline.build_engine
    monkeypatch.setattr(offline, "build_engine", lambda args, work, setting: (built.append(setting.label),
                                                                              build(args, work, setting))[1])

    args = ["bench", "offline", "--model", str(tiny_checkpoint), "--settings", "none,ngram", "--concurrency", "1,2",
            "--output-len", "3", "--num-prompts", "2", "--min-requests", "2", "--device", "cpu", "--interleave",
            "--rounds", "2", "--json", str(tmp_path / "b.json")]
    assert main(args) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    ran = [(r["concurrency"], r["round"], r["setting"]) for r in data["meta"]["every_round"]]
    assert ran == [(1, 0, "none"), (1, 0, "ngram fixed"), (1, 1, "ngram fixed"), (1, 1, "none"),
                   (2, 0, "none"), (2, 0, "ngram fixed"), (2, 1, "ngram fixed"), (2, 1, "none")]
    assert {r["pid"] for r in data["meta"]["every_round"]} == {os.getpid()} and data["meta"]["interleave"]
    assert built == ["none", "ngram fixed"]  # each setting's engine built once, for every level and round
    assert [(r["setting"], r["concurrency"]) for r in data["results"]] == [
        ("none", 1), ("none", 2), ("ngram fixed", 1), ("ngram fixed", 2)]
    assert main(args + ["--process-per-setting"]) == 2  # one process and one per setting: a usage error


def test_bench_offline_output_len_ratio(tiny_checkpoint, tmp_path):
    """--output-len-ratio: each request's length drawn around --output-len, the same lengths for every setting."""
    from sparkspec.bench.offline import output_lengths

    lengths = output_lengths(400, 8, 0.5)
    assert min(lengths) == 4 and max(lengths) == 12 and lengths == output_lengths(400, 8, 0.5)
    assert output_lengths(3, 8, 0.0) == [8, 8, 8]
    args = ["bench", "offline", "--model", str(tiny_checkpoint), "--settings", "none,ngram", "--concurrency", "2",
            "--output-len", "8", "--output-len-ratio", "0.5", "--num-prompts", "2", "--min-requests", "6",
            "--device", "cpu", "--json", str(tmp_path / "b.json")]
    assert main(args) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["results"]
    assert [r["output_tokens"] for r in rows] == [sum(output_lengths(6, 8, 0.5))] * 2
    assert not any("host_calib_us" in r for r in rows)
    assert main(args[:-2] + ["--output-len-ratio", "1.5"]) == 2
    assert main(args + ["--calibrate-host"]) == 0  # the host's speed around every level
    rows = json.loads((tmp_path / "b.json").read_text())["results"]
    assert all(len(r["host_calib_us"]) == 2 and min(r["host_calib_us"]) > 0 for r in rows)


def test_env_lists_every_op(capsys):
    from sparkspec.ops.registry import op_names

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton" in out and "transformers" in out and "cpu" in out
    ops_section = out.split("op implementation per device type:")[1]
    for name in op_names():
        assert f"  {name} " in ops_section


# ---------------------------------------------------------------- device and dtype flags, before the model loads

DEVICE_COMMANDS = {"generate": ["generate"], "serve": ["serve", "--port", "0"], "bench offline": ["bench", "offline"]}
BAD_DEVICES = ["bogus", "cuda:x", "meta"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"])


@pytest.fixture
def unreadable_checkpoint(tmp_path):
    """A checkpoint directory whose config cannot be read: a flag refused after any loading began would report
    the config instead, so naming the flag shows that nothing was read first."""
    (tmp_path / "config.json").write_text("{not json")
    return tmp_path


@pytest.mark.parametrize("command", list(DEVICE_COMMANDS))
@pytest.mark.parametrize("device", BAD_DEVICES)
def test_a_bad_device_is_one_line_before_the_model_loads(capsys, unreadable_checkpoint, command, device):
    code, err = run(capsys, *DEVICE_COMMANDS[command], "--model", str(unreadable_checkpoint), "--device", device)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --device ") and device in err[0], err


@pytest.mark.parametrize("command", ["serve", "bench offline"])
def test_a_bad_dtype_is_one_line_before_the_model_loads(capsys, unreadable_checkpoint, command):
    code, err = run(capsys, *DEVICE_COMMANDS[command], "--model", str(unreadable_checkpoint), "--dtype", "bogus")
    assert code == 2 and len(err) == 1 and "dtype" in err[0] and "bogus" in err[0], err


def test_a_bad_device_from_the_shell(unreadable_checkpoint):
    """The installed entry point: exit code 2, one line on stderr, no traceback."""
    import subprocess

    r = subprocess.run([sys.executable, "-m", "sparkspec.cli", "generate", "--model", str(unreadable_checkpoint),
                        "--device", "bogus"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --device 'bogus': not a device (expected cpu, cuda, cuda:N, xpu or xpu:N)"]


def test_a_failing_engine_under_tensor_parallelism_reports_its_own_error(capsys, monkeypatch, tiny_checkpoint):
    """`LLM(...)` failing on rank 0: the other ranks are still stopped, and the error shown is that failure (the
    group is faked: one rank, no processes)."""
    import sparkspec.engine.llm
    import sparkspec.engine.lockstep as lockstep
    from sparkspec.distributed import ParallelGroup

    finished = []
    monkeypatch.setattr(lockstep, "launch", lambda *a, **k: ParallelGroup(0, 1))
    monkeypatch.setattr(lockstep, "finish", finished.append)

    def failing_llm(*a, **k):
        raise ValueError("max_model_len = 3: the engine refused it")

    monkeypatch.setattr(sparkspec.engine.llm, "LLM", failing_llm)
    code, err = run(capsys, "generate", "--model", str(tiny_checkpoint), "--tensor-parallel-size", "2",
                    "--device", "cpu")
    assert code == 2 and err[-1] == "error: max_model_len = 3: the engine refused it" and finished == [None]
