"""Durations, counts and progress lines in one style, for estimates (``harness/estimate.py``), the
demo, the commands' summaries and a run's own log (``engine/session.py``): the paper's time table
writes ``5m55s``, and a count reads as English (``1 cell``, ``2 cells``)."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """``4.9 s``, ``4m40s``, ``1h12m24s``: the paper's time table's style above a minute."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h{minutes:02d}m" if hours else f"{minutes}m") + f"{secs:02d}s"


def plural(count: float, singular: str, plural_form: str | None = None) -> str:
    """``1 cell``, ``2 cells``, ``0.5 GPUs``: a count and its noun, so that no line says
    ``1 cells`` or ``run(s)``; ``plural_form`` for a noun that does not just take an s
    (``plural(n, "batch", "batches")``)."""
    number = f"{count:g}" if isinstance(count, float) else str(count)
    noun = singular if count == 1 else (plural_form or singular + "s")
    return f"{number} {noun}"


def progress_line(what: str, done: int, total: int, elapsed: float, unit: str = "tasks") -> str:
    """``what: 3/5 tasks, 12 s elapsed, about 8 s left``: the ETA assumes the rest goes at the
    pace so far (a whole run's or a whole sweep's; no FLOP model involved)."""
    if total <= 0:
        raise ValueError(f"total must be >= 1, got {total}")
    text = f"{what}: {done}/{total} {unit}, {duration(elapsed)} elapsed"
    if 0 < done < total:
        text += f", about {duration(elapsed / done * (total - done))} left"
    elif done >= total:
        text += ", done"
    return text
