"""Every fenced ``python`` block of every README (and of docs/) runs as written.

Each block runs in a fresh interpreter (this environment's, which holds the four packages, Ray,
matplotlib), in a temporary directory, within a timeout. Two HTML comments, on the line right
before the fence, change that:

- ``<!-- skip: why -->``: the block is not run; the test is reported skipped with that reason
  (a block that needs a GPU, an inference engine, or several processes a recipe runs instead).
- ``<!-- continues -->``: the block runs after the file's previous python block, in the same
  interpreter (a class defined once, used in the next block).

`test_skipped_blocks_say_why` lists every skipped block with its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(
    [ROOT / "README.md", *ROOT.glob("packages/*/README.md"), *ROOT.glob("docs/*.md")],
    key=lambda p: p.relative_to(ROOT).as_posix(),
)
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARK = re.compile(r"<!--\s*(skip|continues)\s*(?::\s*(.*?))?\s*-->\s*$")
TIMEOUT_S = 240


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    code: str
    skip: str | None  # the reason, when marked skip
    continues: bool

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out: list[Block] = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        kind, reason = (mark.group(1), mark.group(2)) if mark else (None, None)
        if kind == "skip" and not reason:
            raise ValueError(f"{path}:{line}: '<!-- skip: ... -->' must say why")
        out.append(Block(path, line, match.group(1), reason if kind == "skip" else None, kind == "continues"))
    return out


BLOCKS = [block for path in FILES for block in _blocks(path)]


def _program(block: Block) -> str:
    """The block, after the blocks it continues (same file, in order)."""
    same = [b for b in BLOCKS if b.path == block.path]
    chain = [block]
    index = same.index(block)
    while chain[0].continues and index > 0:
        index -= 1
        chain.insert(0, same[index])
    if chain[0].continues:
        raise ValueError(f"{block.name}: '<!-- continues -->' on a file's first python block")
    return "\n".join(b.code for b in chain)


def test_the_readmes_have_blocks() -> None:
    assert len(BLOCKS) >= 10, [b.name for b in BLOCKS]


def test_skipped_blocks_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    skipped = [b for b in BLOCKS if b.skip is not None]
    with capsys.disabled():
        print(f"\nREADME blocks: {len(BLOCKS)}, {len(BLOCKS) - len(skipped)} run, {len(skipped)} skipped")
        for block in skipped:
            print(f"  SKIP {block.name}: {block.skip}")
    for block in skipped:
        chained = [b for b in BLOCKS if b.path == block.path and b.line > block.line]
        if chained and chained[0].continues:
            pytest.fail(f"{chained[0].name} continues {block.name}, which is skipped")


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.name}: {block.skip}")
    script = tmp_path / "block.py"
    script.write_text(_program(block))
    env = {**os.environ, "MPLBACKEND": "Agg", "RAY_DEDUP_LOGS": "0"}
    try:
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.name} did not finish within {TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, (
        f"{block.name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
