"""Shared by every test module.

Importing ddpcomm.ops loads ddpcomm._C, so a native library that did not build fails the
whole run, loudly, with the reason: tests never fall back to reference.py for the ops they
check. Every Future callback in every test (and in the ranks and scripts they start) runs
under the stream-rule check (ddpcomm/futures.py). The ``device`` fixture runs a test on the
CPU and, where torch sees a GPU, on CUDA; without one the CUDA cases skip with that reason.
"""

import os

os.environ.setdefault("DDPCOMM_CHECK_STREAM_RULE", "1")  # before ddpcomm is imported

import pytest  # noqa: E402
import torch  # noqa: E402

import ddpcomm.ops  # noqa: E402

CUDA = torch.cuda.is_available()


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not CUDA, reason="no CUDA device (torch.cuda.is_available() is False)"
            ),
        ),
    ]
)
def device(request) -> str:
    # Fails, not skips: a CUDA machine running a CPU-only build would otherwise report a
    # dispatch error in every CUDA case that hides the cause.
    if request.param == "cuda" and not ddpcomm.ops.build_info()["cuda"]:
        pytest.fail(
            "torch sees a CUDA device but ddpcomm was built without CUDA ops "
            f"(build_info: {ddpcomm.ops.build_info()}); rebuild with nvcc on PATH and a CUDA "
            "build of torch"
        )
    return request.param
