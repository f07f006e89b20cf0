"""The pass-by-pass report as one self-contained HTML page: inline CSS, JS and SVG, no network access."""

from __future__ import annotations

import datetime
import os
from html import escape
from pathlib import Path

from .diff import Drawing, ModelDiff, Region
from .layout import to_svg

MAX_LISTED = 2000  # node names listed per pass (searchable even when not drawn)

CSS = """
:root{--rm:#fde4e1;--rm-s:#c0392b;--ad:#e1f5e6;--ad-s:#1e8449;--ch:#fff2cc;--ch-s:#b7950b;--cx:#f3f4f6;--cx-s:#9ca3af}
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1f2937;background:#fafafa}
header{background:#111827;color:#f9fafb;padding:14px 24px}
header h1{font-size:19px;margin:0 0 4px} header .meta{color:#d1d5db;font-size:13px}
main{padding:12px 24px 60px}
.bar{position:sticky;top:0;background:#fafafa;padding:10px 0;z-index:5;border-bottom:1px solid #e5e7eb}
#search{font-size:14px;padding:5px 9px;width:320px;border:1px solid #9ca3af;border-radius:4px}
#hits{margin-left:10px;color:#4b5563}
.timeline{display:flex;gap:2px;margin-top:8px;height:26px}
.timeline a{flex:1 1 0;min-width:12px;border-radius:3px;text-decoration:none;color:#111;font-size:11px;
 overflow:hidden;white-space:nowrap;padding:4px 3px;box-sizing:border-box}
.s-applied{background:#86efac}.s-slower{background:#fde68a}.s-unchanged{background:#e5e7eb;color:#6b7280!important}
.s-rolled-back,.s-failed{background:#fca5a5}.s-skipped{background:#f3f4f6}
.timeline a.hit{outline:3px solid #2563eb}
section.pass{background:#fff;border:1px solid #e5e7eb;border-radius:6px;margin:14px 0;padding:10px 16px}
section.pass.nomatch{opacity:.3}
section.pass>h2{font-size:16px;margin:4px 0}
.badge{display:inline-block;border-radius:10px;padding:0 8px;font-size:12px;margin-left:6px;vertical-align:2px}
.stats{color:#4b5563;font-size:13px} .stats b{color:#111827}
.msg{color:#991b1b} ul{margin:4px 0 4px 18px;padding:0}
table.ops{border-collapse:collapse;font-size:12.5px;margin:6px 0} table.ops td,table.ops th{padding:1px 10px 1px 0;text-align:right}
table.ops td:first-child,table.ops th:first-child{text-align:left}
.up{color:#1e8449}.down{color:#c0392b}
.region{border-top:1px dashed #e5e7eb;padding-top:6px;margin-top:8px}
.region h3{font-size:13.5px;margin:2px 0;font-weight:600}
.sides{display:flex;flex-wrap:wrap;gap:12px 18px;align-items:flex-start}
.side{flex:1 1 auto;max-width:100%;overflow-x:auto;box-sizing:border-box;border:1px solid #f0f0f0;border-radius:4px;padding:4px}
.side>.label{font-size:12px;color:#6b7280}
svg.graph .edge{fill:none;stroke:#6b7280;stroke-width:1.2}
svg.graph text{font:11px system-ui,sans-serif;text-anchor:middle;fill:#111827}
svg.graph text.op{font-weight:600} svg.graph text.nm{fill:#4b5563;font-size:10px}
svg.graph .node rect{stroke-width:1.3}
.node.removed rect{fill:var(--rm);stroke:var(--rm-s)} .node.added rect{fill:var(--ad);stroke:var(--ad-s)}
.node.changed rect{fill:var(--ch);stroke:var(--ch-s)} .node.context rect{fill:var(--cx);stroke:var(--cx-s);stroke-dasharray:3 2}
.node.body rect{fill:#eef2ff;stroke:#6366f1} .node.input rect,.node.output rect{fill:#e0f2fe;stroke:#0284c7}
.node.hit rect{stroke:#2563eb;stroke-width:3.5}
details{margin:4px 0} summary{cursor:pointer;color:#374151}
.legend span{display:inline-block;padding:0 6px;margin-right:6px;border-radius:3px;font-size:12px}
.names{columns:3;font:12px ui-monospace,monospace;list-style:none;margin:4px 0}
.names li.hit{background:#dbeafe}
.muted{color:#6b7280}
"""

JS = """
(function(){
  var box=document.getElementById('search'), hits=document.getElementById('hits');
  var sections=[].slice.call(document.querySelectorAll('section.pass'));
  function run(){
    var q=box.value.trim().toLowerCase(), total=0, passes=0, first=null;
    sections.forEach(function(s){
      var n=0;
      s.querySelectorAll('[data-name]').forEach(function(el){
        var on=q!=='' && el.getAttribute('data-name').toLowerCase().indexOf(q)>=0;
        el.classList.toggle('hit',on); if(on){n++; if(!first) first=el;}
      });
      s.classList.toggle('nomatch',q!=='' && n===0);
      var chip=document.querySelector('.timeline a[href="#'+s.id+'"]');
      if(chip) chip.classList.toggle('hit',q!=='' && n>0);
      total+=n; if(n) passes++;
    });
    hits.textContent=q===''?'':(total+' match'+(total===1?'':'es')+' in '+passes+' pass'+(passes===1?'':'es'));
    return first;
  }
  box.addEventListener('input',run);
  box.addEventListener('keydown',function(e){
    if(e.key!=='Enter') return;
    var el=run(); if(!el) return;
    for(var p=el.parentElement;p;p=p.parentElement){ if(p.tagName==='DETAILS') p.open=true; }
    el.scrollIntoView({block:'center'});
  });
})();
"""


def _fmt_err(value) -> str:
    return "–" if value is None else f"{value:.1e}"


def _drawing_html(d: Drawing | None, label: str, title: str) -> str:
    if d is None:
        return ""
    parts = [f'<div class="side"><div class="label">{label}</div>']
    parts.append(to_svg(d, title) if d.nodes else '<div class="muted">nothing</div>')
    if d.hidden:
        parts.append(f'<div class="muted">… {d.hidden} more nodes not drawn</div>')
    for n in d.nodes:
        if n.body is not None:
            count = len(n.body.nodes) + n.body.hidden
            parts.append(f'<details><summary>{escape(n.op)} \'{escape(n.name)}\' body ({count} nodes)</summary>'
                         f'{to_svg(n.body, n.name + " body")}'
                         + (f'<div class="muted">… {n.body.hidden} more</div>' if n.body.hidden else "")
                         + "</details>")
    parts.append("</div>")
    return "".join(parts)


def _region_html(r: Region) -> str:
    head = (f'<h3>{escape(r.summary)}</h3><div class="muted">{len(r.removed)} removed, {len(r.added)} added, '
            f'{len(r.changed)} rewired</div>')
    if r.rewiring:
        head += ('<details><summary>rewired nodes</summary><ul>'
                 + "".join(f"<li>{escape(w)}</li>" for w in r.rewiring[:30]) + "</ul></details>")
    sides = (f'<div class="sides">{_drawing_html(r.before, "before", "before")}'
             f'{_drawing_html(r.after, "after", "after")}</div>')
    return f'<div class="region">{head}{sides}</div>'


def _regions_html(diff: ModelDiff) -> str:
    """Regions grouped by scope; Loop/Scan/If bodies in collapsible blocks."""
    out, by_scope = [], {}
    drawn = [r for r in diff.regions if r.before is not None]
    for r in drawn:
        by_scope.setdefault(r.scope, []).append(r)
    for scope, regions in by_scope.items():
        inner = "".join(_region_html(r) for r in regions)
        if scope == "main":
            out.append(inner)
        else:
            out.append(f'<details open><summary>inside {escape(scope)} ({len(regions)} region'
                       f'{"" if len(regions) == 1 else "s"})</summary>{inner}</details>')
    if len(diff.regions) > len(drawn):
        out.append(f'<p class="muted">{len(diff.regions) - len(drawn)} more changed regions not drawn '
                   "(every node is in the lists below).</p>")
    return "".join(out)


def _ops_html(diff: ModelDiff) -> str:
    rows = diff.op_delta()
    if not rows:
        return ""
    body = "".join(f'<tr><td>{escape(op)}</td><td>{b}</td><td>{a}</td>'
                   f'<td class="{"up" if a > b else "down"}">{a - b:+d}</td></tr>' for op, b, a in rows[:40])
    more = f'<tr><td class="muted">… {len(rows) - 40} more</td></tr>' if len(rows) > 40 else ""
    return f'<table class="ops"><tr><th>op</th><th>before</th><th>after</th><th>Δ</th></tr>{body}{more}</table>'


def _names_html(diff: ModelDiff) -> str:
    items = [("removed", diff.removed), ("added", diff.added), ("rewired", diff.changed)]
    parts = []
    for label, nodes in items:
        if not nodes:
            continue
        lis = "".join(f'<li data-name="{escape(name)}">{escape(op)} {escape(name)}'
                      + (f' <span class="muted">({escape(scope)})</span>' if scope != "main" else "") + "</li>"
                      for scope, op, name in nodes[:MAX_LISTED])
        more = f'<li class="muted">… {len(nodes) - MAX_LISTED} more</li>' if len(nodes) > MAX_LISTED else ""
        parts.append(f'<details><summary>{len(nodes)} {label} nodes</summary><ul class="names">{lis}{more}</ul></details>')
    inits = [("added", diff.initializers_added), ("removed", diff.initializers_removed),
             ("changed", diff.initializers_changed)]
    if diff.value_types:
        parts.append(f'<p class="muted">dtype/shape recorded for {diff.value_types} values</p>')
    summary = ", ".join(f"{len(v)} {k}" for k, v in inits if v)
    if summary:
        lis = "".join(f"<li>{k}: {escape(n)}</li>" for k, v in inits for n in v[:200])
        parts.append(f'<details><summary>initializers: {summary}</summary><ul class="names">{lis}</ul></details>')
    return "".join(parts)


def _pass_html(i: int, r) -> str:
    status_cls = "s-" + r.status.replace(" ", "-")
    stats = [f"nodes <b>{r.nodes_before} → {r.nodes_after}</b>"]
    if r.seconds:  # a pass run (not a plain two-model diff)
        stats = [f"matches <b>{r.matches}</b>", f"rewrites <b>{r.rewrites}</b>", *stats,
                 f"max abs err <b>{_fmt_err(r.max_abs_err)}</b>", f"time <b>{r.seconds:.2f} s</b>"]
    if getattr(r, "speedup", None):
        stats.append(f"before/after time <b>{r.speedup:.2f}×</b> ({r.speedup_p10:.2f}–{r.speedup_p90:.2f})")
    parts = [f'<section class="pass" id="pass-{i}"><h2>{i}. {escape(r.name)}'
             f'<span class="badge {status_cls}">{escape(r.status)}</span></h2>',
             f'<div class="stats">{" · ".join(stats)}</div>']
    if r.message:
        parts.append(f'<p class="msg">{escape(r.message)}</p>')
    if r.notes:
        parts.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in r.notes[:30]) + "</ul>")
    if getattr(r, "misses", None):
        parts.append('<details><summary>why it did not fire (closest attempts)</summary><ul>'
                     + "".join(f"<li>{escape(m)}</li>" for m in r.misses) + "</ul></details>")
    if r.diff is not None and not r.diff.empty:
        parts.append(_ops_html(r.diff) + _regions_html(r.diff) + _names_html(r.diff))
    parts.append("</section>")
    return "".join(parts)


def render(records, *, title: str, subtitle: str = "") -> str:
    """The whole page for a list of pass records (PassRecord or anything with the same fields)."""
    chips = "".join(f'<a class="s-{r.status.replace(" ", "-")}" href="#pass-{i}" title="{escape(r.name)}: '
                    f'{escape(r.status)}, {r.seconds:.2f} s">{escape(r.name)}</a>'
                    for i, r in enumerate(records, 1))
    legend = ('<div class="legend">'
              '<span style="background:var(--rm)">removed</span><span style="background:var(--ad)">added</span>'
              '<span style="background:var(--ch)">rewired</span><span style="background:var(--cx)">context '
              '(unchanged)</span><span style="background:#e0f2fe">graph input/output</span>'
              '<span style="background:#eef2ff">⊞ has a body (open below the drawing)</span></div>')
    sections = "".join(_pass_html(i, r) for i, r in enumerate(records, 1))
    marker = ('<svg width="0" height="0" style="position:absolute"><defs><marker id="arrow" viewBox="0 0 10 10" '
              'refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
              '<path d="M0,0 L10,5 L0,10 z" fill="#6b7280"/></marker></defs></svg>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{CSS}</style></head><body>'
            f'{marker}<header><h1>{escape(title)}</h1><div class="meta">{escape(subtitle)}</div></header><main>'
            f'<div class="bar"><input id="search" type="search" placeholder="search node name…" '
            f'aria-label="search node name"><span id="hits"></span><nav class="timeline">{chips}</nav></div>'
            f'{legend}{sections}</main><script>{JS}</script></body></html>')


def write_report(path: str | os.PathLike, records, *, title: str, subtitle: str = "") -> Path:
    """Write the page; `subtitle` is a one-line summary (model, target, node counts)."""
    path = Path(path)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    path.write_text(render(records, title=title, subtitle=f"{subtitle} · {stamp}" if subtitle else stamp),
                    encoding="utf-8")
    return path
