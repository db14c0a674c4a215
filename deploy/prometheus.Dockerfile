# Prometheus (with promtool) from Debian's package, on the local base image: nothing is pulled
# from a registry, only packages from the Debian mirror (built by compose's `monitoring` profile,
# or: docker build -f deploy/prometheus.Dockerfile -t muster/prometheus:2.42.0 deploy).
# The version is pinned to bookworm's; MUSTER_BASE_IMAGE / BASE picks the base.
ARG BASE=muster/base:bookworm
FROM ${BASE}
ARG PROMETHEUS_VERSION=2.42.0+ds-5+deb12u1
RUN set -eu; \
    export DEBIAN_FRONTEND=noninteractive; \
    apt-get update -q >/dev/null; \
    apt-get install -y -q --no-install-recommends "prometheus=${PROMETHEUS_VERSION}" >/dev/null; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; \
    prometheus --version; promtool --version >/dev/null; \
    mkdir -p /prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=:9090", "--web.enable-lifecycle"]
