"""Ask Pagoda through its OpenAI-compatible gateway (`python -m gateway_svc`) with the `openai` package:
python examples/openai_client.py "Hi!"   (PAGODA_GATEWAY_URL, default http://127.0.0.1:8000/v1)"""

import os
import sys

import openai

client = openai.OpenAI(base_url=os.environ.get("PAGODA_GATEWAY_URL", "http://127.0.0.1:8000/v1"),
                       api_key=os.environ.get("PAGODA_API_KEY", "none"))
model = client.models.list().data[0].id
question = sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?"
for event in client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=128, temperature=0, stream=True):
    if event.choices:
        print(event.choices[0].delta.content or "", end="", flush=True)
print()
