"""The `ctropt` command: optimize, passes, inspect, verify. Errors are messages, never tracebacks.

One module per command (`optimize.py`, `diff.py`, `specialize.py`, `repository.py`, `pack_inputs.py`,
`split_strings.py`, `passes.py`, `inspect.py`, `verify.py`, `export.py`, `bench.py`, `zoo.py`, `kernels.py`), each
adding its command to `common.app`; `common.py` holds what they share, `options.py` the `--option` keys. The commands
are imported here in the order `ctropt --help` lists them. `main` is the console script.
"""

from __future__ import annotations

import sys

from rich.markup import escape

# each module adds its command to the app: in this order, the order of `ctropt --help` and docs/cli.md
from . import (optimize, diff, specialize, repository, pack_inputs, split_strings, passes, inspect, verify,  # noqa: F401
               export, bench, zoo, kernels)
from .common import app, err_console
from .options import PASS_OPTIONS

__all__ = ["PASS_OPTIONS", "app", "main"]


def _usage_message(e) -> str:
    """A usage error in one line; a missing argument with the usage line (what `verify RAW OPTIMIZED` needs)."""
    import difflib

    command = e.ctx.command_path if e.ctx else "ctropt"
    if getattr(e, "possibilities", None):  # click's difflib counts the dashes: --frob "matches" --rtol; not the name
        name = e.option_name.lstrip("-")
        e.possibilities = [p for p in e.possibilities
                           if difflib.SequenceMatcher(None, name, p.lstrip("-")).ratio() >= 0.6]
    message = e.format_message()
    if e.ctx and getattr(getattr(e, "param", None), "param_type_name", "") == "argument":
        message = f"{message.rstrip('.')}; usage: {e.ctx.get_usage().removeprefix('Usage: ')}"
    return f"{message} (see {command} --help)"


def main() -> None:
    """The console script: a bad argument is a one-line `error:` and exit 2, like every other bad input."""
    try:   # typer >= 0.2x bundles its click; older ones use the click package
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    UsageError, NoArgsIsHelpError = exceptions.UsageError, getattr(exceptions, "NoArgsIsHelpError", ())

    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError:   # the help is printed already
        sys.exit(2)
    except UsageError as e:
        err_console.print(f"[bold red]error:[/] {escape(_usage_message(e))}", soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
