"""pytest markers: `gpu` (needs a CUDA device; skipped without one), `slow` (long; deselect with -m "not slow").
Registering a marker twice (here and in a pytest.ini) is harmless.
The summary says which train.py runs tests/harness.shared_run trained once for more than one asker."""

import sys


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run: pytest -m gpu); skipped without one")
    config.addinivalue_line("markers", "slow: takes more than ~20 s (deselect: -m 'not slow')")


def pytest_terminal_summary(terminalreporter):
    harness = sys.modules.get("tests.harness")  # not imported: no whole runs in this session
    runs = list(harness.SHARED.values()) if harness is not None else []
    if runs:
        shared = [" = ".join(names) for names in runs if len(names) > 1]
        terminalreporter.write_line(
            f"tests/harness.shared_run: {len(runs)} train.py runs for {sum(map(len, runs))} "
            f"askers; shared: {', '.join(shared) or 'none'}"
        )
