import pytest
import torch

# Small tensors: one intra-op thread is 10x faster than two on a busy 2-core machine (measured).
torch.set_num_threads(1)


@pytest.fixture
def f64():
    """Run the test in float64 and restore the default dtype afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
