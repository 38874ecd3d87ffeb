"""OpenAI-compatible HTTP gateway: `/v1/completions`, `/v1/chat/completions`, `/v1/models`
translated onto Pagoda's gRPC API with `pagoda.client.AsyncClient` (see `python -m gateway_svc --help`)."""
