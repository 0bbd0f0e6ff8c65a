"""Cluster DNS as kubeadm deploys it: CoreDNS in kube-system behind the `kube-dns` Service.

The objects are kubeadm's (a ServiceAccount, the `system:coredns` ClusterRole and binding, the Corefile
ConfigMap, the Deployment with its health and readiness probes, the Service at the address every kubelet
gives its pods as nameserver), in the image `make images` builds from the upstream server. One change, on
purpose: no `forward` plugin, so a name outside the cluster is never sent off the machine.
"""

from __future__ import annotations

from typing import Any

import yaml

from kareus_devcluster.node import CLUSTER_DNS_IP, CLUSTER_DOMAIN

NAMESPACE = "kube-system"
IMAGE = "localhost/kareus/coredns:0.1.0"
READY_TIMEOUT_S = 180

COREFILE = f"""\
.:53 {{
    errors
    health {{
       lameduck 5s
    }}
    ready
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }}
    prometheus :9153
    cache 30
    loop
    reload
    loadbalance
}}
"""


def objects() -> list[dict[str, Any]]:
    labels = {"k8s-app": "kube-dns"}
    meta = {"namespace": NAMESPACE}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "coredns", **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": NAMESPACE}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "coredns", **meta},
         "data": {"Corefile": COREFILE}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "coredns", "labels": labels, **meta},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                  "template": {"metadata": {"labels": labels}, "spec": _pod_spec()}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kube-dns", "labels": labels, **meta,
                                                             "annotations": {"prometheus.io/port": "9153",
                                                                             "prometheus.io/scrape": "true"}},
         "spec": {"selector": labels, "clusterIP": CLUSTER_DNS_IP,
                  "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                            {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
                            {"name": "metrics", "port": 9153, "protocol": "TCP", "targetPort": 9153}]}},
    ]


def _pod_spec() -> dict[str, Any]:
    return {
        "priorityClassName": "system-cluster-critical", "serviceAccountName": "coredns",
        "dnsPolicy": "Default",
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"},
                        {"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"},
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"kubernetes.io/os": "linux"},
        # Port 53 as the image's non-root user: the namespaced sysctl kubelets allow by default, instead of
        # a capability (an added capability is not effective for a non-root process under containerd).
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"},
                            "sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "53"}]},
        "containers": [{
            "name": "coredns", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
            "args": ["-conf", "/etc/coredns/Corefile"],
            "resources": {"limits": {"memory": "170Mi"}, "requests": {"cpu": "50m", "memory": "70Mi"}},
            "volumeMounts": [{"name": "config-volume", "mountPath": "/etc/coredns", "readOnly": True}],
            "ports": [{"containerPort": 53, "name": "dns", "protocol": "UDP"},
                      {"containerPort": 53, "name": "dns-tcp", "protocol": "TCP"},
                      {"containerPort": 9153, "name": "metrics", "protocol": "TCP"}],
            "livenessProbe": {"httpGet": {"path": "/health", "port": 8080, "scheme": "HTTP"},
                              "initialDelaySeconds": 5, "timeoutSeconds": 5, "successThreshold": 1,
                              "failureThreshold": 5},
            "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181, "scheme": "HTTP"}, "periodSeconds": 2},
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                "readOnlyRootFilesystem": True},
        }],
        "volumes": [{"name": "config-volume", "configMap": {"name": "coredns",
                                                            "items": [{"key": "Corefile", "path": "Corefile"}]}}],
    }


def install(cluster: Any) -> None:
    """Apply the objects and wait until CoreDNS is available (`cluster`: a DevCluster)."""
    cluster.kubectl("apply", "--server-side", "--field-manager=kareus-dev", "-f", "-",
                    input=yaml.safe_dump_all(objects(), sort_keys=False))
    cluster.kubectl("rollout", "status", "deployment/coredns", "-n", NAMESPACE, f"--timeout={READY_TIMEOUT_S}s")
