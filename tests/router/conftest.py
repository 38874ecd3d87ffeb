from tests.service.conftest import hf_reference  # noqa: F401  (the transformers reference, session-wide)
