"""A Kubernetes cluster on one machine for developing and testing the operator.

`controlplane` runs the real control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler of the pinned release) with `pki` for its certificates; `kubelet` is an emulated GPU
node (a kubelet stand-in that runs pods as local processes, with a device-plugin and pod-resources
stand-in); `cluster` puts them together and installs the Helm chart (`kareus dev-cluster`).
"""
