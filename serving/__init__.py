"""gRPC serving for jaxlora: the .proto and its stubs (gen/), the server, a client (see README.md)."""
