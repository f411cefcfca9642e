import importlib.metadata
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hypothesis import HealthCheck, settings  # noqa: E402

# Hypothesis profiles. "ci" (the default, what `make test` runs): a fixed budget per test and
# derandomized examples, so a run checks the same cases every time and its length does not vary;
# "long" (`make test-long`, or `--hypothesis-profile=long`): ten times the examples, freshly
# random, the example database on, for hunting new failures; "dev": the ci budget, random.
# Exports are slow and these machines are shared: no deadlines.
_RELAXED = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
CI_EXAMPLES = 25
settings.register_profile("ci", deadline=None, max_examples=CI_EXAMPLES, derandomize=True, database=None,
                          suppress_health_check=_RELAXED)
settings.register_profile("dev", deadline=None, max_examples=CI_EXAMPLES, suppress_health_check=_RELAXED)
settings.register_profile("long", deadline=None, max_examples=10 * CI_EXAMPLES, suppress_health_check=_RELAXED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def examples(n: int) -> int:
    """A test's own example budget ``n`` (its count under the ci profile), scaled to the loaded
    profile: ``@settings(max_examples=examples(12))`` runs 12 in CI and 120 under "long".
    (Hypothesis's pytest plugin loads ``--hypothesis-profile`` before test modules import.)"""
    return max(1, n * settings.default.max_examples // CI_EXAMPLES)

import pytest  # noqa: E402

# The lane this run is on: `make test` sets NEURON_CONSTRAIN_LANE=main (torch 2.9 + torch-xla);
# run by hand, the main lane is the one with torch 2.9. Only the other lanes may lack torch-xla.
LANE = os.environ.get("NEURON_CONSTRAIN_LANE") or (
    "main" if importlib.metadata.version("torch").startswith("2.9.") else "latest")


def pytest_collection_modifyitems(config, items):
    """A host-side test (``torch_agnostic``: its outcome does not depend on torch) runs on one lane only:
    the main lane, or the lane its marker names (``pytest.mark.torch_agnostic(lane="latest")``, to even
    out the lanes' times); so does a test that compiles for minutes (``one_lane``). The other lane lists
    it as deselected. Unmarked tests run on every lane. A ``long`` test (a real model compiled, minutes on
    one core, what the tiny models cover already) runs in the long run alone (``make test-long``)."""
    long_run = (config.getoption("hypothesis_profile", None) or os.environ.get("HYPOTHESIS_PROFILE")) == "long"
    keep, elsewhere = [], []
    for item in items:
        mark = item.get_closest_marker("torch_agnostic") or item.get_closest_marker("one_lane")
        other_lane = mark is not None and mark.kwargs.get("lane", "main") != LANE
        (elsewhere if other_lane or (item.get_closest_marker("long") and not long_run) else keep).append(item)
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = keep


def require_torch_xla():
    """``torch_xla``, imported. On the main lane a missing torch-xla fails the test (the
    lane installs it: a skip would hide that it broke); on the other lanes, which do not
    install it, the test is skipped. Any other import error fails on every lane."""
    try:
        import torch_xla

        return torch_xla
    except ImportError as e:
        error = f"{type(e).__name__}: {e}"
    if LANE == "main":
        pytest.fail(f"torch-xla does not import on the main lane ({error}); the main lane installs torch-xla==2.9.0 "
                    "beside torch==2.9.0: rerun `make .venv/.installed` (or set NEURON_CONSTRAIN_LANE=latest on a "
                    "lane without it)", pytrace=False)
    pytest.skip(f"torch-xla is installed on the main lane only; this is the {LANE} lane", allow_module_level=True)


@pytest.fixture(scope="session")
def tekken():
    """mistral-common's Tekken tokenizer (131072 ids), built once for the session."""
    from neuron_constrain.structured.tokenizers import from_mistral, mistral_data_file

    return from_mistral(mistral_data_file("tekken_240911.json"))


@pytest.fixture(scope="session")
def engines(tekken):
    """Both grammar engines on Tekken."""
    from neuron_constrain.structured import engines

    return {name: engines.make_engine(name, tekken) for name in engines.ENGINES}


# ---- shared models (exported once per session)


@pytest.fixture(scope="session")
def mistral_tokenizers(tekken):
    """The tokenizer files mistral-common ships, built once for the session: Tekken (the
    ``tekken`` fixture itself), sentencepiece v1 and v3. A ``Tokenizer`` holds no request
    state (only caches of what its files determine: ``info``, the decode anchor)."""
    from neuron_constrain.structured.tokenizers import from_mistral, mistral_data_file

    return {"tekken": tekken, "sp1": from_mistral(mistral_data_file("tokenizer.model.v1")),
            "sp3": from_mistral(mistral_data_file("mistral_instruct_tokenizer_240323.model.v3"))}
