"""A Kubernetes cluster on one machine for developing and testing the operator.

`emulator` is the API server (kmock's emulator made realistic), `podrunner` the kubelet (pods as
local processes), `patching` the patch dialects and selectors, `cluster` puts them together with
the operator and the node daemon (`kareus dev-cluster`).
"""
