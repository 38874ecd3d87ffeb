"""Stream a chat answer from a running Pagoda (`make run`): python examples/chat_client.py "Hi!"

Uses the client library (pagoda.client). Connection flags as the `pagoda` CLI's: --target
(PAGODA_TARGET), --api-key (PAGODA_API_KEY) when the scheduler requires keys, --ssl-ca-certs CA.pem
for TLS (and --ssl-certfile / --ssl-keyfile for mutual TLS).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for pagoda

from pagoda.client import Client  # noqa: E402
from pagoda.client.flags import add_connection_flags, client_options  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("question", nargs="?", default="What is the capital of France?")
add_connection_flags(parser)
args = parser.parse_args()
with Client(**client_options(args)) as client:
    stream = client.chat([{"role": "user", "content": args.question}], max_tokens=128, temperature=0.0)
    for chunk in stream:
        print(chunk.text, end="", flush=True)
    print(f"\n[{stream.usage.prompt_tokens} prompt + {stream.usage.completion_tokens} generated tokens]")
