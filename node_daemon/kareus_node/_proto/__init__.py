"""Generated gRPC code for the kubelet pod-resources API (regenerate: see api.proto)."""
