"""The markers, registered here too because the GPU machine runs a copy of tests/
outside the source tree (where pyproject.toml's list is not read)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU backend (skipped without one, "
                            "failed when MAMBA_BACKEND names one that is unusable)")
    config.addinivalue_line("markers", "oracle: compares against torch / Hugging Face "
                            "transformers")
    config.addinivalue_line("markers", "slow: rebuilds the package (sabotage variants)")
