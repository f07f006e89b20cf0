"""Layered (Sugiyama-style) layout of a small dataflow drawing, emitted as inline SVG.

Top to bottom like Netron: layers by longest path, long edges broken by dummy points, a few barycenter
sweeps to untangle each layer, then x positions pulled toward the nodes above. Enough for the few dozen
nodes of a changed region; nothing here is meant for a whole model.
"""

from __future__ import annotations

import collections
from html import escape

from .diff import Drawing

NODE_H, LAYER_GAP, NODE_GAP, MARGIN = 36, 34, 14, 10
CHAR_W = 6.6


def _width(op: str, name: str) -> float:
    return max(60.0, min(200.0, 16 + CHAR_W * max(len(op), min(len(_short(name)), 28))))


def _short(name: str, limit: int = 28) -> str:
    return name if len(name) <= limit else "…" + name[-(limit - 1):]


def _layers(ids: list[str], succ: dict[str, list[str]]) -> dict[str, int]:
    """Longest path from the sources (Kahn order); nodes on a cycle, if any, go after the rest."""
    indeg = collections.Counter(d for s in ids for d in succ[s])
    layer = {i: 0 for i in ids}
    queue = collections.deque(i for i in ids if indeg[i] == 0)
    seen = set()
    while queue:
        s = queue.popleft()
        seen.add(s)
        for d in succ[s]:
            layer[d] = max(layer[d], layer[s] + 1)
            indeg[d] -= 1
            if indeg[d] == 0:
                queue.append(d)
    top = max(layer.values(), default=0)
    for i in ids:
        if i not in seen:
            top += 1
            layer[i] = top
    has_pred = {d for s in ids for d in succ[s]}
    for i in ids:  # sources sit just above their first reader
        if succ[i] and i not in has_pred:
            layer[i] = max(layer[i], min(layer[d] for d in succ[i]) - 1)
    return layer


def layout(drawing: Drawing):
    """Positions {id: (x, y, w)}, edge polylines [(points, value, from id, to id)], and the canvas size."""
    ids = [n.id for n in drawing.nodes]
    known = set(ids)
    width = {n.id: _width(n.op, n.name) for n in drawing.nodes}
    pairs: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for s, d, v in drawing.edges:
        if s in known and d in known and s != d:
            pairs[(s, d)].append(v)
    succ: dict[str, list[str]] = {i: [] for i in ids}
    for s, d in pairs:
        succ[s].append(d)
    layer = _layers(ids, succ)
    # Break edges that span several layers into chains of dummy points.
    chains: dict[tuple[str, str], list[str]] = {}
    up: dict[str, list[str]] = collections.defaultdict(list)
    down: dict[str, list[str]] = collections.defaultdict(list)
    for (s, d) in pairs:
        chain = [s]
        lo, hi = sorted((layer[s], layer[d]))
        for k in range(lo + 1, hi):
            dummy = f"\0{s}\0{d}\0{k}"
            layer[dummy], width[dummy] = k, 2.0
            chain.append(dummy)
        chain.append(d)
        chains[(s, d)] = chain
        for a, b in zip(chain, chain[1:]):
            down[a].append(b)
            up[b].append(a)
    rows: dict[int, list[str]] = collections.defaultdict(list)
    for i in ids + [x for c in chains.values() for x in c[1:-1]]:
        rows[layer[i]].append(i)
    depth = max(rows, default=0) + 1
    pos = {i: float(k) for r in rows.values() for k, i in enumerate(r)}
    for sweep in range(6):  # barycenter ordering, alternately down and up
        order = range(1, depth) if sweep % 2 == 0 else range(depth - 2, -1, -1)
        for r in order:
            nbrs = up if sweep % 2 == 0 else down
            rows[r].sort(key=lambda i: (sum(pos[n] for n in nbrs[i]) / len(nbrs[i])) if nbrs[i] else pos[i])
            for k, i in enumerate(rows[r]):
                pos[i] = float(k)
    # x: centres pulled toward the mean centre of the nodes above, keeping order and spacing.
    x: dict[str, float] = {}
    for r in range(depth):
        cursor = MARGIN
        for i in rows[r]:
            want = (sum(x[n] for n in up[i] if n in x) / len(up[i])) if up[i] else cursor + width[i] / 2
            x[i] = max(cursor + width[i] / 2, want)
            cursor = x[i] + width[i] / 2 + NODE_GAP
    canvas_w = max((x[i] + width[i] / 2 for i in x), default=0) + MARGIN
    for r in range(depth):  # centre rows narrower than the canvas when nothing pulls them
        if r == 0 or not any(up[i] for i in rows[r]):
            right = max((x[i] + width[i] / 2 for i in rows[r]), default=0)
            shift = (canvas_w - MARGIN - right) / 2
            for i in rows[r]:
                x[i] += max(0.0, shift) if r == 0 else 0.0
    y = {i: MARGIN + layer[i] * (NODE_H + LAYER_GAP) for i in x}
    placed = {i: (x[i], y[i], width[i]) for i in ids}
    edges = []
    for (s, d), chain in chains.items():
        points = [(x[c], y[c] + (NODE_H if k == 0 else NODE_H / 2)) if c != d else (x[c], y[c])
                  for k, c in enumerate(chain)]
        if layer[s] > layer[d]:  # a back edge (only on a cycle): leave from the top, enter at the bottom
            points = [(x[s], y[s])] + points[1:-1] + [(x[d], y[d] + NODE_H)]
        edges.append((points, ", ".join(pairs[(s, d)]), s, d))
    height = MARGIN * 2 + depth * NODE_H + (depth - 1) * LAYER_GAP
    return placed, edges, (canvas_w, height)


def _path(points) -> str:
    (x0, y0), rest = points[0], points[1:]
    d = [f"M{x0:.1f},{y0:.1f}"]
    px, py = x0, y0
    for (qx, qy) in rest:
        my = (py + qy) / 2
        d.append(f"C{px:.1f},{my:.1f} {qx:.1f},{my:.1f} {qx:.1f},{qy:.1f}")
        px, py = qx, qy
    return " ".join(d)


def to_svg(drawing: Drawing, title: str = "") -> str:
    """The drawing as an inline <svg> element; node groups carry data-name for search."""
    placed, edges, (w, h) = layout(drawing)
    out = [f'<svg class="graph" xmlns="http://www.w3.org/2000/svg" width="{w:.0f}" height="{h:.0f}" '
           f'viewBox="0 0 {w:.0f} {h:.0f}" role="img" aria-label="{escape(title)}">']
    for points, value, _, _ in edges:
        out.append(f'<path class="edge" d="{_path(points)}" marker-end="url(#arrow)"><title>{escape(value)}</title>'
                   "</path>")
    for n in drawing.nodes:
        if n.id not in placed:
            continue
        x, y, nw = placed[n.id]
        label, sub = (n.op, _short(n.name)) if n.role not in ("input", "output") else (n.role, _short(n.name))
        rx = 17 if n.role in ("input", "output") else 4
        body = ' data-body="1"' if n.body is not None else ""
        out.append(f'<g class="node {n.role}" data-name="{escape(n.name)}"{body}>'
                   f'<title>{escape(n.detail or n.name)}</title>'
                   f'<rect x="{x - nw / 2:.1f}" y="{y:.1f}" width="{nw:.1f}" height="{NODE_H}" rx="{rx}"/>'
                   f'<text class="op" x="{x:.1f}" y="{y + 15:.1f}">{escape(label)}'
                   f'{" ⊞" if n.body is not None else ""}</text>'
                   f'<text class="nm" x="{x:.1f}" y="{y + 28:.1f}">{escape(sub)}</text></g>')
    out.append("</svg>")
    return "".join(out)
