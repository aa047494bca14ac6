"""One-question probes kept runnable because design decisions rest on them (dispatch behind queued
work, page-in copies under a step); candidates for the suite, not part of its headline."""
