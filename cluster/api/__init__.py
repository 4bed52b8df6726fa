"""The OpenAI request and response formats, and the completion service that turns a
request into a routed, streamed answer (shared by the HTTP app and batch jobs)."""
