"""The README's and docs/*.md's commands and config snippets hold as a newcomer copies them (the generated
reproduction pages aside): every YAML block is a valid config, every ``fedweave run`` line names a config that
exists and overrides it validly, no command of a page writes into a run directory that an earlier command of
the same page filled (the run would be refused), the two algorithm classes shown as code are the code, and
docs/models.md's examples and docs/tasks.md's plug-in run. docs/extending.md's examples and docs/tasks.md's
first one are executed by their own tests."""

from __future__ import annotations

import re
import shlex
import sys
import types
from pathlib import Path

import pytest
import yaml

import fedweave
from fedweave.config import load

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "reproductions" not in p.parts)]
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", flags=re.S | re.M)
# a fragment is checked inside this run (a sections' key replaces the base's)
BASE = {
    "rounds": 2,
    "dataset": {"name": "digits"},
    "partition": {"name": "iid", "num_clients": 10},
    "model": {"name": "logistic"},
    "algorithm": {"name": "fedavg", "clients_per_round": 4},
    "output": {"progress": False, "plots": False},
}


def blocks(page: Path, *langs: str) -> list[tuple[int, str]]:
    """The page's fenced blocks in these languages: (line of the fence, text)."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(3)) for m in FENCE.finditer(text) if m.group(2) in langs]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


YAML_BLOCKS = [(f"{name(p)}:{line}", code) for p in PAGES for line, code in blocks(p, "yaml")]


def test_the_pages_have_yaml_blocks():
    assert len(YAML_BLOCKS) >= 10


@pytest.mark.parametrize("code", [c for _, c in YAML_BLOCKS], ids=[i for i, _ in YAML_BLOCKS])
def test_a_yaml_block_is_a_valid_config(code):
    data = yaml.safe_load(code)
    load(data if "dataset" in data else {**BASE, **data})


def commands(page: Path) -> list[tuple[int, list[str]]]:
    """Each shell command of the page's unlabelled and shell blocks, and each ``fedweave.run("PATH", ...)`` of
    its Python blocks, in the page's order: (line, argv); a Python call is ``["python", PATH, run_dir?]``."""
    out = []
    text = page.read_text(encoding="utf-8")
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if m.group(2) == "python":
            for call in re.finditer(r'fedweave\.run\(\s*"([^"]+)"(.*?)\)\n', m.group(3), flags=re.S):
                out.append((line, ["python", call.group(1), "run_dir=" in call.group(2)]))
        elif m.group(2) in ("", "bash", "sh"):
            for cmd in m.group(3).replace("\\\n", " ").splitlines():
                for part in cmd.split("&&"):
                    try:
                        argv = shlex.split(part, comments=True)
                    except ValueError:  # a formula or an output listing, not a command
                        continue
                    if argv[:1] in (["fedweave"], ["make"]):
                        out.append((line, argv))
    return out


def run_line(argv: list[str]) -> tuple[str | None, list[str], str | None, bool]:
    """A ``fedweave run`` line's config, overrides, --out and whether it replaces or resumes a run."""
    config, overrides, out, keeps = None, [], None, False
    args = iter(argv[2:])
    for a in args:
        if a in ("--out", "--plugin"):
            value = next(args)
            out = value if a == "--out" else out
        elif a in ("--overwrite", "--resume"):
            keeps = True
        elif a.startswith("--"):
            continue
        elif config is None:
            config = a
        else:
            overrides.append(a)
    return config, overrides, out, keeps


RUN_LINES = [
    (f"{name(p)}:{line}", argv) for p in PAGES for line, argv in commands(p) if argv[:2] == ["fedweave", "run"]
]


def test_the_pages_have_run_lines():
    assert len(RUN_LINES) >= 20


@pytest.mark.parametrize("argv", [a for _, a in RUN_LINES], ids=[i for i, _ in RUN_LINES])
def test_a_run_line_names_a_config_that_exists_and_its_overrides_load(argv):
    config, overrides, _, _ = run_line(argv)
    if config is None or config.isupper() or "--resume" in argv:  # the synopsis' CONFIG; a resume's RUN_DIR
        return
    if not config.startswith("example:"):
        assert (ROOT / config).is_file(), f"{config} does not exist"
        config = str(ROOT / config)
    load(config, overrides)


def written(argv: list[str]) -> tuple[str | None, bool]:
    """The run directory a page's command writes (None: a new one each time) and whether it may replace it."""
    if argv[:2] == ["make", "demo"]:  # the Makefile: fedweave run configs/demo.yaml --overwrite
        return load(str(ROOT / "configs/demo.yaml")).output.dir, True
    if argv[0] == "python":
        return (None, True) if argv[2] else (load(str(ROOT / argv[1])).output.dir, False)
    if argv[:2] != ["fedweave", "run"]:
        return None, True
    config, overrides, out, keeps = run_line(argv)
    if out is None and config is not None and not config.isupper() and "--resume" not in argv:
        path = config if config.startswith("example:") else str(ROOT / config)
        out = load(path, overrides).output.dir
    return out, keeps


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_no_command_of_a_page_writes_into_a_run_an_earlier_one_filled(page):
    """Run in the page's order, a second run into the same directory is refused (it holds a finished run):
    each command names its own --out / run_dir, or --overwrite / --resume where it means to."""
    filled: dict[str, int] = {}
    for line, argv in commands(page):
        where, replaces = written(argv)
        if where is None:
            continue
        assert replaces or where not in filled, (
            f"{name(page)}:{line}: {' '.join(map(str, argv))} writes {where}, which line {filled.get(where)} filled"
        )
        filled.setdefault(where, line)


def test_architecture_md_shows_fedprox_whole():
    """'FedProx, whole:' is the class in fedprox.py, line for line."""
    [block] = [c for _, c in blocks(ROOT / "docs/architecture.md", "python") if "class FedProx(" in c]
    assert block in (ROOT / "src/fedweave/algorithms/centralized/fedprox.py").read_text(encoding="utf-8")


def test_the_readme_algorithm_runs_and_is_fedavg(tmp_path, monkeypatch):
    """The README's algorithm class, registered under another name, is built and runs FedAvg's numbers."""
    from fedweave.algorithms.centralized.base import Collected, StarAlgorithm
    from fedweave.registry import ALGORITHMS

    [code] = [c for _, c in blocks(ROOT / "README.md", "python") if "@ALGORITHMS.register" in c]
    monkeypatch.setattr(ALGORITHMS, "_items", dict(ALGORITHMS._items))
    module = types.ModuleType("readme_algorithm")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    module.__dict__.update(torch=__import__("torch"), StarAlgorithm=StarAlgorithm, Collected=Collected)
    register = ALGORITHMS.register
    module.ALGORITHMS = types.SimpleNamespace(register=lambda n: register(f"{n}_readme"))
    exec(compile(code, "README.md", "exec", dont_inherit=True), module.__dict__)
    cfg = {**BASE, "local": {"steps": 3, "batch_size": 16, "lr": 0.1}}
    mine = fedweave.run({**cfg, "algorithm": {**BASE["algorithm"], "name": "fedavg_readme"}}, run_dir=tmp_path / "a")
    ref = fedweave.run(cfg, run_dir=tmp_path / "b")
    assert [r["test_loss"] for r in mine.metrics] == [r["test_loss"] for r in ref.metrics]


@pytest.mark.parametrize("code", [c for _, c in blocks(ROOT / "docs/models.md", "python")])
def test_a_models_md_example_runs_as_written(code):
    exec(compile(code, "docs/models.md", "exec", dont_inherit=True), {"__name__": "models_example"})


def test_the_tasks_md_plugin_registers_its_loss_for_a_config(tmp_path, monkeypatch):
    """docs/tasks.md's myplugin.py, as written, named by a config's ``plugins`` and its loss by ``task.loss``."""
    from fedweave.registry import LOSSES

    [code] = [c for _, c in blocks(ROOT / "docs/tasks.md", "python") if c.startswith("# myplugin.py")]
    (tmp_path / "myplugin.py").write_text(code, encoding="utf-8")
    monkeypatch.setattr(LOSSES, "_items", dict(LOSSES._items))  # the loss it registers is forgotten after
    monkeypatch.chdir(tmp_path)  # a plug-in file is found relative to the working directory
    cfg = {**BASE, "dataset": {"name": "diabetes"}, "plugins": ["myplugin.py"], "task": {"loss": "l1"}}
    res = fedweave.run(cfg, run_dir=tmp_path / "run")
    assert res.summary["main_metric"] == "test_mse" and "l1" in LOSSES.names()


def test_architecture_md_layer_table_is_the_layers_contract():
    """The table of layers, top-down, names every module of each layer of pyproject.toml's layers contract
    (which is exhaustive), with ``|`` where that contract makes the modules independent siblings."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    [layers] = [c["layers"] for c in contracts["contracts"] if c["id"] == "layers"]
    expected = [(set(re.split(r"\s*[|:]\s*", layer)), "|" in layer) for layer in layers]
    modules = {p.stem for p in (ROOT / "src/fedweave").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    text = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    table = text.split("| layer | modules |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines():
        cell = line.split("|", 2)[2]  # the modules column (an escaped \| separates independent siblings)
        rows.append(({m for m in re.findall(r"`([\w.]+)`", cell) if m in modules}, "\\|" in cell))
    assert rows == expected


def test_architecture_md_states_the_faults_the_star_template_declares():
    """'The star template ... declares `(...)`' is ``StarAlgorithm.handles_faults``."""
    import ast

    from fedweave.algorithms.centralized.base import StarAlgorithm

    text = re.sub(r"\s+", " ", (ROOT / "docs/architecture.md").read_text(encoding="utf-8"))
    [stated] = re.findall(r"The star template does this for every centralized method \(it declares `([^`]+)`[:)]", text)
    assert ast.literal_eval(stated) == StarAlgorithm.handles_faults


def test_the_readme_states_when_auto_on_a_gpu_picks_loop():
    """``backend: auto`` on a GPU picks ``vmap`` only for a model it can batch: the README says which it
    does not (torch's recurrent modules, batch norm), and those get ``loop``."""
    import torch

    from fedweave.execution import choose_backend
    from fedweave.models import build_model

    for model in (torch.nn.LSTM(4, 8), build_model("cnn_small", (1, 28, 28), 10, norm="batch")):
        assert choose_backend("auto", model, jobs_per_call=10, device="cuda") == "loop"
    assert choose_backend("auto", build_model("cnn_small", (1, 28, 28), 10), jobs_per_call=10, device="cuda") == "vmap"
    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text(encoding="utf-8"))
    [bullet] = re.findall(r"`backend: auto` on a GPU picks `vmap` from 2 clients per call (.*?); `pool`", text)
    assert "`nn.LSTM`" in bullet and "batch norm" in bullet


def test_development_md_names_every_upper_bound_of_pyproject():
    """docs/development.md says where pyproject.toml bounds a dependency from above: every requirement with an
    upper bound (the dependencies' and the extras') is named there with its bound."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(r for extra in extras for r in extra)]
    bounded = {re.sub(r"\[.*\]", "", r) for r in requirements if "<" in r}
    assert bounded, "pyproject.toml has no upper bound: the test would check nothing"
    text = re.sub(r"\s+", " ", (ROOT / "docs/development.md").read_text(encoding="utf-8"))
    stated = set(re.findall(r"`([\w-]+[><=][^`]*<[^`]+)`", text))
    assert bounded <= stated, f"not stated: {sorted(bounded - stated)}"


def test_the_readme_says_the_backends_agree_to_float_rounding(tmp_path):
    """The same seed on loop and vmap gives the same numbers to float rounding, not always bit for bit (as
    docs/architecture.md says: vmap batches the clients' arithmetic); the README's 'Reproducible' claim says so
    too."""
    cfg = {**BASE, "local": {"steps": 3, "batch_size": 16, "lr": 0.1}}
    loop, vmap = (
        [r["test_loss"] for r in fedweave.run({**cfg, "backend": b}, run_dir=tmp_path / b).metrics]
        for b in ("loop", "vmap")
    )
    assert loop == pytest.approx(vmap, rel=1e-6)
    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text(encoding="utf-8"))
    [claim] = re.findall(r"\*\*Reproducible\*\*: (.*?)\.", text)
    assert "float rounding" in claim


def test_development_md_lists_every_page_of_the_api_reference():
    """'one page per public module (...)': each page of docs/api/ is in the list (by its module's word)."""
    words = {"fedweave": "top level", "registry": "registries", "algorithms": "algorithm bases", "robust": "robust"}
    text = re.sub(r"\s+", " ", (ROOT / "docs/development.md").read_text(encoding="utf-8"))
    [listed] = re.findall(r"one page per public module \((.*?)\);", text)
    pages = sorted(p.stem for p in (ROOT / "docs/api").glob("*.rst") if p.stem != "index")
    assert [p for p in pages if words.get(p, p) not in listed] == []


@pytest.mark.parametrize("task", [{}, {"metrics": ["accuracy", "top3"]}], ids=["default", "top3"])
def test_tasks_md_names_the_worst_client_column_personal_evaluation_writes(task, tmp_path):
    """docs/tasks.md's column of the worst client under eval.personal_test is the one a run writes: under the
    default task ``test_accuracy_min``, under another ``test_<main>_worst``."""
    cfg = {**BASE, "algorithm": {"name": "dfedavg"}, "eval": {"personal_test": True}, "task": task}
    columns = set(fedweave.run(cfg, run_dir=tmp_path / "run").metrics[-1])
    [worst] = [c for c in columns if c.endswith(("_min", "_worst")) and c.startswith("test_")]
    text = re.sub(r"\s+", " ", (ROOT / "docs/tasks.md").read_text(encoding="utf-8"))
    assert f"`{worst.replace('test_accuracy_worst', 'test_<main>_worst')}`" in text


def test_reliability_md_lists_every_file_a_run_writes():
    """The bad-input table's ``--overwrite`` row lists the files a run writes: every name and pattern of
    ``fedweave.results.RUN_OUTPUTS`` (an asynchronous run's ``events.csv`` and ``*_vs_sim_time.png`` too)."""
    from fedweave.results import RUN_OUTPUT_DIRS, RUN_OUTPUTS

    [row] = [line for line in (ROOT / "docs/reliability.md").read_text(encoding="utf-8").splitlines() if
             line.startswith("| `--overwrite` into a directory that holds any file no run writes")]  # fmt: skip
    listed = set(re.findall(r"`([^`]+)`", row.split("the files a run writes are", 1)[1]))
    assert set(RUN_OUTPUTS) - listed == set()
    assert {f"{d}/" for d in RUN_OUTPUT_DIRS} - listed == set()


def test_robustness_md_names_the_centralized_methods_that_refuse_byzantine_clients():
    """'`faults.byzantine` is handled by the centralized family (...)': the parenthesis names every centralized
    method that does not declare the fault (FedAsync and FedBuff among them), which refuses it in one line."""
    from fedweave.registry import ALGORITHMS

    text = re.sub(r"\s+", " ", (ROOT / "docs/robustness.md").read_text(encoding="utf-8"))
    [stated] = re.findall(r"`faults\.byzantine` is handled by the centralized family \(([^)]*)\)", text)
    shipped = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).__module__.startswith("fedweave.")]  # not tests'
    refusing = {
        n
        for n in shipped
        if ALGORITHMS.get(n).family == "centralized" and "byzantine" not in ALGORITHMS.get(n).handles_faults
    }
    assert refusing - set(re.findall(r"`(\w+)`", stated)) == set()


def test_the_out_options_help_names_the_config_key_that_comes_before_its_default():
    from fedweave.cli import parser

    # before: "default: runs/<name>-s<seed>-<time>" and "default runs/sweep", while a config's output.dir (a
    # sweep section's out) is where the run (the sweep) goes when --out is not given, as configs/demo.yaml's
    # runs/demo does
    sub = next(a for a in parser()._actions if a.dest == "command").choices
    helps = {name: {a.dest: a.help for a in sub[name]._actions} for name in ("run", "sweep")}
    assert "the config's output.dir, else runs/<name>-s<seed>-<time>" in helps["run"]["out"]
    assert "the sweep section's out, else runs/sweep" in helps["sweep"]["out"]


def _md_table(text: str, after: str) -> list[list[str]]:
    """The cells of the first markdown table after the line that holds ``after`` (bold marks dropped)."""
    lines = text[text.index(after) :].splitlines()
    start = next(i for i, s in enumerate(lines) if s.strip().startswith("|"))
    rows = []
    for s in lines[start:]:
        if not s.strip().startswith("|"):
            break
        if not s.strip().startswith("|---"):
            rows.append([c.strip().strip("*") for c in s.strip().strip("|").split("|")])
    return rows


def test_results_md_baseline_tables_are_what_its_sweep_prints(tmp_path):
    """docs/results.md's sweep of algos.yaml 'prints' its table: the printed cells, four significant digits below
    0.01 as summary.md writes them (before: 0.0032 and -0.0045, from before that rule); the --correction holm
    table's columns likewise."""
    from fedweave.experiments import sweep

    page = (ROOT / "docs/results.md").read_text(encoding="utf-8")
    [config] = [yaml.safe_load(c) for _, c in blocks(ROOT / "docs/results.md", "yaml") if "# algos.yaml" in c]
    grid = {"algorithm.name": ["fedavg", "fedprox", "scaffold"]}
    common = {"seeds": 5, "baseline": "fedavg", "workers": 2, "out": tmp_path / "algos", "progress": False}
    plain = sweep(config, grid, **common).table()
    shown = _md_table(page, "--seeds 5 --baseline fedavg --workers 2 --out runs/algos")
    assert _md_table(plain, "|") == shown
    holm = _md_table(sweep(config, grid, correction="holm", **common).table(), "|")
    shown = _md_table(page, "`--correction holm` (the runs are reused) gives")
    keep = [holm[0].index(c) for c in shown[0]]
    assert [[r[i] for i in keep] for r in holm] == shown


def _suggested(text: str) -> list[list[str]]:
    """The override sets a shipped config's header comment suggests: each alternative of a 'Compare...:'
    sentence (comma-separated, asides in parentheses dropped), and the '[k=v ...]' after a command line."""
    header = " ".join(s.lstrip("#").strip() for s in text.splitlines() if s.startswith("#"))
    found = []
    for m in re.finditer(r"Compare[^:]*:(.*?)\.(?:\s|$)", header):
        alternatives: list[list[str]] = [[]]
        for token in shlex.split(re.sub(r"\([^)]*\)", " , ", m.group(1))):
            if token != ",":
                alternatives[-1].append(token.rstrip(","))
            if token.endswith(","):
                alternatives.append([])
        found += [a for a in alternatives if a]
    found += [[t for t in m.group(1).split() if "=" in t] for m in re.finditer(r"fedweave run \S+ \[([^]]*)\]", header)]
    return found


SUGGESTED = [
    (f"{p.relative_to(ROOT / 'src/fedweave/configs')}:{' '.join(s)}", p, s)
    for p in sorted((ROOT / "src/fedweave/configs").rglob("*.yaml"))
    for s in _suggested(p.read_text(encoding="utf-8"))
]


def test_the_shipped_configs_suggest_overrides():
    assert len(SUGGESTED) >= 5


@pytest.mark.parametrize("path,overrides", [(p, s) for _, p, s in SUGGESTED], ids=[i for i, _, _ in SUGGESTED])
def test_a_shipped_configs_suggested_overrides_load(path, overrides):
    """Each loads, and its algorithm section builds the method's hyper-parameters (where an option of another
    method is refused): fedproto_mnist.yaml suggested algorithm.name=fedavg, which kept FedProto's lam in the
    section, and the run stopped at "unknown key 'algorithm.lam'"."""
    from fedweave.config import build_dataclass
    from fedweave.registry import ALGORITHMS

    cfg = load(str(path), overrides)
    build_dataclass(ALGORITHMS.get(cfg.algorithm.name).Hparams, cfg.algorithm.options, "algorithm")


def test_fedweave_list_prints_every_registry_a_config_names(capsys):
    """The README: `fedweave list` prints every registered name a config can use, i.e. each registry that
    fedweave.registry documents (``#:``) as a config key's. Before, local.augment's augmentations were left out."""
    from fedweave import registry
    from fedweave.cli import main

    source = (ROOT / "src/fedweave/registry.py").read_text(encoding="utf-8")
    documented = re.findall(r"^#:[^\n]*\n(?:#[^\n]*\n)*([A-Z_]+) = Registry\(", source, flags=re.M)
    assert "AUGMENTATIONS" in documented and "RULES" not in documented
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for attr in documented:
        names = ", ".join(getattr(registry, attr).names())
        assert any(line.endswith(f": {names}") for line in lines), f"fedweave list leaves out {attr}"
