"""The package layers: graph ← patterns ← passes, and runtime beside patterns; no import goes back up."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).parent.parent / "ctropt"
# what each layer may import of ctropt (besides itself)
ALLOWED = {
    "graph": set(),
    "patterns": {"graph"},
    "ops": {"graph"},
    "kernels": {"graph"},
    "runtime": {"graph", "kernels"},
}


def ctropt_imports(path: Path) -> set[str]:
    """The top-level ctropt packages a module imports (relative imports resolved against its package)."""
    package = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1]) + (node.module.split(".") if node.module else [])
                names = [base] if node.module else [base + [a.name] for a in node.names]
            else:
                names = [node.module.split(".")] if node.module else []
            found |= {n[1] for n in names if len(n) > 1 and n[0] == "ctropt"}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("ctropt.")}
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_the_layers_below(layer):
    for path in sorted((PKG / layer).rglob("*.py")):
        wrong = ctropt_imports(path) - ALLOWED[layer] - {layer}
        assert not wrong, f"{path.relative_to(PKG.parent)} imports ctropt.{', ctropt.'.join(sorted(wrong))}"
