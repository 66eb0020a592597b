"""Generated protobuf and gRPC stubs of protos/tandem/v1 (python -m tandem.protogen)."""
