"""The outcome classes of a hostile input (issue 34) and the bounded run that sorts a case into one of them.

A case is a callable that feeds one hostile input to hf_structkv and returns ``None`` when what came back is correct
(it loaded and round-tripped, the command saved what it should, the result is finite), or a string saying what is
wrong with it; ``words`` are the names (of the field, argument or file) a refusal must mention. `run_case` runs it
under a memory and a time bound:

* ``refused``: a ``ValueError`` / ``TypeError`` (or a CLI exit 2 with one ``error:`` line) naming one of ``words``;
* ``handled``: it returned ``None``;
* ``silent``: it returned a complaint (accepted, but loaded something other than the file, did not round-trip, or
  gave NaN);
* ``unhelpful``: any other exception, or a refusal that names none of ``words``;
* ``exhausted``: ``MemoryError``, a torch allocation failure, more than `MEMORY_BOUND` bytes of resident memory
  growth or more than `TIME_BOUND` seconds.
"""

from __future__ import annotations

import contextlib
import resource
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, settings

OUTCOMES = ("refused", "handled", "silent", "unhelpful", "exhausted")
"""In the order of the report's table; the target is 0 ``silent``, ``unhelpful`` and ``exhausted``."""
OUTCOME_TITLES = {
    "refused": "refused with a clear error",
    "handled": "handled correctly",
    "silent": "silently accepted wrong",
    "unhelpful": "unhelpful error",
    "exhausted": "resource exhaustion",
}
GOOD_OUTCOMES = frozenset({"refused", "handled"})
MEMORY_BOUND = 256 * 2**20
"""The most resident memory one case may add (every artifact here is under 1 MiB; a tiny-model compaction under
100 MiB)."""
TIME_BOUND = 30.0
"""The most seconds one case may take (a tiny-model compaction from the CLI takes about 2 s)."""
FUZZ = settings(
    max_examples=100,
    deadline=None,  # run_case bounds the time of an example itself
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
"""The hypothesis settings of every fuzz test: 100 examples drawn from a fixed seed (the same in every run), so the
whole ``tests/fuzz`` folder stays within a few minutes on two cores."""
ADDRESS_SPACE_HEADROOM = 4 * 2**30
"""While a case runs, the process may reserve at most this much more address space: an allocation sized by an
edited number fails with ``MemoryError`` instead of taking the machine's memory."""


@dataclass(frozen=True)
class Case:
    """One hostile input: ``category`` (``formats``, ``api`` or ``cli``), ``target`` (the file, function or command
    it is fed to), a ``name`` unique within the target, ``run()`` (``None`` or a complaint; raises to refuse) and the
    ``words`` a refusal must name."""

    category: str
    target: str
    name: str
    run: Callable[[], str | None]
    words: tuple[str, ...]


@dataclass(frozen=True)
class Result:
    case: Case
    outcome: str
    detail: str
    seconds: float
    memory_growth: int


def run_case(case: Case) -> Result:
    """Run ``case`` under the bounds and classify what happened (see the module docstring)."""
    start_rss = _resident_bytes()
    _reset_peak()
    start = time.perf_counter()
    try:
        with _address_space_bound(), _time_bound():
            complaint = case.run()
    except (MemoryError, TimeBoundExceeded) as err:
        outcome, detail = "exhausted", f"{type(err).__name__}: {err}"
    except (ValueError, TypeError) as err:
        named = names_one_of(str(err), case.words)
        outcome, detail = ("refused" if named else "unhelpful"), f"{type(err).__name__}: {err}"
    except RuntimeError as err:
        exhausted = "can't allocate memory" in str(err) or "out of memory" in str(err).lower()
        outcome, detail = ("exhausted" if exhausted else "unhelpful"), f"RuntimeError: {err}"
    except Exception as err:  # noqa: BLE001 - every other exception is what the issue calls unhelpful
        outcome, detail = "unhelpful", f"{type(err).__name__}: {err}"
    else:
        outcome, detail = ("handled", "") if complaint is None else ("silent", complaint)
    seconds = time.perf_counter() - start
    growth = max(0, _peak_bytes() - start_rss)
    if outcome in GOOD_OUTCOMES and (growth > MEMORY_BOUND or seconds > TIME_BOUND):
        outcome, detail = "exhausted", f"{growth / 2**20:.0f} MiB more resident memory, {seconds:.1f} s ({detail})"
    return Result(case, outcome, detail[:400], seconds, growth)


def assert_good(case: Case) -> Result:
    """Run ``case`` and fail unless it was refused with a clear error or handled correctly."""
    result = run_case(case)
    assert result.outcome in GOOD_OUTCOMES, f"{case.target} | {case.name}: {result.outcome}: {result.detail}"
    return result


def names_one_of(message: str, words: tuple[str, ...]) -> bool:
    """Whether ``message`` names one of ``words`` (case-insensitive; as written or as its repr writes it)."""
    message = message.lower()
    return any(word.lower() in message or repr(word)[1:-1].lower() in message for word in words)


class TimeBoundExceeded(Exception):
    """Raised into a case that runs for twice `TIME_BOUND` (a blocked read, an endless loop)."""


@contextlib.contextmanager
def _time_bound() -> Iterator[None]:
    """Interrupt the case after ``2 * TIME_BOUND`` seconds (``SIGALRM``; main thread only, else no bound)."""

    def interrupt(signum, frame):
        raise TimeBoundExceeded(f"still running after {2 * TIME_BOUND:.0f} s")

    try:
        previous = signal.signal(signal.SIGALRM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, 2 * TIME_BOUND)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _address_space_bound() -> Iterator[None]:
    """Lower the soft ``RLIMIT_AS`` to the current address space plus `ADDRESS_SPACE_HEADROOM` (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = _status_bytes("VmSize")
    if size is None:
        yield
        return
    bound = size + ADDRESS_SPACE_HEADROOM
    if hard != resource.RLIM_INFINITY:
        bound = min(bound, hard)
    resource.setrlimit(resource.RLIMIT_AS, (bound, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (``None`` off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _resident_bytes() -> int:
    return _status_bytes("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> None:
    """Reset the kernel's resident high-water mark (``VmHWM``) so that `_peak_bytes` sees this case's peak only."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_bytes() -> int:
    return _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
