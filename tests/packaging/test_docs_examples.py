"""Every code block of the quick start and the how-tos runs, against a real redis-server.

Each page is run the way a reader would run it, in a new directory:

* a ```python block with ``title="name.py"`` is written there as that file;
* a ```console block after ``<!-- run: worker -->`` is started there, each ``$`` line a real
  ``celery worker`` (stopped by its process group at the end), and waited on until ready;
* every other ```python block runs, in page order, as one script (one namespace, as the
  reader's session), whose output is checked against the ``# expected`` comments of its
  ``print(...)`` lines;
* any other block must say why it does not run, on the line before it:
  ``<!-- not run: reason -->`` or ``<!-- output -->`` (what a command prints).

The pages say ``redis://localhost:6379``; here that is the test's private server (never the
machine's own Redis on 6379).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _task_support import ROOT

from celery_singleton_lock.testing.servers import wait_until

DOCS = ROOT / "docs"
PAGES = ["getting-started.md", "django.md", *sorted(p.relative_to(DOCS).as_posix() for p in DOCS.glob("how-to/*.md"))]
FENCE = re.compile(r"^(?P<marker><!--(?P<note>[^\n]*)-->\n)?```(?P<lang>\w*)(?P<info>[^\n]*)\n(?P<body>.*?)^```$",
                   re.M | re.S)
EXPECTED = re.compile(r"^(?P<indent>\s*)print\((?P<expr>.*)\)\s+# (?P<want>.+)$")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@dataclass
class Block:
    lang: str
    title: str | None
    body: str
    note: str | None  # the marker line's text, without <!-- -->


def blocks(page: str) -> list[Block]:
    out = []
    for m in FENCE.finditer((DOCS / page).read_text()):
        title = re.search(r'title="([^"]+)"', m["info"])
        note = m["note"].strip() if m["note"] is not None else None
        out.append(Block(m["lang"], title.group(1) if title else None, m["body"], note))
    return out


def test_every_block_runs_or_says_why_not() -> None:
    assert "getting-started.md" in PAGES and "how-to/choosing.md" in PAGES
    for page in PAGES:
        for block in blocks(page):
            if block.note is None:
                assert block.lang == "python", f"{page}: a ```{block.lang} block neither runs nor says why not"
            elif block.note not in ("output", "run: worker"):
                assert re.match(r"not run( here)?: \S", block.note), f"{page}: marker {block.note!r} gives no reason"
        runnable = [b for b in blocks(page) if b.note is None or b.note == "run: worker"]
        if page != "django.md":
            assert runnable, f"{page} has no block that runs"


def checked(script: str) -> str:
    """``print(x)  # want`` becomes a check that x prints as ``want`` (what the reader is told to expect)."""
    lines = []
    for line in script.splitlines():
        m = EXPECTED.match(line)
        if m and not m["want"].startswith("noqa"):
            lines.append(f"{m['indent']}__check({m['expr']}, {m['want']!r})")
        else:
            lines.append(line)
    prelude = ("def __check(value, want):\n"
               "    print(value)\n"
               "    assert str(value) == want, f'printed {value!s}, the page says {want}'\n")
    return prelude + "\n".join(lines) + "\n"


def localise(text: str, base: str) -> str:
    out = text.replace("redis://localhost:6379", base)
    assert "6379" not in out, "a page points at a Redis other than redis://localhost:6379"
    return out


@pytest.mark.parametrize("page", PAGES)
def test_page_runs(page: str, fresh_redis, tmp_path: Path) -> None:
    base = fresh_redis.url(0).rsplit("/", 1)[0]  # a server of the page's own: it starts from an empty Redis
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("CELERY_APP", None)
    page_blocks = blocks(page)
    script = []
    for block in page_blocks:
        if block.note is None and block.title:
            target = tmp_path / block.title
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(localise(block.body, base))
        elif block.note is None:
            script.append(localise(block.body, base))
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for block in page_blocks:
            if block.note == "run: worker":
                for line in block.body.splitlines():
                    if line.startswith("$ "):
                        workers.append(start_worker(line[2:], tmp_path, env))
        if not script:
            return
        (tmp_path / "page.py").write_text(checked("\n".join(script)))
        proc = subprocess.run([sys.executable, "page.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=150)
        logs = "".join((tmp_path / f"worker{i}.log").read_text() for i in range(len(workers)))
        assert proc.returncode == 0, f"{page}:\n{proc.stdout}\n{proc.stderr[-4000:]}\nworkers:\n{logs[-4000:]}"
        if page == "getting-started.md":  # the duplicate handled, as the page shows it
            assert "is a duplicate: lock singleton_lock:tasks.charge:" in logs, logs[-4000:]
    finally:
        for worker in workers:
            stop(worker)


def start_worker(command: str, cwd: Path, env: dict[str, str], exact: bool = False) -> subprocess.Popen[bytes]:
    """``celery -A x worker ...`` in a process group of its own: as written (``exact``: the first
    ``celery`` on the environment's PATH), else this Python's celery with a node name of its own."""
    n = len(list(cwd.glob("worker*.log")))
    log = cwd / f"worker{n}.log"
    argv = command.split()
    assert argv[0] == "celery", command
    if not exact:
        argv = [sys.executable, "-m", "celery", *argv[1:], "--without-gossip", "--without-mingle", "-n", f"docs{n}@%h"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: " ready." in log.read_text() or proc.poll() is not None, 60, 0.1, "the worker")
    except BaseException:
        stop(proc)
        raise
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """The worker's process group, by its id (TERM, then KILL)."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
