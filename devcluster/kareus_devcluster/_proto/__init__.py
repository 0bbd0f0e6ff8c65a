"""Generated gRPC code for the kubelet device-plugin API v1beta1 (regenerate: see deviceplugin.proto)."""
