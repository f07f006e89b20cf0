"""`ctropt passes`: the registered passes, or the `--option` keys."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.markup import escape

from ..passes import REGISTRY
from .common import PLUGIN, _plugins, _table, _user_errors, app, console
from .options import _known_options

@app.command("passes")
def list_passes(plugin: Optional[List[str]] = PLUGIN,
                options: bool = typer.Option(False, "--options", help="List the --option keys instead.")):
    """List every registered pass (or, with --options, the keys of --option KEY=VALUE)."""
    with _user_errors():
        _plugins(plugin)
        if options:
            table = _table("--option key", "meaning")
            for key, meaning in sorted(_known_options().items()):
                table.add_row(key, escape(meaning))
            console.print(table)
            return
        table = _table("pass", "group", "targets", "in all", "description")
        for p in sorted(REGISTRY.values(), key=lambda p: p.sort_key):
            table.add_row(p.name, p.group, ",".join(p.targets), "yes" if p.default else "opt-in", escape(p.description))
        console.print(table)
