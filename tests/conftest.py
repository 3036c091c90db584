import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A fresh, reported seed per test: data is random but a failure can be replayed."""
    seed = np.random.SeedSequence().entropy % (2**32)
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
