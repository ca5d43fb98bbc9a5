"""Where a process's CPU goes, from py-spy's samples (``bench.py --router-throughput
--profile``): py-spy records the process while a load runs, and the samples are summed by
frame and by the library a frame's code belongs to.

py-spy (``py-spy record --format raw --threads --full-filenames``, Brendan Gregg's collapsed
stacks: one line per distinct stack, ``thread (tid): name;frame;...;leaf COUNT``, each frame
``function (file:line)``) comes with ``ray[serve]``. Samples of idle threads (waiting in
``epoll``, on a lock) are left out, py-spy's default, so shares are of the time the process
was on a CPU. Without ``--native``, time in C code (Ray's core worker, gRPC) counts to the
Python frame that called it: a thread whose Python stack ends in ``Thread.run`` runs native
code the whole time.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

#: Libraries a frame's file belongs to, first match wins: (name, substring of the path).
AREAS = (
    ("the mesh (serve_app)", "serve_app/"),
    ("Ray metrics", "ray/util/metrics"),
    ("Ray Serve", "ray/serve/"),
    ("Ray core (actor calls, serialization)", "/ray/"),
    ("gRPC", "grpc"),
    ("vLLM", "vllm/"),
    ("HTTP (uvicorn, starlette, fastapi, h11, httptools)", ("uvicorn", "starlette", "fastapi",
                                                            "h11", "httptools", "httpx")),
    ("pydantic", "pydantic"),
    ("asyncio and uvloop", ("asyncio/", "uvloop")),
    ("threads (threading, concurrent.futures; native code under Thread.run)",
     ("threading.py", "concurrent/futures", "queue.py")),
    ("logging", "logging/"),
)
#: Areas whose frames are plumbing on every stack (a thread's bootstrap, the event loop's
#: ``run_forever``): left out of the inclusive list, which is about what the time is for.
PLUMBING = (AREAS[-3][0], AREAS[-2][0])
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \(\w+\)(?:: (?P<name>.*))?$")


def parse_collapsed(text: str) -> Counter:
    """Collapsed stacks (``frame;...;leaf COUNT`` a line) -> Counter of stack tuples."""
    stacks: Counter = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def thread_name(frame: str) -> str | None:
    """The thread of a stack's root frame (``thread (123): ThreadPoolExecutor-0_3`` ->
    ``ThreadPoolExecutor-0``: a pool's threads together); None when ``frame`` is not one."""
    m = _THREAD.match(frame)
    if not m:
        return None
    return re.sub(r"[_-]\d+$", "", m["name"] or "unnamed")


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: a frame without its line, so one
    function's samples add up."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m['func']} ({m['file'].rsplit('/', 1)[-1]})"


def area(frame: str) -> str:
    """The library of a frame's file (:data:`AREAS`), ``other`` when none matches."""
    m = _FRAME.match(frame)
    path = m["file"] if m else frame
    for name, needles in AREAS:
        if any(n in path for n in ((needles,) if isinstance(needles, str) else needles)):
            return name
    return "other (Python, C extensions)"


@dataclass
class Profile:
    """Shares of a process's samples (0..1).

    Attributes:
        samples: samples recorded.
        by_thread: thread (a pool's together) -> share of the samples.
        by_area: library -> share of the samples whose leaf frame is in it (self time).
        by_self: function -> share of the samples where it is the leaf.
        by_total: function -> share of the samples where it is on the stack (inclusive),
            without those on nearly every stack (a thread's or an event loop's run).
    """

    samples: int
    by_thread: list[tuple[str, float]]
    by_area: list[tuple[str, float]]
    by_self: list[tuple[str, float]]
    by_total: list[tuple[str, float]]

    def lines(self, top: int = 12) -> list[str]:
        """The summary as text lines: the areas, then the ``top`` functions by self and by
        inclusive share."""
        if not self.samples:
            return ["  no samples (the process was idle, or py-spy could not attach)"]
        out = [f"  {self.samples} samples; by thread:"]
        out += [f"    {share:6.1%}  {name}" for name, share in self.by_thread[:top]]
        out.append("  self time by library:")
        out += [f"    {share:6.1%}  {name}" for name, share in self.by_area]
        out.append("  functions, self time:")
        out += [f"    {share:6.1%}  {name}" for name, share in self.by_self[:top]]
        out.append("  functions, on the stack (inclusive):")
        out += [f"    {share:6.1%}  {name}" for name, share in self.by_total[:top]]
        return out

    def as_json(self, top: int = 30) -> dict:
        """The shares as a JSON-able dict (the ``top`` functions of each list)."""
        return {"samples": self.samples, "by_thread": dict(self.by_thread[:top]),
                "by_area": dict(self.by_area),
                "by_self": dict(self.by_self[:top]), "by_total": dict(self.by_total[:top])}

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls(d["samples"], list(d["by_thread"].items()), list(d["by_area"].items()),
                   list(d["by_self"].items()), list(d["by_total"].items()))


def summarize(stacks: Counter, root_share: float = 0.9) -> Profile:
    """The :class:`Profile` of collapsed ``stacks`` (:func:`parse_collapsed`). Frames of
    :data:`PLUMBING`, and functions on more than ``root_share`` of the samples, are left out
    of ``by_total``: they are on every stack and say nothing."""
    total = sum(stacks.values())
    if not total:
        return Profile(0, [], [], [], [])
    by_thread: Counter = Counter()
    by_area: Counter = Counter()
    by_self: Counter = Counter()
    by_total: Counter = Counter()
    for stack, n in stacks.items():
        thread = thread_name(stack[0])
        if thread is not None:
            by_thread[thread] += n
            stack = stack[1:] or ("(no Python frame)",)
        by_area[area(stack[-1])] += n
        by_self[frame_name(stack[-1])] += n
        for name in {frame_name(f) for f in stack if area(f) not in PLUMBING}:
            by_total[name] += n

    def shares(c: Counter, keep=lambda s: True) -> list[tuple[str, float]]:
        return [(k, v / total) for k, v in c.most_common() if keep(v / total)]

    return Profile(total, shares(by_thread), shares(by_area), shares(by_self),
                   shares(by_total, lambda s: s <= root_share))


def record(pid: int, duration_s: float, rate: int = 100) -> Counter:
    """Sample process ``pid`` for ``duration_s`` seconds with py-spy (``--nonblocking``: the
    process is not paused per sample) and return its collapsed stacks.

    Raises:
        RuntimeError: py-spy failed (not installed, not allowed to attach: ptrace); the
            message is py-spy's.
    """
    out = Path(tempfile.mkdtemp(prefix="bench-pyspy-")) / "stacks.txt"
    local = Path(sys.executable).parent / "py-spy"  # the venv's, when it is not on PATH
    cmd = [str(local) if local.exists() else "py-spy", "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s))),
           "--rate", str(rate), "--format", "raw", "--nonblocking", "--threads",
           "--full-filenames", "--output", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=duration_s + 60)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"py-spy: {e}") from None
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return parse_collapsed(out.read_text())
