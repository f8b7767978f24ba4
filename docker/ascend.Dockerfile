# The Ascend training image: a CANN base image (aarch64, the platform's Ascend nodes) with ma-runtime as PID 1.
# The base brings CANN, the framework and the job's Python (its conda environment), and they stay as they are:
# the runtime gets a venv of its own next to them.
#
# CANN's set_env.sh is neither run here nor copied into ENV lines: its variables depend on the toolkit and the
# driver the node mounts, so the runtime sources it at start (MA_RUNTIME_CANN_SET_ENV) and hands the result to
# the command.
#
# Build it with `docker/build.sh ascend` (on an x86 machine add --platform linux/arm64 and qemu-user-static):
# it assembles the build context this file expects (wheels/, the entrypoint shim, install-runtime.sh; nothing
# else of the checkout) and passes the version. BASE_IMAGE is any CANN image with a python3 (3.9 or later)
# on PATH, e.g. ascendai/cann:<version>-910b-ubuntu22.04-py3.10 (with TARGET_PYTHON=3.10 for the wheelhouse).
ARG BASE_IMAGE=swr.cn-southwest-2.myhuaweicloud.com/atelier/pytorch_2_1_ascend:pytorch_2.1.0-cann_8.0.rc2-py_3.9-hce_2.0.2312-aarch64-snt9b-20240727152329-0f2c29a
FROM ${BASE_IMAGE}

ARG MA_USER_UID=1000
ARG MA_USER_GID=100

# The platform's base images end as ma-user; the install needs root, and the last USER below hands it back.
USER 0
# 1: the runtime's dependencies from the wheelhouse alone (offline); 0: from the package index.
ARG WHEELS_ONLY=1
# With WHEELS_ONLY=0: the index, when not the base image's pip configuration (empty) or PyPI.
ARG PIP_INDEX_URL=
# The interpreter of the runtime's venv: the base's python3 (the platform's images: their conda Python).
ARG RUNTIME_PYTHON=python3
COPY wheels/ /tmp/ma-runtime/wheels/
COPY ma-runtime-entrypoint install-runtime.sh /tmp/ma-runtime/
RUN sh /tmp/ma-runtime/install-runtime.sh && rm -rf /tmp/ma-runtime

# Last: a new version or revision changes these layers only, not the cached ones above.
ARG VERSION=unknown
ARG SOURCE_URL=
ARG REVISION=
LABEL org.opencontainers.image.title="ma-runtime-ascend" \
      org.opencontainers.image.description="Ascend training image: CANN base, ma-runtime as PID 1" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.revision="${REVISION}"

# No HEALTHCHECK: ModelArts and Kubernetes ignore Docker's; the runtime finds a hung job itself and reports
# it through its exit code (83) and termination message.
STOPSIGNAL SIGTERM
USER ${MA_USER_UID}
WORKDIR /home/ma-user
ENTRYPOINT ["/opt/ma-runtime/bin/ma-runtime-entrypoint"]
