"""`ctropt inspect`: ops, interface, embedding tables, recurrent structures and the passes that would match."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from ..graph import interface, load, node_count
from ..passes import resolve
from ..runtime.runnable import check_target
from .common import PLUGIN, TARGET, _plugins, _table, _user_errors, app, console

@app.command()
def inspect(
    model: Path = typer.Argument(..., help="Input .onnx model."),
    target: str = TARGET,
    explain: bool = typer.Option(False, "--explain", help="For passes that would not fire, show the closest miss."),
    top: int = typer.Option(25, "--top", min=1, help="Op histogram rows."),
    plugin: Optional[List[str]] = PLUGIN,
):
    """Show ops, interface, embedding tables, recurrent structures and which passes would match."""
    from .. import inspect as insp
    from ..graph import to_graph

    with _user_errors():
        _plugins(plugin)
        m = load(model)
        check_target(m, target, model.name,
                     "inspect it with --target ort, or the original model with --target openvino")
        opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in m.opset_import)
        console.print(f"[bold]{model}[/]  producer {m.producer_name or '?'} {m.producer_version}  IR {m.ir_version}"
                      f"  opsets: {opsets}  nodes (subgraphs included): {node_count(m)}")
        io = _table("", "name", "dtype", "shape", title="interface")
        import onnx

        for kind, name, elem, dims in interface(m):
            dtype = onnx.TensorProto.DataType.Name(elem) if elem else "?"
            io.add_row(kind, escape(name), dtype, escape("?" if dims is None else str(list(dims))))
        console.print(io)
        counts = insp.op_counts(m)
        ops = _table("op", "count", numbers=("count",), title=f"ops ({len(counts)} types)")
        for op, n in counts[:top]:
            ops.add_row(op, str(n))
        if len(counts) > top:
            ops.add_row(f"... {len(counts) - top} more", str(sum(n for _, n in counts[top:])))
        console.print(ops)
        graph = to_graph(m)
        tables = insp.embedding_tables(graph)
        emb = _table("table", "rows", "width", "lookups", "via", "taken by", numbers=("rows", "width", "lookups"),
                     title=f"embedding tables ({len(tables)})")
        for t in tables:
            emb.add_row(escape(t.name), str(t.rows), str(t.width), str(t.lookups), t.ops, t.taken_by or "-")
        console.print(emb)
        found = insp.ctr_structures(graph)
        kinds = collections.Counter(f.kind for f in found)
        ct = _table("kind", "where", "detail",
                    title="CTR structures (" + (", ".join(f"{k} ×{n}" for k, n in kinds.items()) or "none") + ")")
        for f in found[:top]:
            ct.add_row(f.kind, escape(f.where), escape(f.detail))
        if len(found) > top:
            ct.add_row("...", f"{len(found) - top} more", "")
        console.print(ct)
        rec = insp.recurrent_structures(graph)
        rt = _table("kind", "where", "detail", title=f"recurrent structures ({len(rec)})")
        for r in rec:
            rt.add_row(r.kind, escape(r.where), escape(r.detail))
        console.print(rt)
        previews = insp.preview_passes(m, resolve("all", (), target), target, explain)
        pt = _table("pass", "matches", "rewrites", "notes", numbers=("matches", "rewrites"),
                    title=f"passes that would match (target {target}, dry run)")
        for p in previews:
            pt.add_row(p.name, str(p.matches), str(p.rewrites), escape("; ".join(p.notes + p.misses)))
        console.print(pt)
