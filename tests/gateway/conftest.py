from tests.service.conftest import default_model_dir, hf_reference  # noqa: F401  (shared fixtures)
