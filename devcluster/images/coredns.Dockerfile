# The dev cluster's CoreDNS (kube-dns), as kubeadm deploys it: the upstream server, built from the Go
# module proxy by tools/coredns/build.sh, on the same Debian base as Kareus's images.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
COPY coredns /coredns
USER 65532:65532
EXPOSE 53 53/udp 9153
ENTRYPOINT ["/coredns"]
