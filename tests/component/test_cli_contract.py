"""The CLI's contract with a user who gets something wrong: every subcommand, given a bad value
or a bad file, exits non-zero with a message naming the option or the file, prints no
traceback and leaves no ``.partial`` file behind."""

from __future__ import annotations

import pytest

from eva0_edge.cli import main
from tests.fixtures import SHIPPED

MODEL = str(SHIPPED[1])

# (argv, what the message must name); {tmp} is the test's folder, {missing}/{empty}/{junk}
# model files that do not exist, hold 0 bytes, hold text.
CASES = [
    (["info", "{missing}"], "{missing}"),
    (["info", "{empty}"], "{empty}"),
    (["info", "{junk}"], "{junk}"),
    (["export", "--arch", "no_such_arch", "-o", "{tmp}/m.onnx"], "no_such_arch"),
    (["export", "--arch", "resnet18", "--checkpoint", "{junk}", "-o", "{tmp}/m.onnx"], "{junk}"),
    (["export", "--arch", "vit_tiny_patch16_224", "--opset", "0", "-o", "{tmp}/m.onnx"],
     "--opset"),
    (["export", "--arch", "vit_tiny_patch16_224", "--prompts", "-2", "-o", "{tmp}/m.onnx"],
     "--prompts"),
    (["calibrate", "--model", "{missing}", "--data", "{tmp}", "-o", "{tmp}/c.onnx"],
     "{missing}"),
    (["calibrate", "--model", MODEL, "--data", "{tmp}/nothing", "-o", "{tmp}/c.onnx"],
     "{tmp}/nothing"),
    (["calibrate", "--model", MODEL, "--data", "{tmp}", "--batch-size", "0", "-o",
      "{tmp}/c.onnx"], "--batch-size"),
    (["adapt", "--model", "{empty}", "--input", "{tmp}", "--output", "{tmp}/p.jsonl"],
     "{empty}"),
    (["adapt", "--model", MODEL, "--input", "{tmp}/nothing", "--output", "{tmp}/p.jsonl"],
     "{tmp}/nothing"),
    (["adapt", "--model", MODEL, "--input", "{tmp}", "--output", "{tmp}/p.jsonl", "--set",
      "eta=abc"], "eta"),
    (["adapt", "--model", MODEL, "--input", "{tmp}", "--output", "{tmp}/p.jsonl", "--set",
      "no_such_key=1"], "no_such_key"),
    (["adapt", "--model", MODEL, "--input", "{tmp}", "--output", "{tmp}/p.jsonl", "--method",
      "no_such_method"], "no_such_method"),
    (["adapt", "--model", MODEL, "--input", "{tmp}", "--output", "{tmp}/p.jsonl", "--budget",
      "0.5"], "budget"),
    (["adapt", "--model", MODEL, "--input", "{tmp}", "--output", "{tmp}/p.jsonl", "--state",
      "{junk}"], "{junk}"),
    (["serve", "--model", "{empty}"], "{empty}"),
    (["serve", "--model", MODEL, "--port", "70000"], "--port"),
    (["serve", "--model", MODEL, "--max-batch", "0"], "--max-batch"),
    (["serve", "--model", MODEL, "--max-delay-ms", "-1"], "--max-delay-ms"),
    (["serve", "--model", MODEL, "--max-delay-ms", "inf"], "--max-delay-ms"),
    (["serve", "--model", MODEL, "--max-delay-ms", "nan"], "--max-delay-ms"),
    (["serve", "--model", MODEL, "--max-body-mb", "-1"], "--max-body-mb"),
    (["serve", "--model", MODEL, "--max-body-mb", "inf"], "--max-body-mb"),
    (["serve", "--model", MODEL, "--max-pixels-mp", "nan"], "--max-pixels-mp"),
    (["serve", "--model", MODEL, "--max-pixels-mp", "inf"], "--max-pixels-mp"),
    (["serve", "--model", MODEL, "--header-timeout-s", "inf"], "--header-timeout-s"),
    (["serve", "--model", MODEL, "--summary-every", "0"], "--summary-every"),
    (["serve", "--model", MODEL, "--snapshot-every", "0"], "--snapshot-every"),
    (["serve", "--model", MODEL, "--keep-snapshots", "0"], "--keep-snapshots"),
    (["serve", "--model", MODEL, "--replicas", "-1"], "--replicas"),
    (["quantize", "--model", "{missing}", "--bits", "8", "--calib", "{tmp}", "-o",
      "{tmp}/q.onnx"], "{missing}"),
    (["quantize", "--model", MODEL, "--bits", "7", "--calib", "{tmp}", "-o", "{tmp}/q.onnx"],
     "--bits"),
    (["quantize", "--model", MODEL, "--bits", "8", "--calib", "{tmp}", "--calib-images", "0",
      "-o", "{tmp}/q.onnx"], "--calib-images"),
    (["quantize", "--model", MODEL, "--bits", "8", "--calib", "{tmp}/nothing", "-o",
      "{tmp}/q.onnx"], "{tmp}/nothing"),
    (["eval", "--model", "{missing}"], "{missing}"),
    (["eval", "--model", MODEL, "--methods", "no_such_method"], "no_such_method"),
    (["eval", "--model", MODEL, "--severity", "9"], "--severity"),
    (["eval", "--model", MODEL, "--threads", "0"], "--threads"),
    (["bench", "--model", "{junk}", "--methods", "eva0"], "{junk}"),
    (["bench", "--model", MODEL, "--methods", "no_such_method"], "no_such_method"),
    (["bench", "--model", MODEL, "--warmup", "-1"], "--warmup"),
    (["bench", "--model", MODEL, "--threads", "-3"], "--threads"),
]


@pytest.mark.parametrize("argv,named", CASES, ids=lambda v: " ".join(v[:3]) if isinstance(
    v, list) else None)
def test_a_bad_value_or_file_is_one_line_naming_it(argv, named, tmp_path, capsys):
    files = {"tmp": str(tmp_path), "missing": str(tmp_path / "missing.onnx"),
             "empty": str(tmp_path / "empty.onnx"), "junk": str(tmp_path / "junk.onnx")}
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "junk.onnx").write_text("this is not a model\n")
    argv = [a.format(**files) for a in argv]
    try:
        status = main(argv)
    except SystemExit as stop:  # argparse: usage line, then the error
        status = stop.code
    assert status not in (0, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("eva0-edge") and "error" in message
    assert named.format(**files) in message
    assert not list(tmp_path.rglob("*.partial"))


def test_bench_with_its_defaults_runs_what_the_model_can_and_names_what_it_skips(capsys):
    """A ResNet has no prompt model: FOA is skipped with the reason, the rest is timed."""
    argv = ["bench", "--model", MODEL, "--batch-sizes", "1", "--repeats", "1", "--warmup", "0",
            "--no-memory", "-q"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    reason = out.split("skipped foa:")[1].splitlines()[0]
    assert "VisionTransformer" in reason
    for method in ("noadapt", "eva0", "zoa", "tent"):
        assert f"| {method} | 1 |" in out
    assert "| foa |" not in out


def test_progress_off_a_terminal_is_plain_lines_and_on_one_a_bar():
    import io

    from eva0_edge.runtime.progress import progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    log, terminal = io.StringIO(), Terminal()
    for stream in (log, terminal):
        assert list(progress_bar(range(3), total=3, desc="adapt", stream=stream)) == [0, 1, 2]
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) >= 2  # the start and the end
    assert lines[0].startswith("adapt:") and "3/3" in lines[-1]
    assert "\r" in terminal.getvalue()  # tqdm redraws its bar in place
    quiet = io.StringIO()
    assert list(progress_bar(range(2), quiet=True, stream=quiet)) == [0, 1]
    assert quiet.getvalue() == ""


def test_a_heartbeat_shows_an_opaque_call_is_running():
    import io
    import re
    import time

    from eva0_edge.runtime import progress

    log = io.StringIO()
    with progress.heartbeat("exporting x", stream=log):
        time.sleep(2.3)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("exporting x:")
    assert re.match(r"exporting x: [1-9]\d*s ", lines[-1])  # the seconds it ran


def test_reports_round_float_noise_and_print_the_load_readably():
    from eva0_edge.bench.testbed.output import load_text, tidy

    assert tidy({"a": [80.52000000000001, (1 / 3, 2)], "b": "x", "c": 7}) == {
        "a": [80.52, [0.3333333333, 2]], "b": "x", "c": 7}
    assert load_text((0.5, 1.25, 12.0)) == "0.50 / 1.25 / 12.00"
