import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hypothesis import HealthCheck, settings  # noqa: E402

# Exports are slow and these machines are shared: no deadlines, modest example counts.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

import pytest  # noqa: E402


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
