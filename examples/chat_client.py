"""Stream a chat answer from a running Pagoda (`make run`): python examples/chat_client.py "Hi!"

Uses the client library (pagoda.client); PAGODA_TARGET picks another address.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for pagoda

from pagoda.client import Client

question = sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?"
with Client() as client:
    stream = client.chat([{"role": "user", "content": question}], max_tokens=128, temperature=0.0)
    for chunk in stream:
        print(chunk.text, end="", flush=True)
    print(f"\n[{stream.usage.prompt_tokens} prompt + {stream.usage.completion_tokens} generated tokens]")
