# The image of cluster/kuberay-rayservice.yaml and cluster/ascend-cluster.yaml on Ascend nodes:
# CANN, Ray, torch with the torch_npu that matches it, and this project with its `ascend` extra.
#
#   docker build -f cluster/images/ascend.Dockerfile -t serve-app:ascend .
#
# CANN_IMAGE is an image with the CANN toolkit for your NPUs (Ascend's own, e.g. from
# https://hub.docker.com/r/ascendai/cann; 8.3 or later, see docs/install.md); TORCH and
# TORCH_NPU are a matching pair (torch_npu X.Y.Z goes with torch X.Y.Z) that supports that CANN.
# The driver and firmware stay on the host: the device plugin mounts them into the pods.
ARG CANN_IMAGE=ascendai/cann:8.3.rc1-910b-ubuntu22.04-py3.11
FROM ${CANN_IMAGE}

ARG TORCH=2.13.0
ARG TORCH_NPU=2.13.0
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /srv
COPY pyproject.toml README.md deployments.yaml deployments-pd.yaml ./
COPY serve_app ./serve_app
COPY cluster ./cluster
# torch first and pinned, so that no dependency picks another build; then torch_npu for it
RUN python3 -m pip install --no-cache-dir "torch==${TORCH}" \
    && python3 -m pip install --no-cache-dir "torch-npu==${TORCH_NPU}" \
    && python3 -m pip install --no-cache-dir ".[serve,ascend]" "torch==${TORCH}"

# CANN's environment for every process Ray starts (the pods' commands source it too)
RUN echo "source /usr/local/Ascend/ascend-toolkit/set_env.sh" >> /etc/profile.d/ascend.sh
EXPOSE 8000 6379 8265 10001
