"""Stream a chat answer from a running Pagoda (`make run`): python examples/chat_client.py "Hi!" """

import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for pagoda.v1

from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc

question = sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?"
stub = pb_grpc.GenerationStub(grpc.insecure_channel("127.0.0.1:50051"))
request = pb.GenerateRequest(
    chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]),
    sampling=pb.SamplingParams(temperature=0.0),
    stopping=pb.StoppingCriteria(max_tokens=128),
)
for response in stub.Generate(request):
    for out in response.outputs:
        print(out.text, end="", flush=True)
    if response.HasField("usage"):
        print(f"\n[{response.usage.prompt_tokens} prompt + {response.usage.completion_tokens} generated tokens]")
