# The CPU training image: Debian, a Python for the job, ma-runtime as PID 1.
#
# Build it with `docker/build.sh cpu`: it assembles the build context this file expects (wheels/, the
# entrypoint shim, install-runtime.sh; nothing else of the checkout) and passes the version.
# BASE_IMAGE is any Debian or Ubuntu with python3 in its archive; the tests build FROM local/debian:bookworm,
# made with debootstrap where no registry is reachable.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG MA_USER_UID=1000
ARG MA_USER_GID=100

# The job's Python is a venv of its own, owned by ma-user and first on PATH, as the platform's conda is: pip
# installs into it without root and without Debian's "externally managed" refusal, in a derived image and
# at run time (the runtime's pip requirements step) alike.
# DL3008 (pin the packages' versions): the base release fixes them; a pinned Debian revision leaves the archive
# at the next point release and breaks the build.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/job-venv \
    && chown -R "${MA_USER_UID}:${MA_USER_GID}" /opt/job-venv
ENV PATH=/opt/job-venv/bin:${PATH}

# 1: the runtime's dependencies from the wheelhouse alone (offline); 0: from the package index.
ARG WHEELS_ONLY=1
# With WHEELS_ONLY=0: the index, when not the base image's pip configuration (empty) or PyPI.
ARG PIP_INDEX_URL=
# The interpreter of the runtime's venv: the system's, not the job's venv that comes first on PATH.
ARG RUNTIME_PYTHON=/usr/bin/python3
COPY wheels/ /tmp/ma-runtime/wheels/
COPY ma-runtime-entrypoint install-runtime.sh /tmp/ma-runtime/
RUN sh /tmp/ma-runtime/install-runtime.sh && rm -rf /tmp/ma-runtime

# Last: a new version or revision changes these layers only, not the cached ones above.
ARG VERSION=unknown
ARG SOURCE_URL=
ARG REVISION=
LABEL org.opencontainers.image.title="ma-runtime-cpu" \
      org.opencontainers.image.description="CPU training image: ma-runtime as PID 1, the job's Python in /opt/job-venv" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.revision="${REVISION}"

# No HEALTHCHECK: ModelArts and Kubernetes ignore Docker's; the runtime finds a hung job itself and reports
# it through its exit code (83) and termination message.
STOPSIGNAL SIGTERM
USER ${MA_USER_UID}
WORKDIR /home/ma-user
ENTRYPOINT ["/opt/ma-runtime/bin/ma-runtime-entrypoint"]
