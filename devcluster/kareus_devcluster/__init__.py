"""A Kubernetes cluster on one machine for developing and testing the operator; only the GPU is simulated.

`controlplane` runs the real control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler of the pinned release) with `pki` for its certificates; `network` makes the node
network (a bridge on 198.18.<k>.0/24, a network namespace per node; pod and Service ranges only inside
the nodes); `node` is a real node (the upstream kubelet, containerd and runc, kube-proxy, in its own
network and mount namespace); `images` builds and caches the images the nodes run (`make images`);
`dns` deploys CoreDNS as kubeadm does; `deviceplugin` advertises the node's simulated GPUs on the
kubelet's device-plugin API (its protos in `_proto`); `kueue` and `prometheus` run the real Kueue
controller and Debian's Prometheus beside the cluster; `cluster` puts them together and installs the
Helm chart (`kareus dev-cluster`).
"""
