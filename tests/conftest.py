"""pytest markers: `gpu` (needs a CUDA device; skipped without one), `slow` (long; deselect with -m "not slow").
Registering a marker twice (here and in a pytest.ini) is harmless."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run: pytest -m gpu); skipped without one")
    config.addinivalue_line("markers", "slow: takes more than ~20 s (deselect: -m 'not slow')")
