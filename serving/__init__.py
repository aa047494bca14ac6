"""Serving for jaxlora: one engine behind an OpenAI-compatible HTTP server (`http_server`,
`openai_api`) and a gRPC server (`server`; the .proto and its stubs in proto/ and gen/), with the API
rules both share (`api`, `admission`, `security`), metrics, and a gRPC client (see README.md)."""
