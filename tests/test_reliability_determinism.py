"""Resume is exact because no code draws from a global random state: every draw uses a named stream.

This scans the package's source: torch's sampling functions must get ``generator=``, numpy's global
``np.random.*`` functions and the ``random`` module are not used, ``default_rng()`` always gets a seed, and
torch's global seed is only set inside ``torch.random.fork_rng`` (so it is restored afterwards).
"""

from __future__ import annotations

import ast
from pathlib import Path

import fedweave

SRC = Path(fedweave.__file__).parent
TORCH_SAMPLERS = {
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "bernoulli", "multinomial", "normal", "poisson",
}  # fmt: skip
NUMPY_OK = {"default_rng", "Generator", "PCG64", "SeedSequence", "RandomState"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _inside_fork_rng(stack: list[ast.AST]) -> bool:
    for node in stack:
        if isinstance(node, ast.With):
            for item in node.items:
                if isinstance(item.context_expr, ast.Call) and _dotted(item.context_expr.func).endswith("fork_rng"):
                    return True
    return False


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: list[str] = []

    def visit(node: ast.AST, stack: list[ast.AST]) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if "random" in names:
                out.append(f"{path.name}:{node.lineno}: the global 'random' module")
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            kw = {k.arg for k in node.keywords}
            head, _, fn = name.rpartition(".")
            if head == "torch" and fn in TORCH_SAMPLERS and "generator" not in kw:
                out.append(f"{path.name}:{node.lineno}: {name}() without generator=")
            if head in ("np.random", "numpy.random") and fn not in NUMPY_OK:
                out.append(f"{path.name}:{node.lineno}: global {name}()")
            if name.endswith("default_rng") and not node.args and not kw:
                out.append(f"{path.name}:{node.lineno}: default_rng() without a seed")
            if name in ("torch.manual_seed", "torch.random.manual_seed") and not _inside_fork_rng(stack):
                out.append(f"{path.name}:{node.lineno}: torch.manual_seed outside torch.random.fork_rng")
            if name == "torch.seed":
                out.append(f"{path.name}:{node.lineno}: torch.seed() (a non-deterministic seed)")
        for child in ast.iter_child_nodes(node):
            visit(child, [*stack, node])

    visit(tree, [])
    return out


def test_no_global_random_state_in_the_package():
    bad = [v for p in sorted(SRC.rglob("*.py")) for v in _violations(p)]
    assert not bad, "draws outside the named seed streams (fedweave.seeding):\n" + "\n".join(bad)


def test_the_scanner_finds_what_it_looks_for(tmp_path):
    p = tmp_path / "m.py"
    p.write_text(
        "import random\nimport numpy as np\nimport torch\n"
        "a = torch.randn(3)\nb = np.random.choice(3)\nc = np.random.default_rng()\ntorch.manual_seed(1)\n"
        "ok = torch.randn(3, generator=g)\nrng = np.random.default_rng(5)\n"
        "with torch.random.fork_rng(devices=[]):\n    torch.manual_seed(2)\n"
    )
    found = _violations(p)
    assert [v.split(":")[1] for v in found] == ["1", "4", "5", "6", "7"]
