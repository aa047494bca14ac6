"""Generated gRPC stubs (python -m serving.gen_proto); do not edit."""
