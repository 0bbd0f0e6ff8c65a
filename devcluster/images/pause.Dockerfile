# The pod sandbox ("pause") image every node's containerd runs first in each pod, as registry.k8s.io/pause
# is: upstream's pause.c from the pinned Kubernetes module, compiled static by tools/images/build.sh.
FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]
