"""The pass-by-pass diff: regions and drawings (diff), the terminal tree, the HTML page, and the CLI commands."""

import html.parser
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from rich.console import Console
from typer.testing import CliRunner

import ctropt
from ctropt.cli import app
from ctropt.graph import load, save
from ctropt.report import diff_models, render
from ctropt.report.layout import layout
from ctropt.report.terminal import print_model_diff, print_pass_diffs
from helpers import F, I64, init, make_model, node, run_pass, vi

ROOT = Path(__file__).parent
RNG = np.random.default_rng(0)


def _w(k, n):
    return RNG.normal(size=(k, n)).astype(np.float32)


def fc_model():
    """x → MatMul → Add → Relu → MatMul → y, plus a Sigmoid reading the first layer."""
    return make_model(
        [node("MatMul", ["x", "w1"], ["m1"], name="fc1/MatMul"), node("Add", ["m1", "b1"], ["a1"], name="fc1/Add"),
         node("Relu", ["a1"], ["r1"], name="fc1/Relu"), node("MatMul", ["r1", "w2"], ["y"], name="fc2/MatMul"),
         node("Sigmoid", ["r1"], ["z"], name="side")],
        [vi("x", F, ["B", 8])], [vi("y", F, ["B", 4]), vi("z", F, ["B", 16])],
        [init("w1", _w(8, 16)), init("b1", _w(1, 16)[0]), init("w2", _w(16, 4))])


def test_fusion_is_one_region_with_both_drawings():
    before = fc_model()
    after, _ = run_pass(before, "fuse-fc")
    d = diff_models(before, after)
    assert {(s, op) for s, op, _ in d.removed} == {("main", "MatMul"), ("main", "Add"), ("main", "Relu")}
    assert [op for _, op, _ in d.added].count("Gemm") == 1
    assert len(d.regions) == 1
    region = d.regions[0]
    assert region.summary.startswith("MatMul, Add, Relu → Gemm")
    roles = {n.name: n.role for n in region.before.nodes}
    assert roles["fc1/MatMul"] == "removed" and roles["fc2/MatMul"] in ("context", "changed")
    assert roles["side"] in ("context", "changed") and roles["x"] == "input"
    edges = {(s, t) for s, t, _ in region.before.edges}
    assert ("fc1/MatMul", "fc1/Add") in edges and ("in:x", "fc1/MatMul") in edges
    assert {n.role for n in region.after.nodes} >= {"added", "input"}
    assert dict((op, (b, a)) for op, b, a in d.op_delta())["Gemm"] == (0, 1)
    assert diff_models(after, after).empty


def test_separate_changes_are_separate_regions_and_rewiring_is_described():
    model = make_model(
        [node("Add", ["x", "c1"], ["a"], name="left"), node("Mul", ["x", "c2"], ["b"], name="right"),
         node("Identity", ["a"], ["ia"], name="id_a"), node("Identity", ["b"], ["ib"], name="id_b"),
         node("Relu", ["ia"], ["y1"], name="relu"), node("Sigmoid", ["ib"], ["y2"], name="sigmoid")],
        [vi("x", F, ["B", 4])], [vi("y1", F, ["B", 4]), vi("y2", F, ["B", 4])],
        [init("c1", np.ones(4, np.float32)), init("c2", np.ones(4, np.float32) * 2)])
    after, _ = run_pass(model, "eliminate-identity")
    d = diff_models(model, after)
    assert sorted(name for _, _, name in d.removed) == ["id_a", "id_b"]
    assert sorted(name for _, _, name in d.changed) == ["relu", "sigmoid"]
    assert [r.summary for r in d.regions] == ["Identity → nothing (+1 rewired)"] * 2  # x is an input: no link
    assert d.regions[0].rewiring == ["Relu 'relu': input 0 'ia' → 'a'"]
    model.graph.initializer[1].CopyFrom(init("c2", np.ones(4, np.float32)))
    deduped, _ = run_pass(model, "dedup-initializers")
    d2 = diff_models(model, deduped)
    assert d2.initializers_removed in (["c1"], ["c2"]) and not d2.removed
    assert d2.regions and d2.regions[0].summary.startswith("rewired")


def _loop_model():
    body = helper.make_graph(
        [node("Identity", ["v"], ["vi"], name="body/id"), node("Add", ["vi", "one"], ["v_out"], name="body/add"),
         node("Identity", ["cond"], ["cond_out"], name="body/cond")],
        "body", [vi("i", I64, []), vi("cond", onnx.TensorProto.BOOL, []), vi("v", F, ["B", 4])],
        [vi("cond_out", onnx.TensorProto.BOOL, []), vi("v_out", F, ["B", 4])])
    return make_model([node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)],
                      [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])],
                      [init("n", np.array(3, np.int64)), init("one", np.float32(1))])


def test_changes_inside_a_loop_body_carry_their_scope():
    model = _loop_model()
    after, _ = run_pass(model, "eliminate-identity")
    d = diff_models(model, after)
    assert ("main/Loop 'loop'.body", "Identity", "body/id") in d.removed
    assert all(r.scope == "main/Loop 'loop'.body" for r in d.regions)


def test_a_vanished_loop_is_drawn_with_its_body():
    model = load(ROOT / "data" / "keras_gru_tf2onnx.onnx")
    after, ctx = run_pass(model, "fuse-rnn")
    assert ctx.rewrites
    d = diff_models(model, after)
    loops = [n for r in d.regions for n in r.before.nodes if n.op == "Loop" and n.role == "removed"]
    assert loops and all(n.body is not None and n.body.nodes for n in loops)
    body_ops = {n.op for n in loops[0].body.nodes}
    assert {"MatMul", "Sigmoid"} <= body_ops
    assert any(scope != "main" for scope, _, _ in d.removed)  # body nodes are counted as removed


def test_layout_is_layered_and_inside_the_canvas():
    before = fc_model()
    after, _ = run_pass(before, "fuse-fc")
    drawing = diff_models(before, after).regions[0].before
    placed, edges, (w, h) = layout(drawing)
    y = {k: v[1] for k, v in placed.items()}
    for s, t, _ in drawing.edges:
        assert y[s] < y[t], (s, t)  # every edge points down
    for x0, y0, nw in placed.values():
        assert 0 <= x0 - nw / 2 and x0 + nw / 2 <= w and 0 <= y0 <= h
    rows = {}
    for k, (x0, y0, nw) in placed.items():
        rows.setdefault(y0, []).append((x0 - nw / 2, x0 + nw / 2))
    for spans in rows.values():  # no two boxes of a row overlap
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert len(edges) == len({(s, t) for s, t, _ in drawing.edges})


def test_manager_records_diffs_misses_and_the_attempt_of_a_rolled_back_pass():
    @ctropt.register_pass("test-break-relu", group="fusion", default=False)
    def break_relu(ctx):
        """Turn Relu into Sigmoid (wrong on purpose)."""
        for n in ctx.graph.nodes:
            if n.op == "Relu":
                n.op = "Sigmoid"
                ctx.rewrites += 1

    try:
        model = make_model([node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["a"]),
                            node("Relu", ["a"], ["y"])],
                           [vi("x", F, [2, 4])], [vi("y", F, [2, 3])],
                           [init("w", _w(4, 3)), init("b", _w(2, 3))])  # a [2, 3] bias: not per column
        result = ctropt.optimize(model, passes=["fuse-fc", "test-break-relu"], speed=False)
        fc, broken = result.records
        assert fc.status == "unchanged" and fc.diff is None
        assert "fc+bias+act: matched 1, declined: 'Relu_y' (the Add is not a per-column bias)" in fc.misses
        assert broken.status == "rolled back" and broken.diff is not None
        assert [op for _, op, _ in broken.diff.removed] == ["Relu"]  # same name, other op: a node replaced
        assert [op for _, op, _ in broken.diff.added] == ["Sigmoid"]
    finally:
        ctropt.REGISTRY.pop("test-break-relu")


def wide_model(branches=400):
    """A 5,000-node graph: `branches` feature branches of Gather → MatMul → Add → Relu → ... → Concat."""
    nodes, inits = [], [init("table", RNG.normal(size=(50, 8)).astype(np.float32))]
    outs = []
    for i in range(branches):
        nodes += [node("Gather", ["table", f"i{i}"], [f"e{i}"], name=f"f{i}/lookup", axis=0),
                  node("Identity", [f"e{i}"], [f"id{i}"], name=f"f{i}/identity"),
                  node("MatMul", [f"id{i}", f"w{i}"], [f"m{i}"], name=f"f{i}/MatMul"),
                  node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"f{i}/Add"),
                  node("Relu", [f"a{i}"], [f"r{i}"], name=f"f{i}/Relu"),
                  node("Mul", [f"r{i}", "half"], [f"h{i}"], name=f"f{i}/scale"),
                  node("Sigmoid", [f"h{i}"], [f"s{i}"], name=f"f{i}/gate"),
                  node("Mul", [f"s{i}", f"h{i}"], [f"g{i}"], name=f"f{i}/gated"),
                  node("ReduceSum", [f"g{i}", "ax"], [f"o{i}"], name=f"f{i}/sum", keepdims=1),
                  node("Tanh", [f"o{i}"], [f"t{i}"], name=f"f{i}/tanh"),
                  node("Neg", [f"t{i}"], [f"n{i}"], name=f"f{i}/neg"),
                  node("Abs", [f"n{i}"], [f"q{i}"], name=f"f{i}/abs")]
        inits += [init(f"w{i}", _w(8, 4)), init(f"b{i}", _w(1, 4)[0])]
        outs.append(f"q{i}")
    nodes.append(node("Concat", outs, ["y"], name="concat", axis=1))
    inits += [init("half", np.float32(0.5)), init("ax", np.array([1]))]
    return make_model(nodes, [vi(f"i{i}", I64, ["B"]) for i in range(branches)], [vi("y", F, ["B", branches])],
                      inits)


def test_terminal_tree_summarises_a_5000_node_graph():
    model = wide_model()
    assert sum(1 for _ in model.graph.node) > 4800
    result = ctropt.optimize(model, passes=["eliminate-identity", "fuse-fc"], batch=2, speed=False)
    assert [r.status for r in result.records] == ["applied", "applied"]
    console = Console(record=True, width=120)
    print_pass_diffs(console, result.records)
    text = console.export_text()
    assert len(text.splitlines()) < 20, text
    assert "×400  MatMul, Add, Relu → Gemm, Relu" in text and "(400 regions)" in text
    assert "×400  Identity → nothing" in text
    console = Console(record=True, width=120)
    print_model_diff(console, diff_models(model, result.model), "a.onnx", "b.onnx")
    assert len(console.export_text().splitlines()) < 30
    page = render(result.records, title="wide")
    assert page.count('class="region"') <= 2 * 40  # regions drawn are capped; every node is still listed
    assert page.count('<li data-name="f') >= 400 * 4
    assert len(page) < 3_000_000


class _Tags(html.parser.HTMLParser):
    VOID = {"meta", "input", "br", "img", "rect", "path", "marker"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.tags = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append((tag, list(self.stack[-3:])))
        else:
            self.stack.pop()


def test_page_is_self_contained_and_well_formed():
    before = _loop_model()
    result = ctropt.optimize(fc_model(), passes=["fuse-fc", "fuse-rnn"], speed=False)
    page = render(result.records, title="t <&> title")
    parser = _Tags()
    parser.feed(page)
    assert not parser.errors and not parser.stack
    for tag, attrs in parser.tags:  # nothing is fetched: no src, no external links or stylesheets
        assert "src" not in attrs, tag
        assert not attrs.get("href", "#").startswith(("http", "//")), attrs
    assert not re.search(r"url\((?!#)|@import|https?://(?!www\.w3\.org/2000/svg)", page)
    assert "t &lt;&amp;&gt; title" in page
    assert page.count('<section class="pass"') == 2 and 'data-name="fc1/MatMul"' in page
    assert diff_models(before, before).empty


runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


def test_cli_show_diff_report_and_diff(tmp_path):
    src = save(fc_model(), tmp_path / "m.onnx")
    r = invoke("optimize", src, "--show-diff", "--report", tmp_path / "r.html", "--bench-passes", "--batch", "4")
    assert r.exit_code == 0, r.output
    assert "fuse-fc applied" in r.output and "MatMul, Add, Relu → Gemm" in r.output
    page = (tmp_path / "r.html").read_text()
    assert "fuse-fc" in page and "<svg" in page and "before/after time" in page
    r = invoke("diff", src, tmp_path / "m.opt.onnx", "--report", tmp_path / "d.html")
    assert r.exit_code == 0 and "Gemm" in r.output and "changed regions" in r.output
    assert "MatMul, Add, Relu → Gemm" in (tmp_path / "d.html").read_text()
    original = src.read_bytes()
    for args in (("optimize", src, "--report", src), ("diff", src, tmp_path / "m.opt.onnx", "--report", src)):
        r = invoke(*args)
        assert r.exit_code == 2 and "is the input file" in r.output
    assert src.read_bytes() == original
    r = invoke("diff", src, tmp_path / "missing.onnx")
    assert r.exit_code == 2 and "error" in r.output


@pytest.mark.parametrize("fixture", ["thirdparty/deepctr_torch_DIEN_AUGRU_padded_legacy.onnx",
                                     "thirdparty/torchrec_dlrm_dynamo.onnx"])
def test_reports_on_third_party_exports(fixture, tmp_path):
    model = load(ROOT / "data" / fixture)
    result = ctropt.optimize(model, passes="all", verify=False, speed=False)
    applied = [r for r in result.records if r.status == "applied"]
    assert applied and all(r.diff is not None for r in applied)
    page = render(result.records, title=fixture)
    parser = _Tags()
    parser.feed(page)
    assert not parser.errors
    assert page.count('<section class="pass"') == len(result.records)
