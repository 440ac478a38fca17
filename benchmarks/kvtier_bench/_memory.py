"""The process's resident memory, read from Linux ``/proc`` (None or False elsewhere)."""

from __future__ import annotations


def rss_bytes(field: str) -> int | None:
    """Bytes of a ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, ...); None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS through ``/proc/self/clear_refs``; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
