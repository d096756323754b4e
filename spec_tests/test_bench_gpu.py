"""The GPU generate benchmark says plainly when there is no CUDA device (it then does nothing)."""

from __future__ import annotations

import pytest
import torch

from kvstack.bench import gpu_generate
from kvstack.errors import KVStackError


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_gpu_generate_without_cuda_says_so(tmp_path):
    with pytest.raises(KVStackError, match="needs a CUDA device"):
        gpu_generate.main(["--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())
