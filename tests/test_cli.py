"""The `ctropt` command: each subcommand, and every bad input as a message (never a traceback)."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import ctropt

from ctropt.cli import PASS_OPTIONS, app
from ctropt.graph import MAX_ONNX_OPSET, save
from helpers import F, I64, init, make_model, node, ops, vi

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


@pytest.fixture
def model_path(tmp_path):
    model = make_model(
        [node("Gather", ["table", "ids"], ["e"]), node("Identity", ["e"], ["i"]), node("Mul", ["i", "one"], ["m"]),
         node("ReduceSum", ["m", "ax"], ["y"], keepdims=0)],
        [vi("ids", I64, ["B", 3])], [vi("y", F, ["B", 4])],
        [init("table", np.random.default_rng(0).standard_normal((20, 4)).astype(np.float32)),
         init("one", np.float32(1)), init("ax", np.array([1]))])
    return save(model, tmp_path / "m.onnx")


def test_optimize_prints_the_table_and_saves(model_path):
    result = invoke("optimize", model_path)
    assert result.exit_code == 0, result.output
    out = model_path.with_name("m.opt.onnx")
    assert ops(onnx.load(out)) == ["GatherRows", "SumAxes"]   # the lookup and the sum in ctropt's kernels
    for word in ("eliminate-identity", "rewrites", "max err", "saved"):
        assert word in result.output


def test_quiet_optimize_prints_the_closing_line_and_the_paths_only(model_path, tmp_path):
    """--quiet (for scripts): no progress lines, no table, no cpu/precision lines; the closing line and the files."""
    json_path = tmp_path / "r.json"
    result = invoke("optimize", model_path, "-o", tmp_path / "q.onnx", "--quiet", "--json", json_path)
    assert result.exit_code == 0, result.output
    out = result.output
    for word in ("m.onnx:", "(1/", "eliminate-identity", "max err  ", "cpu:", "precision:"):
        assert word not in out, out
    assert out.index("verified") < out.index("\nsaved ") < out.index("\njson "), out
    assert ops(onnx.load(tmp_path / "q.onnx")) == ["GatherRows", "SumAxes"] and json_path.exists()
    assert "eliminate-identity" in invoke("optimize", model_path, "-o", tmp_path / "l.onnx").output  # not sticky


def test_optimize_named_passes_skip_and_inputs(model_path, tmp_path):
    np.savez(tmp_path / "in.npz", ids=np.array([[0, 19, 3]]))
    result = invoke("optimize", model_path, "-o", tmp_path / "o.onnx", "--passes", "eliminate-identity,fold-constants",
                    "--skip", "fold-constants", "--inputs", tmp_path / "in.npz", "--strict")
    assert result.exit_code == 0, result.output
    assert "fold-constants" not in result.output and "eliminate-identity" in result.output


def test_verify_exit_codes(model_path, tmp_path):
    invoke("optimize", model_path, "-o", tmp_path / "o.onnx")
    ok = invoke("verify", model_path, tmp_path / "o.onnx")
    assert ok.exit_code == 0 and "yes" in ok.output
    changed = onnx.load(tmp_path / "o.onnx")
    table = next(t for t in changed.graph.initializer if t.name == "table")
    table.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(table) + 1, "table"))
    save(changed, tmp_path / "bad.onnx")
    bad = invoke("verify", model_path, tmp_path / "bad.onnx")
    assert bad.exit_code == 1 and "NO" in bad.output
    invoke("optimize", model_path, "-o", tmp_path / "ov.onnx", "--target", "openvino")
    assert invoke("verify", model_path, tmp_path / "ov.onnx", "--backend", "openvino-cpu").exit_code == 0


def test_passes_and_inspect(model_path):
    listing = invoke("passes")
    assert listing.exit_code == 0 and "fold-constants" in listing.output and "cleanup" in listing.output
    report = invoke("inspect", model_path, "--explain")
    assert report.exit_code == 0, report.output
    for word in ("Gather", "embedding tables (1)", "table", "20", "would match", "ids"):
        assert word in report.output


def test_plugin_pass_runs_from_the_cli(model_path, tmp_path):
    plugin = tmp_path / "myplugin.py"
    plugin.write_text(textwrap.dedent('''
        import ctropt
        from ctropt import P, Var, Rewrite

        @ctropt.register_pass("sum-to-mean-times-n", group="fusion")
        def rewrite(ctx):
            """A user's pass: ReduceSum(Mul(x, 1)) -> ReduceSum(x)."""
            ctx.apply(Rewrite("drop-mul", P.Mul(Var("x"), ctropt.Const("one", value=1.0)), lambda m: [m["x"]]))
    '''))
    try:
        listing = invoke("passes", "--plugin", plugin)
        assert "sum-to-mean-times-n" in listing.output
        result = invoke("optimize", model_path, "-o", tmp_path / "p.onnx", "--passes", "sum-to-mean-times-n",
                        "--no-speed-check", "--plugin", plugin)
        assert result.exit_code == 0, result.output
        assert "Mul" not in ops(onnx.load(tmp_path / "p.onnx"))
    finally:  # a pass of `all` left registered would run in every later test's `all`
        ctropt.REGISTRY.pop("sum-to-mean-times-n", None)


def test_plugin_by_dotted_module_name(tmp_path, monkeypatch):
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "passes.py").write_text(textwrap.dedent('''
        import ctropt

        @ctropt.register_pass("user-dotted-noop", group="fusion", default=False)
        def noop(ctx):
            """Does nothing."""
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        result = invoke("passes", "--plugin", "userpkg.passes")
        assert result.exit_code == 0 and "user-dotted-noop" in result.output, result.output
    finally:
        ctropt.REGISTRY.pop("user-dotted-noop", None)


def bad_files(tmp_path):
    truncated = tmp_path / "truncated.onnx"
    data = make_model([node("Relu", ["x"], ["y"])], [vi("x", F, [2])], [vi("y", F, [2])]).SerializeToString()
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\x01not onnx at all")
    new_opset = tmp_path / "new.onnx"
    onnx.save(make_model([node("Relu", ["x"], ["y"])], [vi("x", F, [2])], [vi("y", F, [2])],
                         opset=MAX_ONNX_OPSET + 1), new_opset)
    custom = make_model([node("Relu", ["x"], ["y"])], [vi("x", F, [2])], [vi("y", F, [2])])
    custom.graph.node[0].domain = "com.acme"
    custom.opset_import.append(onnx.helper.make_opsetid("com.acme", 1))
    onnx.save(custom, tmp_path / "custom.onnx")
    unknown_op = make_model([node("Relu", ["x"], ["y"])], [vi("x", F, [2])], [vi("y", F, [2])])
    unknown_op.graph.node[0].op_type = "Frobnicate"
    onnx.save(unknown_op, tmp_path / "unknown_op.onnx")
    (tmp_path / "model.json").write_text('{"name": "a config, not a model"}')
    np.savez(tmp_path / "inputs.npz", x=np.ones(2))
    huge = tmp_path / "huge.onnx"
    with open(huge, "wb") as f:
        f.truncate((2 << 30) + 1)  # sparse file: takes no disk
    return {
        "missing": ([tmp_path / "nope.onnx"], "no such file"),
        "directory": ([tmp_path], "is a directory"),
        "unknown op": ([tmp_path / "unknown_op.onnx"], "unknown ONNX op"),
        "over 2 GB": ([huge], "cannot exceed 2 GiB"),
        "truncated": ([truncated], "truncated"),
        "garbage": ([garbage], "not an ONNX model"),
        "opset": ([new_opset], "newer than supported"),
        "custom domain": ([tmp_path / "custom.onnx"], "custom-op domain"),
        "json": ([tmp_path / "model.json"], "not an ONNX model (onnx reads a .json file as a model in json form"),
        "npz": ([tmp_path / "inputs.npz"], "not an ONNX model"),
    }


@pytest.mark.parametrize("command", ["optimize", "inspect", "verify"])
def test_bad_inputs_are_clear_errors(tmp_path, command):
    """Each bad file is one error line and exit 2 (verify: as either model)."""
    for case, (args, message) in bad_files(tmp_path).items():
        result = invoke(command, *args, *(args if command == "verify" else []))
        assert result.exit_code == 2, (case, result.output)
        assert message in result.output and len(result.output.strip().splitlines()) == 1, (case, result.output)


def test_output_equal_to_input_is_refused_and_input_kept(model_path):
    before = model_path.read_bytes()
    for out in (model_path, model_path.parent / "." / model_path.name):
        result = invoke("optimize", model_path, "-o", out)
        assert result.exit_code == 2 and "is the input file" in result.output
    assert model_path.read_bytes() == before


def test_unknown_pass_target_and_plugin(model_path, tmp_path):
    assert "unknown pass" in invoke("optimize", model_path, "--passes", "nope").output
    assert "unknown target" in invoke("optimize", model_path, "--target", "tpu").output
    assert "cannot load plugin" in invoke("passes", "--plugin", "no_such_module_xyz").output
    assert "cannot read inputs" in invoke("optimize", model_path, "--inputs", tmp_path / "none.npz").output


def test_console_script_has_no_traceback_on_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ctropt", "inspect", str(tmp_path / "nope.onnx")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "no such file" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------------------- the first five minutes (#28)


@pytest.fixture
def residual_path(tmp_path):
    """A model where residual-add-as-sum sees a candidate (an Add) and leaves it: a bias, not a residual."""
    model = make_model([node("Identity", ["x"], ["i"]), node("Add", ["i", "b"], ["a"]), node("Relu", ["a"], ["y"])],
                       [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])], [init("b", np.ones(4, np.float32))])
    return save(model, tmp_path / "r.onnx")


def test_optimize_prints_one_compact_table_and_a_closing_line(residual_path):
    """Each pass once, names whole at 80 columns, a reason for a pass that saw a candidate and left it, the passes
    that found nothing counted, and one closing line with the nodes, the check and the ratio."""
    result = runner.invoke(app, ["optimize", str(residual_path)], catch_exceptions=False, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    progress = [line for line in result.output.splitlines() if re.match(r"\(\d+/\d+\) ", line)]
    out = "\n".join(line for line in result.output.splitlines() if line not in progress)
    assert out.count("eliminate-identity") == 1 and "…" not in out.split("skipped")[0]
    # not on a terminal: a line per pass as it ends, so a long run is never silent
    assert len(progress) == len(ctropt.passes.resolve("all", (), "ort", "cpu"))
    assert progress[0].startswith("(1/") and "eliminate-identity: applied, 3→2 nodes" in " ".join(progress)
    assert "residual-add-as-sum declined: matched 1, declined" in " ".join(out.split())
    assert "a bias, not a residual" in out and "more passes found nothing to do" in out
    text = " ".join(out.split())
    closing = text[text.index("3 → 2 nodes, verified (max err"):]
    assert "× faster on onnxruntime CPU (paired, batch 256, 1 thread" in closing or "× slower on" in closing


def test_infer_shapes_is_not_counted_as_rewrites(residual_path):
    record = next(r for r in ctropt.optimize(onnx.load(residual_path), passes="infer-shapes", speed=False).records)
    assert record.rewrites == 0 and record.notes and "annotated" in record.notes[0]


def test_passes_lists_whole_descriptions_without_markup():
    listing = runner.invoke(app, ["passes"], env={"COLUMNS": "200"}).output
    text = " ".join(listing.split())
    assert "(seed" not in text and "``" not in text and "`" not in text
    assert "concat[q, k, q−k, q·k]" in text or "concat[q, k, q - k, q * k]" in text   # not eaten as markup
    assert "Indicator (multi-hot) columns, OneHot + ReduceSum over the ids, → a scatter-add of ones." in text
    lower = ctropt.REGISTRY["lower-rnn-ort"].description
    assert lower.endswith("rnn_ort_form picks one (kernel, standard, scan, gru-op).") and "\n" not in lower


def test_bench_rows_per_model_the_ratio_in_words_and_bad_batches(model_path, tmp_path):
    invoke("optimize", model_path, "-o", tmp_path / "o.onnx", "--no-speed-check")
    result = runner.invoke(app, ["bench", str(model_path), str(tmp_path / "o.onnx"), "--batch", "2", "--seconds",
                                 "0.2"], catch_exceptions=False, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.split()[:2] == ["2", "A"] for line in lines if line.strip())
    assert any(line.split()[:2] == ["2", "B"] for line in lines if line.strip())
    assert "p50 ms" in result.output and "> 1 means B is faster" in " ".join(result.output.split())
    for bad in ("abc", "0", "1,,x"):
        r = invoke("bench", model_path, "--batch", bad)
        assert r.exit_code == 2 and "error: --batch wants" in r.output, r.output


@pytest.mark.parametrize("args", [["optimize", "{m}", "--batch", "abc"], ["bench"], ["optimize", "{m}", "--nope"],
                                  ["nosuch"], ["bench", "{m}", "--threads", "-1"], ["optimize", "{m}", "--atol", "-1"],
                                  ["verify", "{m}", "{m}", "--rtol", "-0.5"], ["inspect", "{m}", "--top", "0"]])
def test_every_bad_argument_is_one_error_line_and_exit_2(model_path, args):
    """The console script: typer's usage errors get the same contract as every other bad input."""
    argv = [a.replace("{m}", str(model_path)) for a in args]
    result = subprocess.run([sys.executable, "-m", "ctropt", *argv], capture_output=True, text=True,
                            env={**__import__("os").environ, "COLUMNS": "200"})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--help" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------- a newcomer's defects (#52)


def test_option_keys_are_checked(model_path, tmp_path):
    """A typo in --option is one error line naming the closest key and the known ones, before any work."""
    for command in (["optimize", model_path, "-o", tmp_path / "o.onnx"], ["specialize", model_path, "-o", tmp_path]):
        for item, hint in (("ort_kernel=off", "did you mean ort_kernels?"), ("foo=bar", "unknown key (known:")):
            result = invoke(*command, "--option", item)
            assert result.exit_code == 2 and hint in result.output, result.output
            assert "rnn_ort_form" in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "o.onnx").exists()
    listing = " ".join(invoke("passes", "--options").output.split())
    assert all(key in listing for key in PASS_OPTIONS) and "standard ops only" in listing


def test_every_option_key_a_pass_reads_is_documented():
    """Each key read from the options anywhere in ctropt/ has its line in PASS_OPTIONS, and each line is read."""
    texts = [p.read_text() for p in Path(ctropt.__file__).parent.rglob("*.py")]
    aliases = {"options"} | {a for t in texts for a in re.findall(r"(\w+)\s*=\s*(?:ctx|self)\.options\s*$", t, re.M)}
    read = re.compile(rf"\b(?:{'|'.join(aliases)})(?:\.get\(\s*|\[\s*)[\"']([A-Za-z0-9_]+)[\"']")
    keys = {k for t in texts for k in read.findall(t)}
    assert "opt" in aliases and {"ort_kernels", "int8_eval", "calib"} <= keys   # the grep sees its examples
    assert keys - set(PASS_OPTIONS) == set(), "add these keys to ctropt.cli.PASS_OPTIONS with their meaning"
    assert set(PASS_OPTIONS) - keys == set(), "no pass reads these keys any more"
    assert all(meaning and "\n" not in meaning for meaning in PASS_OPTIONS.values())


def test_a_plugin_declares_its_option_keys(model_path, tmp_path, temp_pass):
    seen = {}
    temp_pass("plugin-with-option", lambda ctx: seen.update(ctx.options), default=False,
              options={"plugin_knob": "a plugin's own option"})
    result = invoke("optimize", model_path, "-o", tmp_path / "o.onnx", "--passes", "plugin-with-option",
                    "--no-speed-check", "--option", "plugin_knob=3")
    assert result.exit_code == 0, result.output
    assert seen == {"plugin_knob": 3}


def test_inputs_that_are_not_an_npz(model_path, tmp_path):
    """--inputs model.json: what --inputs takes, not numpy's words about allow_pickle."""
    (tmp_path / "model.json").write_text("{}")
    np.save(tmp_path / "one.npy", np.ones(3))
    np.savez(tmp_path / "objects.npz", ids=np.array([[1, "x"]], dtype=object))
    for name, message in (("model.json", "not an .npz file"), ("one.npy", "not an .npz file"),
                          ("objects.npz", "holds an object array")):
        result = invoke("optimize", model_path, "-o", tmp_path / "o.onnx", "--inputs", tmp_path / name)
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and message in text and "allow_pickle" not in text, text
        assert "an .npz written by numpy.savez(path, NAME=array, ...), one array per input name" in text


def test_version():
    import tomllib

    result = invoke("--version")
    assert result.exit_code == 0 and result.output == f"ctropt {ctropt.__version__}\n"
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert ctropt.__version__ == project["version"]   # one version, said the same in both places


def test_negative_tolerances_and_counts_are_refused(model_path, tmp_path):
    for args in (["optimize", model_path, "--atol", "-1"], ["optimize", model_path, "--rtol", "-1e-3"],
                 ["verify", model_path, model_path, "--atol", "-0.1"], ["inspect", model_path, "--top", "0"]):
        result = invoke(*args)
        assert result.exit_code == 2 and "Invalid value for '--" in result.output, result.output
    assert not model_path.with_name("m.opt.onnx").exists()
    result = invoke("export", "x", "-o", tmp_path / "x.onnx", "--batch", "1,abc")   # was a ValueError
    assert result.exit_code == 2 and "--batch wants comma-separated integers" in result.output, result.output


def help_text(*command) -> str:
    """A command's --help as one line of words, the boxes' borders taken out."""
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())


def test_verify_names_its_two_models(model_path):
    """`verify a.onnx` says what verify needs: RAW then OPTIMIZED (not "Missing argument 'model_b'")."""
    result = subprocess.run([sys.executable, "-m", "ctropt", "verify", str(model_path)], capture_output=True,
                            text=True, env={**__import__("os").environ, "COLUMNS": "200"})
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Missing argument 'OPTIMIZED'; usage: " in result.stderr and "verify [OPTIONS] {RAW} {OPTIMIZED}" in \
        result.stderr, result.stderr
    text = help_text("verify")
    assert "RAW then OPTIMIZED" in text and "what optimize (or pack-inputs, split-strings) made of RAW" in text


def test_unknown_options_suggest_only_close_names(model_path):
    """click suggests by difflib over whole option strings, so the dashes alone make --frob "close" to --rtol;
    the console script keeps the suggestions whose names (dashes off) are close."""
    def error(option):
        result = subprocess.run([sys.executable, "-m", "ctropt", "optimize", str(model_path), option],
                                capture_output=True, text=True, env={**__import__("os").environ, "COLUMNS": "200"})
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr

    assert "No such option: --frob (see" in error("--frob")
    assert "(Possible options: --atol)" in error("--atl")


def test_help_texts_keep_their_brackets():
    """rich markup reads [i] or [batch, width] as a style tag and drops it: help texts escape such brackets."""
    import typer.main
    from rich.text import Text

    assert "a packed [batch, width] input: NAME[i] or NAME[i:j] (deepctr-torch's X)" in help_text("optimize")

    def texts(command):
        yield command.help or ""
        yield from (getattr(p, "help", None) or "" for p in command.params)
        for sub in getattr(command, "commands", {}).values():
            yield from texts(sub)

    eaten = [t for t in texts(typer.main.get_command(app)) if Text.from_markup(t).plain != t.replace("\\[", "[")]
    assert not eaten, "escape the brackets of these help texts (rich.markup.escape)"


def test_tables_keep_numbers_whole_at_80_columns(tmp_path, temp_pass, monkeypatch):
    """Off a terminal rich's width is 80 (COLUMNS) or ctropt's 120: the pass table folds a long name rather than cut
    a node count ("1203→12…") or a speed ("2.0…")."""
    from ctropt import P, Rewrite, Var

    relus = [node("Relu", ["x"], [f"r{i}"]) for i in range(1200)]   # wide: a 1200-deep chain is a RecursionError
    model = make_model([*relus, node("Sum", [f"r{i}" for i in range(1200)], ["s"]), node("Mul", ["s", "one"], ["m"]),
                        node("Relu", ["m"], ["y"])], [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])],
                       [init("one", np.float32(1))])
    path = save(model, tmp_path / "long.onnx")
    name = "a-plugin-pass-with-a-rather-long-name"
    temp_pass(name, lambda ctx: ctx.apply(Rewrite("drop-mul", P.Mul(Var("x"), ctropt.Const("one", value=1.0)),
                                                  lambda m: [m["x"]])), default=False)
    monkeypatch.delenv("COLUMNS", raising=False)
    for columns, whole_name in (("80", False), (None, True)):
        result = runner.invoke(app, ["optimize", str(path), "--passes", name, "--no-speed-check"],
                               catch_exceptions=False, env={"COLUMNS": columns} if columns else {})
        assert result.exit_code == 0, result.output
        table = result.output[result.output.index("rewrites"):result.output.index("1203 → 1202 nodes")]
        assert "1203→1202" in table and "0.0e+00" in table and "…" not in table, table
        assert (name in table) == whole_name, table
        assert max(len(line) for line in table.splitlines()) <= int(columns or 120)


def test_report_and_json_never_overwrite_the_model_or_each_other(model_path, tmp_path):
    """--report and --json, like -o, never go over the input; nor over the model, its .data or each other. An
    existing file is replaced, as -o always has, and the line that names the output says so."""
    out = tmp_path / "o.onnx"
    for args, message in ((["--report", model_path], "is the input file; choose another path (--report)"),
                          (["--json", out], "--json " + str(out) + " is also the path of the model (-o)"),
                          (["--report", tmp_path / "o.onnx.data"], "the model's large tensors (-o)"),
                          (["--report", tmp_path / "r", "--json", tmp_path / "r"], "is also the path of the report")):
        result = invoke("optimize", model_path, "-o", out, "--no-speed-check", *args)
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not out.exists() and not (tmp_path / "r").exists()
    (tmp_path / "r.html").write_text("an earlier report")
    result = invoke("optimize", model_path, "-o", out, "--no-speed-check", "--report", tmp_path / "r.html",
                    "--json", tmp_path / "r.json")
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and f"saved {out}" in text and f"saved {out} (replaced" not in text, text
    assert f"report {tmp_path / 'r.html'} (replaced the file there)" in text and f"json {tmp_path / 'r.json'}" in text
    assert "<html" in (tmp_path / "r.html").read_text()


def test_bench_runs_one_thread_as_optimize_times_unless_told(model_path, tmp_path):
    """bench's default is the speed check's 1 thread (its numbers then compare with optimize's), said in its output."""
    import json

    for args, said, threads in (([], "on ort-cpu, 1 thread", 1), (["--threads", "2"], "on ort-cpu, 2 threads", 2),
                                (["--threads", "0"], "on ort-cpu, the runtime's default threads", 0)):
        result = invoke("bench", model_path, "--batch", "2", "--seconds", "0.1", "--json", tmp_path / "b.json", *args)
        assert result.exit_code == 0 and said in result.output, result.output
        assert json.loads((tmp_path / "b.json").read_text())["threads"] == threads
