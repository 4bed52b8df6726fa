"""The HTTP app: the OpenAI-compatible API, each replica's own listener, chunk registration
and tenants."""
