"""Every ```python and ```bash example of README.md and of docs/*.md runs as written: an example that does not run
fails CI.

How an example runs:
- A bash line that is one ``qwenvl-vision ...`` command runs in this process, through ``qwenvl_vision.cli.main``,
  and must exit 0; any other line (a pipeline, another program) runs in ``bash -c`` with this venv's scripts
  first on PATH. A comment ``# -> PATH`` after a command says what it writes: PATH must exist afterwards.
- A python block is executed as one module. An expression statement whose comment starts with a Python literal
  (``len(out.deepstack[0])  # 3: ...``) must equal it; for a tensor the literal is its shape.
- Where: a fresh working directory holding a copy of ``examples/photos``; ``/tmp/`` in an example stands for
  that directory's ``tmp/`` (so runs never collide with each other or with a user's files).
- Hub repo ids (``Qwen/NAME``) are served by the stand-in Hub (tests.helpers.serve_hub) as tiny random
  checkpoints of the family NAME says (tests.helpers.FAMILY_SMALL); presets build random weights at full size,
  so the README keeps to its cheap ones (qwen3.5-0.8b, qwen3-vl-2b with small max_pixels).

Lines that cannot run here are listed in EXCUSED with the reason; the check that can be made instead is made
(the set-up and test commands are what .ci/run runs). A fenced block in another language than python, bash, text
or none fails: mark it so that it runs, or as text.
"""

from __future__ import annotations

import ast
import importlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import qwenvl_vision
from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_manifest_lines
from tests.helpers import FAMILY_SMALL, REPO, write_checkpoint
from tests.helpers.handoff import write_full_model

README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]  # every page whose examples run
SETUP_LINE = ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.14.1 torchvision==0.29.1 '
              '&& pip install -e ".[test]"')
TEST_LINE = "ruff check . && python -m pytest -q"
CONTRACT_LINE = "bash .ci/contract"
DEVICE_SOFTWARE_LINE = "bash .ci/device-software"
EXCUSED = {  # README command (without its comment) -> why it is not run here
    SETUP_LINE: "creates and fills the virtual environment these tests run in; .ci/run runs it (checked below)",
    TEST_LINE: "the test command, of which this file is a part; .ci/run runs it (checked below)",
    CONTRACT_LINE: "the contract tier, in a venv of its own with vLLM; .ci/run runs it (checked below)",
    DEVICE_SOFTWARE_LINE: "the device-software tier, in a venv of its own with the GPU machine's torch and "
    "transformers; .ci/run runs it (checked below)",
    "torchrun --nproc-per-node 4 -m qwenvl_vision.cli embed photos/ --model Qwen/Qwen3-VL-8B-Instruct --out emb/ "
    "--device cuda": "needs 4 CUDA devices; torchrun runs are tested with 2 CPU ranks in tests/test_embed*.py",
    "vllm serve Qwen/Qwen3-VL-2B-Instruct --ec-transfer-config '{\"ec_connector\": \"ECExampleConnector\", "
    "\"ec_role\": \"ec_consumer\", \"ec_connector_extra_config\": {\"shared_storage_path\": \"/tmp/ec\"}}'":
    "needs vLLM with a GPU; tests/contract/ builds this consumer's VllmConfig from the line and loads the items with "
    "its ECExampleConnector",
    "python -m bench.throughput --preset qwen2.5-vl-3b --device cpu --dtype bf16 --inputs 256-patch --depth 8 "
    "--repeats 3 --one-forward": "a benchmark of minutes at real size; tests/bench/test_bench.py runs its logic on "
    "small towers",
    "python -m bench.cuda_check --out DIR": "needs a GPU; its --dry-run, the same logic on CPU, runs in "
    "tests/bench/test_cuda_check.py",
    "qwenvl-vision serve --model Qwen/Qwen3-VL-2B-Instruct --dtype bfloat16 --ec-shared-storage /tmp/ec --port 8001":
    "a server that runs until stopped; tests/contract/test_serve.py reads this line and runs it on tiny models (its "
    "folders and port moved) against vLLM's own code",
    "vllm serve Qwen/Qwen3-VL-2B-Instruct --port 8002 --ec-transfer-config '{\"ec_connector\": \"ECExampleConnector\", "
    "\"ec_role\": \"ec_consumer\", \"ec_connector_extra_config\": {\"shared_storage_path\": \"/tmp/ec\"}}'":
    "needs vLLM with a GPU; tests/contract/test_serve.py builds this consumer's VllmConfig from the line and loads the "
    "server's items with its ECExampleConnector",
    "python disagg_epd_proxy.py --encode-servers-urls http://127.0.0.1:8001 --prefill-servers-urls disable "
    "--decode-servers-urls http://127.0.0.1:8002 --port 8000": "vLLM's own example proxy (not shipped here) in front "
    "of a GPU vLLM; tests/contract/test_serve.py sends the server the requests it sends",
    "curl -s http://127.0.0.1:8001/v1/embeddings -H 'Content-Type: application/json' -d '{\"model\": "
    "\"Qwen/Qwen3-VL-2B-Instruct\", \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", "
    "\"image_url\": {\"url\": \"data:image/jpeg;base64,'\"$(base64 -w0 examples/photos/hopper.jpg)\"'\"}}]}]}'":
    "needs the server above running; tests/contract/test_serve.py runs it against that server",
    "qwenvl-vision embed s3://my-bucket/photos/a.jpg https://example.com/b.jpg --model qwen3.5-0.8b --random-weights "
    "--out /tmp/qwenvl-remote": "needs a bucket and the network; tests/embed/test_remote.py runs URLs against an HTTP "
    "server and an S3 server on loopback",
}
RUN_LANGUAGES = {"python", "bash"}
ILLUSTRATION_LANGUAGES = {"text", ""}  # output samples and the layout tree: shown, not run
# Which family a released repo's name belongs to, most specific first.
HUB_FAMILIES = [
    (r"Qwen2\.5-Omni", "qwen2_5_omni"), (r"Qwen2\.5-VL", "qwen2_5_vl"), (r"Qwen2-VL", "qwen2_vl"),
    (r"Qwen3-Omni", "qwen3_omni_moe"), (r"Qwen3-VL-.*-A\d+B", "qwen3_vl_moe"), (r"Qwen3-VL", "qwen3_vl"),
    (r"Qwen3\.[5-9]-.*-A\d+B", "qwen3_5_moe"), (r"Qwen3\.[5-9]", "qwen3_5"),
]
REPO_ID = re.compile(r"\bQwen/[A-Za-z0-9][\w.-]*")


# ---------------------------------------------------------------------- reading the README


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # the page's line of its first code line
    page: Path = README

    @property
    def where(self) -> str:
        return str(self.page.relative_to(REPO))

    @property
    def id(self) -> str:
        return f"{self.language or 'plain'}@{self.where}:{self.line}"


@dataclass(frozen=True)
class Command:
    text: str  # without its comment
    comment: str
    line: int
    where: str = "README.md"  # its page


def readme_blocks() -> list[Block]:
    blocks = []
    for page in DOCS:
        text = page.read_text()
        for match in re.finditer(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", text, re.M | re.S):
            line = text[:match.start(2)].count("\n") + 1
            blocks.append(Block(match.group(1).strip(), match.group(2), line, page))
    return blocks


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment) of a shell line: a '#' at the start of a word, outside quotes, starts the comment."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1:].strip()
    return line.strip(), ""


def commands(block: Block) -> list[Command]:
    """A bash block's command lines (backslash continuations joined), without blank and comment-only lines."""
    found, pending, start = [], "", 0
    for number, raw in enumerate(block.code.splitlines(), block.line):
        if not pending:
            start = number
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        text, comment = split_comment(pending + raw)
        pending = ""
        if text:
            found.append(Command(text, comment, start, block.where))
    return found


BLOCKS = readme_blocks()
RUN_BLOCKS = [b for b in BLOCKS if b.language in RUN_LANGUAGES]


# ---------------------------------------------------------------------- where examples run


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A fresh working directory with examples/, as in a checkout; the current directory for the test."""
    work = tmp_path / "work"
    shutil.copytree(REPO / "examples", work / "examples")
    (work / "tmp").mkdir()
    monkeypatch.chdir(work)
    return work


def family_of(repo_id: str) -> str:
    name = repo_id.split("/", 1)[1]
    for pattern, family in HUB_FAMILIES:
        if re.match(pattern, name):
            return family
    raise AssertionError(f"README names {repo_id}: add its family to HUB_FAMILIES in tests/test_readme.py")


# Local folders an example names that stand for a full released VLM: a tiny random one of the family, saved by
# transformers (tests/helpers/handoff.py), written into the working directory before the example runs.
TINY_FULL_MODELS = {"tiny-qwen3-vl": "qwen3_vl"}


def write_tiny_full_models(code: str, workdir: Path) -> None:
    for folder, family in TINY_FULL_MODELS.items():
        if f'"{folder}"' in code:
            write_full_model(workdir / folder, family)


def serve_repos(hub, code: str, folder: Path) -> None:
    """Every repo id the example names, on the stand-in Hub: a tiny random checkpoint of its family."""
    for repo_id in sorted(set(REPO_ID.findall(code))):
        path = folder / repo_id.replace("/", "--")
        write_checkpoint(path, FAMILY_SMALL[family_of(repo_id)], sharded=True, other_shards=1)
        hub.add(repo_id, path)


def in_workdir(text: str, workdir: Path) -> str:
    return text.replace("/tmp/", f"{workdir}/tmp/")


# ---------------------------------------------------------------------- running them


def run_command(command: Command, workdir: Path, capsys) -> None:
    text = in_workdir(command.text, workdir)
    argv = shlex.split(text)
    where = f"{command.where}:{command.line}: {command.text}"
    if argv[0] == "qwenvl-vision" and not re.search(r"[|&;<>$`()*?]", text):  # one command, nothing for a shell
        code = main(argv[1:])
        out = capsys.readouterr()
        assert code == 0, f"{where}\nexit {code}\n{out.out}\n{out.err}"
    else:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "PYTHONPATH": str(REPO)}
        done = subprocess.run(["bash", "-c", text], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{where}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    if command.comment.startswith("-> "):  # what the command writes
        written = in_workdir(command.comment[3:].split()[0], workdir)
        assert Path(written).exists(), f"{where}: does not write {written}"


def claimed_values(code: str) -> dict[int, object]:
    """Line -> the literal its comment starts with (`x.shape  # (2, 2048): ...` -> (2, 2048))."""
    claims = {}
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type == tokenize.COMMENT:
            head = token.string[1:].split(":", 1)[0].strip()
            try:
                claims[token.start[0]] = ast.literal_eval(head)
            except (ValueError, SyntaxError):
                pass
    return claims


class _CheckClaims(ast.NodeTransformer):
    """`expr  # LITERAL` -> `_readme_claim(expr, LITERAL, line)`."""

    def __init__(self, claims: dict[int, object]) -> None:
        self.claims = claims

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        if node.lineno not in self.claims:
            return node
        literal = ast.parse(repr(self.claims[node.lineno]), mode="eval").body  # lists and dicts too
        call = ast.Call(ast.Name("_readme_claim", ast.Load()), [node.value, literal, ast.Constant(node.lineno)], [])
        return ast.copy_location(ast.Expr(call), node)


def run_python(block: Block, workdir: Path) -> None:
    code = in_workdir(block.code, workdir)
    tree = ast.fix_missing_locations(_CheckClaims(claimed_values(code)).visit(ast.parse(code)))

    def claim(value, expected, line):
        found = tuple(value.shape) if isinstance(value, torch.Tensor) else value
        assert found == expected, f"{block.where}:{block.line + line - 1}: {found!r}, the page says {expected!r}"

    ast.increment_lineno(tree, block.line - 1)  # tracebacks point into the page
    exec(compile(tree, str(block.page), "exec"), {"__name__": "readme_example", "_readme_claim": claim})


def uses_ray(block: Block) -> bool:
    """Examples that start Ray (seconds of start-up each): the slow lane."""
    return "--engine ray" in block.code or "import ray" in block.code


@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.slow) if uses_ray(b) else b for b in RUN_BLOCKS],
                         ids=[b.id for b in RUN_BLOCKS])
def test_readme_example_runs(block, workdir, hub, tmp_path, capsys):
    runnable = block.code if block.language == "python" else "\n".join(
        c.text for c in commands(block) if c.text not in EXCUSED)
    if not runnable:
        pytest.skip("excused: " + "; ".join(EXCUSED[c.text] for c in commands(block)))
    serve_repos(hub, runnable, tmp_path / "repos")
    write_tiny_full_models(runnable, workdir)
    if block.language == "python":
        run_python(block, workdir)
        return
    for command in commands(block):
        if command.text in EXCUSED:
            continue
        run_command(command, workdir, capsys)


# ---------------------------------------------------------------------- the README as a whole


def test_every_block_is_run_illustrative_or_excused():
    languages = {b.id: b.language for b in BLOCKS}
    assert all(lang in RUN_LANGUAGES | ILLUSTRATION_LANGUAGES for lang in languages.values()), languages
    assert sum(b.page == README for b in RUN_BLOCKS) >= 4  # the extraction found the README's examples
    lines = {c.text for b in RUN_BLOCKS if b.language == "bash" for c in commands(b)}
    stale = set(EXCUSED) - lines
    assert not stale, f"excused but no longer in README.md or docs/: {stale}"
    assert (REPO / "bench" / "cuda_check.py").is_file()


def test_ci_runs_exactly_the_readme_set_up_and_test_commands():
    """.ci/run is the README's set-up line then its test command, its contract-tier and its device-software-tier
    commands, after its own preamble. `|| exit 1`: under
    `set -e` a failing command that is not the last of an && list does not stop the script."""
    bash = [c.text for b in BLOCKS if b.language == "bash" for c in commands(b)]
    assert SETUP_LINE in bash and TEST_LINE in bash and CONTRACT_LINE in bash and DEVICE_SOFTWARE_LINE in bash
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', f"{SETUP_LINE} || exit 1", f"{TEST_LINE} || exit 1",
                  f"{CONTRACT_LINE} || exit 1", DEVICE_SOFTWARE_LINE]


def test_readme_names_only_what_the_package_has():
    """Every `qv.NAME` / `qwenvl_vision.NAME` the README and docs/ mention, in code or prose, exists (a README call
    that raises AttributeError is how a broken README began)."""
    missing = []
    text = "\n".join(page.read_text() for page in DOCS)
    for match in sorted(set(re.findall(r"\b(?:qv|qwenvl_vision)((?:\.\w+)+)", text))):
        target = qwenvl_vision
        for part in match.lstrip(".").split("."):
            if not hasattr(target, part) and hasattr(target, "__path__"):
                importlib.import_module(f"{target.__name__}.{part}")
            if not hasattr(target, part):
                missing.append(match)
                break
            target = getattr(target, part)
    assert not missing, missing


def test_illustrated_manifest_lines_are_what_embed_writes(workdir, capsys):
    """The manifest lines README's embed illustration shows: the fields embed writes, the error it gives."""
    text = next(b.code for b in BLOCKS if b.language == "text" and "manifest.jsonl" in b.code)
    shown = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    ok, error = (next(r for r in shown if r["status"] == s) for s in ("ok", "error"))
    (workdir / "photos").mkdir()
    (workdir / "photos" / "broken.jpg").write_text("not an image")
    shutil.copy(workdir / "examples" / "photos" / "hopper.jpg", workdir / "photos" / "a.jpg")
    assert main(["embed", "photos", "--model", "qwen3.5-0.8b", "--random-weights", "--out", "emb",
                 "--max-pixels", str(64 * 64), "--quiet"]) == 1
    written = {r["path"]: r for r in read_manifest_lines(workdir / "emb" / "manifest.jsonl")}
    assert set(written) == {ok["path"], error["path"]}
    assert written[ok["path"]].keys() == ok.keys() and written[error["path"]].keys() == error.keys()
    assert written[error["path"]]["error"] == error["error"]


def test_the_readme_is_short_with_the_commands_first_and_the_api_soon():
    """A newcomer reads the README in minutes: at most ~200 lines, the set-up and test commands on its first screen,
    the Python API within its first 80 lines; the rest is in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    first_screen = "\n".join(lines[:50])
    assert SETUP_LINE in first_screen and TEST_LINE in first_screen
    assert any(line == "## Python API" for line in lines[:80])


def slug(header: str) -> str:
    """GitHub's anchor for a Markdown header."""
    return re.sub(r"[^\w\- ]", "", header.strip("# ").lower()).replace(" ", "-")


def headers(page: Path) -> set[str]:
    """The anchors of a page's headers (lines starting with # outside code fences)."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(slug(line))
    return found


def test_every_link_between_the_pages_resolves():
    """Relative links of the README and docs/ point at files that exist and at headers those files have."""
    broken = []
    for page in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md":
                if anchor not in headers(linked):
                    broken.append(f"{page.name}: {target}")
    assert not broken, broken
